"""The 80/20 rule (arXiv 2506.01939): train only on the step's highest-entropy tokens (--top-entropy-fraction 0.2).
Reference: TRL f2cd577 trl/trainer/grpo_trainer.py get_high_entropy_mask (top_entropy_quantile). The selection is
made once per step from the score pass's token entropies over every rank's tokens, so neither the micro-batch split
nor the world size can change it; it acts on the surrogate only (a dropped token keeps its KL term and counts in
the normaliser), and GMPO takes it inside its geometric mean."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError, out_of_range
from distributed import gather_rows
from losses import need


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    top_entropy_fraction: float = 1.0  # 80/20 rule: train only on this top fraction of the step's tokens by entropy


def enabled(cfg) -> bool:
    return cfg.top_entropy_fraction < 1


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(top_entropy_fraction="[0, 1]"))


def needs_scores(cfg) -> bool:
    """The mask needs the token entropies before the update (the score pass)."""
    return True


def select(run, batch, adv: Tensor, mask: Tensor) -> tuple[Tensor, None, dict]:
    """This rank's rows (B, T) -> (keep (B, T) bool, None, {}): the top fraction of the whole step's tokens."""
    (ent_all, mine), (mask_all, _) = [gather_rows(x.float(), run.rank, run.world) for x in (batch.entropy, mask)]
    mask_all = mask_all.bool()
    keep = (mask_all & high_entropy_mask(ent_all, mask_all, run.cfg.top_entropy_fraction)) | ~mask_all
    return keep[mine, : mask.shape[1]], None, {}


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_fraction: float) -> Tensor:
    """The 80/20 rule's entropy mask (arXiv 2506.01939): train only on the step's highest-entropy tokens.

    entropy (the scoring pass's token entropy), mask: [B, T], the whole step -> keep [B, T] bool.
    threshold = the (1 - top_fraction) quantile of the masked entropies, linear interpolation (torch.quantile's
    default); keep = entropy >= threshold on the mask. top_fraction = 1 keeps every token, 0 only the maximum (ties
    kept); the paper's value is 0.2. The caller multiplies keep into the token weights, so dropped tokens still count
    in the normaliser (TRL multiplies their loss by 0). Follows TRL's get_high_entropy_mask (top_entropy_quantile),
    which takes the quantile over one micro-batch gathered across ranks; the paper's "top 20% in each batch" is the
    whole step, which also keeps the micro-batch split out of it. Under DDP pass the entropies of every rank.
    The quantile is computed from a sort, as torch.quantile does, without its 2^24-element input limit.
    """
    need(0 <= top_fraction <= 1, f"high_entropy_mask: --top-entropy-fraction must be in [0, 1], got {top_fraction}")
    mask = mask.bool()
    values = entropy.detach()[mask].sort().values
    if values.numel() == 0:
        return torch.zeros_like(mask)
    q = torch.tensor(1.0 - top_fraction, dtype=values.dtype, device=values.device)
    rank = q * (values.numel() - 1)  # in the entropy's dtype, as torch.quantile computes it
    below, above = rank.floor().long(), rank.ceil().long()
    threshold = torch.lerp(values[below], values[above], rank - below.to(values.dtype))
    return mask & (entropy >= threshold)
