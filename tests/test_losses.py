"""Tests for losses.py: each method's values and gradients on small hand-made tensors, against a per-element
transcription of the formula as its reference implementation computes it (plain Python floats and the math module),
plus what the trainer relies on: padding garbage never reaches a loss or a gradient, every table entry is row-local
(so micro-batches cannot change it), and random selections are reproducible from their generator."""

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from losses import unbiased_kl
from methods.cov import clip_cov_mask, kl_cov_objective, kl_cov_select
from methods.dppo import dppo_objective
from methods.dsv32 import off_policy_sequence_mask
from methods.entropy_mask import high_entropy_mask
from methods.gmpo import gmpo_objective
from methods.gpg import gpg_alpha, gpg_objective
from methods.mismatch import ROLLOUT_IS_MODES, mismatch_is_weights
from methods.sapo import sapo_objective

NAN, INF = math.nan, math.inf
# Four sequences, padded to T = 4, with row advantages +1.5, -0.8, 0, +0.6 on their tokens. Padding holds garbage:
# -inf log-probs, nan old log-probs and advantages; nothing of it may reach the results.
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
ROW_ADV = [1.5, -0.8, 0.0, 0.6]
OLD = [[-0.7, -1.0, -2.3, NAN], [-0.4, -1.9, NAN, NAN], [-1.1, -0.2, -3.0, -0.6], [-0.4, NAN, NAN, NAN]]
LOG_RATIO = [[0.5, -0.6, 0.1, 0], [-0.5, 0.7, 0, 0], [0.3, -0.3, 0.05, -0.45], [0.25, 0, 0, 0]]
LOGP = [[OLD[i][t] + LOG_RATIO[i][t] if MASK[i][t] else -INF for t in range(4)] for i in range(4)]
CELLS = [(i, t) for i in range(4) for t in range(4) if MASK[i][t]]


def tensors():
    """(logp with grad, old_logp, adv, mask) as float64 [4, 4] tensors."""
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[a if m else NAN for m in MASK[i]] for i, a in enumerate(ROW_ADV)], dtype=torch.float64)
    return logp, torch.tensor(OLD, dtype=torch.float64), adv, torch.tensor(MASK, dtype=torch.bool)


def run(objective, hp, weight=None):
    """obj, cut and d(sum(weight * obj)) / d logp (weight: the mask unless given)."""
    logp, old, adv, mask = tensors()
    obj, cut = objective(logp, old, adv, mask, hp)
    w = mask.double() if weight is None else weight
    (w * obj).sum().backward()
    assert torch.isfinite(obj).all() and torch.isfinite(logp.grad).all(), "padding garbage leaked"
    assert (obj[~mask] == 0).all() and (logp.grad[~mask] == 0).all()
    return obj.detach(), cut, logp.grad


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_sapo_gate_values_and_gradients():
    """SAPO: f(r) A with f(r) = 4/tau sigmoid(tau (r - 1)), tau by the advantage's sign; gradient 4 s (1 - s) r A,
    exactly A at r = 1. Guards against a swapped temperature, a missing 4/tau, or a hard clip creeping back."""
    hp = SimpleNamespace(sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    obj, cut, grad = run(sapo_objective, hp)
    for i, t in CELLS:
        r, a = math.exp(LOG_RATIO[i][t]), ROW_ADV[i]
        tau = 1.0 if a > 0 else 1.05
        s = sigmoid(tau * (r - 1))
        assert obj[i, t].item() == pytest.approx(4 / tau * s * a, rel=1e-12, abs=1e-15)
        assert grad[i, t].item() == pytest.approx(4 * s * (1 - s) * r * a, rel=1e-12, abs=1e-15)
    assert not cut.any()
    # on-policy (r = 1): the gradient is the advantage itself, the value 2/tau A
    logp, _, adv, mask = tensors()
    on = torch.where(mask, logp.detach(), torch.zeros_like(logp)).requires_grad_(True)
    obj, _ = sapo_objective(on, on.detach(), adv, mask, hp)
    obj.sum().backward()
    assert torch.allclose(on.grad, adv.nan_to_num(), rtol=0, atol=1e-15)
    assert obj[0, 0].item() == pytest.approx(2 * 1.5) and obj[1, 0].item() == pytest.approx(2 / 1.05 * -0.8)


def test_gmpo_geometric_mean_with_sign_aware_log_clip():
    """GMPO: per row exp(mean of the pessimistically clipped log-ratios) times the row's advantage, on every token;
    with seq_mean_token_mean weights the loss is the mean over sequences (the references' aggregation), and the
    gradient reaches only unclipped tokens, A s / n each. Guards against clipping in ratio space, clipping both
    sides, an arithmetic mean, or a length-weighted aggregation."""
    hp = SimpleNamespace(clip_low=0.4, clip_high=0.4)
    lengths = [sum(row) for row in MASK]
    weight = torch.tensor([[m / (lengths[i] * 4) for m in MASK[i]] for i in range(4)], dtype=torch.float64)
    obj, cut, grad = run(gmpo_objective, hp, weight)
    seq_values = []
    for i in range(4):
        tokens = [t for t in range(4) if MASK[i][t]]
        clipped, kept = [], []
        for t in tokens:
            lr = LOG_RATIO[i][t]
            c = min(max(lr, -0.4), 0.4)
            pessimistic = min(lr, c) if ROW_ADV[i] > 0 else max(lr, c)
            clipped.append(pessimistic)
            kept.append(pessimistic == lr)
        s = math.exp(sum(clipped) / len(tokens))
        seq_values.append(s * ROW_ADV[i])
        for t, k in zip(tokens, kept):
            assert obj[i, t].item() == pytest.approx(s * ROW_ADV[i], rel=1e-12, abs=1e-15)
            assert cut[i, t].item() == (not k)
            assert grad[i, t].item() == pytest.approx(ROW_ADV[i] * s / len(tokens) / 4 if k else 0.0, abs=1e-15)
    # 0.5 > 0.4 with A > 0; -0.5 < -0.4 with A < 0; -0.45 with A = 0 (the A <= 0 side, as TRL): value 0 anyway
    assert cut.nonzero().tolist() == [[0, 0], [1, 0], [2, 3]]
    assert (weight * obj).sum().item() == pytest.approx(sum(seq_values) / 4, rel=1e-12)


def test_dppo_probability_gap_mask_and_log_ratio_penalty():
    """DPPO (prime-rl's default loss): tokens whose probability moved past the bound in the advantage's direction
    are masked; the rest get r A with its gradient; every token pays tau l^2. Guards against masking on the ratio
    instead of the probability gap, masking the wrong side, or dropping the penalty on masked tokens."""
    hp = SimpleNamespace(dppo_mask_low=0.2, dppo_mask_high=0.2, dppo_kl_tau=1e-3)
    obj, cut, grad = run(dppo_objective, hp)
    for i, t in CELLS:
        lr, a = LOG_RATIO[i][t], ROW_ADV[i]
        gap = math.exp(LOGP[i][t]) - math.exp(OLD[i][t])
        masked = gap > 0.2 if a > 0 else gap < -0.2
        assert cut[i, t].item() == masked
        assert obj[i, t].item() == pytest.approx((0 if masked else math.exp(lr) * a) - 1e-3 * lr**2, abs=1e-15)
        assert grad[i, t].item() == pytest.approx((0 if masked else math.exp(lr) * a) - 2e-3 * lr, abs=1e-15)
    # row 0 token 0 rose by 0.32 with A > 0; row 1 token 0 fell by 0.26 with A < 0; row 2 token 1 fell by 0.21, A = 0
    assert cut.nonzero().tolist() == [[0, 0], [1, 0], [2, 1]]


def test_gpg_is_the_plain_policy_gradient_and_alpha_counts_groups_with_a_spread():
    """GPG: obj = A logp, gradient A; alpha = groups / groups with unequal rewards. Guards against a ratio or clip
    in GPG, and against verl's count of non-zero rewards in place of the paper's count of learning groups."""
    obj, cut, grad = run(gpg_objective, SimpleNamespace())
    for i, t in CELLS:
        assert obj[i, t].item() == pytest.approx(ROW_ADV[i] * LOGP[i][t], abs=1e-15)
        assert grad[i, t].item() == ROW_ADV[i]
    assert not cut.any()
    rewards = torch.tensor([[1.0, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0.5, 0, 0, 0]])
    assert gpg_alpha(rewards) == 2.0  # 4 groups, 2 with a spread (verl's rule would give 16 / 4 non-zero = 4)
    assert gpg_alpha(torch.ones(3, 4)) == 1.0
    assert gpg_alpha(torch.tensor([[0.0, 1.0]])) == 1.0


def test_kl_cov_selects_the_top_covariance_tokens_and_penalises_only_them():
    """KL-Cov: the top max(1, int(ratio n)) tokens by (A - mean A)(logp - mean logp) over the step get
    - coef |l| on top of the unclipped r A. Guards against selecting by |cov| or the lowest covariance, against
    centring per row, and against a penalty on every token."""
    logp, old, adv, mask = tensors()
    adv = adv + torch.tensor([[0.0, 0.3, -0.2, 0.0]], dtype=torch.float64)  # per-token advantages spread the scores
    cells = CELLS
    a = [adv[i, t].item() for i, t in cells]
    lp = [LOGP[i][t] for i, t in cells]
    mean_a, mean_lp = sum(a) / len(a), sum(lp) / len(lp)
    cov = sorted(((a[j] - mean_a) * (lp[j] - mean_lp), cells[j]) for j in range(len(cells)))
    # int(n * ratio) tokens: 2.9 -> 2; the third largest covariance, 0.20, is below the third largest |cov|, 0.94
    for ratio, k in ((0.29, 2), (0.3, 3), (0.01, 1), (1.0, 10)):
        selected = kl_cov_select(logp, adv, mask, ratio=ratio)
        assert sorted(map(tuple, selected.nonzero().tolist())) == sorted(cell for _, cell in cov[-k:])
    selected = kl_cov_select(logp, adv, mask, ratio=0.25)
    hp = SimpleNamespace(kl_cov_coef=1.0)
    obj, cut = kl_cov_objective(logp, old, adv, mask, hp, selected=selected)
    obj.sum().backward()
    for i, t in cells:
        lr, s = LOG_RATIO[i][t], float(selected[i, t])
        assert obj[i, t].item() == pytest.approx(math.exp(lr) * adv[i, t].item() - s * abs(lr), abs=1e-15)
        assert logp.grad[i, t].item() == pytest.approx(math.exp(lr) * adv[i, t].item() - s * math.copysign(1, lr))
    assert not cut.any() and (obj[~mask] == 0).all() and torch.isfinite(logp.grad).all()


def test_kl_cov_penalty_is_inert_on_policy():
    """At r = 1 (mu = 1) |l| has zero gradient: KL-Cov's gradient is exactly r A. Guards the documented claim that
    the preset needs mu > 1 for the penalty to act."""
    logp, _, adv, mask = tensors()
    on = torch.where(mask, logp.detach(), torch.zeros_like(logp)).requires_grad_(True)
    obj, _ = kl_cov_objective(on, on.detach(), adv, mask, SimpleNamespace(kl_cov_coef=1.0), selected=mask)
    obj.sum().backward()
    assert torch.equal(on.grad, adv.nan_to_num())


def test_clip_cov_drops_a_seeded_random_subset_of_the_covariance_band():
    """Clip-Cov: max(int(ratio n), 1) of the tokens with lb < cov < ub are dropped, drawn from the generator: all
    of them when there are fewer, exactly that many otherwise, the same for the same seed. Guards against drawing
    outside the band, from the global RNG, or a count from the wrong n."""
    logp, _, adv, mask = tensors()
    adv = adv + torch.tensor([[0.0, 0.3, -0.2, 0.0]], dtype=torch.float64)
    a = [adv[i, t].item() for i, t in CELLS]
    lp = [LOGP[i][t] for i, t in CELLS]
    mean_a, mean_lp = sum(a) / len(a), sum(lp) / len(lp)
    cov = {cell: (a[j] - mean_a) * (lp[j] - mean_lp) for j, cell in enumerate(CELLS)}
    band = {cell for cell, c in cov.items() if 0.0 < c < 1.1}
    assert len(band) == 4 and len(CELLS) == 10  # the fixture's band: 4 candidates out of 10 tokens
    gen = torch.Generator().manual_seed(0)
    keep = clip_cov_mask(logp, adv, mask, ratio=0.5, low=0.0, high=1.1, generator=gen)  # 5 >= 4: all dropped
    assert {cell for cell in CELLS if not keep[cell]} == band and not keep[~mask].any()
    draws = set()
    for seed in range(8):
        keep = clip_cov_mask(
            logp, adv, mask, ratio=0.2, low=0.0, high=1.1, generator=torch.Generator().manual_seed(seed)
        )
        dropped = frozenset(cell for cell in CELLS if not keep[cell])
        assert len(dropped) == 2 and dropped <= band  # int(0.2 * 10) = 2
        again = clip_cov_mask(
            logp, adv, mask, ratio=0.2, low=0.0, high=1.1, generator=torch.Generator().manual_seed(seed)
        )
        assert torch.equal(keep, again)
        draws.add(dropped)
    assert len(draws) > 1  # the draw depends on the seed
    keep = clip_cov_mask(logp, adv, mask, ratio=1e-4, low=0.0, high=1.1, generator=torch.Generator().manual_seed(0))
    assert (~keep & mask).sum() == 1  # at least one token, even when ratio * n < 1


def test_high_entropy_mask_keeps_the_top_fraction_over_the_step():
    """ "80/20": threshold = the (1 - rho) quantile (linear interpolation) of the step's masked entropies, keep
    entropy >= threshold. Guards against counting padding, a nearest-rank quantile, or a strict inequality."""
    entropy = torch.tensor([[0.1, 0.5, 0.9, 7.0], [0.2, 0.6, 1.0, 7.0], [0.3, 0.7, 9.0, 9.0], [0.4, 0.8, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    # 10 tokens 0.1 .. 1.0: the 0.8 quantile sits at rank 0.8 * 9 = 7.2, i.e. 0.8 + 0.2 * (0.9 - 0.8) = 0.82
    keep = high_entropy_mask(entropy, mask, 0.2)
    assert keep.nonzero().tolist() == [[0, 2], [1, 2]]
    assert high_entropy_mask(entropy, mask, 1.0).equal(mask)
    assert high_entropy_mask(entropy, mask, 0.0).nonzero().tolist() == [[1, 2]]  # only the maximum, 1.0
    # rank 0.7 * 9 = 6.3: threshold 0.73, keeps 0.8, 0.9, 1.0; ties at the threshold are kept
    assert high_entropy_mask(entropy, mask, 0.3).sum() == 3
    tied = torch.tensor([[1.0, 1.0, 0.5, 0.5]])
    assert high_entropy_mask(tied, torch.ones(1, 4, dtype=torch.bool), 0.25).tolist() == [[True, True, False, False]]
    # the threshold is torch.quantile's, to the bit, on a larger random step
    gen = torch.Generator().manual_seed(0)
    ent, m = torch.rand(64, 50, generator=gen) * 3, torch.rand(64, 50, generator=gen) < 0.7
    for rho in (0.2, 0.05, 0.5):
        expected = m & (ent >= torch.quantile(ent[m], 1 - rho))
        assert torch.equal(high_entropy_mask(ent, m, rho), expected)
    assert not high_entropy_mask(ent, torch.zeros_like(m), 0.2).any()


def test_off_policy_sequence_mask_drops_drifted_negative_sequences():
    """DeepSeek-V3.2: a token is dropped when its advantage is negative and its row's mean (sampler - current)
    log-prob gap exceeds delta. Guards against dropping positive sequences, a sum in place of the mean, the
    reversed KL sign, or padding in the mean."""
    logp = torch.tensor([[-1.0, -1.0, -INF], [-1.0, -1.0, -1.0], [-1.0, -1.0, 5.0], [-1.0, -3.0, -INF]])
    sampler = torch.tensor([[-0.5, -0.8, NAN], [-1.2, -1.0, -1.0], [-0.5, -0.5, 0.0], [-0.5, -0.5, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[-1.0] * 3, [-1.0] * 3, [2.0] * 3, [-1.0, 1.0, -1.0]])
    # row KLs: (0.5 + 0.2) / 2 = 0.35; (-0.2 + 0 + 0) / 3 < 0; 0.5 (positive row); (0.5 + 2.5) / 2 = 1.5
    keep = off_policy_sequence_mask(logp, sampler, adv, mask, delta=0.3)
    assert keep.tolist() == [[False, False, False], [True] * 3, [True, True, False], [False, True, False]]
    keep = off_policy_sequence_mask(logp, sampler, adv, mask, delta=0.35)  # kl <= delta is kept
    assert keep[0].tolist() == [True, True, False]


def test_unbiased_kl_is_k3_times_the_ratio_with_the_true_kl_gradient():
    """DeepSeek-V3.2's estimator: r (e^d - d - 1), gradient through both factors = r (logp - ref_logp), which is
    not k3's (1 - e^d) even at r = 1. Guards against a detached ratio or the ratio's inverse."""
    logp = torch.tensor([[-1.0, -0.5, -INF], [-2.0, -0.1, -0.3]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.3, -0.2, NAN], [-1.5, -0.1, -0.9]], dtype=torch.float64)
    old = torch.tensor([[-0.8, -0.5, NAN], [-2.2, -0.4, -0.3]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    kl = unbiased_kl(logp, ref, old, mask)
    kl.sum().backward()
    for i, t in [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]:
        lp, rf, od = logp[i, t].item(), ref[i, t].item(), old[i, t].item()
        r, d = math.exp(lp - od), rf - lp
        assert kl[i, t].item() == pytest.approx(r * (math.exp(d) - d - 1), abs=1e-15)
        assert logp.grad[i, t].item() == pytest.approx(r * (lp - rf), abs=1e-15)
    assert kl[0, 2].item() == 0 and logp.grad[0, 2].item() == 0
    assert logp.grad[0, 1].item() == pytest.approx(-0.3) != pytest.approx(1 - math.exp(0.3))  # r = 1 here


@pytest.mark.parametrize("mode", ROLLOUT_IS_MODES)
def test_mismatch_weights_truncate_or_mask_per_token_or_per_sequence(mode):
    """TRL's four modes: rho per token or exp(sum) per sequence, then clamp to [low, high] or keep rho only inside
    it. Guards against a geometric mean for the sequence ratio, a 0/1 mask losing the ratio, the inverse ratio, and
    a gradient through the weights."""
    old = torch.tensor([[-1.0, -1.0, -1.0, NAN], [-1.0, -1.0, -1.0, -1.0], [-2.0, NAN, NAN, NAN]], requires_grad=True)
    sampler = torch.tensor([[-2.0, -0.2, -1.1, NAN], [-1.2, -1.1, -0.9, -1.0], [-0.5, -INF, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    low, high = 0.5, 2.0
    w = mismatch_is_weights(old, sampler, mask, mode=mode, low=low, high=high)
    assert w.grad_fn is None
    for i in range(3):
        cells = [t for t in range(4) if mask[i, t]]
        seq = math.exp(sum(old[i, t].item() - sampler[i, t].item() for t in cells))
        for t in range(4):
            if not mask[i, t]:
                assert w[i, t].item() == 1.0
                continue
            rho = seq if mode.startswith("sequence") else math.exp(old[i, t].item() - sampler[i, t].item())
            expected = min(max(rho, low), high) if mode.endswith("truncate") else (rho if low <= rho <= high else 0.0)
            assert w[i, t].item() == pytest.approx(expected, rel=1e-6)
    # the sequence ratios are e^0.3 (inside), e^0.3 (inside) and e^-1.5 (below 0.5): row 2 masked or floored
    if mode == "sequence_mask":
        assert w[2, 0].item() == 0.0 and w[0, 0].item() == pytest.approx(math.exp(0.3), rel=1e-6)
    if mode == "token_mask":  # e^1 = 2.72 > 2 and e^-0.8 = 0.45 < 0.5 masked: IcePop's two-sided token mask
        assert w[0, :3].tolist() == [0.0, 0.0, pytest.approx(math.exp(0.1), rel=1e-6)]


def test_token_truncate_without_a_floor_is_the_per_token_truncated_is():
    """token_truncate at [0, C] is min(rho, C): the project's truncated IS, so one flag family covers both."""
    gen = torch.Generator().manual_seed(1)
    old, sampler = -torch.rand(5, 7, generator=gen) * 3, -torch.rand(5, 7, generator=gen) * 3
    mask = torch.rand(5, 7, generator=gen) < 0.8
    w = mismatch_is_weights(old, sampler, mask, mode="token_truncate", low=0.0, high=2.0)
    expected = torch.where(mask, torch.exp(old - sampler).clamp(max=2.0), torch.ones_like(old))
    assert torch.equal(w, expected)


TABLE = {
    "sapo": (sapo_objective, SimpleNamespace(sapo_tau_pos=1.0, sapo_tau_neg=1.05)),
    "gmpo": (gmpo_objective, SimpleNamespace(clip_low=0.4, clip_high=0.4)),
    "dppo": (dppo_objective, SimpleNamespace(dppo_mask_low=0.2, dppo_mask_high=0.2, dppo_kl_tau=1e-3)),
    "gpg": (gpg_objective, SimpleNamespace()),
    "kl_cov": (kl_cov_objective, SimpleNamespace(kl_cov_coef=1.0)),
}


@pytest.mark.parametrize("name", TABLE)
def test_every_entry_is_row_local(name):
    """Each row's objective depends on that row only, so splitting the step's rows into micro-batches cannot change
    the loss or its gradient. Guards against a batch statistic computed inside an entry (e.g. KL-Cov's top-k)."""
    objective, hp = TABLE[name]
    logp, old, adv, mask = tensors()
    if name == "kl_cov":
        selected = kl_cov_select(logp, adv, mask, ratio=0.3)
        full, cut = functools.partial(objective, selected=selected)(logp, old, adv, mask, hp)
        parts = [
            functools.partial(objective, selected=selected[s])(logp[s], old[s], adv[s], mask[s], hp)
            for s in (slice(0, 1), slice(1, 4))
        ]
    else:
        full, cut = objective(logp, old, adv, mask, hp)
        parts = [objective(logp[s], old[s], adv[s], mask[s], hp) for s in (slice(0, 1), slice(1, 4))]
    assert torch.equal(full, torch.cat([p[0] for p in parts])) and torch.equal(cut, torch.cat([p[1] for p in parts]))
    assert cut.dtype == torch.bool and cut.shape == mask.shape and not cut[~mask].any()


def test_bad_hyperparameters_name_their_flag():
    logp, old, adv, mask = tensors()
    with pytest.raises(ValueError, match="--sapo-tau-neg"):
        sapo_objective(logp, old, adv, mask, SimpleNamespace(sapo_tau_pos=1.0, sapo_tau_neg=0.0))
    with pytest.raises(ValueError, match="--clip-low"):
        gmpo_objective(logp, old, adv, mask, SimpleNamespace(clip_low=-0.4, clip_high=0.4))
    with pytest.raises(ValueError, match="--top-entropy-fraction"):
        high_entropy_mask(adv, mask, 1.5)
    with pytest.raises(ValueError, match="--clip-cov-lb"):
        clip_cov_mask(logp, adv, mask, ratio=0.1, low=5.0, high=1.0, generator=torch.Generator())
    with pytest.raises(ValueError, match="choose one of token_truncate"):
        mismatch_is_weights(old, old, mask, mode="tokens", high=2.0)
    with pytest.raises(ValueError, match="--tis-floor"):
        mismatch_is_weights(old, old, mask, mode="token_mask", low=3.0, high=2.0)
