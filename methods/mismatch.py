"""Rollout-mismatch corrections: a sampler whose numerics differ from the trainer's (the --rollout-dtype bfloat16
copy, another kernel) samples from pi_sampler, not pi_old; each token's (or sequence's) loss is reweighted by
pi_old / pi_sampler, truncated or masked (--rollout-is, --tis-floor, --tis-cap; IcePop is token_mask 0.5 / 5).
References: Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL training", truncated IS);
TRL f2cd577 vllm_importance_sampling_mode; verl b178a3c verl/trainer/ppo/rollout_corr_helper.py; slime 624b824
icepop. Per micro-batch, in the update, from the scoring parameters' log-probs; on the surrogate only."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError, UserError, out_of_range
from distributed import rollout_dtype
from losses import Tokens, need

ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    tis_cap: float = 2.0  # bf16 rollout copy or --staleness: losses times min(pi_train / pi_sampler, CAP) (0 = off)
    rollout_is: str = "token_truncate"  # the --tis-cap correction: per token or sequence, truncate or mask (0 weight)
    tis_floor: float = 0.0  # lower bound of the correction's ratio (IcePop: --rollout-is token_mask, 0.5 and 5)


CHOICES = dict(rollout_is=ROLLOUT_IS_MODES)


def enabled(cfg) -> bool:
    """On when --tis-cap is not 0 and the sampler's policy is not the trainer's: a --rollout-dtype copy samples
    (bfloat16 on CUDA by default), or the rollouts are stale (--staleness K, methods/staleness.py: the weight is
    pi_prox / pi_behaviour, the decoupled loss's behaviour weight, under --is-anchor old)."""
    return cfg.tis_cap > 0 and (rollout_dtype(cfg) != "float32" or getattr(cfg, "staleness", 0) > 0)


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(tis_cap=">= 0", tis_floor=">= 0"))
    if cfg.tis_cap > 0 and cfg.tis_floor >= cfg.tis_cap:
        yield FlagError(("tis_floor",), f"must be below --tis-cap, got {cfg.tis_floor} and {cfg.tis_cap}")
    if cfg.rollout_is.startswith("sequence") and cfg.answers > 1:
        yield FlagError(("rollout_is",), "needs --answers 1", ("answers",), f"--rollout-is {cfg.rollout_is}")


def check_rollout_dtype(cfg, rollout: str) -> None:
    """Refused before any step: a mode or floor on a run that samples with its float32 policy, on-policy (nothing
    to correct)."""
    if (
        rollout == "float32"
        and not getattr(cfg, "staleness", 0)
        and (cfg.rollout_is != "token_truncate" or cfg.tis_floor > 0)
    ):
        why = "this run samples with its float32 policy, on-policy, so there is nothing to correct"
        fix = "pass --rollout-dtype bfloat16 or --staleness K"
        what = "--rollout-is and --tis-floor correct a --rollout-dtype bfloat16 copy or stale rollouts"
        raise UserError(f"{what}; {why}: {fix}")


def micro_batch(run, tok: Tokens, mb, sampled: Tensor, sums: dict, epoch: int) -> Tokens:
    """With a sampler copy: the micro-batch's importance weights (the first epoch's go to the tis/ metrics)."""
    cfg = run.cfg
    kw = dict(mode=cfg.rollout_is, low=cfg.tis_floor, high=cfg.tis_cap)
    tok.is_weight = w = mismatch_is_weights(tok.old_logp, mb.sampler_logp, sampled, **kw)
    if epoch == 0:
        sums["tis"] = sums.get("tis", 0.0) + (w * sampled).sum().item()
        bound = ((w >= cfg.tis_cap) | (w <= cfg.tis_floor)) & sampled
        sums["tis_capped"] = sums.get("tis_capped", 0.0) + bound.sum().item()
    return tok


def mismatch_is_weights(
    old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, *, mode: str, low: float = 0.0, high: float = 3.0
) -> Tensor:
    """Importance weights for a sampler whose numerics differ from the trainer's: [B, T] each -> weight [B, T].

    rho = pi_old / pi_sampler per token (old_logp: the trainer's log-probs at the sampling parameters), or per
    sequence rho_i = exp(sum over row i of the log-ratios), the product of its token ratios (not their geometric
    mean), on each of its tokens. Then, with bounds [low, high]:
      token_truncate / sequence_truncate  w = clamp(rho, low, high)
      token_mask / sequence_mask          w = rho where low <= rho <= high, else 0 (the ratio stays the weight)
    low = 0 is no lower bound; high may be math.inf for the masks. The caller multiplies w into the token weights,
    so masked tokens still count in the normaliser (TRL, slime). Detached; 1 off the mask.
    Follows TRL's vllm_importance_sampling_mode (default sequence_mask, clip_max 3, no clip_min). IcePop (arXiv
    2510.18855) is token_mask with [0.5, 5] (TRL's test of it; slime's icepop_function computes the same). verl's
    equivalents: rollout_is token/sequence with rollout_is_threshold (truncation, default 2, no lower bound, log-ratio
    clamped to +-20 before exp: identical unless a bound lies beyond e^+-20); its rejection sampling (rollout_rs
    token_k1, seq_sum_k1) is a 0/1 mask without the ratio, and it DROPS the rejected tokens from the normaliser
    (response_mask is rewritten): for that, compute the token weights from mask & (w > 0) and leave w out. Its k1
    bounds apply to -log rho, i.e. to 1 / rho: the same as here for bounds symmetric in log space (0.5, 2).
    token_truncate with low = 0, high = C is the project's per-token truncated IS at cap C.
    """
    modes = ", ".join(ROLLOUT_IS_MODES)
    need(mode in ROLLOUT_IS_MODES, f"mismatch_is_weights: unknown mode {mode!r}; choose one of {modes}")
    need(0 <= low < high, f"mismatch_is_weights: need 0 <= --tis-floor < --tis-cap, got {low} and {high}")
    need(mode.endswith("mask") or high < math.inf, "mismatch_is_weights: a truncation needs a finite --tis-cap")
    shapes = f"old_logp {tuple(old_logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} and mask {tuple(mask.shape)}"
    need(old_logp.shape == sampler_logp.shape == mask.shape, f"mismatch_is_weights: {shapes} must have one shape.")
    mask = mask.bool()
    log_rho = torch.where(mask, old_logp.detach() - sampler_logp.detach(), torch.zeros_like(old_logp))
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = torch.exp(log_rho)
    if mode.endswith("truncate"):
        w = rho.clamp(low, high)
    else:
        w = torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho))
    return torch.where(mask, w, torch.ones_like(w))


def truncated_is_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """Truncated importance weights for rollouts sampled by other numerics than the trainer's
    (a bf16 copy of the weights, another kernel): w = min(pi_old / pi_sampler, cap) per token, [B, T].

    old_logp: the trainer's log-probs at the sampling-time parameters; sampler_logp: the sampler's own
    for the same tokens; mask: the tokens that exist (w = 1 elsewhere, so padded garbage cannot reach
    the loss). No gradient flows through w. Multiplying each token's loss weight by w is the
    correction of Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL
    training", truncated IS; verl's tis_imp_ratio_cap, default 2): the gradient of the clipped surrogate
    becomes an importance-weighted estimate under pi_old instead of pi_sampler, with its variance
    bounded by the cap. The tokens the sampler overrated (w < 1) are not clipped from below."""
    need(cap > 0, f"truncated_is_weights: cap must be > 0, got {cap}.")
    return mismatch_is_weights(old_logp, sampler_logp, mask, mode="token_truncate", low=0.0, high=cap)
