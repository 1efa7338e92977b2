"""The entropy bonus (PPO, arXiv 1707.06347, eq. 9's c2 S[pi]): the loss minus COEF times the step's token-weighted
entropy of the policy, so that the update also pushes each sampled position's distribution to stay spread
(--entropy-coef COEF, 0 = off).

loss += -coef * sum_t weight_t * H_t, H_t = -sum_v p_v log p_v of softmax(logits_t / temperature) at each trained
token's position; weight: the step's token weights (the aggregation, whole step), so micro-batch bonuses add up like
the policy loss and the bonus is verl's entropy_coeff * agg_loss(entropy) for the same aggregation.

Seam: the loss's extra term, added in the update after policy_loss: loss = loss - entropy_bonus(ent, tok.weight, ...).
What the trainer must supply: the token entropy WITH its gradient, in every epoch's update pass. Today
pack.token_stats(entropy=True) returns it from logprobs.head_logprobs, whose sliced autograd function marks the entropy
non-differentiable (and the update asks for it only in the first epoch, for a metric). Needed there: keep the entropy
differentiable and, in _HeadLogprobs.backward, add g_ent * dH/dlogits to each slice's d logp / d logits, where
dH/dlogits = -p (log p + H) / temperature (entropy_logit_grad below; the logits are recomputed per slice already, so
no (rows, V) tensor is kept). The weight is the plain weight (not times the selections or importance weights), as the
KL term's: verl aggregates the entropy over response_mask.

Reference read: verl v0.7.0+125 (b178a3c) verl/workers/actor/dp_actor.py update_policy (entropy_agg =
agg_loss(entropy, response_mask, loss_agg_mode); policy_loss -= entropy_agg * entropy_coeff, entropy from logits with
gradient) and verl/trainer/config/actor/actor.yaml (entropy_coeff: 0). Stated: the bonus coef * aggregated entropy
subtracted from the loss. Chosen: the coefficient is >= 0 (a bonus; a negative one would minimise entropy).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError, out_of_range


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    entropy_coef: float = 0.0  # entropy bonus: loss minus COEF * the step's token-weighted policy entropy (0 = off)


def enabled(cfg) -> bool:
    return cfg.entropy_coef > 0


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(entropy_coef=">= 0"))


def needs_entropy_grad(cfg) -> bool:
    """The update pass computes the token entropy with its gradient, in every epoch."""
    return cfg.entropy_coef > 0


def entropy_bonus(entropy: Tensor, weight: Tensor, coef: float, mask: Tensor | None = None) -> Tensor:
    """coef * sum(weight * entropy) over the trained tokens: entropy [B, T] (with grad), weight [B, T] (the step's
    token weights), mask [B, T] bool (default weight != 0) -> scalar, to SUBTRACT from the loss. Padded entries of
    entropy (nan, inf) never reach the value or the gradient."""
    m = weight != 0 if mask is None else mask.bool()
    return coef * (weight * torch.where(m, entropy, torch.zeros_like(entropy))).sum()


def entropy_logit_grad(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """d H / d logits for H = entropy of softmax(logits / temperature): [N, V] -> [N, V], at least float32.
    With x = logits / temperature, p = softmax(x): dH/dx_v = -p_v (log p_v + H), and dH/dlogits = dH/dx / temperature.
    The term a sliced backward adds (times the entropy's incoming gradient) to make the entropy differentiable."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    p = logp.exp()
    H = -(p * logp).sum(-1, keepdim=True)
    return -p * (logp + H) / temperature


def loss_terms(run, loss: Tensor, tok, entropy: Tensor) -> Tensor:
    """The policy loss minus the bonus on this micro-batch's trained tokens, with the step's plain token weights."""
    mask = tok.weight != 0 if tok.mask is None else tok.mask
    return loss - entropy_bonus(entropy, tok.weight, run.cfg.entropy_coef, mask)
