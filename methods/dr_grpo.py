"""Dr. GRPO (arXiv 2503.20783): GRPO without its two length and difficulty biases: rewards centred, not divided by
the group's std (--no-std-normalize), and each sequence's token sum divided by one constant, the completion limit
(--aggregation seq_mean_token_sum_norm). Both are core flags; this file is its preset."""

from __future__ import annotations

from collections.abc import Iterator

from cli import FlagError

PRESETS = {"dr_grpo": dict(std_normalize=False, aggregation="seq_mean_token_sum_norm")}


def enabled(cfg) -> bool:
    return False  # flags of the core only: nothing to call


def check(cfg) -> Iterator[FlagError]:
    return iter(())
