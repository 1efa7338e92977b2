"""DPPO, Binary-TV form (arXiv 2602.04879; prime-rl's default loss): a trust region on the probability gap.
Reference: prime-rl 559b447 src/prime_rl/trainer/rl/loss.py default_loss_fn. With mu = 1 it is the plain policy
gradient: its preset takes a second epoch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cli import FlagError, out_of_range
from losses import Objective, masked_log_ratio, need, on_mask


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    dppo_mask_low: float = 0.2  # DPPO: mask a negative-advantage token whose probability fell by more than this
    dppo_mask_high: float = 0.2  # DPPO: mask a positive-advantage token whose probability rose by more than this
    dppo_kl_tau: float = 1e-3  # DPPO: coefficient of the squared log-ratio on every token


PRESETS = {"dppo": dict(loss="dppo", aggregation="token_mean", mu=2)}  # prime-rl's defaults 0.2, 0.2, 1e-3


def enabled(cfg) -> bool:
    return cfg.loss == "dppo"


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict.fromkeys(("dppo_mask_low", "dppo_mask_high", "dppo_kl_tau"), ">= 0"))


def dppo_objective(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any) -> tuple[Tensor, Tensor]:
    """DPPO, Binary-TV form (arXiv 2602.04879; prime-rl's default loss): a trust region on the probability gap.

    d = exp(logp) - exp(old_logp) (the sampled token's probability moved by d). A token is masked when it left the
    region in its advantage's direction: d > hp.dppo_mask_high where A > 0, d < -hp.dppo_mask_low elsewhere.
    obj = (1 - masked) * r * A - hp.dppo_kl_tau * l^2, l = logp - old_logp, r = exp(l): the unclipped ratio with
    its gradient r A grad logp, and a squared log-ratio regulariser on every token, masked ones included.
    d obj / d logp = (1 - masked) r A - 2 tau l; masked tokens are cut. At r = 1 nothing is masked and the penalty's
    gradient is 0, so with mu = 1 DPPO is the plain policy gradient.
    Aggregation: token_mean (prime-rl divides the summed loss by the step's loss-token count). Defaults 0.2, 0.2,
    1e-3 (prime-rl DefaultLossConfig; its adv_tau, a factor on A, is left out: 1 by default). Follows prime-rl's
    default_loss_fn, whose code this is; its docs/algorithms.md still describes min(r, delta) * A, which the code no
    longer computes. prime-rl's pi_old is the inference engine's log-probs (it has no separate trainer pi_old); here
    it is old_logp, the trainer's, as in the DPPO authors' "recompute" variant (sail-sg/Stable-RL c6af1d1
    core_algos.py, dppo_binary_tv_recompute), and the sampler gap is left to mismatch_is_weights.
    """
    mask = mask.bool()
    low, high, tau = float(hp.dppo_mask_low), float(hp.dppo_mask_high), float(hp.dppo_kl_tau)
    bad = f"--dppo-mask-low, --dppo-mask-high and --dppo-kl-tau must be >= 0, got {low}, {high}, {tau}"
    need(low >= 0 and high >= 0 and tau >= 0, f"dppo_objective: {bad}")
    adv, log_ratio = on_mask(adv, mask), masked_log_ratio(logp, old_logp, mask)
    zero = torch.zeros_like(logp)
    with torch.no_grad():
        gap = torch.exp(torch.where(mask, logp, zero)) - torch.exp(torch.where(mask, old_logp, zero))
        cut = mask & torch.where(adv > 0, gap > high, gap < -low)
    obj = torch.where(cut, zero, torch.exp(log_ratio) * adv) - tau * log_ratio.square()
    return on_mask(obj, mask), cut


LOSSES = {"dppo": Objective(dppo_objective)}
