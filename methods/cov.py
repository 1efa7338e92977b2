"""Clip-Cov and KL-Cov (arXiv 2505.22617): the tokens whose log-prob and advantage covary most are where entropy
collapses. Clip-Cov drops a random few of the tokens in a covariance band from the surrogate; KL-Cov gives the top
tokens by covariance a |log-ratio| penalty. References: verl b178a3c verl/trainer/ppo/core_algos.py
(compute_policy_loss_clip_cov, compute_policy_loss_kl_cov); PRIME-RL/Entropy-Mechanism-of-RL 8850579
recipe/dapo/7b_clip_cov.sh and 7b_kl_cov.sh.
- Each selection is made once per step, after the advantages, from the score pass's log-probs (score_pass runs the
  policy when needs_scores), over every rank's tokens (distributed.gather_rows): neither the micro-batch split nor the
  world size can change it.
- Clip-Cov's drops are a keep mask that policy_loss multiplies into the surrogate's token weights (a dropped token
  still counts in the normaliser and keeps its KL term, as in the references); KL-Cov's selection goes to its
  objective, through the record's `selected`.
- Clip-Cov's random draw comes from a generator seeded by the run's seed and the step: a resumed run draws alike."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cli import FlagError, out_of_range
from distributed import derive_seed, gather_rows
from losses import CLIP, Objective, masked_log_ratio, need, on_mask


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    clip_cov_ratio: float = 2e-4  # Clip-Cov: fraction of the step's tokens dropped from the high-covariance band
    clip_cov_lb: float = 1.0  # Clip-Cov: the band's lower covariance bound
    clip_cov_ub: float = 5.0  # Clip-Cov: the band's upper covariance bound
    kl_cov_ratio: float = 2e-3  # KL-Cov: fraction of the step's tokens, top by covariance, given the |log-ratio| term
    kl_cov_coef: float = 1.0  # KL-Cov: coefficient of the |log-ratio| penalty on the selected tokens


PRESETS = {
    # Clip-Cov's recipe (7b_clip_cov.sh) clips the ratio to [1 - 1, 1 + 1]: no lower clip. --clip-low stays in [0, 1),
    # so 0.99: the two differ only for a ratio below 0.01
    "clip_cov": dict(loss="clip_cov", clip_low=0.99, clip_high=1.0, aggregation="token_mean"),
    "kl_cov": dict(loss="kl_cov", aggregation="token_mean", mu=2),  # ratio 2e-3, coef 1 (7b_kl_cov.sh)
}


def enabled(cfg) -> bool:
    return cfg.loss in ("clip_cov", "kl_cov")


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(clip_cov_ratio="(0, 1]", kl_cov_ratio="(0, 1]", kl_cov_coef=">= 0"))
    if cfg.clip_cov_lb >= cfg.clip_cov_ub:
        yield FlagError(("clip_cov_lb",), f"must be below --clip-cov-ub, got {cfg.clip_cov_lb} and {cfg.clip_cov_ub}")


def needs_scores(cfg) -> bool:
    """The selections need the policy's log-probs before the update (the score pass)."""
    return True


def select(run, batch, adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None, dict]:
    """This rank's rows (B, T) -> (keep (B, T) bool: Clip-Cov's, all True for KL-Cov; KL-Cov's selected (B, T) or
    None; metrics). The statistics are the whole step's."""
    cfg, rank, world = run.cfg, run.rank, run.world
    (logp_all, mine), (adv_all, _), (mask_all, _) = [
        gather_rows(x.float(), rank, world) for x in (batch.score_logp, adv, mask)
    ]
    mask_all = mask_all.bool()
    keep, selected, metrics = mask_all.clone(), None, {}
    if cfg.loss == "clip_cov":
        generator = torch.Generator(device=adv.device).manual_seed(derive_seed(cfg.seed, run.state["step"], -1))
        kw = dict(ratio=cfg.clip_cov_ratio, low=cfg.clip_cov_lb, high=cfg.clip_cov_ub, generator=generator)
        keep &= clip_cov_mask(logp_all, adv_all, mask_all, **kw)
    else:
        selected_all = kl_cov_select(logp_all, adv_all, mask_all, ratio=cfg.kl_cov_ratio)
        selected = selected_all[mine, : mask.shape[1]]
        metrics["kl_cov/selected_frac"] = (selected_all.sum() / mask_all.sum().clamp(min=1)).item()
    keep = keep | ~mask_all  # outside the trained tokens the weight is already 0: leave it
    return keep[mine, : mask.shape[1]], selected, metrics


def kl_cov_select(logp: Tensor, adv: Tensor, mask: Tensor, *, ratio: float) -> Tensor:
    """KL-Cov's token selection: the top max(1, int(ratio * n)) tokens by covariance of log-prob and advantage.

    logp (the scoring pass's log-probs), adv, mask: [B, T], the whole step -> selected [B, T] bool.
    cov_t = (A_t - mean A) (logp_t - mean logp), both means over the step's n masked tokens. ratio is a fraction
    (the paper's k: 2e-3 for its 7B model, 2e-4 for 32B; its recipe's k_percent 0.2 is in percent). Follows verl's
    compute_policy_loss_kl_cov, which selects within each micro-batch with the current log-probs; the step's
    selection keeps the gradient independent of the micro-batch split, and equals verl's for the first epoch over a
    step taken as one micro-batch. Ties at the cut-off are broken by torch.topk (unspecified order).
    """
    need(0 < ratio <= 1, f"kl_cov_select: --kl-cov-ratio must be in (0, 1], got {ratio}")
    mask = mask.bool()
    selected = torch.zeros_like(mask)
    n = int(mask.sum())
    if n == 0:
        return selected
    a, lp = adv.detach()[mask], logp.detach()[mask]
    cov = (a - a.mean()) * (lp - lp.mean())  # (n,) in row-major order of the masked tokens
    top = torch.nonzero(mask)[torch.topk(cov, max(1, int(n * ratio))).indices]  # (k, 2)
    selected[top[:, 0], top[:, 1]] = True
    return selected


def clip_cov_mask(
    logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    ratio: float,
    low: float = 1.0,
    high: float = 5.0,
    generator: torch.Generator,
) -> Tensor:
    """Clip-Cov (arXiv 2505.22617): drop a random few of the tokens whose covariance lies in (low, high).

    logp (the scoring pass's log-probs), adv, mask: [B, T], the whole step -> keep [B, T] bool (False off the mask).
    cov_t = (A_t - mean A) (logp_t - mean logp) over the step's n masked tokens; of the tokens with
    low < cov_t < high, max(int(ratio * n), 1) are drawn uniformly without replacement (all of them if fewer) and
    dropped: the caller multiplies keep into the token weights, so they carry neither loss nor gradient (verl
    multiplies their loss by 0) and still count in the normaliser. The policy loss is otherwise the clipped
    surrogate; the paper's recipe (recipe/dapo/7b_clip_cov.sh) sets the PPO clip to 1 / 1 and token_mean, with
    ratio 2e-4, low 1, high 5 (verl's defaults too). The draw is torch.randperm over the candidates in row-major
    order from `generator` (seed it from the run's seed and step: the draw is then the same on resume).
    Follows verl's compute_policy_loss_clip_cov. Departures: it selects within each micro-batch, with the current
    log-probs, and excludes tokens the PPO clip already cut; here the selection is made once per step from the
    scoring pass (before the update nothing is clipped yet), so the micro-batch split cannot change it; for mu = 1
    with the step as one micro-batch the rule is verl's (the draw itself comes from `generator`, verl's from the
    global RNG). Means are exact (verl adds 1e-8 to the count).
    """
    need(0 < ratio <= 1, f"clip_cov_mask: --clip-cov-ratio must be in (0, 1], got {ratio}")
    need(low < high, f"clip_cov_mask: --clip-cov-lb must be below --clip-cov-ub, got {low} and {high}")
    mask = mask.bool()
    keep = mask.clone()
    n = int(mask.sum())
    if n == 0:
        return keep
    a = torch.where(mask, adv.detach(), torch.zeros_like(adv))
    lp = torch.where(mask, logp.detach(), torch.zeros_like(logp))  # padded log-probs may be -inf
    cov = (a - a.sum() / n) * (lp - lp.sum() / n)
    candidates = torch.nonzero(mask & (cov > low) & (cov < high))  # (N, 2) row-major
    n_drop = max(int(ratio * n), 1)
    order = torch.randperm(len(candidates), generator=generator, device=generator.device).to(candidates.device)
    drop = candidates[order[:n_drop]]
    keep[drop[:, 0], drop[:, 1]] = False
    return keep


def kl_cov_objective(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any, *, selected: Tensor
) -> tuple[Tensor, Tensor]:
    """KL-Cov (arXiv 2505.22617): the unclipped surrogate, with a |log-ratio| penalty on the high-covariance tokens.

    obj = r * A - hp.kl_cov_coef * |logp - old_logp| * selected, r = exp(logp - old_logp), no clip anywhere.
    selected: [B, T] bool, the step's top tokens by covariance (kl_cov_select over the whole step, sliced to this
    call's rows); the table calls this entry with it bound (functools.partial), the one argument beyond the contract.
    d obj / d logp = r A - coef * sign(l) on selected tokens. At r = 1 (mu = 1, or the first epoch) |l| has gradient 0,
    so the penalty acts only from the second epoch on: with mu = 1 KL-Cov is the plain policy gradient.
    No token is cut. Aggregation: token_mean in the paper's recipe (recipe/dapo/7b_kl_cov.sh). Follows verl's
    compute_policy_loss_kl_cov, which selects within each micro-batch; here the selection is the whole step's.
    """
    mask = mask.bool()
    coef = float(hp.kl_cov_coef)
    need(coef >= 0, f"kl_cov_objective: --kl-cov-coef must be >= 0, got {coef}")
    shapes = f"selected {tuple(selected.shape)} and mask {tuple(mask.shape)}"
    need(selected.shape == mask.shape, f"kl_cov_objective: {shapes} must have one shape")
    adv, log_ratio = on_mask(adv, mask), masked_log_ratio(logp, old_logp, mask)
    obj = torch.exp(log_ratio) * adv - coef * log_ratio.abs() * selected.to(logp.dtype)
    return on_mask(obj, mask), torch.zeros_like(mask)


LOSSES = {
    "clip_cov": CLIP,  # the clipped surrogate; Clip-Cov's drops are in the step's selections (select)
    "kl_cov": Objective(kl_cov_objective, takes=("selected",)),
}
