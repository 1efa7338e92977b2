"""The policy-loss table (losses.LOSSES) and its seam: every objective keeps the contract policy_loss relies on,
policy_loss hands each objective the right tokens and hyperparameters, --loss picks the entry, and the old
--sequence-ratio flag still means GSPO."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from cli import parse_config
from losses import Objective, Tokens, loss_name, policy_loss
from methods import LOSSES, objective
from methods.dagrpo import luffy_shaped
from train import PRESETS, TrainConfig

T = torch.tensor


def loss_for(tok: Tokens, h) -> tuple[torch.Tensor, dict]:
    """policy_loss with the objective --loss (h.loss, or h.sequence_ratio) names, as the trainer passes it."""
    return policy_loss(tok, h, objective(h))


def hp(**kw) -> types.SimpleNamespace:
    """The hyperparameters the trainer passes (every TrainConfig field, at its default), changed by kw: a loss
    added to the table finds its own flags here too."""
    return types.SimpleNamespace(**{**dataclasses.asdict(TrainConfig()), **kw})


def padded_batch() -> tuple[torch.Tensor, ...]:
    """Two rows, the second one token shorter, whose padding holds -inf and nan as a model's may."""
    logp = T([[-0.5, -1.0, -2.0], [-0.3, -0.7, float("-inf")]], dtype=torch.float64, requires_grad=True)
    old = T([[-0.6, -0.9, -2.5], [-0.2, -0.9, float("nan")]], dtype=torch.float64)
    adv = T([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    mask = T([[True, True, True], [True, True, False]])
    return logp, old, adv, mask


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_objective_keeps_the_contract(name):
    """Guards against a table entry that returns the wrong shapes or dtype, lets padded -inf/nan reach the
    objective or its gradient, or reports a cut token outside the mask."""
    logp, old, adv, mask = padded_batch()
    extra = dict(selected=T([[True, False, True], [False, True, False]])) if name == "kl_cov" else {}
    obj, cut = LOSSES[name](logp, old, adv, mask, hp(), **extra)
    assert obj.shape == mask.shape and cut.shape == mask.shape and cut.dtype == torch.bool
    assert not (cut & ~mask).any()
    value = (torch.where(mask, obj, torch.zeros_like(obj))).sum()
    (grad,) = torch.autograd.grad(value, logp)
    assert torch.isfinite(value) and torch.isfinite(grad).all()


def test_clip_and_gspo_entries_exact_values():
    """Guards against the clip entry using another ratio than exp(logp - old_logp) per token, and GSPO's entry
    not putting each row's sequence ratio exp(mean log-ratio) on every token of the row (clip ranges wide open)."""
    logp, old, adv, mask = padded_batch()
    wide = hp(clip_low=0.99, clip_high=10.0)
    obj, cut = LOSSES["clip"](logp, old, adv, mask, wide)
    want = [[math.exp(0.1), math.exp(-0.1), math.exp(0.5)], [-2 * math.exp(-0.1), -2 * math.exp(0.2), 0.0]]
    torch.testing.assert_close(torch.where(mask, obj, 0.0), T(want, dtype=torch.float64), atol=1e-12, rtol=0)
    assert not cut.any()
    obj, _ = LOSSES["gspo"](logp, old, adv, mask, wide)
    s0, s1 = math.exp((0.1 - 0.1 + 0.5) / 3), math.exp((-0.1 + 0.2) / 2)
    want = [[s0, s0, s0], [-2 * s1, -2 * s1, 0.0]]
    torch.testing.assert_close(torch.where(mask, obj, 0.0), T(want, dtype=torch.float64), atol=1e-12, rtol=0)


def test_policy_loss_hands_the_objective_its_tokens_and_hyperparameters(monkeypatch):
    """Guards against the seam: policy_loss must call the entry --loss names (under DaGRPO's LUFFY shaping: with
    the on-policy tokens only, the off-policy ones shaped instead), pass the trainer's hyperparameters through,
    weight and negate the objective, and report the entry's cut tokens as clip_frac."""
    seen = {}

    def probe(logp, old_logp, adv, mask, h):
        seen.update(mask=mask.clone(), h=h)
        return 3.0 * adv * torch.ones_like(logp), mask & (adv < 0)

    monkeypatch.setitem(LOSSES, "probe", Objective(probe))
    logp = T([[math.log(0.5), -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    adv, w = T([[1.0, 1.0, -1.0]], dtype=torch.float64), T([[0.5, 0.25, 0.25]], dtype=torch.float64)
    h = hp(loss="probe")
    tok = Tokens(logp, logp.detach(), adv, w, off_policy=T([[True, False, False]]))
    loss, m = policy_loss(tok, h, luffy_shaped(objective(h), 0.5))  # DaGRPO's anchors: LUFFY's shaping around it
    assert seen["mask"].tolist() == [[False, True, True]] and seen["h"] is h
    # the anchor token: f(.5) = .5 / (.5 + .5) = .5 times A = 1; the others: 3 * A
    assert math.isclose(loss.item(), -(0.5 * 0.5 + 0.25 * 3.0 - 0.25 * 3.0), abs_tol=1e-12)
    assert math.isclose(m["clip_frac"], 1 / 3, rel_tol=1e-6)
    assert m["clip_frac_low"] == m["clip_frac"] and m["clip_frac_high"] == 0


def test_sequence_ratio_flag_is_the_gspo_entry():
    """Guards against --sequence-ratio (GSPO's switch before --loss existed, still in users' commands and saved
    runs) drifting from --loss gspo, and against the gspo preset no longer choosing GSPO's objective."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv, w = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5), torch.full((3, 5), 1 / 15)
    assert loss_name(hp(sequence_ratio=True)) == "gspo" and loss_name(hp()) == "clip"
    a, ma = loss_for(Tokens(logp, old, adv, w), hp(sequence_ratio=True, clip_low=0.0003, clip_high=0.0004))
    b, mb = loss_for(Tokens(logp, old, adv, w), hp(loss="gspo", clip_low=0.0003, clip_high=0.0004))
    c, _ = loss_for(Tokens(logp, old, adv, w), hp(clip_low=0.0003, clip_high=0.0004))
    assert torch.equal(a, b) and ma == mb and not torch.equal(a, c)
    cfg, _ = parse_config(TrainConfig, ["--algo", "gspo"], presets=PRESETS, preset_field="algo")
    assert loss_name(cfg) == "gspo" and loss_name(TrainConfig(sequence_ratio=True)) == "gspo"


@pytest.mark.parametrize("name", [n for n in LOSSES if n not in ("clip", "gspo")])
def test_sequence_ratio_contradicts_another_loss(name):
    """Guards against --sequence-ratio silently overriding (or being overridden by) another --loss."""
    with pytest.raises(ValueError, match=f"contradicts --loss {name}"):
        TrainConfig(sequence_ratio=True, loss=name, answers=1)


def test_cispo_weights_are_clipped_detached_and_keep_every_gradient():
    """Guards against CISPO built as PPO's clip (a token past the cap would lose its gradient, the one thing CISPO
    keeps), a weight that carries gradient itself, a lower bound (TRL and the paper's runs have none), or a cap read
    as TRL's absolute epsilon_high instead of 1 + --clip-high (losses.cispo's docstring). Ratios .01, 1.2, 6 with
    --clip-high 4 give weights .01, 1.2, 5 (TRL's -clamp(coef, max=5).detach() * A * logp); the objective is
    w * A * logp and its gradient under token weights v is -v * w * A on every token."""
    ratio = T([[0.01, 1.2, 6.0]], dtype=torch.float64)
    logp = T([[-1.0, -0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    old, adv = (logp - ratio.log()).detach(), T([[1.0, -2.0, 3.0]], dtype=torch.float64)
    h, w = hp(loss="cispo", clip_low=0.2, clip_high=4.0), [0.01, 1.2, 5.0]
    obj, cut = LOSSES["cispo"](logp, old, adv, torch.ones(1, 3, dtype=torch.bool), h)
    want = T([[w[0] * 1 * -1.0, w[1] * -2 * -0.5, w[2] * 3 * -2.0]], dtype=torch.float64)
    torch.testing.assert_close(obj.detach(), want, atol=1e-12, rtol=0)
    assert not cut.any()
    v = T([[0.5, 0.25, 0.25]], dtype=torch.float64)
    loss, m = loss_for(Tokens(logp, old, adv, v), h)
    (grad,) = torch.autograd.grad(loss, logp)
    want = T([[-0.5 * w[0] * 1, -0.25 * w[1] * -2, -0.25 * w[2] * 3]], dtype=torch.float64)
    torch.testing.assert_close(grad, want, atol=1e-12, rtol=0)
    assert m["clip_frac"] == 0.0
    clip_loss, _ = loss_for(Tokens(logp, old, adv, v), hp(clip_low=0.2, clip_high=4.0))
    assert torch.autograd.grad(clip_loss, logp)[0][0, 2] == 0  # the clip loss cuts the token CISPO keeps


def test_the_newer_losses_are_table_entries_with_their_references_defaults():
    """Guards against a newer loss reachable only as a function (no flag), a preset that does not choose it, or a
    preset whose hyperparameters drift from the reference defaults its docstring cites."""
    import losses
    from methods import cov, dppo, gmpo, gpg, sapo

    entries = dict(sapo=sapo.sapo_objective, gmpo=gmpo.gmpo_objective, kl_cov=cov.kl_cov_objective)
    entries |= dict(dppo=dppo.dppo_objective, gpg=gpg.gpg_objective, clip_cov=losses.clip)
    for name, fn in entries.items():
        assert LOSSES[name].fn is fn
        assert PRESETS[name]["loss"] == name
    d = TrainConfig()
    assert (d.sapo_tau_pos, d.sapo_tau_neg) == (1.0, 1.05)  # SAPO paper, TRL, verl
    assert (d.clip_cov_ratio, d.clip_cov_lb, d.clip_cov_ub) == (2e-4, 1.0, 5.0)  # verl, 7b_clip_cov.sh
    assert (d.kl_cov_ratio, d.kl_cov_coef) == (2e-3, 1.0)  # 7b_kl_cov.sh
    assert (d.dppo_mask_low, d.dppo_mask_high, d.dppo_kl_tau) == (0.2, 0.2, 1e-3)  # prime-rl DefaultLossConfig
    assert PRESETS["gmpo"] | {} == dict(loss="gmpo", clip_low=0.4, clip_high=0.4, mu=2)  # GMPO's script
    assert PRESETS["clip_cov"] == dict(loss="clip_cov", clip_low=0.99, clip_high=1.0, aggregation="token_mean")
    assert PRESETS["gpg"] == dict(loss="gpg", std_normalize=False, aggregation="token_mean", gpg_alpha=True)
    assert PRESETS["dsv32"] == dict(opsm_delta=1e-4, kl_estimator="unbiased", beta=1e-3, mu=2)  # slime's delta


def test_policy_loss_passes_kl_covs_selection_and_uses_the_unbiased_kl():
    """Guards against the seam dropping KL-Cov's step selection (its penalty would never act) or --kl-estimator
    unbiased computing k3 anyway: the loss is -sum(w * (obj - beta * kl)) with the table's obj and losses.unbiased_kl,
    and a KL-Cov loss without its selection is refused."""
    import losses
    from methods import cov

    logp, old, adv, mask = padded_batch()
    w = torch.where(mask, 0.2, 0.0).double()
    sel = T([[True, False, True], [False, True, False]])
    h = hp(loss="kl_cov", kl_cov_coef=0.5)
    loss, _ = loss_for(Tokens(logp, old, adv, w, mask=mask, selected=sel), h)
    obj, _ = cov.kl_cov_objective(logp, old, adv, mask, h, selected=sel)
    torch.testing.assert_close(loss, -(w * torch.where(mask, obj, 0.0)).sum(), atol=1e-12, rtol=0)
    unselected, _ = loss_for(Tokens(logp, old, adv, w, mask=mask, selected=torch.zeros_like(sel)), h)
    assert not torch.equal(loss, unselected)
    with pytest.raises(TypeError):
        loss_for(Tokens(logp, old, adv, w, mask=mask), h)
    ref = T([[-0.4, -1.2, -2.2], [-0.1, -0.6, float("nan")]], dtype=torch.float64)
    h = hp(beta=0.3, kl_estimator="unbiased")
    loss, m = loss_for(Tokens(logp, old, adv, w, ref_logp=ref, mask=mask), h)
    obj, _ = LOSSES["clip"](logp, old, adv, mask, h)
    kl = losses.unbiased_kl(logp, ref, old, mask)
    torch.testing.assert_close(loss, -(w * torch.where(mask, obj - 0.3 * kl, 0.0)).sum(), atol=1e-12, rtol=0)
    k3, _ = loss_for(Tokens(logp, old, adv, w, ref_logp=ref, mask=mask), hp(beta=0.3))
    assert not torch.equal(loss, k3) and math.isclose(
        m["kl"], (kl * mask).sum().item() / 5, rel_tol=1e-6
    )  # metrics are float32


def test_rollout_is_default_mode_is_the_old_truncation_bit_for_bit():
    """Guards against --rollout-is's default (token_truncate, floor 0) changing a run that used --tis-cap before the
    modes existed: its weights equal truncated_is_weights exactly."""
    from methods import mismatch

    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 7, generator=g) * 3
    sampler = old + 0.3 * torch.randn(4, 7, generator=g)
    mask = torch.rand(4, 7, generator=g) > 0.2
    for cap in (1.5, 2.0):
        a = mismatch.mismatch_is_weights(old, sampler, mask, mode="token_truncate", low=0.0, high=cap)
        before = torch.where(mask, torch.exp(torch.where(mask, old - sampler, 0.0)).clamp(max=cap), 1.0)  # its code
        assert torch.equal(a, before) and torch.equal(mismatch.truncated_is_weights(old, sampler, mask, cap), before)


@pytest.mark.parametrize("estimator", ["k3", "unbiased"])
def test_the_kl_penalty_keeps_the_tokens_the_surrogates_masks_drop(estimator):
    """Guards against the KL term taking the surrogate's masks and importance weights (a token dropped by the
    entropy mask or V3.2's sequence mask losing its KL pull too). Reference: a transcription of TRL f2cd577
    GRPOTrainer._compute_loss (loss_type "dapo", token mean): per_token_loss = -min(r A, clip(r) A), times the
    entropy mask, the off-policy mask and the importance-sampling ratio, THEN + beta * per_token_kl (times coef_1 with
    use_bias_correction_kl), summed over the mask and divided by its count."""
    g = torch.Generator().manual_seed(3)
    B, L, beta = 3, 5, 0.2
    logp = (-torch.rand(B, L, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(B, L, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    adv = T([[1.5], [-0.5], [-1.0]], dtype=torch.float64).expand(B, L)
    mask = T([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]).bool()
    entropy_mask = T([[1, 0, 1, 1, 0], [0, 1, 1, 0, 0], [1, 1, 0, 1, 0]], dtype=torch.float64)
    off_policy_mask = T([[1.0], [1.0], [0.0]], dtype=torch.float64)  # the third sequence dropped whole
    is_ratio = 0.5 + torch.rand(B, L, generator=g, dtype=torch.float64)
    m = mask.double()

    coef_1 = torch.exp(logp - old)
    per_token_loss = -torch.min(coef_1 * adv, torch.clamp(coef_1, 0.8, 1.2) * adv)
    per_token_loss = per_token_loss * entropy_mask * off_policy_mask * is_ratio
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    if estimator == "unbiased":
        per_token_kl = per_token_kl * coef_1
    expected = ((per_token_loss + beta * per_token_kl) * m).sum() / m.sum()
    (want,) = torch.autograd.grad(expected, logp)

    normaliser = m / m.sum()  # advantage.token_weights(m, "token_mean")
    w = normaliser * entropy_mask * off_policy_mask * is_ratio
    h = hp(clip_low=0.2, clip_high=0.2, beta=beta, kl_estimator=estimator)
    keep = (entropy_mask * off_policy_mask).bool()  # the selections; the KL takes the plain normaliser
    tok = Tokens(logp, old, adv, normaliser, mask=mask, keep=keep, is_weight=is_ratio, ref_logp=ref)
    loss, metrics = loss_for(tok, h)
    (got,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert math.isclose(metrics["kl"], (per_token_kl * m).sum().item() / m.sum().item(), rel_tol=1e-6)
    masked_kl, _ = loss_for(Tokens(logp, old, adv, w, ref_logp=ref, mask=mask), h)  # masks folded into the weight
    assert not torch.allclose(masked_kl, expected)


def entropy_masked_rows() -> tuple[torch.Tensor, ...]:
    """Two rows of four tokens (the second one shorter), drifted from pi_old, and an 80/20-style selection that
    keeps 2 of the first row's 4 tokens and 2 of the second row's 3: float64, with padding garbage."""
    logp = T([[-0.5, -1.0, -2.0, -0.2], [-0.3, -0.7, -1.1, float("-inf")]], dtype=torch.float64, requires_grad=True)
    old = T([[-0.6, -0.8, -2.3, -0.25], [-0.2, -0.9, -1.0, float("nan")]], dtype=torch.float64)
    adv = T([[1.5], [-0.5]], dtype=torch.float64).expand(2, 4)
    mask = T([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    keep = T([[1, 0, 1, 0], [0, 1, 1, 0]]).bool()
    return logp, old, adv, mask, keep


def test_gmpo_selection_chooses_the_geometric_mean_and_each_row_keeps_its_weight():
    """Guards against the entropy mask folded into GMPO's token weights: each row was also scaled by its kept
    fraction (2 of 4 tokens: half the loss, and at fraction 0.2 about a fifth of the gradient). Reference: a
    transcription of TRL f2cd577 trl/experimental/gmpo/gmpo_trainer.py GMPOTrainer._compute_loss: log-space clip on
    the advantage's side, seq_mask = mask * entropy_mask inside the geometric mean, per_sequence_loss = -coef * A,
    mean over sequences."""
    logp, old, adv, mask, keep = entropy_masked_rows()
    eps = 0.4
    log_ratio = torch.where(mask, logp - old, 0.0)
    clamped = log_ratio.clamp(-eps, eps)
    a = adv[:, :1]
    clipped = torch.where(a > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))
    seq_mask = (mask & keep).double()
    coef = torch.exp((clipped * seq_mask).sum(-1) / seq_mask.sum(-1).clamp(min=1.0))
    expected = (-coef * adv[:, 0]).mean()
    (want,) = torch.autograd.grad(expected, logp)

    m = mask.double()
    w = m / (m.sum(-1, keepdim=True) * 2)  # advantage.token_weights(m, "seq_mean_token_mean")
    h = hp(loss="gmpo", clip_low=eps, clip_high=eps)
    loss, _ = loss_for(Tokens(logp, old, adv, w, mask=mask, keep=keep), h)
    (got,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.where(mask, got, 0.0), torch.where(mask, want, 0.0), atol=1e-12, rtol=0)
    folded, _ = loss_for(Tokens(logp, old, adv, w * keep), h)  # the selection folded into the weights
    assert not torch.allclose(folded, expected)


def test_gspo_sequence_ratio_runs_over_every_completion_token_under_a_selection():
    """Guards against GSPO's sequence ratio taken over the tokens a selection keeps: TRL f2cd577 grpo_trainer.py
    (importance_sampling_level "sequence": (log_ratio * mask).sum(-1) / mask.sum(-1) over the completion mask, then
    per_token_loss * entropy_mask, loss_type "grpo") and verl b178a3c core_algos.py compute_policy_loss_gspo (the
    ratio over response_mask) average every completion token. The value equals TRL's; the gradient follows verl's
    token form (sg[s] * pi / sg[pi]), so it reaches the kept tokens only, each row's total equal to TRL's."""
    logp, old, adv, mask, keep = entropy_masked_rows()
    lo, hi = 0.2, 0.28  # wide enough that no row is clipped: the gradients are compared
    m = mask.double()
    log_ratio = torch.where(mask, logp - old, 0.0)
    log_s = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)  # (B, 1): every completion token
    s = torch.exp(log_s)
    per_token = -torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv) * keep.double()
    expected = ((per_token * m).sum(-1) / m.sum(-1)).mean()
    (trl_grad,) = torch.autograd.grad(expected, logp, retain_graph=True)
    s_token = torch.exp(log_ratio - log_ratio.detach() + log_s.detach())  # verl's GSPO-token ratio
    per_token = -torch.minimum(s_token * adv, s_token.clamp(1 - lo, 1 + hi) * adv) * keep.double()
    (want,) = torch.autograd.grad(((per_token * m).sum(-1) / m.sum(-1)).mean(), logp)

    w = m / (m.sum(-1, keepdim=True) * 2)
    h = hp(loss="gspo", clip_low=lo, clip_high=hi)
    loss, _ = loss_for(Tokens(logp, old, adv, w, mask=mask, keep=keep), h)
    (got,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    got, want, trl_grad = (torch.where(mask, g, 0.0) for g in (got, want, trl_grad))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(got.sum(-1), trl_grad.sum(-1), atol=1e-12, rtol=0)
    assert (got[~keep & mask] == 0).all() and (got[keep] != 0).all()
    kept_only, _ = loss_for(Tokens(logp, old, adv, w * keep), h)  # the ratio over the kept tokens only
    assert not torch.allclose(kept_only, expected)


def icepop_rows(mode: str) -> tuple[torch.Tensor, ...]:
    """Three rows drifted from pi_old (the third one token shorter, its padding -inf/nan), a sampler whose log-probs
    put some tokens outside IcePop's [0.5, 5] (so their importance weight is 0), and those weights for `mode`."""
    from methods.mismatch import mismatch_is_weights

    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(3, 5, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    sampler = old + T([[0.0, 1.2, 0.1, 0.0, -0.2], [0.1, 0.0, -0.9, 0.2, 0.0], [0.0, 0.1, 0.0, 0.3, 0.0]])
    mask = T([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]).bool()
    with torch.no_grad():
        logp[2, 4], old[2, 4] = float("-inf"), float("nan")
    w = mismatch_is_weights(old, sampler.double(), mask, mode=mode, low=0.5, high=5.0)
    adv = T([[1.5], [-0.5], [0.8]], dtype=torch.float64).expand(3, 5)
    return logp, old, adv, mask, w


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_gmpo_leaves_the_tokens_rollout_is_masks_out_of_its_geometric_mean(mode):
    """Guards against GMPO's geometric mean running over tokens whose --rollout-is weight is 0 (IcePop's
    token_mask, sequence_mask): moving the importance weights out of the token weights into Tokens.is_weight put them
    back into each row's mean, and a rejected token got up to 2.8e-3 of gradient through its row's ratio. Reference:
    GMPO's sequence value over the accepted tokens only (verl b178a3c geo_mean on a response mask its rejection
    sampling rewrote), each token's share scaled by its weight; the normaliser counts every trained token."""
    logp, old, adv, mask, w = icepop_rows(mode)
    assert (w[mask] == 0).any() and (w[mask] != 0).any()  # both kinds of token, or the test proves nothing
    eps = 0.4
    accepted = mask & (w != 0)
    log_ratio = torch.where(accepted, logp - old, 0.0)
    clamped = log_ratio.clamp(-eps, eps)
    clipped = torch.where(adv > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))
    a = accepted.double()
    n = a.sum(-1, keepdim=True).clamp(min=1.0)
    value = torch.exp((clipped * a).sum(-1, keepdim=True) / n) * (adv * a).sum(-1, keepdim=True) / n  # (B, 1)
    m = mask.double()
    normaliser = m / (m.sum(-1, keepdim=True) * 3)  # seq_mean_token_mean over the trained tokens
    expected = -(normaliser * w * value).sum()
    (want,) = torch.autograd.grad(expected, logp)

    h = hp(loss="gmpo", clip_low=eps, clip_high=eps)
    loss, _ = loss_for(Tokens(logp, old, adv, normaliser, mask=mask, is_weight=w), h)
    (got,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.where(mask, got, 0.0), torch.where(mask, want, 0.0), atol=1e-12, rtol=0)
    assert (got[mask & (w == 0)] == 0).all()  # a rejected token gets no gradient at all


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_gspo_sequence_ratio_leaves_the_tokens_rollout_is_masks_out(mode):
    """Guards against GSPO's sequence ratio averaging the log-ratios of tokens --rollout-is rejected (weight 0): a
    rejected sample moved its row's ratio, so the clip and every accepted token's gradient, though it had no weight.
    Reference: verl's GSPO on the response mask its rejection sampling rewrote (the ratio over accepted tokens), the
    GSPO-token form, each token scaled by its importance weight."""
    logp, old, adv, mask, w = icepop_rows(mode)
    lo, hi = 0.2, 0.28
    accepted = mask & (w != 0)
    a = accepted.double()
    log_ratio = torch.where(accepted, logp - old, 0.0)
    log_s = (log_ratio * a).sum(-1, keepdim=True) / a.sum(-1, keepdim=True).clamp(min=1.0)
    s = torch.exp(log_ratio - log_ratio.detach() + log_s.detach())
    per_token = torch.where(accepted, -torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv), 0.0)
    m = mask.double()
    normaliser = m / m.sum()  # token_mean over the trained tokens
    expected = (normaliser * w * per_token).sum()
    (want,) = torch.autograd.grad(expected, logp)

    loss, _ = loss_for(
        Tokens(logp, old, adv, normaliser, mask=mask, is_weight=w), hp(loss="gspo", clip_low=lo, clip_high=hi)
    )
    (got,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.where(mask, got, 0.0), torch.where(mask, want, 0.0), atol=1e-12, rtol=0)
    assert (got[mask & (w == 0)] == 0).all()
