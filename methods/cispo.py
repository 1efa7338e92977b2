"""CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight clipped and detached, so every token keeps its
gradient (the objective's docstring says how TRL's and verl's versions are reconciled)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from cli import FlagError
from losses import Objective, token_ratio

# TRL's recommended cap of 5 on the importance weight, its token mean; mu = 2, or every weight is 1
PRESETS = {"cispo": dict(loss="cispo", clip_high=4.0, aggregation="token_mean", mu=2)}


def enabled(cfg) -> bool:
    return cfg.loss == "cispo"


def check(cfg) -> Iterator[FlagError]:
    return iter(())


def cispo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): sg[min(rho, 1 + clip_high)] * A * logp. The importance weight is
    clipped and detached, so every token keeps the gradient w * A * grad logp: the clip bounds a token's weight,
    never cuts its gradient (cut is all False). The value is w * A * logp, not a ratio's.
    Read from trl/trainer/grpo_trainer.py (loss_type "cispo", commit f2cd577: clamp(coef_1, max=epsilon_high)
    .detach(), no lower bound, epsilon_high an absolute cap, recommended 5.0) and verl/trainer/ppo/core_algos.py
    (compute_policy_loss_cispo, commit b178a3c: clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()).
    Where they disagree: the cap is verl's 1 + clip_high (--clip-high keeps its meaning; TRL's 5.0 is
    --clip-high 4), and there is no lower bound, as TRL and the paper's runs (its lower bound never binds), so
    --clip-low is unused. Both aggregate by token mean (--aggregation token_mean, the cispo preset's)."""
    weight = token_ratio(logp, old_logp, mask).clamp(max=1 + hp.clip_high).detach()
    return weight * adv * torch.where(mask, logp, torch.zeros_like(logp)), torch.zeros_like(mask)


LOSSES = {"cispo": Objective(cispo)}
