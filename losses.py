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

The newer objectives (SAPO, GMPO, KL-Cov, DPPO, GPG) follow the same contract; the per-token masks and weights that
come with them (Clip-Cov, KL-Cov's selection, the high-entropy mask, DeepSeek-V3.2's off-policy mask, the rollout
mismatch weights) return a [B, T] bool or float that goes into policy_loss's record (Tokens.keep, .is_weight,
.selected) and acts on the surrogate only: the KL penalty keeps the plain weight, as in the references. Those needing
statistics of the whole step take the whole step's tensors, from the scoring pass, so the micro-batch split cannot
change them.

References read, at these versions (a departure from them is said where it is made):
  TRL v1.9.0+26 (f2cd577): trl/trainer/grpo_trainer.py, grpo_config.py, experimental/gmpo/gmpo_trainer.py
  verl v0.7.0+125 (b178a3c): verl/trainer/ppo/core_algos.py, rollout_corr_helper.py, trainer/config/actor/actor.yaml
  slime v0.3.1+38 (624b824): slime/utils/ppo_utils.py, slime/backends/megatron_utils/loss.py
  prime-rl v0.8.1.dev67 (559b447): src/prime_rl/trainer/rl/loss.py, packages/prime-rl-configs/.../trainer.py
  GPG's code (AMAP-ML/GPG e096da8): open-r1/src/open_r1/gpg_trainer.py, configs.py, train.sh
  GMPO's code (callsys/GMPO 205b2bf): train_zero_math_gmpo.py, scripts/qwen2.5-math-7b-gmpo.sh
  Clip-Cov / KL-Cov code (PRIME-RL/Entropy-Mechanism-of-RL 8850579): verl/trainer/ppo/core_algos.py, recipe/dapo/*.sh
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    _need(cap > 0, f"truncated_is_weights: cap must be > 0, got {cap}.")
    return mismatch_is_weights(old_logp, sampler_logp, mask, mode="token_truncate", low=0.0, high=cap)


# ----------------------------------------------------------------------------------------------
# The table: importance ratios and the objectives built on them


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log(pi / pi_old) on the mask, 0 elsewhere: padded log-probs may be -inf or garbage, and exp of them times a
    zero weight would still put nan into the loss and its gradient."""
    return torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))


def token_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """rho = exp(logp - old_logp) per token on the mask, 1 elsewhere (the difference is zeroed before exp:
    padded log-probs may be -inf or garbage, and exp(inf) * 0 would put nan into the loss and its gradient)."""
    return torch.exp(_log_ratio(logp, old_logp, mask))


def sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's (arXiv 2507.18071) s_i = exp(mean over row i's masked tokens of (logp - old_logp)), in the
    GSPO-token form sg[s_i] * exp(logp_t - sg[logp_t]): the value is s_i on every token of the row, the
    gradient s_i * grad logp_t, GSPO's gradient for uniform row weights, and right for per-token advantages."""
    log_ratio = _log_ratio(logp, old_logp, mask)
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
    With mu = 1 every ratio is 1 and it is the clip loss's gradient. The ratio averages every trained token (mask);
    a selection (the 80/20 mask) acts on the weights only, as TRL's and verl's: the value is TRL's sequence-level
    loss times the selection, and in the token form the gradient reaches only the kept tokens (TRL's sequence form
    spreads each row's, of equal total, over every token, the dropped ones too)."""
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


# ----------------------------------------------------------------------------------------------
# The field's newer objectives (same contract)


def _on_mask(x: Tensor, mask: Tensor) -> Tensor:
    """x on the mask, 0 elsewhere (entries apply it to adv first: padded garbage times a zero gradient is nan)."""
    return torch.where(mask, x, torch.zeros_like(x))


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def sapo_objective(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any) -> tuple[Tensor, Tensor]:
    """SAPO (arXiv 2511.20347): a smooth gate in place of PPO's hard clip, steeper for negative advantages.

    obj = f(r) * A with f(r) = (4 / tau) * sigmoid(tau * (r - 1)), r = exp(logp - old_logp) per token, and
    tau = hp.sapo_tau_pos where A > 0, hp.sapo_tau_neg elsewhere (the paper and both references: 1.0 and 1.05).
    d obj / d logp = 4 s (1 - s) r A with s = sigmoid(tau (r - 1)): exactly A at r = 1 (on-policy SAPO is the plain
    policy gradient), fading smoothly to 0 as r leaves 1, faster for the larger tau. No token is cut.
    Aggregation: the references use seq_mean_token_mean (verl forces it; TRL's "sapo" shares GRPO's); other weights
    change only how tokens are averaged. Follows TRL's _compute_loss ("sapo") and verl's compute_policy_loss_sapo;
    the log-ratio is clamped to [-20, 20] before exp as verl does (TRL does not): an overflowing r would make the
    gate's gradient 0 * inf = nan, and no real update moves a token's log-prob by 20.
    """
    mask = mask.bool()
    tau_pos, tau_neg = float(hp.sapo_tau_pos), float(hp.sapo_tau_neg)
    bad = f"--sapo-tau-pos and --sapo-tau-neg must be > 0, got {tau_pos} and {tau_neg}"
    _need(tau_pos > 0 and tau_neg > 0, f"sapo_objective: {bad}")
    adv = _on_mask(adv, mask)
    ratio = torch.exp(_log_ratio(logp, old_logp, mask).clamp(-20.0, 20.0))
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    return _on_mask(gate * adv, mask), torch.zeros_like(mask)


def gmpo_objective(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any, *, keep: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios, each clipped in log space on its sign's side.

    For row i with n_i tokens: l_t = logp_t - old_logp_t, c_t = clamp(l_t, -hp.clip_low, hp.clip_high), where the
    clip bounds are in LOG space (the paper's range (e^-0.4, e^0.4) is clip_low = clip_high = 0.4);
    l~_t = min(l_t, c_t) where A_t > 0, max(l_t, c_t) elsewhere (PPO's pessimistic side);
    s_i = exp(mean_t l~_t), A_i = mean_t A_t, and every token of row i carries the sequence value s_i * A_i.
    d(s_i A_i) / d logp_t = A_i s_i / n_i where l_t is inside the clip (or beyond it on the side that does not bind),
    0 on the others, which are cut: l_t > clip_high with A_t > 0, l_t < -clip_low with A_t <= 0. At r = 1 this is
    GRPO's gradient, A_i / n_i per token.
    Aggregation: the references average the sequence value over sequences (TRL per_sequence_loss.mean(), verl
    torch.mean over rows, GMPO's code one sequence per micro-batch); seq_mean_token_mean weights reproduce that
    exactly. token_mean would weigh each sequence by its length. Follows TRL's experimental GMPOTrainer (A > 0 takes
    min, as GMPO's code does for A >= 0: the two differ only on A = 0, whose value is 0); A_i as the mean of the
    token advantages is verl's compute_policy_loss_geo_mean (the same as TRL's for sequence-level advantages). The
    mean divides by max(n_i, 1) (verl adds 1e-8 instead; identical for non-empty rows). A packed row of a thought and
    several answers would share one ratio: use it with --answers 1.
    keep: [B, T] bool, the step's token selections (the entropy mask, V3.2's sequence mask; None = every token).
    They choose which tokens enter each row's geometric mean and nothing else: the row keeps its whole weight (its
    value sits on every token of the mask), as TRL's GMPO takes mask * entropy_mask into the mean and averages the
    sequences' values (TRL f2cd577 trl/experimental/gmpo/gmpo_trainer.py). policy_loss therefore hands this entry the
    selections instead of multiplying them into its weights (TAKES). A row with no kept token has value 0. With
    --rollout-is weights each token's weight multiplies the sequence value it carries, so a row's factor is the
    arithmetic mean of its token weights; verl's geo_mean takes their geometric mean (exp of the mean log weight).
    """
    mask = mask.bool()
    low, high = float(hp.clip_low), float(hp.clip_high)
    bad = f"--clip-low and --clip-high (log space under GMPO) must be > 0, got {low} and {high}"
    _need(low > 0 and high > 0, f"gmpo_objective: {bad}")
    adv, log_ratio = _on_mask(adv, mask), _log_ratio(logp, old_logp, mask)
    clamped = log_ratio.clamp(-low, high)
    pessimistic = torch.where(adv > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))
    m = (mask if keep is None else mask & keep.bool()).to(logp.dtype)  # the tokens of the geometric mean
    n = m.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    seq_ratio = torch.exp((pessimistic * m).sum(-1, keepdim=True) / n)  # (B, 1) geometric mean of clipped ratios
    seq_adv = (adv * m).sum(-1, keepdim=True) / n  # (B, 1)
    obj = (seq_ratio * seq_adv).expand_as(logp)
    lr = log_ratio.detach()
    cut = mask & torch.where(adv > 0, lr > high, lr < -low)
    return _on_mask(obj, mask), cut


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
    _need(coef >= 0, f"kl_cov_objective: --kl-cov-coef must be >= 0, got {coef}")
    shapes = f"selected {tuple(selected.shape)} and mask {tuple(mask.shape)}"
    _need(selected.shape == mask.shape, f"kl_cov_objective: {shapes} must have one shape")
    adv, log_ratio = _on_mask(adv, mask), _log_ratio(logp, old_logp, mask)
    obj = torch.exp(log_ratio) * adv - coef * log_ratio.abs() * selected.to(logp.dtype)
    return _on_mask(obj, mask), torch.zeros_like(mask)


def dppo_objective(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any) -> tuple[Tensor, Tensor]:
    """DPPO, Binary-TV form (arXiv 2602.04879; prime-rl's default loss): a trust region on the probability gap.

    d = exp(logp) - exp(old_logp) (the sampled token's probability moved by d). A token is masked when it left the
    region in its advantage's direction: d > hp.dppo_mask_high where A > 0, d < -hp.dppo_mask_low elsewhere.
    obj = (1 - masked) * r * A - hp.dppo_kl_tau * l^2, l = logp - old_logp, r = exp(l): the unclipped ratio with
    its gradient r A grad logp, and a squared log-ratio regulariser on every token, masked ones included.
    d obj / d logp = (1 - masked) r A - 2 tau l; masked tokens are cut. At r = 1 nothing is masked and the penalty's
    gradient is 0, so with mu = 1 DPPO is the plain policy gradient.
    Aggregation: token_mean (prime-rl divides the summed loss by the step's loss-token count). Defaults 0.2, 0.2,
    1e-3 (prime-rl DefaultLossConfig; its adv_tau, a factor on A, is left out: 1 by default). Follows prime-rl's
    default_loss_fn, whose code this is; its docs/algorithms.md still describes min(r, delta) * A, which the code no
    longer computes. prime-rl's pi_old is the inference engine's log-probs (it has no separate trainer pi_old); here
    it is old_logp, the trainer's, as in the DPPO authors' "recompute" variant (sail-sg/Stable-RL c6af1d1
    core_algos.py, dppo_binary_tv_recompute), and the sampler gap is left to mismatch_is_weights.
    """
    mask = mask.bool()
    low, high, tau = float(hp.dppo_mask_low), float(hp.dppo_mask_high), float(hp.dppo_kl_tau)
    bad = f"--dppo-mask-low, --dppo-mask-high and --dppo-kl-tau must be >= 0, got {low}, {high}, {tau}"
    _need(low >= 0 and high >= 0 and tau >= 0, f"dppo_objective: {bad}")
    adv, log_ratio = _on_mask(adv, mask), _log_ratio(logp, old_logp, mask)
    zero = torch.zeros_like(logp)
    with torch.no_grad():
        gap = torch.exp(torch.where(mask, logp, zero)) - torch.exp(torch.where(mask, old_logp, zero))
        cut = mask & torch.where(adv > 0, gap > high, gap < -low)
    obj = torch.where(cut, zero, torch.exp(log_ratio) * adv) - tau * log_ratio.square()
    return _on_mask(obj, mask), cut


def gpg_objective(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp: Any) -> tuple[Tensor, Tensor]:
    """GPG (arXiv 2504.02546): the plain policy gradient, obj = A * logp (old_logp unused, no ratio, no clip).

    d obj / d logp = A: GRPO's on-policy gradient without the clip. The method's other parts are elsewhere: Dr. GRPO
    centring (std off, GPG's train.sh runs --scale_rewards False), token_mean aggregation (its loss divides by the
    batch's token count) and the batch factor gpg_alpha. GPG's code trains on-policy (one update per batch); with
    mu > 1 this is REINFORCE on stale samples. No token is cut. Follows GPG's gpg_trainer.py compute_loss and verl's
    compute_policy_loss_gpg (the same expression).
    """
    mask = mask.bool()
    return _on_mask(adv, mask) * _on_mask(logp, mask), torch.zeros_like(mask)


LOSSES: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "clip": clip,
    "gspo": gspo,
    "cispo": cispo,
    "sapo": sapo_objective,
    "gmpo": gmpo_objective,
    "clip_cov": clip,  # the clipped surrogate; Clip-Cov's token mask is in the weights (methods/token_select.py)
    "kl_cov": kl_cov_objective,  # takes the step's selection (methods/token_select.py) as `selected`
    "dppo": dppo_objective,
    "gpg": gpg_objective,
}
SEQUENCE_LEVEL = ("gspo", "gmpo")  # objectives whose ratio is one per sequence: ratio_mean reports that ratio
KL_ESTIMATORS = ("k3", "unbiased")  # --kl-estimator: Schulman's k3, or DeepSeek-V3.2's k3 times the ratio


def loss_name(hp) -> str:
    """The objective hp asks for: hp.loss, or GSPO's where hp.sequence_ratio is set (the trainer's
    --sequence-ratio, GSPO's switch before --loss existed, kept so that existing commands and runs work)."""
    return "gspo" if getattr(hp, "sequence_ratio", False) else hp.loss


# ----------------------------------------------------------------------------------------------
# The wrapper the trainer calls


@dataclass
class Tokens:
    """One micro-batch's per-token record for policy_loss: every tensor [B, T], rows are sequences (or packed
    GRPO-MA rows, where a sequence-level objective spans the whole row)."""

    logp: Tensor  # the policy's log-probs of the sampled tokens, with gradient
    old_logp: Tensor  # at the sampling-time parameters (the ratio's denominator)
    adv: Tensor  # per-token advantage
    weight: Tensor  # the aggregation weight of the WHOLE step (advantage.token_weights): the loss is a plain sum
    mask: Tensor | None = None  # bool, the trained tokens (default weight != 0); must cover every non-zero weight
    keep: Tensor | None = None  # bool, the tokens the step's selections keep (entropy mask, Clip-Cov, V3.2); None = all
    is_weight: Tensor | None = None  # importance weights of the policy-gradient term (rollout mismatch); None = 1
    ref_logp: Tensor | None = None  # the reference model's log-probs (beta > 0)
    off_policy: Tensor | None = None  # bool, tokens not sampled from pi_old (an injected reference solution)
    selected: Tensor | None = None  # bool, KL-Cov's tokens (its objective takes them)


TAKES: dict[str, tuple[str, ...]] = {  # record fields an objective takes as keywords, beyond the contract
    "kl_cov": ("selected",),
    "gmpo": ("keep",),  # it applies the selections inside its geometric mean, not to its weights
}


def policy_loss(tok: Tokens, hp) -> tuple[Tensor, dict[str, float]]:
    """loss = -sum(weight * keep * is_weight * obj) + hp.beta * sum(weight * KL), obj = LOSSES[loss_name(hp)] (the
    clip loss: min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A)), KL per token by hp.kl_estimator: k3 (kl3), or
    "unbiased" (DeepSeek-V3.2's unbiased_kl: k3 times pi / pi_old; it needs old_logp on every KL token).

    The weight carries the aggregation normaliser, so the loss is a plain sum and micro-batch losses add up. The
    objective sees every trained token (mask): the selections (keep) and importance weights act on the surrogate's
    weights only, so a sequence ratio (GSPO) runs over the whole completion, as TRL's and verl's do; an objective
    listed in TAKES receives the selections instead (GMPO chooses the tokens of its geometric mean with them).
    The KL penalty takes the plain weight: the references apply the selections and importance weights to the
    policy-gradient term only and add the KL after (TRL _compute_loss; verl's dp_actor and slime compute the KL loss
    apart), so a dropped token keeps its KL pull.
    off_policy: there LUFFY's policy shaping (arXiv 2504.14945; its code's off_policy_reshape="p_div_p_0.1")
    replaces the objective: obj = f(p) * A with f(p) = p / (p + hp.anchor_gamma), p = exp(logp), gradient through p
    (d f / d logp = gamma p / (p + gamma)^2, so low-probability expert tokens still learn), no clip and no old_logp
    (unused there, may be garbage). The objective sees only the other tokens (they are left out of GSPO's sequence
    mean); the KL term, if any, still covers them. None (default) is the plain loss, bit for bit.
    Metrics (floats, no grad) are means over this call's tokens with a non-zero surrogate weight, i.e. partial for
    one micro-batch: the trainer averages them weighted by metrics["num_tokens"]. clip_frac_low / clip_frac_high
    split clip_frac by the sign of the advantage. Off-policy tokens are never clipped; with off_policy given,
    "off_policy_frac" (of those tokens) and "off_policy_p_mean" (mean p over this call's off-policy tokens) are added.
    """
    name, logp, old_logp, adv = loss_name(hp), tok.logp, tok.old_logp, tok.adv
    if hp.beta != 0.0 and tok.ref_logp is None:
        raise ValueError("policy_loss: beta != 0 needs ref_logp (the reference model's log-probs).")
    if tok.off_policy is not None and not hp.anchor_gamma > 0:
        raise ValueError(f"policy_loss: anchor_gamma (off-policy shaping) must be > 0, got {hp.anchor_gamma}.")
    mask = tok.weight != 0 if tok.mask is None else tok.mask.bool()
    off = None if tok.off_policy is None else tok.off_policy.bool() & mask
    on = mask if off is None else mask & ~off  # tokens sampled from pi_old: the objective's ratio applies
    extra = {f: getattr(tok, f) for f in TAKES.get(name, ()) if getattr(tok, f) is not None}
    obj, cut = LOSSES[name](logp, old_logp, adv, on, hp, **extra)
    if off is not None:
        p = torch.exp(torch.where(off, logp, torch.zeros_like(logp)))  # (B, T), with grad; 1 off these tokens
        obj = torch.where(off, p / (p + hp.anchor_gamma) * adv, obj)
    zero = torch.zeros_like(logp)
    weight = tok.weight if tok.keep is None or "keep" in extra else tok.weight * tok.keep.to(tok.weight.dtype)
    weight = weight if tok.is_weight is None else weight * tok.is_weight
    loss = -(weight * torch.where(mask, obj, zero)).sum()
    counted = mask & (weight != 0)  # the tokens the surrogate trains: its metrics' denominator
    kl = None
    if tok.ref_logp is not None:
        if getattr(hp, "kl_estimator", "k3") == "unbiased":  # k3 for an hp without the flag
            kl = unbiased_kl(logp, tok.ref_logp, old_logp, mask)
        else:
            kl = kl3(torch.where(mask, logp, zero), torch.where(mask, tok.ref_logp.detach(), zero))
        loss = loss + hp.beta * (tok.weight * torch.where(mask, kl, zero)).sum()

    with torch.no_grad():
        cut = cut & counted
        n_tok = counted.sum().clamp(min=1)
        r = (sequence_ratio if name in SEQUENCE_LEVEL else token_ratio)(logp, old_logp, on)
        names = ["clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "num_tokens"]
        vals = [(cut & (adv < 0)).sum() / n_tok, (cut & (adv > 0)).sum() / n_tok, cut.sum() / n_tok]
        vals += [(r * counted).sum() / n_tok, counted.sum().float()]
        if kl is not None:
            names.append("kl")
            vals.append((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        if off is not None:
            names += ["off_policy_frac", "off_policy_p_mean"]
            vals += [(off & counted).sum() / n_tok, (p.detach() * off).sum() / off.sum().clamp(min=1)]
        metrics = dict(zip(names, torch.stack([v.float() for v in vals]).tolist()))  # one device sync
    return loss, metrics


# ----------------------------------------------------------------------------------------------
# Masks and weights multiplied into the token weights


def gpg_alpha(rewards: Tensor) -> float:
    """GPG's gradient correction alpha = P / (groups whose rewards are not all equal): rewards [P, G] -> float.

    Groups with equal rewards carry no gradient, yet count in the batch mean; multiplying the step's token weights by
    alpha makes the gradient the mean over the groups that do learn. 1.0 when no group has a spread (the gradient is
    0 then). Follows GPG's gpg_trainer.py (--adjust_gd: loss / inverse_alpha, inverse_alpha = valid groups / groups,
    at most 1); pass the whole step's rewards. verl's compute_gpg_outcome_advantage instead divides the batch size by
    the number of non-zero rewards, which is not the paper's count; GPG's own code is followed. GPG's code also
    re-samples until at least half the groups have a spread (min_inverse_alpha 0.5), closer to --dynamic-sampling.
    """
    _need(rewards.dim() == 2, f"gpg_alpha: rewards must be [P, G], got shape {tuple(rewards.shape)}")
    spread = rewards.amax(-1) != rewards.amin(-1)
    n = int(spread.sum())
    return rewards.shape[0] / n if n > 0 else 1.0


def kl_cov_select(logp: Tensor, adv: Tensor, mask: Tensor, *, ratio: float) -> Tensor:
    """KL-Cov's token selection: the top max(1, int(ratio * n)) tokens by covariance of log-prob and advantage.

    logp (the scoring pass's log-probs), adv, mask: [B, T], the whole step -> selected [B, T] bool.
    cov_t = (A_t - mean A) (logp_t - mean logp), both means over the step's n masked tokens. ratio is a fraction
    (the paper's k: 2e-3 for its 7B model, 2e-4 for 32B; its recipe's k_percent 0.2 is in percent). Follows verl's
    compute_policy_loss_kl_cov, which selects within each micro-batch with the current log-probs; the step's
    selection keeps the gradient independent of the micro-batch split, and equals verl's for the first epoch over a
    step taken as one micro-batch. Ties at the cut-off are broken by torch.topk (unspecified order).
    """
    _need(0 < ratio <= 1, f"kl_cov_select: --kl-cov-ratio must be in (0, 1], got {ratio}")
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
    _need(0 < ratio <= 1, f"clip_cov_mask: --clip-cov-ratio must be in (0, 1], got {ratio}")
    _need(low < high, f"clip_cov_mask: --clip-cov-lb must be below --clip-cov-ub, got {low} and {high}")
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


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_fraction: float) -> Tensor:
    """The 80/20 rule's entropy mask (arXiv 2506.01939): train only on the step's highest-entropy tokens.

    entropy (the scoring pass's token entropy), mask: [B, T], the whole step -> keep [B, T] bool.
    threshold = the (1 - top_fraction) quantile of the masked entropies, linear interpolation (torch.quantile's
    default); keep = entropy >= threshold on the mask. top_fraction = 1 keeps every token, 0 only the maximum (ties
    kept); the paper's value is 0.2. The caller multiplies keep into the token weights, so dropped tokens still count
    in the normaliser (TRL multiplies their loss by 0). Follows TRL's get_high_entropy_mask (top_entropy_quantile),
    which takes the quantile over one micro-batch gathered across ranks; the paper's "top 20% in each batch" is the
    whole step, which also keeps the micro-batch split out of it. Under DDP pass the entropies of every rank.
    The quantile is computed from a sort, as torch.quantile does, without its 2^24-element input limit.
    """
    _need(0 <= top_fraction <= 1, f"high_entropy_mask: --top-entropy-fraction must be in [0, 1], got {top_fraction}")
    mask = mask.bool()
    values = entropy.detach()[mask].sort().values
    if values.numel() == 0:
        return torch.zeros_like(mask)
    q = torch.tensor(1.0 - top_fraction, dtype=values.dtype, device=values.device)
    rank = q * (values.numel() - 1)  # in the entropy's dtype, as torch.quantile computes it
    below, above = rank.floor().long(), rank.ceil().long()
    threshold = torch.lerp(values[below], values[above], rank - below.to(values.dtype))
    return mask & (entropy >= threshold)


def off_policy_sequence_mask(logp: Tensor, sampler_logp: Tensor, adv: Tensor, mask: Tensor, *, delta: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9): drop the negative-advantage tokens of
    sequences the current policy has drifted away from.

    logp (current, this micro-batch's), sampler_logp (the policy that sampled the tokens: the sampler's own log-probs
    with a rollout copy, else old_logp), adv, mask: [B, T] -> keep [B, T] bool.
    kl_i = mean over row i's tokens of (sampler_logp - logp), the k1 estimate of KL(pi_sampler || pi_theta);
    keep = mask & (A >= 0 | kl_i <= delta). Detached (a mask). Per row, so the micro-batch split cannot change it;
    computed per call because logp moves between epochs. A kept token keeps its weight; a dropped one still counts
    in the normaliser. Follows TRL's get_off_policy_mask (sampler log-probs when present, as here) and slime's
    compute_opsm_mask (the same expression). delta: the paper gives none; slime defaults to 1e-4, TRL's docs
    suggest 0.5 as a start. A packed row of a thought and several answers would share kl_i: use it with --answers 1.
    """
    _need(delta >= 0, f"off_policy_sequence_mask: --opsm-delta must be >= 0, got {delta}")
    mask = mask.bool()
    gap = torch.where(mask, sampler_logp.detach() - logp.detach(), torch.zeros_like(logp))
    kl = gap.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return mask & ((adv >= 0) | (kl <= delta))


def unbiased_kl(logp: Tensor, ref_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """DeepSeek-V3.2's unbiased KL estimate (arXiv 2512.02556): k3 times the importance ratio pi_theta / pi_old.

    [B, T] each -> per-token KL [B, T] (0 off the mask), the term the caller multiplies by beta and adds to the loss:
    kl = r * (exp(d) - d - 1), r = exp(logp - old_logp), d = ref_logp - logp. The samples come from pi_old, so k3
    alone estimates KL at pi_old; the ratio makes it unbiased for KL(pi_theta || pi_ref). The gradient flows through
    both factors and is r * (logp - ref_logp) * grad logp, the true KL's gradient (plain k3 gives (1 - e^d) grad logp).
    It differs from k3 even at r = 1. Follows TRL (use_bias_correction_kl: per_token_kl * coef_1, ratio not
    detached) and slime (use_unbiased_kl: importance_ratio * kl, the same). The ratio is the token's under every
    --loss, as slime's; TRL's coef_1 is the sequence ratio under GSPO.
    """
    mask = mask.bool()
    zero = torch.zeros_like(logp)
    d = torch.where(mask, ref_logp.detach() - logp, zero)
    return torch.exp(_log_ratio(logp, old_logp, mask)) * (torch.exp(d) - d - 1)


ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


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
    _need(mode in ROLLOUT_IS_MODES, f"mismatch_is_weights: unknown mode {mode!r}; choose one of {modes}")
    _need(0 <= low < high, f"mismatch_is_weights: need 0 <= --tis-floor < --tis-cap, got {low} and {high}")
    _need(mode.endswith("mask") or high < math.inf, "mismatch_is_weights: a truncation needs a finite --tis-cap")
    shapes = f"old_logp {tuple(old_logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} and mask {tuple(mask.shape)}"
    _need(old_logp.shape == sampler_logp.shape == mask.shape, f"mismatch_is_weights: {shapes} must have one shape.")
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
