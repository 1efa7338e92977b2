"""GMPO (arXiv 2507.20673): the geometric mean of the token ratios, each clipped in log space on its sign's side.
References: TRL f2cd577 trl/experimental/gmpo/gmpo_trainer.py; callsys/GMPO 205b2bf train_zero_math_gmpo.py,
scripts/qwen2.5-math-7b-gmpo.sh; verl b178a3c core_algos.py compute_policy_loss_geo_mean."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from cli import FlagError
from losses import Objective, masked_log_ratio, need, on_mask

PRESETS = {"gmpo": dict(loss="gmpo", clip_low=0.4, clip_high=0.4, mu=2)}  # the clip in log space: (e^-0.4, e^0.4)


def enabled(cfg) -> bool:
    return cfg.loss == "gmpo"


def check(cfg) -> Iterator[FlagError]:
    if cfg.loss == "gmpo" and cfg.answers > 1:  # a packed thought and its answers would share one ratio
        yield FlagError(("loss",), "needs --answers 1", ("answers",), "--loss gmpo (one ratio per sequence)")


def gmpo_objective(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any, *, keep: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios, each clipped in log space on its sign's side.

    For row i with n_i tokens: l_t = logp_t - old_logp_t, c_t = clamp(l_t, -hp.clip_low, hp.clip_high), where the
    clip bounds are in LOG space (the paper's range (e^-0.4, e^0.4) is clip_low = clip_high = 0.4);
    l~_t = min(l_t, c_t) where A_t > 0, max(l_t, c_t) elsewhere (PPO's pessimistic side);
    s_i = exp(mean_t l~_t), A_i = mean_t A_t, and every token of row i carries the sequence value s_i * A_i.
    d(s_i A_i) / d logp_t = A_i s_i / n_i where l_t is inside the clip (or beyond it on the side that does not bind),
    0 on the others, which are cut: l_t > clip_high with A_t > 0, l_t < -clip_low with A_t <= 0. At r = 1 this is
    GRPO's gradient, A_i / n_i per token.
    Aggregation: the references average the sequence value over sequences (TRL per_sequence_loss.mean(), verl
    torch.mean over rows, GMPO's code one sequence per micro-batch); seq_mean_token_mean weights reproduce that
    exactly. token_mean would weigh each sequence by its length. Follows TRL's experimental GMPOTrainer (A > 0 takes
    min, as GMPO's code does for A >= 0: the two differ only on A = 0, whose value is 0); A_i as the mean of the
    token advantages is verl's compute_policy_loss_geo_mean (the same as TRL's for sequence-level advantages). The
    mean divides by max(n_i, 1) (verl adds 1e-8 instead; identical for non-empty rows). A packed row of a thought and
    several answers would share one ratio: use it with --answers 1.
    keep: [B, T] bool, the step's token selections (the entropy mask, V3.2's sequence mask; None = every token).
    They choose which tokens enter each row's geometric mean and nothing else: the row keeps its whole weight (its
    value sits on every token of the mask), as TRL's GMPO takes mask * entropy_mask into the mean and averages the
    sequences' values (TRL f2cd577 trl/experimental/gmpo/gmpo_trainer.py). policy_loss therefore hands this entry the
    selections instead of multiplying them into its weights (TAKES). A row with no kept token has value 0. With
    --rollout-is weights each token's weight multiplies the sequence value it carries, so a row's factor is the
    arithmetic mean of its token weights; verl's geo_mean takes their geometric mean (exp of the mean log weight).
    A token masked by --rollout-is (weight 0) is not on `mask` here (policy_loss leaves rejected tokens out), so it
    leaves the geometric mean and gets no gradient, as verl's rejection sampling drops it from the response mask.
    """
    mask = mask.bool()
    low, high = float(hp.clip_low), float(hp.clip_high)
    bad = f"--clip-low and --clip-high (log space under GMPO) must be > 0, got {low} and {high}"
    need(low > 0 and high > 0, f"gmpo_objective: {bad}")
    adv, log_ratio = on_mask(adv, mask), masked_log_ratio(logp, old_logp, mask)
    clamped = log_ratio.clamp(-low, high)
    pessimistic = torch.where(adv > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))
    m = (mask if keep is None else mask & keep.bool()).to(logp.dtype)  # the tokens of the geometric mean
    n = m.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    seq_ratio = torch.exp((pessimistic * m).sum(-1, keepdim=True) / n)  # (B, 1) geometric mean of clipped ratios
    seq_adv = (adv * m).sum(-1, keepdim=True) / n  # (B, 1)
    obj = (seq_ratio * seq_adv).expand_as(logp)
    lr = log_ratio.detach()
    cut = mask & torch.where(adv > 0, lr > high, lr < -low)
    return on_mask(obj, mask), cut


LOSSES = {"gmpo": Objective(gmpo_objective, takes=("keep",), sequence_level=True)}
