"""Token selections over a whole step: the wiring of Clip-Cov and KL-Cov (arXiv 2505.22617, --loss clip_cov and
--loss kl_cov) and of the 80/20 high-entropy mask (arXiv 2506.01939, --top-entropy-fraction). Formulas: losses.py.
- Each is decided once per step, after the advantages, from the score pass's log-probs and entropies (score_pass
  runs the policy when needs_scores), over every rank's tokens (distributed.gather_rows): neither the micro-batch
  split nor the world size can change it.
- Clip-Cov and the entropy mask are a keep mask that policy_loss multiplies into the surrogate's token weights (GMPO:
  into its geometric mean) while the KL keeps every token (a dropped token still counts in the normaliser, as in
  the references); KL-Cov's selection goes to its objective, through policy_loss's `selected`.
- Clip-Cov's random draw comes from a generator seeded by the run's seed and the step: a resumed run draws alike."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cli import FlagError, out_of_range
from distributed import derive_seed, gather_rows
from losses import clip_cov_mask, high_entropy_mask, kl_cov_select


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    clip_cov_ratio: float = 2e-4  # Clip-Cov: fraction of the step's tokens dropped from the high-covariance band
    clip_cov_lb: float = 1.0  # Clip-Cov: the band's lower covariance bound
    clip_cov_ub: float = 5.0  # Clip-Cov: the band's upper covariance bound
    kl_cov_ratio: float = 2e-3  # KL-Cov: fraction of the step's tokens, top by covariance, given the |log-ratio| term
    kl_cov_coef: float = 1.0  # KL-Cov: coefficient of the |log-ratio| penalty on the selected tokens
    top_entropy_fraction: float = 1.0  # 80/20 rule: train only on this top fraction of the step's tokens by entropy


PRESETS = {
    # Clip-Cov's recipe (7b_clip_cov.sh) clips the ratio to [1 - 1, 1 + 1]: no lower clip. --clip-low stays in [0, 1),
    # so 0.99: the two differ only for a ratio below 0.01
    "clip_cov": dict(loss="clip_cov", clip_low=0.99, clip_high=1.0, aggregation="token_mean"),
    "kl_cov": dict(loss="kl_cov", aggregation="token_mean", mu=2),  # ratio 2e-3, coef 1 (7b_kl_cov.sh)
}


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(clip_cov_ratio="(0, 1]", kl_cov_ratio="(0, 1]", top_entropy_fraction="[0, 1]"))
    yield from out_of_range(cfg, dict(kl_cov_coef=">= 0"))
    if cfg.clip_cov_lb >= cfg.clip_cov_ub:
        yield FlagError(("clip_cov_lb",), f"must be below --clip-cov-ub, got {cfg.clip_cov_lb} and {cfg.clip_cov_ub}")


def needs_scores(cfg) -> bool:
    """A selection is on: the score pass measures the policy's log-probs and entropies."""
    return cfg.loss in ("clip_cov", "kl_cov") or cfg.top_entropy_fraction < 1


def select(
    logp: torch.Tensor, adv: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, cfg, step: int, rank: int, world
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """logp, adv, entropy, mask (B, T): this rank's rows -> (keep (B, T) bool, the selections' surviving tokens;
    KL-Cov's selected (B, T) bool or None; the step's metrics). The statistics are the whole step's."""
    parts = [gather_rows(x.float(), rank, world) for x in (logp, adv, entropy, mask)]
    (logp_all, mine), (adv_all, _), (ent_all, _), (mask_all, _) = parts
    mask_all = mask_all.bool()
    keep = mask_all.clone()
    selected, metrics = None, {}
    if cfg.top_entropy_fraction < 1:
        keep &= high_entropy_mask(ent_all, mask_all, cfg.top_entropy_fraction)
    if cfg.loss == "clip_cov":
        generator = torch.Generator(device=logp.device).manual_seed(derive_seed(cfg.seed, step, -1))
        kw = dict(ratio=cfg.clip_cov_ratio, low=cfg.clip_cov_lb, high=cfg.clip_cov_ub, generator=generator)
        keep &= clip_cov_mask(logp_all, adv_all, mask_all, **kw)
    if cfg.loss == "kl_cov":
        selected_all = kl_cov_select(logp_all, adv_all, mask_all, ratio=cfg.kl_cov_ratio)
        selected = selected_all[mine, : mask.shape[1]]
        metrics["kl_cov/selected_frac"] = (selected_all.sum() / mask_all.sum().clamp(min=1)).item()
    metrics["token_select/kept_frac"] = (keep.sum() / mask_all.sum().clamp(min=1)).item()
    keep = keep | ~mask_all  # outside the trained tokens the weight is already 0: leave it
    return keep[mine, : mask.shape[1]], selected, metrics
