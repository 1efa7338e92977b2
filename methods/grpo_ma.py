"""GRPO-MA (arXiv 2509.24494): several answers per thought. The core loop is GRPO-MA's tree (--answers M; M = 1 is
plain GRPO), so its sampling, advantages and token weights are the core's (sampler.sample_tree,
advantage.grpo_ma_advantages, grpo_ma_token_weights); this file is its preset: 4 thoughts x 4 answers."""

from __future__ import annotations

from collections.abc import Iterator

from cli import FlagError

PRESETS = {"grpo_ma": dict(thoughts=4, answers=4)}


def enabled(cfg) -> bool:
    return False  # the core's own tree: nothing to call


def check(cfg) -> Iterator[FlagError]:
    return iter(())
