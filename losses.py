"""losses.py: the policy loss. policy_loss is the one function the trainer calls: it takes one micro-batch's
per-token record (Tokens) and an objective (Objective: GRPO's clipped surrogate, CLIP, unless a method's, from
methods.LOSSES by --loss) and adds what every objective shares: the token weights (the step's aggregation), the
selections and importance weights of the surrogate, the KL penalty, the off-policy shaping of tokens the policy did
not sample, diagnostics. The ratios every objective builds on (token_ratio, sequence_ratio, clipped) are here.

An objective is fn(logp, old_logp, adv, mask, hp, **takes) -> (obj, cut):
  logp, old_logp, adv, mask  [B, T]; rows are sequences, mask (bool) the tokens that exist
  hp                         any object carrying the hyperparameters as attributes (the trainer's TrainConfig)
  obj                        [B, T] the per-token objective to MAXIMISE; a sequence-level objective (GSPO) puts
                             its sequence's value on each of its tokens
  cut                        [B, T] bool: the tokens whose gradient the objective cuts (clip_frac); all False if none
  takes                      the record's fields it needs beyond these (KL-Cov's selected, GMPO's keep)
Off the mask an objective may see -inf or nan (padding): it must keep them out of its value and gradient.

The per-token masks and weights the methods add (the token selections, DeepSeek-V3.2's off-policy mask, the rollout
mismatch weights) go into the record (Tokens.keep, .is_weight, .selected) and act on the surrogate only: the KL
penalty keeps the plain weight, as in the references (TRL f2cd577 grpo_trainer.py _compute_loss; verl b178a3c
dp_actor; slime 624b824 ppo_utils.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def kl3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 with d = ref_logp - logp.
    Always >= 0 and 0 where logp == ref_logp; unbiased for the KL under samples from pi."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def unbiased_kl(logp: Tensor, ref_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """DeepSeek-V3.2's unbiased KL estimate (arXiv 2512.02556): k3 times the importance ratio pi_theta / pi_old.

    [B, T] each -> per-token KL [B, T] (0 off the mask), the term the caller multiplies by beta and adds to the loss:
    kl = r * (exp(d) - d - 1), r = exp(logp - old_logp), d = ref_logp - logp. The samples come from pi_old, so k3
    alone estimates KL at pi_old; the ratio makes it unbiased for KL(pi_theta || pi_ref). The gradient flows through
    both factors and is r * (logp - ref_logp) * grad logp, the true KL's gradient (plain k3 gives (1 - e^d) grad logp).
    It differs from k3 even at r = 1. Follows TRL (use_bias_correction_kl: per_token_kl * coef_1, ratio not
    detached) and slime (use_unbiased_kl: importance_ratio * kl, the same). The ratio is the token's under every
    --loss, as slime's; TRL's coef_1 is the sequence ratio under GSPO."""
    mask = mask.bool()
    zero = torch.zeros_like(logp)
    d = torch.where(mask, ref_logp.detach() - logp, zero)
    return torch.exp(masked_log_ratio(logp, old_logp, mask)) * (torch.exp(d) - d - 1)


def _gap(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """d = logp - ref_logp on the mask, 0 elsewhere (padding may hold -inf or nan: -inf - -inf is nan)."""
    return torch.where(mask, logp - ref_logp.detach(), torch.zeros_like(logp))


def k1(logp: Tensor, ref_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """k1 = logp - ref_logp per token; unbiased for KL(pi || ref) under samples from pi, may be negative. Its gradient
    in the loss, grad logp, is 0 in expectation: it belongs in the reward (--kl-in-reward, methods/kl.py)."""
    return _gap(logp, ref_logp, mask)


def k2(logp: Tensor, ref_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """k2 = (logp - ref_logp)^2 / 2 per token; >= 0, biased, its gradient is the KL's on-policy."""
    return 0.5 * _gap(logp, ref_logp, mask).square()


def k3(logp: Tensor, ref_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """kl3 on the mask, 0 elsewhere (GRPO's estimator, the default)."""
    zero = torch.zeros_like(logp)
    return kl3(torch.where(mask, logp, zero), torch.where(mask, ref_logp.detach(), zero))


def low_var_kl(logp: Tensor, ref_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """verl's low_var_kl (its kl_loss_type default), which verl also calls "k3": x = clamp(ref_logp - logp, -20, 20),
    clamp(exp(x) - x - 1, -10, 10). k3 wherever exp(x) - x - 1 <= 10; beyond, the value is 10 and its gradient 0
    (verl b178a3c core_algos.py kl_penalty_forward sends "low_var_kl" and "k3" to this one branch)."""
    x = (-_gap(logp, ref_logp, mask)).clamp(-20.0, 20.0)
    return (torch.exp(x) - x - 1).clamp(-10.0, 10.0)


# --kl-estimator: each (logp, ref_logp, old_logp, mask) -> [B, T], 0 off the mask, gradient through logp only (the
# unbiased one also through its ratio). Schulman's k1/k2/k3, as OpenRLHF's compute_approx_kl names them; k3 is TRL's
# and the GRPO paper's, unclamped. verl's "k3" is its low_var_kl (clamped): methods/kl.py has the table.
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]] = {
    "k3": k3,
    "k1": k1,
    "k2": k2,
    "low_var_kl": low_var_kl,
    "unbiased": unbiased_kl,
}


# ----------------------------------------------------------------------------------------------
# Ratios, and GRPO's clipped surrogate


def masked_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log(pi / pi_old) on the mask, 0 elsewhere: padded log-probs may be -inf or garbage, and exp of them times a
    zero weight would still put nan into the loss and its gradient."""
    return torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))


def token_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """rho = exp(logp - old_logp) per token on the mask, 1 elsewhere (the difference is zeroed before exp:
    padded log-probs may be -inf or garbage, and exp(inf) * 0 would put nan into the loss and its gradient)."""
    return torch.exp(masked_log_ratio(logp, old_logp, mask))


def sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's (arXiv 2507.18071) s_i = exp(mean over row i's masked tokens of (logp - old_logp)), in the
    GSPO-token form sg[s_i] * exp(logp_t - sg[logp_t]): the value is s_i on every token of the row, the
    gradient s_i * grad logp_t, GSPO's gradient for uniform row weights, and right for per-token advantages."""
    log_ratio = masked_log_ratio(logp, old_logp, mask)
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


def on_mask(x: Tensor, mask: Tensor) -> Tensor:
    """x on the mask, 0 elsewhere (objectives apply it to adv first: padded garbage times a zero gradient is nan)."""
    return torch.where(mask, x, torch.zeros_like(x))


def need(ok: bool, msg: str) -> None:
    """A formula's argument check: a ValueError with msg."""
    if not ok:
        raise ValueError(msg)


# ----------------------------------------------------------------------------------------------
# The wrapper the trainer calls


@dataclass(frozen=True)
class Objective:
    """An entry of the loss table (--loss): the objective and what policy_loss must know of it."""

    fn: Callable[..., tuple[Tensor, Tensor]]  # fn(logp, old_logp, adv, mask, hp, **takes) -> (obj, cut)
    takes: tuple[str, ...] = ()  # Tokens fields passed as keywords; "keep": it applies the selections itself
    sequence_level: bool = False  # one ratio per sequence: the ratio_mean metric reports the sequence ratio

    def __call__(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.fn(*args, **kwargs)


CLIP = Objective(clip)  # GRPO's (DAPO's with clip_high > clip_low)


def loss_name(hp) -> str:
    """The objective hp asks for: hp.loss, or GSPO's where hp.sequence_ratio is set (the trainer's
    --sequence-ratio, GSPO's switch before --loss existed, kept so that existing commands and runs work)."""
    return "gspo" if getattr(hp, "sequence_ratio", False) else hp.loss


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
    off_policy: Tensor | None = None  # bool, tokens not sampled from pi_old (DaGRPO's anchors): an objective takes it
    selected: Tensor | None = None  # bool, KL-Cov's tokens (its objective takes them)
    beta: float | None = None  # the KL penalty's coefficient (None: hp.beta; 0: the KL is in the reward instead)


def policy_loss(tok: Tokens, hp, objective: Objective | None = None) -> tuple[Tensor, dict[str, float]]:
    """loss = -sum(weight * keep * is_weight * obj) + hp.beta * sum(weight * KL), obj = objective's (default CLIP,
    GRPO's min(rho*A, clip(rho, 1-clip_low, 1+clip_high)*A); a method's from methods.LOSSES, --loss), KL per token
    by hp.kl_estimator (KL_ESTIMATORS: k3 by default; k1, k2, low_var_kl; "unbiased", DeepSeek-V3.2's k3 times
    pi / pi_old, which needs old_logp on every KL token). tok.beta = 0: the KL is in the reward (methods/kl.py), and
    only its metric is kept.

    The weight carries the aggregation normaliser, so the loss is a plain sum and micro-batch losses add up. The
    objective sees every trained token (mask) but the rejected ones (an importance weight of 0: --rollout-is
    token_mask or sequence_mask, IcePop), which leave GMPO's geometric mean and GSPO's ratio as verl's rejection
    sampling drops them from its response mask. The selections (keep) and importance weights act on the surrogate's
    weights only, so a sequence ratio (GSPO) runs over the whole sampled completion, as TRL's and verl's do; an
    objective whose `takes` lists "keep" receives the selections instead (GMPO chooses its geometric mean's tokens).
    The KL penalty takes the plain weight: the references apply the selections and importance weights to the
    policy-gradient term only and add the KL after (TRL _compute_loss; verl's dp_actor and slime compute the KL loss
    apart), so a dropped token keeps its KL pull.
    Tokens the policy did not sample (tok.off_policy) are the objective's to treat: an objective whose `takes` lists
    "off_policy" receives them (DaGRPO's anchors: methods/dagrpo.py's luffy_shaped); for any other they are tokens
    like the rest. Metrics (floats, no grad) are means over this call's tokens with a non-zero surrogate weight,
    i.e. partial for one micro-batch: the trainer averages them weighted by metrics["num_tokens"]. clip_frac_low /
    clip_frac_high split clip_frac by the sign of the advantage."""
    objective, logp, old_logp, adv = objective or CLIP, tok.logp, tok.old_logp, tok.adv
    beta = hp.beta if tok.beta is None else tok.beta
    if beta != 0.0 and tok.ref_logp is None:
        raise ValueError("policy_loss: beta != 0 needs ref_logp (the reference model's log-probs).")
    mask = tok.weight != 0 if tok.mask is None else tok.mask.bool()
    # a token whose importance weight is 0 (--rollout-is token_mask / sequence_mask) is a rejected sample: it leaves
    # the objective's tokens, so sequence statistics (GMPO's geometric mean, GSPO's ratio) do not run over it
    sampled = mask if tok.is_weight is None else mask & (tok.is_weight != 0)
    extra = {f: getattr(tok, f) for f in objective.takes if getattr(tok, f) is not None}
    obj, cut = objective.fn(logp, old_logp, adv, sampled, hp, **extra)
    weight = tok.weight if tok.keep is None or "keep" in extra else tok.weight * tok.keep.to(tok.weight.dtype)
    weight = weight if tok.is_weight is None else weight * tok.is_weight
    loss = -(weight * torch.where(sampled, obj, 0.0)).sum()
    counted = sampled & (weight != 0)  # the tokens the surrogate trains: its metrics' denominator
    kl = None
    if tok.ref_logp is not None:
        kl = KL_ESTIMATORS[getattr(hp, "kl_estimator", "k3")](logp, tok.ref_logp, old_logp, mask)  # k3 without the flag
        loss = loss + beta * (tok.weight * torch.where(mask, kl, 0.0)).sum()

    with torch.no_grad():
        cut = cut & counted
        n_tok = counted.sum().clamp(min=1)
        on = mask if tok.off_policy is None else mask & ~tok.off_policy.bool()  # the tokens with a ratio (1 elsewhere)
        r = (sequence_ratio if objective.sequence_level else token_ratio)(logp, old_logp, on)
        names = ["clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "num_tokens"]
        vals = [(cut & (adv < 0)).sum() / n_tok, (cut & (adv > 0)).sum() / n_tok, cut.sum() / n_tok]
        vals += [(r * counted).sum() / n_tok, counted.sum().float()]
        if kl is not None:
            names.append("kl")
            vals.append((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        metrics = dict(zip(names, torch.stack([v.float() for v in vals]).tolist()))  # one device sync
    return loss, metrics
