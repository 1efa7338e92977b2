"""Dual-clip PPO (arXiv 1912.09729): for a negative advantage the clipped surrogate is also bounded below by C * A,
so a token whose ratio has grown past C cannot push the loss without bound (--dual-clip C, 0 = off).

obj = min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A)            where A >= 0 (PPO's)
obj = max(C A, min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A))  where A < 0
i.e. the loss -obj of a negative-advantage token is at most C |A|. It binds exactly where A < 0 and rho > C (C > 1):
there the value is the constant C A and the token's gradient is cut, as PPO's clip cuts the others.

Seam: the loss table. dual_clip_objective has the contract of losses.LOSSES (objective(logp, old_logp, adv, mask, hp)
-> (obj, cut)) and reads hp.dual_clip, hp.clip_low, hp.clip_high; with hp.dual_clip = 0 it is losses.clip bit for
bit on the mask, so it can stand in the table's "clip" (and "clip_cov") entry.

Reference read: verl v0.7.0+125 (b178a3c) verl/trainer/ppo/core_algos.py compute_policy_loss_vanilla (clip_ratio_c,
default 3.0, asserted > 1; always on in verl's default loss); verl/trainer/config/actor/actor.yaml (clip_ratio_c: 3.0).
Stated: the bound C * A for A < 0, C > 1 (the paper and verl). Chosen: off by default (the project's clip loss is
unchanged unless asked; verl's value is 3), and no clamp of the log-ratio to [-20, 20] before exp (verl clamps; the
project's clip does not). cut marks both clips' tokens (verl reports the dual clip's as pg_clipfrac_lower).
Left out: a dual clip for the other objectives (the sequence ratio of GSPO, CISPO's weights, SAPO's gate).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cli import FlagError
from losses import Objective, clipped, loss_name, token_ratio


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    dual_clip: float = 0.0  # dual-clip PPO: bound a negative-advantage token's loss by C * |A| (verl's C: 3; 0 = off)


def enabled(cfg) -> bool:
    return cfg.dual_clip > 0


def check(cfg) -> Iterator[FlagError]:
    c = cfg.dual_clip
    if not (c == 0 or 1 < c < float("inf")):
        yield FlagError(("dual_clip",), f"must be > 1 (a bound on the ratio above 1), or 0 (off), got {c}")
    if c > 0 and loss_name(cfg) not in ("clip", "clip_cov"):
        why = f"bounds PPO's clipped token ratio: it needs --loss clip or clip_cov, not {loss_name(cfg)}"
        yield FlagError(("dual_clip",), why, ("loss",))


def dual_clip_objective(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any) -> tuple[Tensor, Tensor]:
    """The clipped surrogate with the dual clip at C = hp.dual_clip (0 = off): logp, old_logp, adv, mask [B, T] ->
    (obj [B, T], cut [B, T] bool). d obj / d logp = rho A where neither clip binds, 0 on the cut tokens:
    rho < 1 - clip_low with A < 0, rho > 1 + clip_high with A > 0 (PPO), rho > C with A < 0 (the dual clip)."""
    c = float(hp.dual_clip)
    if not (c == 0 or c > 1):
        raise ValueError(f"dual_clip_objective: --dual-clip must be > 1, or 0 (off), got {c}.")
    mask = mask.bool()
    adv = torch.where(mask, adv, torch.zeros_like(adv))  # padded garbage times a zero gradient would be nan
    obj, cut = clipped(token_ratio(logp, old_logp, mask), adv, mask, hp)
    if c == 0:
        return obj, cut
    floor = c * adv  # (B, T) the bound; it matters where A < 0
    dual = mask & (adv < 0) & (obj.detach() < floor)
    return torch.where(dual, floor, obj), cut | dual


def objective(cfg, entry: Objective) -> Objective:
    """The dual clip in place of the clipped surrogate (--loss clip, or clip_cov with its selections)."""
    return Objective(dual_clip_objective)
