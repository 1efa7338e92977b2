"""A-GRAE (arXiv 2602.05548): asymmetric advantages. The GRPO (or Dr. GRPO) advantage times a difficulty weight
of the group's accuracy p and the batch's P, positive entries times min(1, P / alpha) (advantage.agrae_advantages).
P is the batch accuracy measured before any transform of the rollouts (DAPO's dynamic sampling)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor

from advantage import agrae_advantages
from cli import FlagError, out_of_range
from pack import per_group


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- advantages
    agrae_alpha: float = 1.0  # A-GRAE: positive advantages times min(1, batch accuracy / alpha)


PRESETS = {"agrae": dict(advantage="agrae")}


def enabled(cfg) -> bool:
    return cfg.advantage == "agrae"


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(agrae_alpha="> 0"))
    if cfg.advantage == "agrae" and cfg.answers > 1:
        yield FlagError(("advantage",), "needs --answers 1", ("answers",), "--advantage agrae")


def asymmetric_advantages(run, groups: list, reward: Tensor, batch_accuracy: float) -> tuple[None, Tensor]:
    """--advantage agrae: rewards [P, G, 1] -> answer advantages, with the task's 0/1 correctness as the accuracy."""
    kw = dict(correct=per_group(groups, "correct"), alpha=run.cfg.agrae_alpha, batch_accuracy=batch_accuracy)
    adv = agrae_advantages(reward.view(len(reward), -1), **kw, std_normalize=run.cfg.std_normalize)
    return None, adv.view(reward.shape)


ADVANTAGES = {"agrae": asymmetric_advantages}
