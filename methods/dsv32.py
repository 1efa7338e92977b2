"""DeepSeek-V3.2 (arXiv 2512.02556): the off-policy sequence mask (--opsm-delta) and the unbiased KL estimate
(--kl-estimator unbiased, losses.unbiased_kl). The mask drops the negative-advantage tokens of sequences the current
policy has drifted from; it is computed per micro-batch from the current log-probs (they move between epochs) and
acts on the surrogate only. References: TRL f2cd577 grpo_trainer.py get_off_policy_mask; slime 624b824
slime/utils/ppo_utils.py compute_opsm_mask."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError
from losses import Tokens, need


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    opsm_delta: float = -1.0  # DeepSeek-V3.2: drop negative-advantage sequences with KL(sampler||pi) > DELTA (-1 off)


# the off-policy sequence mask at slime's delta and the unbiased KL
PRESETS = {"dsv32": dict(opsm_delta=1e-4, kl_estimator="unbiased", beta=1e-3, mu=2)}


def enabled(cfg) -> bool:
    return cfg.opsm_delta >= 0


def check(cfg) -> Iterator[FlagError]:
    if cfg.opsm_delta != -1 and not (math.isfinite(cfg.opsm_delta) and cfg.opsm_delta >= 0):
        yield FlagError(("opsm_delta",), f"must be >= 0, or -1 (off), got {cfg.opsm_delta}")
    if cfg.opsm_delta >= 0 and cfg.answers > 1:
        yield FlagError(("opsm_delta",), "needs --answers 1", ("answers",), "--opsm-delta (one KL per sequence)")


def micro_batch(run, tok: Tokens, mb, sampled: Tensor, sums: dict, epoch: int) -> Tokens:
    """The sequence mask on this micro-batch's rows, joined to the step's selections; its share of the sampled
    tokens, averaged over the epochs, goes to the opsm/masked_frac metric."""
    behaviour = mb.sampler_logp if run.sampler is not run.policy else tok.old_logp
    keep = off_policy_sequence_mask(tok.logp, behaviour, tok.adv, sampled, delta=run.cfg.opsm_delta)
    sums["opsm_masked"] = sums.get("opsm_masked", 0.0) + (~keep & sampled).sum().item() / run.cfg.mu
    tok.keep = keep if tok.keep is None else tok.keep & keep
    return tok


def off_policy_sequence_mask(logp: Tensor, sampler_logp: Tensor, adv: Tensor, mask: Tensor, *, delta: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9): drop the negative-advantage tokens of
    sequences the current policy has drifted away from.

    logp (current, this micro-batch's), sampler_logp (the policy that sampled the tokens: the sampler's own log-probs
    with a rollout copy, else old_logp), adv, mask: [B, T] -> keep [B, T] bool.
    kl_i = mean over row i's tokens of (sampler_logp - logp), the k1 estimate of KL(pi_sampler || pi_theta);
    keep = mask & (A >= 0 | kl_i <= delta). Detached (a mask). Per row, so the micro-batch split cannot change it;
    computed per call because logp moves between epochs. A kept token keeps its weight; a dropped one still counts
    in the normaliser. Follows TRL's get_off_policy_mask (sampler log-probs when present, as here) and slime's
    compute_opsm_mask (the same expression). delta: the paper gives none; slime defaults to 1e-4, TRL's docs
    suggest 0.5 as a start. A packed row of a thought and several answers would share kl_i: use it with --answers 1.
    """
    need(delta >= 0, f"off_policy_sequence_mask: --opsm-delta must be >= 0, got {delta}")
    mask = mask.bool()
    gap = torch.where(mask, sampler_logp.detach() - logp.detach(), torch.zeros_like(logp))
    kl = gap.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return mask & ((adv >= 0) | (kl <= delta))
