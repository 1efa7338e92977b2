"""GTPO (arXiv 2508.03772): the wiring of its advantage and weight controls (formulas: advantage.py section 3).
- advantages: completions whose mean token entropy exceeds --entropy-threshold are dropped (the gate, unless the
  starting policy is already above it: decided once, at the first step, kept in the trainer state), the rest
  shifted by -gamma * mean entropy; the score pass measures the entropy (needs_entropy);
- token weights: tokens shared by positive and negative completions of a group (conflict tokens) reweighted."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from advantage import gtpo_conflict_weights, gtpo_entropy_gate, gtpo_entropy_shift
from cli import FlagError, out_of_range
from distributed import all_sum


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- advantages
    gtpo_conflict: bool = False  # GTPO: reweight tokens shared by positive and negative completions
    gtpo_w_pos: float = 2.0  # GTPO weight on conflict tokens of positive completions
    gtpo_w_neg: float = 0.0  # GTPO weight on conflict tokens of negative completions
    entropy_gate: bool = False  # GTPO: drop completions whose mean entropy (at --temperature) exceeds the threshold
    entropy_threshold: float = 0.6931471805599453  # GTPO gate threshold in nats (ln 2)
    entropy_gamma: float = 0.0  # GTPO: advantage minus gamma * mean token entropy (0 = off)


PRESETS = {"gtpo": dict(std_normalize=False, gtpo_conflict=True, entropy_gate=True, entropy_gamma=0.1)}


FLAGS = ("gtpo_conflict", "entropy_gate", "entropy_gamma")


def enabled(cfg) -> bool:
    return any(getattr(cfg, f) for f in FLAGS)


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(gtpo_w_pos=">= 0", gtpo_w_neg=">= 0", entropy_threshold="> 0"))
    yield from out_of_range(cfg, dict(entropy_gamma=">= 0"))
    used = tuple(f for f in FLAGS if getattr(cfg, f))
    if used and cfg.answers > 1:  # rows must be whole completions, compared position by position
        yield FlagError(used, "needs --answers 1", ("answers",))


def needs_scores(cfg) -> bool:
    """The entropy gate or shift is on: the score pass measures token entropy."""
    return cfg.entropy_gate or cfg.entropy_gamma > 0


def start(run) -> None:
    """The gate's decision (None until the first step) lives in the trainer state: a resumed run keeps it."""
    run.state.setdefault("gate_on", None)


def sequence_advantages(run, adv: torch.Tensor, batch, mask: torch.Tensor) -> torch.Tensor:
    """The entropy gate and shift of each completion's advantage (B,), from the score pass's entropies."""
    if not needs_scores(run.cfg):
        return adv
    return entropy_control(adv, batch.entropy, mask.float(), run.cfg, run.state, run.world)


def token_weights(run, weight: torch.Tensor, groups: list, batch, raw: torch.Tensor, mask: torch.Tensor, metrics: dict):
    """--gtpo-conflict: the step's token weights times the conflict tokens' weights."""
    if not run.cfg.gtpo_conflict:
        return weight
    return weight * conflict_weights(batch.ids, mask.float(), raw, run.cfg)


def entropy_control(seq_adv: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, cfg, state: dict, world: int):
    """seq_adv (B,), entropy and mask (B, T) -> (B,): gated and shifted advantages. state["gate_on"] (None until
    the first step) records whether the starting policy's mean entropy was under the threshold."""
    keep, mean_ent = gtpo_entropy_gate(entropy, mask, threshold=cfg.entropy_threshold, enabled=cfg.entropy_gate)
    if state["gate_on"] is None:
        state["gate_on"] = bool(all_sum(mean_ent.sum(), world) / all_sum(len(mean_ent), world) <= cfg.entropy_threshold)
    keep = keep | (not state["gate_on"])
    return torch.where(keep.cpu(), gtpo_entropy_shift(seq_adv, mean_ent.cpu(), gamma=cfg.entropy_gamma), 0.0)


def conflict_weights(ids: torch.Tensor, mask: torch.Tensor, raw_adv: torch.Tensor, cfg) -> torch.Tensor:
    """Weights (B, T) of the conflict tokens. Positive vs negative by the sign of the raw group advantage (B,),
    as GTPO's paper and code, not of the entropy-shaped one; rows are completions, compared position by position."""
    return gtpo_conflict_weights(ids, mask, raw_adv, cfg.thoughts, w_pos=cfg.gtpo_w_pos, w_neg=cfg.gtpo_w_neg)
