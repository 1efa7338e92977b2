"""M2PO (arXiv 2510.01161; AReaL cbff54d, PR #480): on stale rollouts, mask the tokens whose behaviour-proximal
log-ratio is most extreme, until the second moment of the rest is under --m2po-threshold. The mask is made once per
step from the score pass's proximal log-probs and the sampler's (behaviour) log-probs of the sampled tokens of every
rank, so neither the micro-batch split nor the world size changes it; it acts on the surrogate only (a masked token
keeps its KL term and counts in the normaliser, as the step's other selections). It needs --staleness K > 0 (with
K = 0 the two policies are one). Paper example: --m2po-threshold 0.04, --staleness 2, and AReaL's ratio rejection at
5 (--rollout-is token_mask --tis-cap 5)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError, out_of_range
from distributed import all_sum, gather_rows
from losses import need


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    m2po_threshold: float = 0.0  # M2PO: mask the largest (behaviour - proximal log-prob)^2 until their mean is below


def enabled(cfg) -> bool:
    return cfg.m2po_threshold > 0


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(m2po_threshold=">= 0"))
    if cfg.m2po_threshold > 0 and cfg.staleness == 0:
        yield FlagError(("m2po_threshold",), "needs --staleness K > 0 (on-policy its two policies are one)")


def needs_scores(cfg) -> bool:
    """The mask compares the proximal log-probs of the score pass with the sampler's."""
    return True


def select(run, batch, adv: Tensor, mask: Tensor) -> tuple[Tensor, None, dict]:
    """This rank's rows (B, T) -> (keep (B, T) bool, None, {m2po/masked_frac}): the mask over the whole step's
    sampled tokens (anchors, which the sampler did not draw, are never masked)."""
    sampled = mask if batch.off_policy is None else mask & ~batch.off_policy
    rows = [gather_rows(x.float(), run.rank, run.world) for x in (batch.sampler_logp, batch.score_logp, sampled)]
    (b_all, mine), (o_all, _), (s_all, _) = rows
    keep = m2po_mask(b_all, o_all, s_all.bool(), run.cfg.m2po_threshold)[mine, : mask.shape[1]]
    masked = all_sum((~keep & sampled).sum(), run.world) / all_sum(sampled.sum(), run.world).clamp(min=1)
    return keep, None, {"m2po/masked_frac": masked.item()}


def m2po_mask(behaviour_logp: Tensor, proximal_logp: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """M2PO's second-moment mask: [B, T] each -> keep [B, T] bool (True off the mask).

    m2_t = (b_t - o_t)^2 over the masked tokens. Sort them by m2 descending, ties in row-major order (a stable sort:
    of equal values the earlier token is dropped first), and drop the first k, the smallest k in [0, n - 1] with
    mean(rest) < threshold (strictly); if none, all but the last one are dropped (at least one token is kept). Dropping
    the largest value never raises the mean of the rest, so this is AReaL's loop "mask the largest until the mean is
    below the threshold" in one pass. No token masked when the whole mean is already below. Follows AReaL's M2PO
    (its code computes the moment with pi_prox and pi_behave, as here; the paper writes pi_theta).
    """
    need(threshold > 0, f"m2po_mask: threshold must be > 0, got {threshold}")
    mask = mask.bool()
    m2 = (behaviour_logp.detach() - proximal_logp.detach()).square()[mask]
    keep = torch.ones_like(mask)
    n = m2.numel()
    if n == 0:
        return keep
    values, order = torch.sort(m2.double(), descending=True, stable=True)
    rest = values.flip(0).cumsum(0).flip(0)  # rest[k]: the sum after dropping the first k
    mean_rest = rest / torch.arange(n, 0, -1, dtype=values.dtype, device=values.device)
    below = (mean_rest < threshold).nonzero()
    k = int(below[0]) if below.numel() else n - 1
    kept = torch.ones(n, dtype=torch.bool, device=mask.device)
    kept[order[:k]] = False
    keep[mask] = kept
    return keep
