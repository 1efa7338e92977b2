"""DAPO (arXiv 2503.14476): the wiring of two of its four changes; clip-higher and the token-mean loss are plain
flags (--clip-high 0.28, --aggregation token_mean).
- transform rewards: the soft overlong penalty (advantage.overlong_penalty) is added to each reward;
- transform rollouts: dynamic sampling redraws the groups whose rewards are all equal, from a stream of top-up
  prompts of its own; the groups still flat after --max-resample-rounds stay and drop out of the loss (kept)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from advantage import dynamic_sampling_keep, overlong_penalty
from cli import FlagError, out_of_range
from distributed import derive_seed
from pack import Group, per_group


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- rewards
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens of the limit (0 = off)
    dynamic_sampling: bool = False  # DAPO: replace prompts whose rewards are all equal
    max_resample_rounds: int = 3  # dynamic sampling: top-up rounds before keeping a flat group


PRESETS = {"dapo": dict(clip_high=0.28, aggregation="token_mean", dynamic_sampling=True, overlong_buffer=16)}


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(max_resample_rounds=">= 1", overlong_buffer=">= 0"))
    if cfg.overlong_buffer >= cfg.completion_limit:
        why = "must be shorter than the completion limit (--max-thought-tokens + --max-answer-tokens)"
        limits = ("max_thought_tokens", "max_answer_tokens")
        yield FlagError(("overlong_buffer",), why, limits, f"--overlong-buffer {cfg.overlong_buffer}")


def enabled(cfg) -> bool:
    return cfg.dynamic_sampling or cfg.overlong_buffer > 0


def stream_size(cfg) -> int:
    """--max-resample-rounds replacement prompts per global slot of each step (with --dynamic-sampling)."""
    return cfg.max_steps * cfg.prompts_per_step * cfg.max_resample_rounds if cfg.dynamic_sampling else 0


def streams(task, cfg) -> dict[str, list[dict]]:
    """The replacement prompts, a training stream of their own."""
    return {"topups": task.train(stream_size(cfg), derive_seed(cfg.seed, 1))} if cfg.dynamic_sampling else {}


def rewards(run, reward: torch.Tensor, step) -> torch.Tensor:
    """--overlong-buffer: the soft overlong penalty of each completion by its length in tokens."""
    return overlong(reward, step.lengths, run.cfg) if run.cfg.overlong_buffer else reward


def resample(run, groups: list[Group], step: int, slots: list[int], redraw: Callable, counts: dict) -> list[Group]:
    """--dynamic-sampling: the flat groups redrawn from the top-up stream (their number to counts["resampled"])."""
    if not run.cfg.dynamic_sampling:
        return groups
    groups, counts["resampled"] = dynamic_sampling(groups, step, slots, run.streams["topups"], run.cfg, redraw)
    return groups


def trained_mask(run, mask: torch.Tensor, groups: list[Group], batch) -> torch.Tensor:
    """--dynamic-sampling: the groups still flat after the top-ups drop out of the loss."""
    if not run.cfg.dynamic_sampling:
        return mask
    return mask & kept(groups).to(mask.device)[batch.group][:, None]


def overlong(reward: torch.Tensor, lengths: torch.Tensor, cfg) -> torch.Tensor:
    """Rewards [N] plus the soft penalty of completions whose length [N] enters the last --overlong-buffer tokens."""
    return reward + overlong_penalty(lengths, cfg.completion_limit, cfg.overlong_buffer)


def kept(groups: list[Group]) -> torch.Tensor:
    """[P] bool: the groups with some contrast in their rewards (the others have zero advantage)."""
    return dynamic_sampling_keep(per_group(groups, "reward"))


def dynamic_sampling(
    groups: list[Group], step: int, slots: list[int], topups: list[dict], cfg, redraw: Callable
) -> tuple[list[Group], int]:
    """Replace the groups whose K*M rewards are all equal with fresh prompts, slot by slot, for up to
    --max-resample-rounds rounds; redraw(examples, seeds) samples and scores them. Each global slot has its own
    top-ups and seeds, so the world size cannot change them. Returns the groups and how many were redrawn."""
    n_resampled = 0
    for rnd in range(1, cfg.max_resample_rounds + 1):
        redo = (~kept(groups)).nonzero().flatten().tolist()
        if not redo:
            break
        index = [(step * cfg.prompts_per_step + slots[i]) * cfg.max_resample_rounds + rnd - 1 for i in redo]
        seeds = [derive_seed(cfg.seed, step, slots[i], rnd, 1) for i in redo]
        for i, group in zip(redo, redraw([topups[j] for j in index], seeds)):
            groups[i] = group
        n_resampled += len(redo)
    return groups, n_resampled
