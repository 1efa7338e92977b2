"""SAPO (arXiv 2511.20347): a smooth gate in place of PPO's hard clip, steeper for negative advantages.
References: TRL f2cd577 trl/trainer/grpo_trainer.py (loss_type "sapo"); verl b178a3c verl/trainer/ppo/core_algos.py
compute_policy_loss_sapo. With mu = 1 the ratio is 1 and SAPO is the plain policy gradient: its preset takes a
second epoch."""

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
    sapo_tau_pos: float = 1.0  # SAPO: gate temperature for positive advantages
    sapo_tau_neg: float = 1.05  # SAPO: gate temperature for negative advantages (steeper)


PRESETS = {"sapo": dict(loss="sapo", mu=2)}  # tau 1.0 / 1.05 (the flags' defaults)


def enabled(cfg) -> bool:
    return cfg.loss == "sapo"


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict.fromkeys(("sapo_tau_pos", "sapo_tau_neg"), "> 0"))


def sapo_objective(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any) -> tuple[Tensor, Tensor]:
    """SAPO (arXiv 2511.20347): a smooth gate in place of PPO's hard clip, steeper for negative advantages.

    obj = f(r) * A with f(r) = (4 / tau) * sigmoid(tau * (r - 1)), r = exp(logp - old_logp) per token, and
    tau = hp.sapo_tau_pos where A > 0, hp.sapo_tau_neg elsewhere (the paper and both references: 1.0 and 1.05).
    d obj / d logp = 4 s (1 - s) r A with s = sigmoid(tau (r - 1)): exactly A at r = 1 (on-policy SAPO is the plain
    policy gradient), fading smoothly to 0 as r leaves 1, faster for the larger tau. No token is cut.
    Aggregation: the references use seq_mean_token_mean (verl forces it; TRL's "sapo" shares GRPO's); other weights
    change only how tokens are averaged. Follows TRL's _compute_loss ("sapo") and verl's compute_policy_loss_sapo;
    the log-ratio is clamped to [-20, 20] before exp as verl does (TRL does not): an overflowing r would make the
    gate's gradient 0 * inf = nan, and no real update moves a token's log-prob by 20.
    """
    mask = mask.bool()
    tau_pos, tau_neg = float(hp.sapo_tau_pos), float(hp.sapo_tau_neg)
    bad = f"--sapo-tau-pos and --sapo-tau-neg must be > 0, got {tau_pos} and {tau_neg}"
    need(tau_pos > 0 and tau_neg > 0, f"sapo_objective: {bad}")
    adv = on_mask(adv, mask)
    ratio = torch.exp(masked_log_ratio(logp, old_logp, mask).clamp(-20.0, 20.0))
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    return on_mask(gate * adv, mask), torch.zeros_like(mask)


LOSSES = {"sapo": Objective(sapo_objective)}
