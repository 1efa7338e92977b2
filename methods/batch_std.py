"""Batch-level std normalisation for GRPO (Lite PPO, arXiv 2508.08221): each reward minus its group's mean, divided
by the std of the WHOLE step's rewards instead of the group's (--batch-std). Also the step statistics it shares with
REINFORCE++'s whitening (methods/reinforce_pp.py): moments that add up over ranks and micro-batches.

Seam: advantages. rewards [P, G] (or GRPO-MA's thought values [P, K] and answers [P, K*M]) -> advantages of the same
shape, in place of advantage.group_advantages.

Whole-step statistics: the functions take MOMENTS, three float64 sums (count, sum, sum of squares) that the caller
adds up over ranks (distributed.all_sum(moments(x), world)); the std of the step is then the same whatever the world
size or the micro-batch split. Without them the tensor passed in is the whole step (one process).

Reference read: TRL v1.9.0+26 (f2cd577) trl/trainer/grpo_trainer.py, _generate_and_score_completions with
scale_rewards="batch": advantages = (rewards - group mean) / (nanstd(all gathered rewards) + 1e-4), nanstd unbiased.
Stated there: the group mean, the unbiased std over the generation batch (every rank's rewards). Chosen here: eps =
1e-6 (the project's eps for a std; TRL's 1e-4), and a group whose rewards are all equal gets exactly 0 by an explicit
mask (the project's rule; TRL's numerator is exactly 0 there too, up to rounding of the mean). With GRPO-MA's tree
the thought advantage divides by the std of the step's thought values and the answer advantage by the std of the
step's answer rewards: each has its own step statistic, as GRPO-MA normalises each over its own group.
Left out: TRL's multi-objective "normalize_then_sum" (a batch z-score of per-function group z-scores).
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
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- advantages
    batch_std: bool = False  # Lite PPO: divide (reward - group mean) by the std of the whole step's rewards


PRESETS = {"lite_ppo": dict(batch_std=True, aggregation="token_mean")}  # group mean, batch std, token-level loss


def enabled(cfg) -> bool:
    return cfg.batch_std


def check(cfg) -> Iterator[FlagError]:
    if cfg.batch_std and not cfg.std_normalize:
        why = "chooses which std divides the advantages (the step's): it contradicts --no-std-normalize"
        yield FlagError(("batch_std",), why, ("std_normalize",))
    if cfg.batch_std and cfg.advantage != "grpo":
        yield FlagError(("batch_std",), "needs --advantage grpo (it replaces GRPO's group std)", ("advantage",))


def moments(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """[3] float64 (count, sum, sum of squares) of x's entries on mask (every entry when None). Sums add up: the
    moments of a step are the sum of its pieces' (ranks, micro-batches), so pass distributed.all_sum(moments(x))."""
    x = x.detach().double()
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    x = torch.where(m, x, torch.zeros_like(x))  # padding may hold nan or inf
    return torch.stack([m.sum().double(), x.sum(), x.square().sum()])


def mean_std(stats: Tensor) -> tuple[float, float]:
    """(mean, unbiased std) from moments; the std is 0 for fewer than 2 entries (no spread to measure) and never
    negative (the sum of squares minus n mean^2 can round below 0)."""
    n, s1, s2 = (float(v) for v in stats)
    if n < 1:
        return 0.0, 0.0
    mean = s1 / n
    if n < 2:
        return mean, 0.0
    return mean, max(s2 - s1 * mean, 0.0) ** 0.5 / (n - 1) ** 0.5


def batch_std_advantages(rewards: Tensor, stats: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """A = (r - mean_g r) / (std_step r + eps): rewards [P, G] -> [P, G].

    stats: moments of the whole step's rewards (all_sum over ranks), default moments(rewards), i.e. this tensor is
    the whole step. A group whose rewards are all equal (G == 1 included) gets exactly 0."""
    r = rewards if rewards.is_floating_point() else rewards.float()
    _, std = mean_std(moments(r) if stats is None else stats)
    adv = (r - r.mean(-1, keepdim=True)) / (std + eps)
    return adv.masked_fill(r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True), 0.0)


def grpo_ma_batch_std_advantages(
    rewards: Tensor, stats: tuple[Tensor, Tensor] | None = None, *, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """GRPO-MA's advantages with the step's std: rewards [P, K, M] -> (thought [P, K], answer [P, K, M]).

    Thought: V = mean over a thought's M answers, V - mean_K V over the step's std of V. Answer: R - mean over the
    prompt's K*M answers, over the step's std of R. stats: (moments of the step's V, moments of the step's R), each
    summed over ranks; default this tensor's. M = 1 gives batch_std_advantages on [P, K] twice (the same values)."""
    P, K, M = rewards.shape
    r = rewards if rewards.is_floating_point() else rewards.float()
    value, flat = r.mean(-1), r.reshape(P, K * M)
    th_stats, ans_stats = (moments(value), moments(flat)) if stats is None else stats
    thought = batch_std_advantages(value, th_stats, eps=eps)
    return thought, batch_std_advantages(flat, ans_stats, eps=eps).view(P, K, M)


def advantages(run, groups: list, reward: Tensor, batch_accuracy: float) -> tuple[Tensor, Tensor]:
    """--batch-std: GRPO-MA's centring over the step's std, the moments summed over every rank."""
    P, K, M = reward.shape
    stats = (moments(reward.mean(-1)), moments(reward.reshape(P, K * M)))
    stats = tuple(all_sum(s, run.world) for s in stats)
    return grpo_ma_batch_std_advantages(reward, stats)
