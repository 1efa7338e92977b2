"""GSPO (arXiv 2507.18071): the clipped surrogate on the sequence ratio s_i = exp(mean_t (logp - old_logp)) with its
small ranges (3e-4 / 4e-4). With mu = 1 every ratio is 1 and it is the clip loss's gradient, so its preset takes a
second epoch. The ratio itself is losses.sequence_ratio (GMPO's metric uses it too); --sequence-ratio is GSPO's
switch from before --loss existed, kept so that existing commands and runs work."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor

from cli import FlagError
from losses import Objective, clipped, loss_name, sequence_ratio


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    sequence_ratio: bool = False  # GSPO's sequence ratio: the same as --loss gspo (kept for existing commands)


PRESETS = {"gspo": dict(loss="gspo", clip_low=3e-4, clip_high=4e-4, mu=2)}


def enabled(cfg) -> bool:
    return loss_name(cfg) == "gspo"


def check(cfg) -> Iterator[FlagError]:
    if cfg.sequence_ratio and cfg.loss not in ("clip", "gspo"):
        why = f"is GSPO's ratio (--loss gspo); it contradicts --loss {cfg.loss}"
        yield FlagError(("sequence_ratio",), why, ("loss",))
    if cfg.answers > 1 and cfg.sequence_ratio:
        yield FlagError(("sequence_ratio",), "needs --answers 1", ("answers",), "--sequence-ratio (GSPO)")
    elif cfg.answers > 1 and cfg.loss == "gspo":
        yield FlagError(("loss",), "needs --answers 1", ("answers",), "--loss gspo")


def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp) -> tuple[Tensor, Tensor]:
    """GSPO: the clipped surrogate on the sequence ratio (its small ranges: clip_low 3e-4, clip_high 4e-4).
    With mu = 1 every ratio is 1 and it is the clip loss's gradient. The ratio averages every trained token (mask);
    a selection (the 80/20 mask) acts on the weights only, as TRL's and verl's: the value is TRL's sequence-level
    loss times the selection, and in the token form the gradient reaches only the kept tokens (TRL's sequence form
    spreads each row's, of equal total, over every token, the dropped ones too)."""
    return clipped(sequence_ratio(logp, old_logp, mask), adv, mask, hp)


LOSSES = {"gspo": Objective(gspo, sequence_level=True)}
