"""MaxRL (arXiv 2602.02710): the group mean as both baseline and scale, A_i = (r_i - mean_g r) / mean_g r, and 0 for a
group whose mean is 0 (--advantage maxrl, or --algo maxrl). With binary rewards and pass rate p = mean_g r, a success
gets 1/p - 1 and a failure -1: a prompt weighs about 1/p, so the update follows the gradient of log p (the
maximum-likelihood objective) rather than of p, truncated at an order the group size sets. Defined for rewards in
{0, 1}: a step with any other reward is refused.

Seam: advantages. rewards [P, G] -> [P, G], or with GRPO-MA's tree rewards [P, K, M] -> (thought [P, K],
answer [P, K, M]), in place of advantage.grpo_ma_advantages.

References (docs/algorithms.md): prime-rl `max_rl` and rlhf-book `maxrl.yaml`: where(mean > 0, (r - mean) / mean, 0),
no std, no eps; a group of one gets 0. This file follows them. SkyRL `maxrl` differs: (r - mean) / (mean + 1e-6), so
a group of one returns its raw reward r and a negative mean (possible only with non-binary rewards) flips the sign;
with binary rewards and G >= 2 it differs from prime-rl's by the relative 1e-6 / p in the scale only.
Chosen: the rewards must be 0 or 1 (every built-in task's reward is: its format component weighs 0), checked at each
step over every rank, since a method that shapes rewards (DAPO's overlong penalty, the KL in the reward) would break it
mid-run; the check names the step's first offending value. With the tree: the thought advantage is MaxRL over the K
thought values V = mean_j R[p, i, j] (their mean is the prompt's pass rate p), the answer advantage MaxRL over the
prompt's K*M answers (GRPO-MA's groups); M = 1 gives plain MaxRL over the K completions.
Left out: the paper's loss (prime-rl's DPPO+KL, rlhf-book's REINFORCE without a ratio): --loss keeps its table.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError
from distributed import all_sum


@dataclass
class Flags:
    """MaxRL is a value of the core's --advantage flag; it has no flag of its own."""


PRESETS = {"maxrl": dict(advantage="maxrl", std_normalize=False)}  # prime-rl / rlhf-book: no std


def enabled(cfg) -> bool:
    return cfg.advantage == "maxrl"


def check(cfg) -> Iterator[FlagError]:
    if cfg.advantage == "maxrl" and cfg.std_normalize:
        why = "scales by the group mean, not its std: it needs --no-std-normalize, or --algo maxrl"
        yield FlagError(("advantage",), why, ("std_normalize",), "--advantage maxrl")


def maxrl_advantages(rewards: Tensor) -> Tensor:
    """A = (r - mean) / mean over the last dim where mean > 0, else 0: rewards [P, G] (any leading dims) -> same shape.
    Groups of one, all-0 and all-1 groups give exactly 0; in a group with mean p > 0 of 0/1 rewards a success gets
    1/p - 1 and a failure -1, and the advantages sum to 0."""
    r = rewards if rewards.is_floating_point() else rewards.float()
    mean = r.mean(-1, keepdim=True)
    safe = torch.where(mean > 0, mean, torch.ones_like(mean))  # no 0/0 even in the branch where() discards
    return torch.where(mean > 0, (r - mean) / safe, torch.zeros_like(r))


def grpo_ma_maxrl_advantages(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """MaxRL on GRPO-MA's tree: rewards [P, K, M] -> (thought [P, K], answer [P, K, M]).
    Thought: MaxRL over the K thought values V = mean_j R[p, i, j]; answer: over the prompt's K*M answers.
    M = 1: both equal maxrl_advantages(rewards[..., 0])."""
    P, K, M = rewards.shape
    r = rewards if rewards.is_floating_point() else rewards.float()
    return maxrl_advantages(r.mean(-1)), maxrl_advantages(r.reshape(P, K * M)).view(P, K, M)


def check_binary(reward: Tensor, world: int) -> None:
    """A ValueError unless every reward of the step (every rank's: all ranks raise together) is 0 or 1."""
    bad = (reward != 0) & (reward != 1)
    if all_sum(bad.sum(), world).item():
        value = reward[bad][0].item() if bad.any() else "another"
        raise ValueError(
            f"--advantage maxrl needs rewards in {{0, 1}}, and this step has {value}: use a task whose reward is "
            "correctness only and drop what shapes it (--overlong-buffer, --kl-in-reward, --noise-correct)."
        )


def advantages(run, groups: list, reward: Tensor, batch_accuracy: float) -> tuple[Tensor, Tensor]:
    """--advantage maxrl: rewards [P, K, M] (0 or 1) -> (thought [P, K], answer [P, K, M])."""
    check_binary(reward, run.world)
    return grpo_ma_maxrl_advantages(reward)


ADVANTAGES = {"maxrl": advantages}
