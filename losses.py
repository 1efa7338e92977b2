"""losses.py: the policy loss, as a table of objectives with one signature (chosen by --loss) and the one
wrapper the trainer calls, policy_loss, which adds what every objective shares: the token weights (the
step's aggregation), the KL penalty, the off-policy shaping of tokens the policy did not sample, diagnostics.

An entry of LOSSES is objective(logp, old_logp, adv, mask, hp) -> (obj, cut):
  logp, old_logp, adv, mask  [B, T]; rows are sequences, mask (bool) the tokens that exist
  hp                         any object carrying the hyperparameters as attributes (the trainer's TrainConfig)
  obj                        [B, T] the per-token objective to MAXIMISE; a sequence-level objective (GSPO) puts
                             its sequence's value on each of its tokens
  cut                        [B, T] bool: the tokens whose gradient the objective cuts (clip_frac); all False if none
Off the mask an objective may see -inf or nan (padding): it must keep them out of its value and gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def kl3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 with d = ref_logp - logp.
    Always >= 0 and 0 where logp == ref_logp; unbiased for the KL under samples from pi."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


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
    if not cap > 0:
        raise ValueError(f"truncated_is_weights: cap must be > 0, got {cap}.")
    if old_logp.shape != sampler_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"truncated_is_weights: old_logp {tuple(old_logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} "
            f"and mask {tuple(mask.shape)} must have one shape."
        )
    m = mask.bool()
    zero = torch.zeros_like(old_logp)
    w = torch.exp(torch.where(m, old_logp.detach() - sampler_logp.detach(), zero)).clamp(max=cap)
    return torch.where(m, w, torch.ones_like(w))


# ----------------------------------------------------------------------------------------------
# The table: importance ratios and the objectives built on them


def token_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """rho = exp(logp - old_logp) per token on the mask, 1 elsewhere (the difference is zeroed before exp:
    padded log-probs may be -inf or garbage, and exp(inf) * 0 would put nan into the loss and its gradient)."""
    return torch.exp(torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp)))


def sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's (arXiv 2507.18071) s_i = exp(mean over row i's masked tokens of (logp - old_logp)), in the
    GSPO-token form sg[s_i] * exp(logp_t - sg[logp_t]): the value is s_i on every token of the row, the
    gradient s_i * grad logp_t, GSPO's gradient for uniform row weights, and right for per-token advantages."""
    log_ratio = torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    log_s = log_ratio.detach().sum(-1, keepdim=True) / n  # (B, 1) log of the geometric mean ratio
    return torch.exp(log_s + log_ratio - log_ratio.detach())


def clipped(ratio: Tensor, adv: Tensor, mask: Tensor, hp) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A), and the tokens where the
    clip binds (zero gradient): rho below 1 - clip_low with A < 0, above 1 + clip_high with A > 0."""
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - hp.clip_low, 1 + hp.clip_high) * adv)
    r = ratio.detach()
    cut = mask & (((r < 1 - hp.clip_low) & (adv < 0)) | ((r > 1 + hp.clip_high) & (adv > 0)))
    return obj, cut


def clip(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp) -> tuple[Tensor, Tensor]:
    """GRPO's clipped surrogate on the token ratio (DAPO's clip-higher: hp.clip_high > hp.clip_low)."""
    return clipped(token_ratio(logp, old_logp, mask), adv, mask, hp)


def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp) -> tuple[Tensor, Tensor]:
    """GSPO: the clipped surrogate on the sequence ratio (its small ranges: clip_low 3e-4, clip_high 4e-4).
    With mu = 1 every ratio is 1 and it is the clip loss's gradient."""
    return clipped(sequence_ratio(logp, old_logp, mask), adv, mask, hp)


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


LOSSES: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {"clip": clip, "gspo": gspo, "cispo": cispo}
SEQUENCE_LEVEL = ("gspo",)  # objectives whose ratio is one per sequence: ratio_mean reports that ratio


def loss_name(hp) -> str:
    """The objective hp asks for: hp.loss, or GSPO's where hp.sequence_ratio is set (the trainer's
    --sequence-ratio, GSPO's switch before --loss existed, kept so that existing commands and runs work)."""
    return "gspo" if getattr(hp, "sequence_ratio", False) else hp.loss


# ----------------------------------------------------------------------------------------------
# The wrapper the trainer calls


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    weight: Tensor,
    hp,
    *,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    off_policy: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """loss = -sum(weight * (obj - hp.beta * KL3)), obj = LOSSES[loss_name(hp)] (the clip loss:
    min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A)).

    logp, old_logp, adv, weight (and ref_logp, mask): [B, T]. The weight carries the aggregation normaliser
    (advantage.token_weights), so the loss is a plain sum and micro-batch losses add up. mask: tokens that
    exist (default weight != 0); it must cover every token with non-zero weight. For packed GRPO-MA rows a
    sequence-level objective spans the whole row.
    off_policy: [B, T] bool, tokens not sampled from pi_old (e.g. an injected reference solution, see
    advantage.splice_anchor_rewards). There LUFFY's policy shaping (arXiv 2504.14945; its code's
    off_policy_reshape="p_div_p_0.1") replaces the objective: obj = f(p) * A with f(p) = p / (p + hp.anchor_gamma),
    p = exp(logp), gradient through p (d f / d logp = gamma p / (p + gamma)^2, so low-probability expert tokens
    still learn), no clip and no old_logp (unused there, may be garbage). The objective sees only the other
    tokens (they are left out of GSPO's sequence mean); the KL term, if any, still covers them. None (default)
    is the plain loss, bit for bit.
    Metrics (floats, no grad) are means over this call's masked tokens, i.e. partial for one micro-batch: the
    trainer averages them weighted by metrics["num_tokens"]. clip_frac_low / clip_frac_high split clip_frac by
    the sign of the advantage. Off-policy tokens are never clipped; with off_policy given, "off_policy_frac"
    (of the masked tokens) and "off_policy_p_mean" (mean p over this call's off-policy tokens) are added.
    """
    name = loss_name(hp)
    if hp.beta != 0.0 and ref_logp is None:
        raise ValueError("policy_loss: beta != 0 needs ref_logp (the reference model's log-probs).")
    if off_policy is not None and not hp.anchor_gamma > 0:
        raise ValueError(f"policy_loss: anchor_gamma (off-policy shaping) must be > 0, got {hp.anchor_gamma}.")
    mask = weight != 0 if mask is None else mask.bool()
    off = None if off_policy is None else off_policy.bool() & mask
    on = mask if off is None else mask & ~off  # tokens sampled from pi_old: the objective's ratio applies
    obj, cut = LOSSES[name](logp, old_logp, adv, on, hp)
    if off is not None:
        p = torch.exp(torch.where(off, logp, torch.zeros_like(logp)))  # (B, T), with grad; 1 off these tokens
        obj = torch.where(off, p / (p + hp.anchor_gamma) * adv, obj)
    kl = None
    if ref_logp is not None:
        zero = torch.zeros_like(logp)
        kl = kl3(torch.where(mask, logp, zero), torch.where(mask, ref_logp.detach(), zero))
        obj = obj - hp.beta * kl
    loss = -(weight * torch.where(mask, obj, torch.zeros_like(obj))).sum()

    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1)
        r = (sequence_ratio if name in SEQUENCE_LEVEL else token_ratio)(logp, old_logp, on)
        names = ["clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "num_tokens"]
        vals = [(cut & (adv < 0)).sum() / n_tok, (cut & (adv > 0)).sum() / n_tok, cut.sum() / n_tok]
        vals += [(r * mask).sum() / n_tok, mask.sum().float()]
        if kl is not None:
            names.append("kl")
            vals.append((kl.detach() * mask).sum() / n_tok)
        if off is not None:
            names += ["off_policy_frac", "off_policy_p_mean"]
            vals += [off.sum() / n_tok, (p.detach() * off).sum() / off.sum().clamp(min=1)]
        metrics = dict(zip(names, torch.stack([v.float() for v in vals]).tolist()))  # one device sync
    return loss, metrics
