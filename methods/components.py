"""The reward's named components, scored for the methods that read them (GDPO): each completion's value of every
component of the task's reward (Task.components: name -> (fn, weight), weighted to sum to the reward; the built-in
tasks' are `correct`, `format` and countdown's `each_number_once`, rewards.components) into pack.Answer.components,
whose means the step's row logs as reward/NAME (metrics.rollout_metrics).

Seam: rewards, before GDPO's advantages read them. The reward's own function is not run twice: the component that is
the task's reward takes the reward's values as the rewards seam receives them (GDPO refuses every transform before
it: reward noise, DaGRPO's anchors and credit, DAPO's overlong penalty). Off for every other run, which neither scores
nor logs the components (a plain step's read path stays the scalar reward).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from rewards import score_batch


def enabled(cfg) -> bool:
    return cfg.advantage == "gdpo"


def check(cfg) -> Iterator:
    return iter(())


def rewards(run, reward: Tensor, step) -> Tensor:
    """Every component of every completion, into its Answer.components; the reward passes unchanged."""
    parts, n = run.task.components or {}, run.cfg.reward_workers
    values = reward.tolist()
    scored = {
        k: values if f is run.task.reward else score_batch(f, step.texts, step.examples, n)
        for k, (f, _) in parts.items()
    }
    for i, a in enumerate(step.answers):
        a.components = {k: v[i] for k, v in scored.items()}
    return reward
