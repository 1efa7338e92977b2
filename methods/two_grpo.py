"""2-GRPO (arXiv 2510.00977): groups of two, A = +1 / -1 for the better / worse completion, 0 on ties (the
paper's population-std normalisation of a pair: advantage.two_grpo_advantages). Its recipe against 16-GRPO keeps
the rollouts per step (prompts x8) and raises the learning rate x8, with clip-higher 0.28."""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from advantage import two_grpo_advantages
from cli import FlagError

# against 16-GRPO at the core's defaults (16 prompts, lr 3e-4): the same rollouts per step and the learning rate x8
PRESETS = {"two_grpo": dict(thoughts=2, advantage="two_grpo", prompts_per_step=8 * 16, lr=8 * 3e-4, clip_high=0.28)}


def enabled(cfg) -> bool:
    return cfg.advantage == "two_grpo"


def check(cfg) -> Iterator[FlagError]:
    if cfg.advantage == "two_grpo" and (cfg.thoughts, cfg.answers) != (2, 1):
        group = ("thoughts", "answers")
        yield FlagError(("advantage",), "needs --thoughts 2 --answers 1", group, "--advantage two_grpo")


def pair_advantages(run, groups: list, reward: Tensor, batch_accuracy: float) -> tuple[None, Tensor]:
    """--advantage two_grpo: rewards [P, 2, 1] -> answer advantages [P, 2, 1]."""
    return None, two_grpo_advantages(reward.view(len(reward), -1)).view(reward.shape)


ADVANTAGES = {"two_grpo": pair_advantages}
