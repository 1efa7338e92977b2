"""Tests for advantage.py: exact hand-computed values for every formula, plus the properties the
trainer relies on (zero-mean groups, GRPO-MA's M = 1 reduction, micro-batch invariance of the
gradient, GTPO weights against a brute-force loop, GRPO-MA's variance claim)."""

import math
import random
import types

import pytest
import torch

from advantage import (
    agrae_advantages,
    dynamic_sampling_keep,
    estimate_noise_rates,
    flip_rewards,
    gradient_spike_score,
    group_advantages,
    grpo_ma_advantages,
    grpo_ma_token_advantages,
    grpo_ma_token_weights,
    gtpo_conflict_weights,
    gtpo_entropy_gate,
    gtpo_entropy_shift,
    noise_corrected_rewards,
    overlong_penalty,
    pairwise_distinct_advantages,
    select_hard_examples,
    splice_anchor_rewards,
    token_weights,
    two_grpo_advantages,
)
from losses import Tokens, kl3, loss_name, policy_loss
from methods import LOSSES
from methods.dagrpo import luffy_shaped
from methods.mismatch import truncated_is_weights

T = torch.tensor


def loss_for(tok: Tokens, h) -> tuple[torch.Tensor, dict]:
    """policy_loss with the objective --loss (h.loss, or h.sequence_ratio) names, as the trainer passes it."""
    return policy_loss(tok, h, LOSSES[loss_name(h)])


def shaped_loss(tok: Tokens, h, gamma: float = 0.1) -> tuple[torch.Tensor, dict]:
    """policy_loss with --loss's objective under DaGRPO's anchors: LUFFY's shaping on tok.off_policy."""
    return policy_loss(tok, h, luffy_shaped(LOSSES[loss_name(h)], gamma))


def hp(**kw) -> types.SimpleNamespace:
    """policy_loss's hyperparameters: the trainer's defaults (TrainConfig), changed by kw."""
    return types.SimpleNamespace(**{"loss": "clip", "clip_low": 0.2, "clip_high": 0.2, "beta": 0.0, **kw})


def close(a, b, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=tol
    )


# ---------------------------------------------------------------------------------------------
# 1. Group advantages


def test_group_advantages_values_unbiased_std():
    """Guards against population std (would give +-1 / [1.73, -0.58..]) or a missing mean shift."""
    # [1,0,1,0]: mean .5, unbiased var = 4*.25/3 = 1/3, std .57735 -> .5/.57735 = .866025
    # [1,0,0,0]: mean .25, unbiased var = (.5625 + 3*.0625)/3 = .25, std .5 -> [1.5, -.5, -.5, -.5]
    adv = group_advantages(T([[1.0, 0, 1, 0], [1, 0, 0, 0]]))
    assert close(adv, [[0.866025, -0.866025, 0.866025, -0.866025], [1.5, -0.5, -0.5, -0.5]])


def test_group_advantages_degenerate_and_single_sample_exactly_zero():
    """Guards against 0/(0+eps) noise, nan from torch.std of one sample, and Dr. GRPO skipping the mask."""
    for std_normalize in (True, False):
        assert torch.equal(group_advantages(T([[0.3, 0.3, 0.3]]), std_normalize=std_normalize), torch.zeros(1, 3))
        assert torch.equal(group_advantages(T([[0.7], [-2.0]]), std_normalize=std_normalize), torch.zeros(2, 1))
    # float32 mean of six 0.3s is off by 3e-8; without the explicit mask this gives 3e-8/(0+eps) = 0.029
    assert torch.equal(group_advantages(torch.full((1, 6), 0.3)), torch.zeros(1, 6))


def test_dr_grpo_advantages_are_centred_only():
    """Guards against Dr. GRPO (std_normalize=False) still dividing by the std."""
    assert torch.equal(group_advantages(T([[1.0, 0, 0, 0]]), std_normalize=False), T([[0.75, -0.25, -0.25, -0.25]]))


def test_group_advantages_zero_mean_and_unit_sample_variance():
    """Guards against normalising over the wrong dim (prompts instead of the group) or the wrong std."""
    r = torch.rand(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = group_advantages(r, eps=0.0)
    assert close(adv.sum(-1), torch.zeros(6), 1e-12)
    assert close((adv**2).sum(-1), torch.full((6,), 4.0), 1e-10)  # unbiased: sum A^2 = G - 1


def test_grpo_ma_thoughts_tie_answers_differ():
    """Guards against per-thought answer normalisation and against thought ties leaking a signal."""
    # V = [.5, .5] -> thought adv exactly 0. Answers: 4 ones, 4 zeros over all K*M = 8 answers:
    # unbiased var = 8*.25/7 = 2/7, std .534522 -> +-.5/.534522 = +-.935414
    th, ans = grpo_ma_advantages(T([[[1.0, 1, 0, 0], [0, 0, 1, 1]]]))
    assert torch.equal(th, torch.zeros(1, 2))
    a = 0.935414
    assert close(ans, [[[a, a, -a, -a], [-a, -a, a, a]]])


def test_grpo_ma_hand_values():
    """Guards against using the answer mean instead of the thought value V, or normalising V wrongly."""
    # V = [.75, .25]: unbiased std of a pair = |d|/sqrt2 = .353553 -> +-.25/.353553 = +-.707107
    th, ans = grpo_ma_advantages(T([[[1.0, 1, 1, 0], [1, 0, 0, 0]]]))
    a = 0.935414  # 4 ones and 4 zeros again
    assert close(th, [[0.707107, -0.707107]])
    assert close(ans, [[[a, a, a, -a], [a, -a, -a, -a]]])
    # V = [1, .5, 0]: unbiased std .5 -> [1, 0, -1]; answers [1,1,1,0,0,0]: var 6*.25/5 = .3, std .547723
    th, ans = grpo_ma_advantages(T([[[1.0, 1], [1, 0], [0, 0]]]))
    b = 0.5 / math.sqrt(0.3)
    assert close(th, [[1.0, 0.0, -1.0]])
    assert close(ans, [[[b, b], [b, -b], [-b, -b]]])


def test_grpo_ma_m1_reduces_to_grpo_exactly_and_k1_thought_is_zero():
    """Guards against any extra arithmetic on the M = 1 path (must be bit-exact GRPO) and K = 1 nan."""
    g = torch.Generator().manual_seed(1)
    r = torch.randint(0, 2, (7, 5, 1), generator=g).float()
    r[0] = 1.0  # one degenerate group
    th, ans = grpo_ma_advantages(r)
    assert torch.equal(th, group_advantages(r[..., 0]))
    assert torch.equal(ans[..., 0], group_advantages(r[..., 0]))
    th, ans = grpo_ma_advantages(T([[[1.0, 0, 0, 0]]]))  # K = 1: answers still learn
    assert torch.equal(th, torch.zeros(1, 1))
    assert close(ans, [[[1.5, -0.5, -0.5, -0.5]]])


def test_two_grpo_values_and_population_std_equivalence():
    """Guards against unbiased std (+-0.707), keeping the reward gap, or a non-zero tie advantage."""
    assert torch.equal(two_grpo_advantages(T([[1.0, 0], [0, 0], [0.2, 0.9]])), T([[1.0, -1], [0, 0], [-1, 1]]))
    r = torch.randn(50, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    pop = (r - r.mean(-1, keepdim=True)) / r.std(-1, keepdim=True, unbiased=False)
    assert close(two_grpo_advantages(r), pop, 1e-12)
    with pytest.raises(ValueError):
        two_grpo_advantages(torch.zeros(2, 3))


def test_agrae_hand_values_from_batch_accuracy():
    """Guards against swapped easy/hard terms, suppressing negatives, or P not from the batch."""
    r = T([[1.0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    # p = [.25, .75, 1, 0] -> P = .5, beta = min(1, .5/1) = .5 on positive entries.
    # p=.25: sqrt .5, w = .5*.5/.5 + .5*.5/.5 = 1; GRPO adv [1.5,-.5,-.5,-.5] -> [.75, -.5, -.5, -.5]
    # p=.75: sqrt .866025, w = .5*.5/.133975 + .5*.5/.866025 = 1.866025 + .288675 = 2.154701
    #        GRPO adv [.5,.5,.5,-1.5] -> pos .5*2.154701*.5 = .538675, neg -1.5*2.154701 = -3.232051
    adv = agrae_advantages(r)
    assert close(adv[:2], [[0.75, -0.5, -0.5, -0.5], [0.538675, 0.538675, 0.538675, -3.232051]], 1e-4)
    assert torch.equal(adv[2:], torch.zeros(2, 4))  # degenerate groups stay exactly 0
    assert torch.equal(agrae_advantages(torch.full((1, 6), 0.3)), torch.zeros(1, 6))  # inexact float mean


def test_agrae_low_and_high_accuracy_curriculum():
    """Guards against ignoring batch_accuracy or the curriculum direction (easy first, hard later)."""
    r = T([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    # P = .1 (low): p=.75: w = .9*.5/.133975 + .1*.5/.866025 = 3.358846 + .057735 = 3.416581, beta .1
    #   -> pos .5*3.416581*.1 = .170829, neg -1.5*3.416581 = -5.124871
    #   p=.5: sqrt .707107, w = .9*.5/.292893 + .1*.5/.707107 = 1.536396 + .070711 = 1.607107
    #   GRPO adv of [1,1,0,0]: +-.5/.57735 = +-.866025 -> pos .866025*1.607107*.1 = .139180, neg -1.391795
    low = agrae_advantages(r, batch_accuracy=0.1)
    assert close(low, [[0.170829] * 3 + [-5.124871], [0.139180, 0.139180, -1.391795, -1.391795]], 1e-4)
    # P = .9 (high): p=.75: w = .1*.5/.133975 + .9*.5/.866025 = .373205 + .519615 = .892820, beta .9
    #   -> pos .5*.892820*.9 = .401769, neg -1.5*.892820 = -1.339230
    #   p=.5: w = .1*1.707107 + .9*.707107 = .807107 -> pos .866025*.807107*.9 = .629079, neg -.698975
    high = agrae_advantages(r, batch_accuracy=0.9)
    assert close(high, [[0.401769] * 3 + [-1.339230], [0.629079, 0.629079, -0.698975, -0.698975]], 1e-4)
    # Hard groups (p=.5) gain against easy ones (p=.75) as accuracy rises: the curriculum's direction.
    assert (high[1, 3] / high[0, 3]) > (low[1, 3] / low[0, 3])


def test_agrae_correct_tensor_and_dr_grpo_variant():
    """Guards against p read from non-0/1 rewards, the p in {0,1} weight blow-up, and std in Dr. GRPO."""
    c = T([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    assert close(agrae_advantages(10 * c + 3, correct=c), agrae_advantages(c), 1e-4)
    # All correct but rewards differ (e.g. overlong penalty): weight 1, not ~5e5 (documented departure).
    # P = 1 -> beta 1; GRPO adv of [1, .5] = +-.25/.353553 = +-.707107.
    adv = agrae_advantages(T([[1.0, 0.5]]), correct=T([[1.0, 1.0]]))
    assert close(adv, [[0.707107, -0.707107]])
    # Dr. GRPO: [1,1,1,0] centred = [.25,.25,.25,-.75], P = .75 -> w = .25*3.732051 + .75*.577350 = 1.366025,
    # beta .75 -> pos .25*1.366025*.75 = .256130, neg -.75*1.366025 = -1.024519
    adv = agrae_advantages(T([[1.0, 1, 1, 0]]), std_normalize=False)
    assert close(adv, [[0.256130] * 3 + [-1.024519]], 1e-4)


def test_noise_corrected_rewards():
    """Guards against a wrong de-biasing formula and against silently inverting a non-invertible channel."""
    r_hat = noise_corrected_rewards(T([[1.0, 0, 1, 1]]), 0.2, 0.1)  # (r - .2)/.7
    assert close(r_hat, [[8 / 7, -2 / 7, 8 / 7, 8 / 7]])
    # centred: (r - mean r) / .7, mean r = .75 -> [.25, -.75, .25, .25] / .7
    assert close(group_advantages(r_hat, std_normalize=False), [[0.25 / 0.7, -0.75 / 0.7, 0.25 / 0.7, 0.25 / 0.7]])
    assert torch.equal(group_advantages(noise_corrected_rewards(torch.ones(1, 4), 0.2, 0.1)), torch.zeros(1, 4))
    with pytest.raises(ValueError):
        noise_corrected_rewards(T([1.0]), 0.6, 0.4)


def test_noise_rates_out_of_range_are_errors():
    """Guards against silently inverting a channel with no signal (rho_plus + rho_minus >= 1), negative
    or >= 1 rates, and nan rates slipping through comparisons that are all False."""
    r = T([[1.0, 0, 1, 0]])
    g = torch.Generator().manual_seed(0)
    for rho_p, rho_m in ((0.6, 0.4), (0.7, 0.5), (-0.1, 0.2), (1.0, 0.0), (0.0, 1.0), (float("nan"), 0.1)):
        with pytest.raises(ValueError):
            noise_corrected_rewards(r, rho_p, rho_m)
        with pytest.raises(ValueError):
            flip_rewards(r, rho_p, rho_m, g)
    with pytest.raises(ValueError):  # per-prompt rates: one bad group is enough
        noise_corrected_rewards(T([[1.0, 0], [1, 0]]), T([[0.2], [0.5]]), T([[0.1], [0.5]]))


def test_zero_noise_is_the_identity():
    """Guards against flips at rate 0 (u <= rho instead of u < rho), a dtype change, and a correction
    that is not the identity when there is no noise."""
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 2, (64, 8), generator=g).float()
    assert torch.equal(flip_rewards(r, 0.0, 0.0, g), r)
    assert torch.equal(flip_rewards(r.long(), 0.0, 0.0, g), r.long())
    assert torch.equal(flip_rewards(r.bool(), 0.0, 0.0, g), r.bool())
    assert torch.equal(noise_corrected_rewards(r, 0.0, 0.0), r)
    with pytest.raises(ValueError):  # flips are defined for 0/1 rewards only
        flip_rewards(T([[0.5, 1.0]]), 0.1, 0.1, g)


def test_flip_rewards_flips_each_class_at_its_own_rate():
    """Guards against swapped rates (flipping wrong answers at rho_minus), flipping both ways for one class,
    an unseeded draw, and per-prompt rates not broadcasting. 100k per class: SE <= .0016, tolerance 5 SE."""
    n = 100_000
    clean = torch.cat([torch.zeros(n), torch.ones(n)])
    noisy = flip_rewards(clean, 0.2, 0.1, torch.Generator().manual_seed(1))
    assert torch.equal(noisy, flip_rewards(clean, 0.2, 0.1, torch.Generator().manual_seed(1)))  # seeded
    rho_p, rho_m = estimate_noise_rates(noisy, clean)
    assert abs(rho_p - 0.2) < 5 * math.sqrt(0.2 * 0.8 / n) and abs(rho_m - 0.1) < 5 * math.sqrt(0.1 * 0.9 / n)
    # per-prompt rates [P, 1]: group 0 has no noise at all, group 1 flips half of its wrong answers
    noisy = flip_rewards(torch.zeros(2, n), T([[0.0], [0.5]]), 0.0, torch.Generator().manual_seed(2))
    assert torch.equal(noisy[0], torch.zeros(n)) and abs(noisy[1].mean().item() - 0.5) < 5 * math.sqrt(0.25 / n)


def test_flip_rewards_one_generator_per_row_is_independent_of_batching():
    """Guards against per-prompt generators whose draws depend on which other rows share the batch (the
    trainer's flips must not change with the batch split or world size), or a generator count not checked."""
    rewards = T([[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 1]])
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]
    whole = flip_rewards(rewards, 0.3, 0.4, gens([7, 8, 9]))
    assert torch.equal(whole[1:], flip_rewards(rewards[1:], 0.3, 0.4, gens([8, 9])))
    assert torch.equal(whole[0], flip_rewards(rewards[0], 0.3, 0.4, torch.Generator().manual_seed(7)))
    with pytest.raises(ValueError, match="2 generators for 3 rows"):
        flip_rewards(rewards, 0.3, 0.4, gens([1, 2]))


def test_estimate_noise_rates_hand_values_and_missing_class():
    """Guards against swapped outputs or arguments, rho_minus counted as a keep rate, and a nan rate
    (0/0) when the calibration sample lacks a class."""
    noisy = T([1.0, 1, 0, 0, 0, 1, 1, 1, 1, 1])
    correct = T([0.0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    rho_p, rho_m = estimate_noise_rates(noisy, correct)  # 2 of 4 wrong read as right; 1 of 6 right as wrong
    assert rho_p == 0.5 and close(rho_m, 1 / 6, 1e-12)
    with pytest.raises(ValueError, match="truly right"):
        estimate_noise_rates(T([0.0, 1, 1]), T([0.0, 0, 0]))
    with pytest.raises(ValueError, match="truly wrong"):
        estimate_noise_rates(T([0.0, 1, 1]), T([1.0, 1, 1]))
    with pytest.raises(ValueError):
        estimate_noise_rates(T([0.0, 1]), T([0.0, 1, 1]))


def test_noise_correction_is_unbiased_by_simulation():
    """Guards against a biased correction (wrong sign or denominator): with 200k injected flips the corrected
    means match the clean ones to 5 standard errors, while the uncorrected ones miss by > 25 SE, both for
    the per-sample reward (E[r_hat | r*] = r*) and for the Dr. GRPO advantage (noisy = (1 - rho+ - rho-) x clean)."""
    rho_p, rho_m, J = 0.2, 0.1, 0.7
    n = 100_000
    clean = torch.cat([torch.zeros(n), torch.ones(n)]).double()
    noisy = flip_rewards(clean, rho_p, rho_m, torch.Generator().manual_seed(3))
    r_hat = noise_corrected_rewards(noisy, rho_p, rho_m)
    for label in (0.0, 1.0):
        sel = clean == label
        tol = 5 * r_hat[sel].std().item() / math.sqrt(n)  # ~.007
        assert abs(r_hat[sel].mean().item() - label) < tol
        assert abs(noisy[sel].mean().item() - label) > 5 * tol  # uncorrected: off by rho_p or rho_m
    # Dr. GRPO advantage over 50k groups of 4 with clean rewards [1, 0, 0, 0] (200k samples)
    P = 50_000
    clean = T([1.0, 0, 0, 0], dtype=torch.float64).repeat(P, 1)
    noisy = flip_rewards(clean, rho_p, rho_m, torch.Generator().manual_seed(4))
    corrected = group_advantages(noise_corrected_rewards(noisy, rho_p, rho_m), std_normalize=False)
    uncorrected = group_advantages(noisy, std_normalize=False)
    want = group_advantages(clean[:1], std_normalize=False)[0]  # [.75, -.25, -.25, -.25]
    tol = 5 * corrected.std(0) / math.sqrt(P)  # (4,) ~.009
    assert ((corrected.mean(0) - want).abs() < tol).all()
    assert ((uncorrected.mean(0) - J * want).abs() < tol * J).all()  # the shrunk contrast, as derived
    assert ((uncorrected.mean(0) - want).abs() > 5 * tol).all()  # off by .3 * want: 34-120 SE


def test_std_normalisation_cancels_noise_correction():
    """Guards against pairing the correction with GRPO's std normalisation, where it does nothing: the
    z-score of r_hat equals the z-score of r (exactly at eps = 0), so the correction goes with Dr. GRPO
    centring, where with global rates it is the constant rescale 1 / (1 - rho+ - rho-)."""
    r = torch.randint(0, 2, (40, 8), generator=torch.Generator().manual_seed(5)).double()
    r_hat = noise_corrected_rewards(r, 0.2, 0.1)
    assert close(group_advantages(r_hat, eps=0.0), group_advantages(r, eps=0.0), 1e-12)
    assert close(group_advantages(r_hat), group_advantages(r), 1e-5)  # eps rescales by .7: a 3e-7 relative gap
    assert close(group_advantages(r_hat, std_normalize=False), group_advantages(r, std_normalize=False) / 0.7, 1e-12)


def test_pairwise_distinct_delta_zero_is_dr_grpo_bit_exact():
    """Guards against the pair sum drifting from Dr. GRPO when nothing is masked (delta = 0 must give
    group_advantages bit for bit, with or without std) and against a pair formula other than
    (1/G) sum_j (r_i - r_j) = r_i - mean r."""
    g = torch.Generator().manual_seed(6)
    for G in (1, 3, 5, 8):
        r = torch.rand(20, G, generator=g)
        r[0] = 0.3  # a degenerate group with an inexact float mean
        s = torch.rand(20, G, generator=g)
        for std_normalize in (False, True):
            got = pairwise_distinct_advantages(r, s, 0.0, std_normalize=std_normalize)
            assert torch.equal(got, group_advantages(r, std_normalize=std_normalize)), (G, std_normalize)
        pair_sum = (r[:, :, None] - r[:, None, :]).double().sum(-1) / G
        assert close(pairwise_distinct_advantages(r, s, 0.0), pair_sum, 1e-6)
    ints = T([[1, 0, 0, 0]])  # integer rewards are accepted, as in group_advantages
    assert torch.equal(pairwise_distinct_advantages(ints, torch.zeros(1, 4), 0.0), T([[0.75, -0.25, -0.25, -0.25]]))


def test_pairwise_distinct_hand_values():
    """Guards against masking samples instead of pairs, a strict > at the threshold, renormalising by the
    kept-pair count instead of G, and a mask that is not symmetric (groups must stay centred)."""
    # Reference §5: pair (1, 2) has gap .05 < .1 and is dropped; cross pairs (0,2), (0,3), (1,3) stay.
    # A = 1/4 * [(1-0)+(1-0), (1-0), -(1-0), -(1-0)-(1-0)]
    r, s = T([[1.0, 1, 0, 0]]), T([[0.9, 0.55, 0.5, 0.1]])
    assert close(pairwise_distinct_advantages(r, s, 0.1), [[0.5, 0.25, -0.25, -0.5]], 1e-7)
    # GRPO form: the same over the unmasked std of [1, 1, 0, 0], .57735
    assert close(
        pairwise_distinct_advantages(r, s, 0.1, std_normalize=True), [[0.866025, 0.433013, -0.433013, -0.866025]]
    )
    # G = 3, graded rewards: only pair (0, 2) has |s_i - s_j| = 1 >= .75 -> [1/3, 0, -1/3] (Dr. GRPO: [.5, 0, -.5])
    assert close(
        pairwise_distinct_advantages(T([[1.0, 0.5, 0]]), T([[0.0, 0.5, 1.0]]), 0.75), [[1 / 3, 0, -1 / 3]], 1e-7
    )
    # Exact gaps of .25 (binary fractions): delta = .25 keeps them all (>=), delta = .5 drops adjacent pairs,
    # leaving only the cross pair (0, 3): A = [1/4, 0, 0, -1/4]
    r, s = T([[1.0, 0, 1, 0]]), T([[0.75, 0.5, 0.25, 0.0]])
    assert torch.equal(pairwise_distinct_advantages(r, s, 0.25), T([[0.5, -0.5, 0.5, -0.5]]))
    assert torch.equal(pairwise_distinct_advantages(r, s, 0.5), T([[0.25, 0.0, 0.0, -0.25]]))
    g = torch.Generator().manual_seed(7)
    adv = pairwise_distinct_advantages(torch.rand(30, 6, generator=g), torch.rand(30, 6, generator=g), 0.3)
    assert close(adv.sum(-1), torch.zeros(30), 1e-6)
    with pytest.raises(ValueError):
        pairwise_distinct_advantages(r, s, -0.1)
    with pytest.raises(ValueError):
        pairwise_distinct_advantages(r, s[:, :3], 0.1)


def test_pairwise_distinct_degenerate_and_fully_masked_groups_are_exactly_zero():
    """Guards against 0/(0+eps) noise on all-equal groups, nan at G = 1, and rounding residue when every
    pair of a row is masked (the row must carry no signal at all)."""
    g = torch.Generator().manual_seed(8)
    for std_normalize in (False, True):
        for delta in (0.0, 0.2):
            r = torch.full((1, 6), 0.3)
            got = pairwise_distinct_advantages(r, torch.rand(1, 6, generator=g), delta, std_normalize=std_normalize)
            assert torch.equal(got, torch.zeros(1, 6))
            assert torch.equal(pairwise_distinct_advantages(T([[0.7]]), T([[0.1]]), delta), torch.zeros(1, 1))
        same = pairwise_distinct_advantages(
            T([[0.9, 0.2, 0.1]]), torch.full((1, 3), 0.5), 0.1, std_normalize=std_normalize
        )
        assert torch.equal(same, torch.zeros(1, 3))


def test_splice_anchor_rewards_and_anchor_advantage():
    """Guards against anchoring groups that already have a correct sample, triggering on rewards instead of
    correctness, growing the group, and the anchor not getting the positive (G-1)/G advantage."""
    rewards = T([[-0.1, 0, 0, 0], [1.0, 0, 0, 0]])  # group 0: all wrong (one with a format penalty)
    correct = T([[0.0, 0, 0, 0], [1, 0, 0, 0]])
    spliced, is_anchor = splice_anchor_rewards(rewards, correct)
    assert torch.equal(spliced, T([[-0.1, 0, 0, 1.0], [1.0, 0, 0, 0]]))
    assert is_anchor.tolist() == [[False, False, False, True], [False] * 4]
    zeros = torch.zeros(1, 4)
    spliced, _ = splice_anchor_rewards(zeros, zeros)
    # Dr. GRPO / pairwise(delta = 0): the anchor gets (G-1)/G, each wrong rollout -1/G
    assert torch.equal(pairwise_distinct_advantages(spliced, torch.zeros(1, 4), 0.0), T([[-0.25, -0.25, -0.25, 0.75]]))
    assert torch.equal(group_advantages(spliced, std_normalize=False), T([[-0.25, -0.25, -0.25, 0.75]]))
    # GRPO at G = 8 (reference §1.5): .875 / .353553 = 2.474874, wrong rollouts -.125 / .353553
    spliced, _ = splice_anchor_rewards(torch.zeros(1, 8), torch.zeros(1, 8))
    assert close(group_advantages(spliced), [[-0.353553] * 7 + [2.474874]])
    # With the distinctiveness mask and the anchor scored 1.0: the wrong rollout scored .95 is too close
    # to the reference to be pushed down; the anchor contrasts only with rollouts 0 and 2.
    spliced, is_anchor = splice_anchor_rewards(zeros, zeros)
    scores = T([[0.2, 0.95, 0.3, 0.0]]).masked_fill(is_anchor, 1.0)
    assert close(pairwise_distinct_advantages(spliced, scores, 0.1), [[-0.25, 0.0, -0.25, 0.5]], 1e-7)
    spliced, is_anchor = splice_anchor_rewards(rewards, correct, anchor_reward=0.9, max_correct=1)
    assert is_anchor[:, -1].tolist() == [True, True] and close(spliced[:, -1], [0.9, 0.9], 1e-7)


# ---------------------------------------------------------------------------------------------
# 2. DAPO


def test_dynamic_sampling_keep():
    """Guards against keeping all-equal groups (zero gradient) or dropping mixed ones."""
    keep = dynamic_sampling_keep(T([[1.0, 1], [0, 1], [0, 0], [0.5, 0.5], [0.2, 0.3]]))
    assert keep.tolist() == [False, True, False, False, True]


def test_overlong_penalty_boundaries():
    """Guards against off-by-one at the buffer edges and a missing -1 floor beyond max_len."""
    got = overlong_penalty(T([0, 16, 17, 18, 20, 21, 100]), max_len=20, buffer=4)
    assert close(got, [0, 0, -0.25, -0.5, -1, -1, -1], 1e-7)
    got = overlong_penalty(T([16384, 18432, 20480, 20481]), max_len=20480, buffer=4096)  # DAPO's values
    assert close(got, [0, -0.5, -1, -1], 1e-7)
    with pytest.raises(ValueError):
        overlong_penalty(T([1]), max_len=4, buffer=8)


# ---------------------------------------------------------------------------------------------
# 3. GTPO


def test_gtpo_conflict_weights_hand_example():
    """Guards against matching across groups, counting zero-advantage rows, misaligned suffix runs on
    padded rows, and a run that continues past a non-conflict token."""
    ids = T([[5, 6, 7, 9], [5, 6, 8, 9], [5, 1, 9, 0], [5, 6, 7, 9]] * 2)
    mask = T([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]] * 2)
    adv = T([1.0, -1, 1, 0, 1, 1, 1, 1])  # group 1: rows 0,2 positive, 1 negative, 3 zero; group 2 all positive
    # prefix: t0 token 5 in pos and neg -> rows 0,1,2; t1: pos {6,1}, neg {6} -> rows 0,1; t2: pos {7,9} neg {8} stop
    # suffix (from each last token): 9,9,9 -> rows 0,1,2; next 7 / 8 / 1 -> stop. Row 3 (A=0) never conflicts.
    want = T(
        [
            [2.0, 2, 1, 2],
            [0, 0, 1, 0],
            [2, 1, 2, 0],
            [1, 1, 1, 1],
            [1, 1, 1, 1],
            [1, 1, 1, 1],
            [1, 1, 1, 0],
            [1, 1, 1, 1],
        ]
    )
    assert torch.equal(gtpo_conflict_weights(ids, mask, adv, 4), want)
    # Both runs cover every token: w_pos once (advantage.gtpo_conflict_weights), not w_pos**2 as in the released code.
    assert torch.equal(
        gtpo_conflict_weights(T([[3, 4], [3, 4]]), torch.ones(2, 2), T([1.0, -1]), 2), T([[2.0, 2], [0, 0]])
    )


def brute_conflict_weights(ids, mask, adv, group_size, w_pos, w_neg):
    """The definition, written as loops: runs from each end of the completion's own tokens."""
    B, L = len(ids), len(ids[0])
    out = [[0.0] * L for _ in range(B)]
    for g in range(B // group_size):
        rows = range(g * group_size, (g + 1) * group_size)
        comp = {i: [t for t in range(L) if mask[i][t]] for i in rows}  # columns of each completion

        def tok(i, k, from_end):
            cols = comp[i]
            return ids[i][cols[len(cols) - 1 - k] if from_end else cols[k]] if k < len(cols) else None

        def conflicting(i, k, from_end):
            t = tok(i, k, from_end)
            pos = any(adv[j] > 0 and tok(j, k, from_end) == t for j in rows)
            neg = any(adv[j] < 0 and tok(j, k, from_end) == t for j in rows)
            return adv[i] != 0 and pos and neg

        for i in rows:
            n = len(comp[i])
            conflict = [False] * n
            for from_end in (False, True):
                k = 0
                while k < n and conflicting(i, k, from_end):
                    conflict[n - 1 - k if from_end else k] = True
                    k += 1
            for k, t in enumerate(comp[i]):
                out[i][t] = (w_pos if adv[i] > 0 else w_neg) if conflict[k] else 1.0
    return out


def test_gtpo_conflict_weights_match_brute_force_loop():
    """Guards against any vectorisation bug (key collisions, flip misalignment, cross-group leaks,
    pad ids treated as tokens) on random small groups with shared tokens and ragged lengths."""
    rng = random.Random(0)
    for _ in range(200):
        P, G, L = rng.randint(1, 3), rng.randint(2, 4), rng.randint(1, 7)
        ids = [[rng.randint(0, 2) for _ in range(L)] for _ in range(P * G)]
        mask = []
        for _ in range(P * G):
            start = rng.choice([0, 0, 0, rng.randint(0, L - 1)])  # mostly right-padded; some offset rows
            n = rng.randint(0, L - start)
            mask.append([1 if start <= t < start + n else 0 for t in range(L)])
        adv = [rng.choice([-1.0, 0.0, 1.0]) * rng.uniform(0.5, 2) for _ in range(P * G)]
        w_pos, w_neg = rng.choice([(2.0, 0.0), (3.0, 0.5)])
        got = gtpo_conflict_weights(T(ids), T(mask), T(adv), G, w_pos=w_pos, w_neg=w_neg)
        assert torch.equal(got, T(brute_conflict_weights(ids, mask, adv, G, w_pos, w_neg))), (ids, mask, adv)


def test_gtpo_entropy_gate_and_shift():
    """Guards against an unmasked entropy mean, a strict/loose boundary mix-up, and the gate staying on
    when the trainer disables it (start entropy above the threshold)."""
    H = T([[0.25, 0.75, 9.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    mask = T([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    keep, mean = gtpo_entropy_gate(H, mask, threshold=0.5)
    assert torch.equal(mean, T([0.5, 1.0, 0.0])) and keep.tolist() == [True, False, True]
    keep, _ = gtpo_entropy_gate(H, mask)  # ln 2 = .693
    assert keep.tolist() == [True, False, True]
    keep, _ = gtpo_entropy_gate(H, mask, enabled=False)
    assert keep.tolist() == [True, True, True]
    assert close(gtpo_entropy_shift(T([1.0, -0.5, 0.0]), T([0.5, 1.0, 0.2])), [0.95, -0.6, -0.02], 1e-7)


# ---------------------------------------------------------------------------------------------
# 4. Token weights

MASK = T([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # lengths 2, 4, 0 (an empty row)


def test_token_weights_values():
    """Guards against per-micro-batch denominators, counting empty rows, and a wrong Dr. GRPO constant."""
    w = token_weights(MASK, "seq_mean_token_mean")  # 2 sequences: 1/(2*2), 1/(2*4)
    assert torch.equal(w, T([[0.25, 0.25, 0, 0], [0.125] * 4, [0.0] * 4]))
    assert torch.equal(token_weights(MASK, "token_mean"), MASK / 6.0)
    assert torch.equal(token_weights(MASK, "seq_mean_token_sum_norm", max_len=8), MASK / 16.0)
    # global counts (DDP / top-ups) override the local ones
    assert torch.equal(token_weights(MASK, "seq_mean_token_mean", num_seqs=4), w / 2)
    assert torch.equal(token_weights(MASK, "token_mean", num_tokens=12), MASK / 12.0)
    with pytest.raises(ValueError):
        token_weights(MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError):
        token_weights(MASK, "sequence_mean")


def test_token_weights_split_over_ranks_equal_full_step():
    """Guards against a rank normalising by its own counts: with global counts passed in, each rank's
    weights equal its slice of the single-process weights (so the DDP gradient equals the full one)."""
    mask = (torch.rand(8, 6, generator=torch.Generator().manual_seed(3)) > 0.3).float()
    for agg in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"):
        full = token_weights(mask, agg, max_len=6)
        n_seqs, n_tok = float((mask.sum(-1) > 0).sum()), float(mask.sum())
        for rows in (slice(0, 3), slice(3, 8)):
            part = token_weights(mask[rows], agg, max_len=6, num_seqs=n_seqs, num_tokens=n_tok)
            assert torch.equal(part, full[rows]), agg


def test_grpo_ma_token_weights_packed_rows():
    """Guards against counting the thought M times, per-row (not per-answer) means, and mixing segments."""
    thought = T([[1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]])
    answer_id = T([[-1, -1, -1, 0, 0, 1, -1], [-1, 0, 0, 0, 1, 1, -1]])
    # 2 thoughts (lengths 3, 1) -> 1/6, 1/2; 4 answers (lengths 2, 1, 3, 2) -> 1/8, 1/4, 1/12, 1/8
    want = T([[1 / 6, 1 / 6, 1 / 6, 1 / 8, 1 / 8, 1 / 4, 0], [1 / 2, 1 / 12, 1 / 12, 1 / 12, 1 / 8, 1 / 8, 0]])
    assert close(grpo_ma_token_weights(thought, answer_id), want, 1e-7)
    w = grpo_ma_token_weights(thought, answer_id, thought_weight=0.5, answer_weight=2.0, num_answers=8)
    assert close(w, want * torch.where(thought.bool(), 0.5, 1.0), 1e-7)  # answers: 2 * (1/8 of 4 -> of 8)
    with pytest.raises(ValueError):
        grpo_ma_token_weights(T([[1, 1]]), T([[0, -1]]))


def test_grpo_ma_token_weights_without_thoughts_is_grpo():
    """Guards against empty thoughts (no end-of-thought marker, M = 1) changing GRPO's normaliser."""
    answer_id = MASK.long() - 1  # answer 0 on the mask, -1 elsewhere
    got = grpo_ma_token_weights(torch.zeros_like(MASK), answer_id)
    assert torch.equal(got, token_weights(MASK, "seq_mean_token_mean"))


def test_grpo_ma_token_advantages():
    """Guards against giving answer tokens the thought's advantage or reading the wrong (p, i, j) slot."""
    thought_adv = T([[0.5, -0.5]])  # P=1, K=2
    answer_adv = T([[[1.0, 2.0], [3.0, 4.0]]])  # M=2
    thought = T([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    answer_id = T([[-1, -1, 0, 1, -1], [-1, 1, 1, 0, -1]])
    want = T([[0.5, 0.5, 1.0, 2.0, 0.0], [-0.5, 4.0, 4.0, 3.0, 0.0]])
    assert torch.equal(grpo_ma_token_advantages(thought_adv, answer_adv, thought, answer_id), want)


# ---------------------------------------------------------------------------------------------
# 5. Policy loss


def tiny_policy(seed=0):
    """A bigram 'model': logits of the next token from the current one (float64 for exact compares)."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(5, 5, generator=g, dtype=torch.float64))


def seq_logp(table, ids):
    """(B, T+1) ids -> (B, T) log-probs of ids[:, 1:] under the bigram table."""
    return torch.log_softmax(table[ids[:, :-1]], -1).gather(-1, ids[:, 1:, None])[..., 0]


def batch(seed=0, B=8, L=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (B, L + 1), generator=g)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask = (torch.arange(L)[None] < lengths[:, None]).double()
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64) * mask
    return ids, mask, adv, g


def test_policy_loss_on_policy_is_plain_policy_gradient():
    """Guards against a wrong sign, a stray normaliser inside the loss, or gradient through old_logp:
    on-policy with beta = 0 the value is -sum(w*A) and the gradient is -sum(w*A*grad logp)."""
    table = tiny_policy()
    ids, mask, adv, _ = batch()
    w = token_weights(mask, "seq_mean_token_mean")
    logp = seq_logp(table, ids)
    loss, m = loss_for(Tokens(logp, logp.detach(), adv, w), hp())
    assert close(loss, -(w * adv).sum(), 1e-12)
    (grad,) = torch.autograd.grad(loss, table)
    (want,) = torch.autograd.grad(-(w * adv * seq_logp(table, ids)).sum(), table)
    assert close(grad, want, 1e-12)
    assert m["ratio_mean"] == 1.0 and m["clip_frac"] == 0.0 and m["num_tokens"] == mask.sum().item()


def test_policy_loss_clipping_for_positive_and_negative_advantage():
    """Guards against clipping on the wrong side, a symmetric clip ignoring clip_high, and gradients
    leaking through clipped tokens (PPO's min keeps the pessimistic branch)."""
    ratio = T([[1.5, 1.5, 0.5, 0.5, 1.1]], dtype=torch.float64)
    adv = T([[1.0, -1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    logp = torch.zeros(1, 5, dtype=torch.float64, requires_grad=True)
    old = -ratio.log()  # rho = exp(0 - old) = ratio
    w = torch.ones(1, 5, dtype=torch.float64)
    loss, m = loss_for(Tokens(logp, old, adv, w), hp(clip_low=0.2, clip_high=0.28))
    # per token: min(1.5, 1.28) = 1.28 (clipped); min(-1.5, -1.28) = -1.5; min(.5, .8) = .5;
    # min(-.5, -.8) = -.8 (clipped); 1.1 inside
    assert close(loss, -(1.28 - 1.5 + 0.5 - 0.8 + 1.1), 1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    assert close(grad, [[0.0, 1.5, -0.5, 0.0, -1.1]], 1e-12)  # d(-rho*A)/dlogp = -rho*A where unclipped
    got = [m["clip_frac_low"], m["clip_frac_high"], m["clip_frac"], m["ratio_mean"]]
    assert close(got, [0.2, 0.2, 0.4, 1.02], 1e-7)  # ratio mean = 5.1 / 5


def test_kl3_nonnegative_and_in_the_loss():
    """Guards against the wrong KL estimator (k1 can be negative), a wrong sign of beta, and kl metrics
    averaged over padding."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert (kl3(a, b) >= 0).all() and torch.equal(kl3(a, a), torch.zeros(1000))
    assert close(kl3(T([0.0]), T([1.0])), [math.e - 2], 1e-6)  # exp(1) - 1 - 1
    logp = T([[0.0, 0.0, 0.0]], dtype=torch.float64)
    ref = T([[1.0, 0.0, 5.0]], dtype=torch.float64)
    w = T([[0.5, 0.5, 0.0]], dtype=torch.float64)  # the third token is padding
    loss, m = loss_for(Tokens(logp, logp, torch.zeros_like(w), w, ref_logp=ref), hp(beta=0.1))
    assert close(loss, 0.1 * 0.5 * (math.e - 2), 1e-12)
    assert close(m["kl"], (math.e - 2) / 2, 1e-6)
    with pytest.raises(ValueError):
        loss_for(Tokens(logp, logp, w, w), hp(beta=0.1))


def test_policy_loss_ignores_nonfinite_padding():
    """Guards against nan/inf log-probs on padding (weight 0) poisoning the loss or its gradient."""
    logp = T([[-1.0, float("-inf")]], dtype=torch.float64, requires_grad=True)
    old = T([[-1.2, float("nan")]], dtype=torch.float64)
    for seq in (False, True):
        loss, _ = loss_for(
            Tokens(logp, old, T([[1.0, 1.0]]), T([[1.0, 0.0]]), ref_logp=T([[0.0, float("nan")]])),
            hp(sequence_ratio=seq, beta=0.1),
        )
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_gspo_sequence_ratio_value_and_gradient():
    """Guards against a per-token ratio in GSPO mode, a mean over padding, and a gradient that is not
    GSPO's s_i * mean_t grad logp_t (checked against autograd through s = exp(mean log-ratio))."""
    table = tiny_policy(1)
    ids, mask, adv, g = batch(1)
    old = (seq_logp(table, ids) + 0.1 * torch.randn(mask.shape, generator=g, dtype=torch.float64)).detach()
    w = mask / (mask.sum(-1, keepdim=True) * len(mask))  # seq_mean_token_mean, built in float64
    logp = seq_logp(table, ids)
    loss, m = loss_for(Tokens(logp, old, adv, w), hp(sequence_ratio=True, clip_low=10.0, clip_high=10.0))
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))  # (B,) GSPO's sequence ratio
    A = adv[:, 0]
    want_loss = -(s * A).sum() / len(s)  # seq_mean: each row's weights sum to 1/B
    assert close(loss, want_loss, 1e-12)
    (grad,) = torch.autograd.grad(loss, table, retain_graph=True)  # want_loss shares logp's graph
    (want,) = torch.autograd.grad(want_loss, table)
    assert close(grad, want, 1e-12)
    assert close(m["ratio_mean"], (s[:, None] * mask).sum() / mask.sum(), 1e-6)
    # With GSPO's tiny clip range a positive-advantage row with s > 1 + 4e-4 gets no gradient.
    logp = T([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    loss, m = loss_for(
        Tokens(logp, T([[-0.01, -0.03]]), T([[1.0, 1.0]]), T([[0.5, 0.5]])),
        hp(sequence_ratio=True, clip_low=0.0003, clip_high=0.0004),
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(grad, torch.zeros(1, 2)) and close(loss, -(1 + 4e-4), 1e-12) and m["clip_frac_high"] == 1.0


def test_policy_loss_off_policy_shaping_value_and_gradient():
    """Guards against feeding injected reference tokens through the PPO ratio (old_logp is garbage there),
    a missing or detached shaping f(p) = p/(p+gamma), clipping them, and touching on-policy tokens:
    d/dlogp [p/(p+g)] = g p/(p+g)^2."""
    # token 0: off-policy p = .5, A = 2; token 1: off-policy p = .1, A = -1; token 2: on-policy ratio 1.1, A = 1
    logp = T([[math.log(0.5), math.log(0.1), 0.0]], dtype=torch.float64, requires_grad=True)
    old = T([[float("nan"), float("-inf"), -math.log(1.1)]], dtype=torch.float64)
    adv = T([[2.0, -1.0, 1.0]], dtype=torch.float64)
    w = T([[0.5, 0.5, 1.0]], dtype=torch.float64)
    off = T([[True, False, False]]) | T([[False, True, False]])
    loss, m = shaped_loss(Tokens(logp, old, adv, w, off_policy=off), hp())
    # f(.5) = 5/6, f(.1) = .5 -> obj [5/3, -.5, 1.1], loss = -(.5*5/3 - .5*.5 + 1.1) = -1.683333
    assert close(loss, -(0.5 * 5 / 3 - 0.25 + 1.1), 1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    # -w*A*g*p/(p+g)^2: -.5*2*(.05/.36) = -.138889; -.5*-1*(.01/.04) = .125; on-policy -w*A*rho = -1.1
    assert close(grad, [[-0.5 * 2 * 0.05 / 0.36, 0.125, -1.1]], 1e-12)
    assert close(m["ratio_mean"], 3.1 / 3, 1e-7)  # the anchors' tokens have no ratio: 1 there
    assert m["clip_frac"] == 0.0
    # gamma is a knob: g = .5 at p = .5 -> f = .5, df/dlogp = .25/1 = .25
    logp = T([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    loss, _ = shaped_loss(Tokens(logp, T([[0.0]]), T([[1.0]]), T([[1.0]]), off_policy=T([[True]])), hp(), gamma=0.5)
    assert close(loss, -0.5, 1e-12) and close(torch.autograd.grad(loss, logp)[0], [[-0.25]], 1e-12)
    with pytest.raises(ValueError, match="gamma"):
        shaped_loss(Tokens(logp, logp, T([[1.0]]), T([[1.0]]), off_policy=T([[True]])), hp(), gamma=0.0)


def test_policy_loss_off_policy_rows_leave_on_policy_rows_alone():
    """Guards against an all-False off_policy changing the loss, anchor rows leaking into other rows, and
    GSPO's sequence mean averaging over off-policy tokens (their old_logp is meaningless)."""
    table = tiny_policy(3)
    ids, mask, adv, g = batch(3)
    old = (seq_logp(table, ids) + 0.2 * torch.randn(mask.shape, generator=g, dtype=torch.float64)).detach()
    w = token_weights(mask, "token_mean")
    for seq in (False, True):
        base, _ = loss_for(Tokens(seq_logp(table, ids), old, adv, w), hp(sequence_ratio=seq))
        no_off = Tokens(seq_logp(table, ids), old, adv, w, off_policy=mask < 0)
        none_off, _ = shaped_loss(no_off, hp(sequence_ratio=seq))
        assert torch.equal(base, none_off)
        # row 0 becomes an anchor: the other rows' terms are unchanged, row 0 gets -sum(w * A * f(p))
        off = torch.zeros_like(mask, dtype=torch.bool)
        off[0] = True
        bad_old = old.clone()
        bad_old[0] = float("nan")
        logp = seq_logp(table, ids)
        loss, _ = shaped_loss(Tokens(logp, bad_old, adv, w, off_policy=off), hp(sequence_ratio=seq))
        rest, _ = loss_for(Tokens(logp[1:], old[1:], adv[1:], w[1:]), hp(sequence_ratio=seq))
        p = logp[0].exp()
        assert close(loss, rest - (w[0] * adv[0] * p / (p + 0.1)).sum(), 1e-12)
        (grad,) = torch.autograd.grad(loss, table)
        assert torch.isfinite(grad).all()
    # a mixed row under GSPO: s = exp(mean of the ON-policy log-ratios) = exp((.1 + .3) / 2)
    logp = T([[math.log(0.5), 0.0, 0.0]], dtype=torch.float64)
    old = T([[float("nan"), -0.1, -0.3]], dtype=torch.float64)
    loss, _ = shaped_loss(
        Tokens(
            logp,
            old,
            torch.ones(1, 3, dtype=torch.float64),
            torch.full((1, 3), 1 / 3, dtype=torch.float64),
            off_policy=T([[True, False, False]]),
        ),
        hp(sequence_ratio=True, clip_low=10.0, clip_high=10.0),
    )
    assert close(loss, -(5 / 6 + 2 * math.exp(0.2)) / 3, 1e-12)


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("sequence_ratio", [False, True])
def test_micro_batch_gradients_sum_to_full_batch(agg, sequence_ratio):
    """Guards against normalising per micro-batch: with weights computed once for the step, the summed
    micro-batch gradients (clipping and KL active) equal the full-batch gradient."""
    table = tiny_policy(2)
    ids, mask, adv, g = batch(2, B=9)
    with torch.no_grad():
        old = seq_logp(table, ids) + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
        ref = seq_logp(table, ids) + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    w = token_weights(mask, agg, max_len=6)
    h, kw = hp(beta=0.05, sequence_ratio=sequence_ratio, clip_high=0.28), dict(ref_logp=ref)
    loss, _ = loss_for(Tokens(seq_logp(table, ids), old, adv, w, **kw), h)
    (full,) = torch.autograd.grad(loss, table)
    summed = torch.zeros_like(full)
    for rows in (slice(0, 2), slice(2, 7), slice(7, 9)):
        kw["ref_logp"] = ref[rows]
        part, _ = loss_for(Tokens(seq_logp(table, ids[rows]), old[rows], adv[rows], w[rows], **kw), h)
        summed += torch.autograd.grad(part, table)[0]
    assert close(summed, full, 1e-12)


# ---------------------------------------------------------------------------------------------
# 6. Diagnostics


def test_gradient_spike_score():
    """Guards against dividing by the mean of previous steps only, or by the global mean of all steps."""
    gss, frac = gradient_spike_score([2.0, 4.0, 6.0])  # running means 2, 3, 4
    assert close(gss, [1.0, 4 / 3, 1.5], 1e-12) and frac == 0.0
    gss, frac = gradient_spike_score([1.0] * 19 + [100.0])  # 100 / (119/20) = 16.81 > 10
    assert close(gss[-1], 2000 / 119, 1e-12) and frac == 1 / 20
    gss, _ = gradient_spike_score(torch.zeros(3))
    assert torch.equal(gss, torch.zeros(3, dtype=torch.float64))


def test_thought_advantage_variance_floor_in_k_and_one_over_m():
    """Guards against a simulation that does not measure GRPO-MA's thought-advantage error: the error
    must not fall with K (a floor) and must fall as 1/M, toward the delta-method limit
    M * err -> E[q(1-q)] / Var(q) * (K-1)/K, with q ~ U(.1,.9): E[q(1-q)] = .25 - .8**2/12 = .196667,
    Var(q) = .053333, ratio 3.6875 (reference §1.6; the (K-1)/K is torch.std's unbiased rescale)."""
    from experiments.variance import thought_advantage_variance  # the simulation of experiments/variance.py

    err = {
        (k, m): thought_advantage_variance(k, m, n_trials=32768 // k, seed=0) for k in (16, 64, 256) for m in (1, 8, 64)
    }
    for m in (1, 8, 64):  # 16x more thoughts do not reduce the error: the floor
        assert 0.95 < err[256, m] / err[16, m] < 1.15
    for k in (16, 64, 256):
        assert 0.9 < err[k, 1] < 1.2  # reference table: 1.07-1.13 (population std)
        assert err[k, 8] / err[k, 64] > 5  # 8x more answers: ~6x less error (-> 8x as M grows)
        assert abs(64 * err[k, 64] / (3.6875 * (k - 1) / k) - 1) < 0.06
    same_seed = [thought_advantage_variance(16, 4, n_trials=50, seed=7) for _ in range(2)]
    assert same_seed[0] == same_seed[1]  # seeded by its own torch.Generator, not the global RNG


def test_select_hard_examples():
    """Guards against selecting the easiest, unstable tie order, and float floor errors (100 * .29)."""
    rates = T([0.5, 0.0, 0.9, 0.0, 0.2, 0.0])
    assert select_hard_examples(rates, 0.5).tolist() == [1, 3, 5]
    assert select_hard_examples(rates, 0.34).tolist() == [1, 3]  # floor(2.04)
    assert select_hard_examples(rates, 1.0).tolist() == [1, 3, 5, 4, 0, 2]
    assert len(select_hard_examples(torch.rand(100), 0.29)) == 29
    with pytest.raises(ValueError):
        select_hard_examples(rates, 1.5)


def test_select_examples_modes_and_tie_order():
    """Guards against a medium window off the median, easiest-first order reversed, and ties broken by an
    unstable sort (with many prompts at pass rate 0 the selected set must be reproducible: data order)."""
    rates = T([0.5, 0.0, 0.9, 0.0, 0.2, 0.0])  # hardest-first order [1, 3, 5, 4, 0, 2]
    assert select_hard_examples(rates, 0.5, mode="easiest").tolist() == [2, 0, 4]
    assert select_hard_examples(rates, 0.67, mode="easiest").tolist() == [2, 0, 4, 1]  # tie at 0: index 1 first
    assert select_hard_examples(rates, 0.34, mode="medium").tolist() == [5, 4]  # n = 2, ranks [2, 4)
    assert select_hard_examples(rates, 0.5, mode="medium").tolist() == [3, 5, 4]  # n = 3, ranks [1, 4)
    tied = torch.zeros(1000)
    for mode in ("hardest", "easiest"):
        assert torch.equal(select_hard_examples(tied, 0.1, mode=mode), torch.arange(100))
    assert torch.equal(select_hard_examples(tied, 0.1, mode="medium"), torch.arange(450, 550))


def test_select_examples_fraction_one_zero_and_random():
    """Guards against fraction = 1 dropping or duplicating examples, a selection of 0 examples passing
    silently, an unseeded random mode, and 'random' that is not uniform (e.g. always the first n)."""
    rates = T([0.5, 0.0, 0.9, 0.0, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    for mode in ("hardest", "medium", "easiest", "random"):
        keep = select_hard_examples(rates, 1.0, mode=mode, generator=g)
        assert sorted(keep.tolist()) == list(range(6)), mode
        for fraction in (0.0, 0.1):  # floor(6 * .1) = 0
            with pytest.raises(ValueError, match="keeps none"):
                select_hard_examples(rates, fraction, mode=mode, generator=g)
    assert select_hard_examples(rates, 1.0, mode="medium").tolist() == [1, 3, 5, 4, 0, 2]
    with pytest.raises(ValueError, match="generator"):
        select_hard_examples(rates, 0.5, mode="random")
    with pytest.raises(ValueError):
        select_hard_examples(rates, 0.5, mode="middle")
    with pytest.raises(ValueError):
        select_hard_examples(rates[None], 0.5)
    draw = [
        select_hard_examples(rates, 0.5, mode="random", generator=torch.Generator().manual_seed(9)) for _ in range(2)
    ]
    assert torch.equal(draw[0], draw[1]) and len(set(draw[0].tolist())) == 3
    counts = torch.zeros(6)
    for _ in range(2000):
        counts[select_hard_examples(rates, 0.5, mode="random", generator=g)] += 1
    assert ((counts / 2000 - 0.5).abs() < 5 * math.sqrt(0.25 / 2000)).all()  # each index kept half the time


def test_truncated_is_weights_hand_values_and_padding():
    """Guards against the ratio inverted (pi_sampler / pi_old), a missing cap, a gradient through the
    weights, or padded garbage (-inf, huge) reaching the loss: w = min(exp(old - sampler), cap) on the
    mask, 1 off it."""
    old = T([[-1.0, -2.0, -0.5, 0.0], [-3.0, float("-inf"), 5.0, 0.0]], requires_grad=True)
    smp = T([[-1.0, -1.0, -2.0, -9.0], [-3.5, 0.0, -40.0, 0.0]])
    mask = T([[1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    w = truncated_is_weights(old, smp, mask, cap=2.0)
    want = T([[1.0, math.exp(-1.0), 2.0, 1.0], [math.exp(0.5), 1.0, 1.0, 1.0]])
    assert torch.allclose(w, want, atol=0, rtol=1e-7) and not w.requires_grad
    assert truncated_is_weights(old, smp, mask, cap=1.5)[0, 2] == 1.5
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(old, smp, mask, cap=0.0)
    with pytest.raises(ValueError, match="one shape"):
        truncated_is_weights(old, smp[:, :3], mask)


def test_truncated_is_weights_make_the_gradient_importance_weighted():
    """Guards against the correction being applied as anything but a per-token weight: with samples
    drawn from pi_sampler, the weighted on-policy loss has the gradient of sum(w * w_is * A * grad logp)."""
    table = tiny_policy()
    ids, mask, adv, _ = batch()
    w = token_weights(mask, "seq_mean_token_mean")
    logp = seq_logp(table, ids)
    sampler_logp = logp.detach() + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(0))
    w_is = truncated_is_weights(logp.detach(), sampler_logp, mask.bool(), cap=1.3)
    assert (w_is[mask.bool()] < 1.3).any() and (w_is[mask.bool()] == 1.3).any()  # both regimes occur
    loss, _ = loss_for(Tokens(logp, logp.detach(), adv, w * w_is), hp())
    (grad,) = torch.autograd.grad(loss, table)
    (want,) = torch.autograd.grad(-(w * w_is * adv * seq_logp(table, ids)).sum(), table)
    assert close(grad, want, 1e-12)
