"""RLOO, the REINFORCE leave-one-out estimator (arXiv 2402.14740): each completion's baseline is the mean reward of
the OTHER completions of its group, A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g r) (--advantage rloo).

Seam: advantages. rewards [P, G] -> [P, G], or with GRPO-MA's tree rewards [P, K, M] -> (thought [P, K],
answer [P, K, M]), in place of advantage.grpo_ma_advantages. With --kl-in-reward the rewards are the KL-shaped
sequence returns (methods/kl.py shaped_returns), as TRL's RLOO and verl's do.

References read:
  verl v0.7.0+125 (b178a3c) verl/trainer/ppo/core_algos.py: compute_rloo_outcome_advantage
    (scores * n / (n - 1) - mean * n / (n - 1), no std; a group of one keeps its raw score) and
    compute_rloo_vectorized_outcome_advantage ((c r - sum) / (c - 1) times (c > 1): a group of one gets 0).
  TRL v1.9.0+26 (f2cd577) trl/trainer/rloo_trainer.py, rloo_config.py: baseline (sum - r) / (n - 1), advantages
    r - baseline, optional whitening over the batch (normalize_advantages, default False); KL in the reward as k1
    summed over the completion, beta 0.05 by default; num_generations = 1 gives 0.
Stated: the leave-one-out mean baseline, no std scaling (both references by default; the paper's estimator).
Chosen: a group of one gets 0 (verl's vectorised form and TRL; verl's loop form would hand it its raw reward), and
a group whose rewards are all equal gets exactly 0 by an explicit mask (the project's rule; the formula gives 0 up to
rounding). The core flag check already refuses groups of fewer than 2 samples. With the tree: the thought's baseline
is the mean value of the OTHER K - 1 thoughts of its prompt, the answer's the mean of the other K*M - 1 answers of the
prompt (GRPO-MA's groups, each with a leave-one-out mean); M = 1 gives plain RLOO over the K completions.
Left out: TRL's sequence-level ratio loss (the project keeps its --loss table) and normalize_advantages.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor

from cli import FlagError


@dataclass
class Flags:
    """RLOO is a value of the core's --advantage flag; it has no flag of its own."""


# TRL RLOOConfig's defaults: the k1 KL in the reward at beta 0.05, advantages not normalised.
PRESETS = {"rloo": dict(advantage="rloo", std_normalize=False, kl_in_reward=True, kl_estimator="k1", beta=0.05)}


def enabled(cfg) -> bool:
    return cfg.advantage == "rloo"


def check(cfg) -> Iterator[FlagError]:
    if cfg.advantage == "rloo" and cfg.std_normalize:
        why = "is unscaled (its leave-one-out baseline only): it needs --no-std-normalize, or --algo rloo"
        yield FlagError(("advantage",), why, ("std_normalize",), "--advantage rloo")


def rloo_advantages(rewards: Tensor) -> Tensor:
    """A_i = r_i - mean_{j != i} r_j over the last dim: rewards [P, G] (any leading dims) -> same shape.
    G == 1 and groups whose rewards are all equal give exactly 0."""
    r = rewards if rewards.is_floating_point() else rewards.float()
    G = r.shape[-1]
    if G < 2:
        return r.new_zeros(r.shape)
    adv = (r - r.mean(-1, keepdim=True)) * (G / (G - 1))
    return adv.masked_fill(r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True), 0.0)


def grpo_ma_rloo_advantages(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """RLOO on GRPO-MA's tree: rewards [P, K, M] -> (thought [P, K], answer [P, K, M]).
    Thought: leave-one-out over the K thought values V = mean_j R[p, i, j]; answer: leave-one-out over the prompt's
    K*M answers. M = 1: both equal rloo_advantages(rewards[..., 0])."""
    P, K, M = rewards.shape
    r = rewards if rewards.is_floating_point() else rewards.float()
    return rloo_advantages(r.mean(-1)), rloo_advantages(r.reshape(P, K * M)).view(P, K, M)


def advantages(run, groups: list, reward: Tensor, batch_accuracy: float) -> tuple[Tensor, Tensor]:
    """--advantage rloo: rewards [P, K, M] -> (thought [P, K], answer [P, K, M]) leave-one-out advantages."""
    return grpo_ma_rloo_advantages(reward)


ADVANTAGES = {"rloo": advantages}
