"""GPG (arXiv 2504.02546): the plain policy gradient A * logp (no ratio, no clip) with Dr. GRPO centring, a token
mean, and the batch factor alpha = groups / groups whose rewards differ on the step's token weights (the KL's too).
References: AMAP-ML/GPG e096da8 open-r1/src/open_r1/gpg_trainer.py, configs.py, train.sh; verl b178a3c
core_algos.py compute_policy_loss_gpg."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cli import FlagError
from distributed import gather_rows
from losses import Objective, need, on_mask
from pack import per_completion


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    gpg_alpha: bool = False  # GPG: token weights times groups / groups whose rewards differ


PRESETS = {"gpg": dict(loss="gpg", std_normalize=False, aggregation="token_mean", gpg_alpha=True)}


def enabled(cfg) -> bool:
    return cfg.gpg_alpha or cfg.loss == "gpg"


def check(cfg) -> Iterator[FlagError]:
    return iter(())


def token_weights(run, weight: Tensor, groups: list, batch, raw: Tensor, mask: Tensor, metrics: dict) -> Tensor:
    """--gpg-alpha: the step's token weights times alpha, over every rank's groups (the gradient becomes the mean
    over the groups whose rewards differ)."""
    if not run.cfg.gpg_alpha:
        return weight
    rewards = per_completion(groups, "reward").view(len(groups), -1).to(weight.device)
    metrics["gpg/alpha"] = alpha = gpg_alpha(gather_rows(rewards, run.rank, run.world)[0])
    return weight * alpha


def gpg_alpha(rewards: Tensor) -> float:
    """GPG's gradient correction alpha = P / (groups whose rewards are not all equal): rewards [P, G] -> float.

    Groups with equal rewards carry no gradient, yet count in the batch mean; multiplying the step's token weights by
    alpha makes the gradient the mean over the groups that do learn. 1.0 when no group has a spread (the gradient is
    0 then). Follows GPG's gpg_trainer.py (--adjust_gd: loss / inverse_alpha, inverse_alpha = valid groups / groups,
    at most 1); pass the whole step's rewards. verl's compute_gpg_outcome_advantage instead divides the batch size by
    the number of non-zero rewards, which is not the paper's count; GPG's own code is followed. GPG's code also
    re-samples until at least half the groups have a spread (min_inverse_alpha 0.5), closer to --dynamic-sampling.
    """
    need(rewards.dim() == 2, f"gpg_alpha: rewards must be [P, G], got shape {tuple(rewards.shape)}")
    spread = rewards.amax(-1) != rewards.amin(-1)
    n = int(spread.sum())
    return rewards.shape[0] / n if n > 0 else 1.0


def gpg_objective(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any) -> tuple[Tensor, Tensor]:
    """GPG (arXiv 2504.02546): the plain policy gradient, obj = A * logp (old_logp unused, no ratio, no clip).

    d obj / d logp = A: GRPO's on-policy gradient without the clip. The method's other parts are elsewhere: Dr. GRPO
    centring (std off, GPG's train.sh runs --scale_rewards False), token_mean aggregation (its loss divides by the
    batch's token count) and the batch factor gpg_alpha. GPG's code trains on-policy (one update per batch); with
    mu > 1 this is REINFORCE on stale samples. No token is cut. Follows GPG's gpg_trainer.py compute_loss and verl's
    compute_policy_loss_gpg (the same expression).
    """
    mask = mask.bool()
    return on_mask(adv, mask) * on_mask(logp, mask), torch.zeros_like(mask)


LOSSES = {"gpg": Objective(gpg_objective)}
