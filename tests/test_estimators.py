"""Tests for the estimators of methods/: RLOO, Lite PPO's batch std, REINFORCE++ (and -baseline), the KL estimators and
KL in the reward, dual-clip PPO, the entropy bonus, masking truncated answers. Each formula is checked on small
hand-made tensors (exact values), against a short transcription of its reference implementation (verl b178a3c,
OpenRLHF 3c3be62, TRL f2cd577; the same operations, restated here) on random inputs, for its gradient where it has
one, for padding garbage (-inf, nan) that must not leak, and, where it needs the whole step's statistics, for
invariance to splitting the step into pieces whose sums the caller adds up. The flag checks refuse what cannot work."""

from __future__ import annotations

import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from cli import build_parser
from config import TrainConfig
from helpers import BUNDLED
from losses import KL_ESTIMATORS, clip, kl3, low_var_kl, unbiased_kl
from methods import batch_std, dual_clip, entropy_bonus, kl, mask_truncated, reinforce_pp, rloo

F64 = torch.float64
NAN, INF = math.nan, math.inf


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def rand_mask(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """Right-padded rows of lengths 1..T (a row of full length first)."""
    lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = T
    return torch.arange(T)[None, :] < lengths[:, None]


def close(a: torch.Tensor, b, tol: float = 1e-12) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=0)


# ----------------------------------------------------------------------------------------------
# References, transcribed


def verl_rloo(scores: list[float], index: list[int]) -> list[float]:
    """verl compute_rloo_outcome_advantage: per index, score * n / (n - 1) - mean * n / (n - 1); n = 1 keeps it."""
    id2score = defaultdict(list)
    for s, i in zip(scores, index):
        id2score[i].append(s)
    id2mean = {i: (0.0 if len(v) == 1 else sum(v) / len(v)) for i, v in id2score.items()}
    out = list(scores)
    for k, (s, i) in enumerate(zip(scores, index)):
        n = len(id2score[i])
        if n > 1:
            out[k] = s * n / (n - 1) - id2mean[i] * n / (n - 1)
    return out


def trl_rloo(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """TRL RLOOTrainer: baseline = (group sum - r) / (G - 1), advantage = r - baseline (no normalisation)."""
    grouped = rewards.view(-1, G)
    baselines = (grouped.sum(1, keepdim=True) - grouped) / (G - 1)
    return rewards - baselines.view(-1)


def trl_nanstd(x: torch.Tensor) -> torch.Tensor:
    mean = torch.nanmean(x)
    var = torch.nanmean((x - mean) ** 2)
    count = (~torch.isnan(x)).sum()
    return torch.sqrt(var * count / (count - 1))


def trl_batch_scaled(rewards: torch.Tensor, G: int, eps: float) -> torch.Tensor:
    """TRL GRPOTrainer with scale_rewards="batch": (r - group mean) / (nanstd(all rewards) + eps); TRL's eps is 1e-4."""
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    return (rewards - mean) / (trl_nanstd(rewards).expand_as(rewards) + eps)


def verl_kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    assert kl_penalty in ("low_var_kl", "k3")
    x = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(x) - x - 1, min=-10, max=10)


def openrlhf_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_estimator: str) -> torch.Tensor:
    log_ratio = log_probs - log_probs_base
    if kl_estimator == "k2":
        log_ratio = log_ratio**2 / 2.0
    elif kl_estimator == "k3":
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    return log_ratio.clamp(min=-10, max=10)


def openrlhf_compute_reward(r: torch.Tensor, kl_coef: float, kl_: torch.Tensor, action_mask: torch.Tensor):
    """OpenRLHF compute_reward: the outcome at the last action token, -kl_coef * kl on every token."""
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl_).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl_.dtype))
    return last_reward + -kl_coef * kl_


def openrlhf_cumulative_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0):
    rewards = action_mask * rewards
    returns = torch.zeros_like(rewards)
    cumulative = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    for t in reversed(range(rewards.size(1))):
        cumulative = rewards[:, t] + gamma * cumulative
        returns[:, t] = cumulative
    return returns


def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl_F.masked_whiten: masked mean (sum / (n + 1e-8)), unbiased masked var, (x - mean) * rsqrt(var + 1e-8)."""
    mask = mask.to(values.dtype)
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = (((values - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8)
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_reinforce_pp(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0):
    """verl compute_reinforce_plus_plus_outcome_advantage."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros(token_level_rewards.shape[0], dtype=token_level_rewards.dtype)
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask, returns


def verl_reinforce_pp_baseline(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: list[int]):
    """verl compute_reinforce_plus_plus_baseline_outcome_advantage."""
    mask = response_mask.to(token_level_rewards.dtype)
    scores = token_level_rewards.sum(-1)
    id2score = defaultdict(list)
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    id2mean = {i: (torch.tensor(0.0, dtype=F64) if len(v) == 1 else torch.stack(v).mean()) for i, v in id2score.items()}
    scores = torch.stack([scores[i] - id2mean[index[i]] for i in range(len(scores))])
    scores = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * mask
    return verl_masked_whiten(scores, mask) * mask


def verl_dual_clip_losses(old_log_prob, log_prob, advantages, cliprange_low, cliprange_high, clip_ratio_c):
    """verl compute_policy_loss_vanilla's per-token pg_losses and the dual clip's tokens (pg_clipfrac_lower's)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    lower = torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), lower


def verl_agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    loss_mask = loss_mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    seq_len = loss_mask.sum(-1)
    seq_losses = (loss_mat * loss_mask).sum(-1) / (seq_len + 1e-8)
    seq_mask = (seq_len > 0).to(loss_mat.dtype)
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


# ----------------------------------------------------------------------------------------------
# RLOO


def test_rloo_exact_values_and_edge_cases():
    """Guards against a baseline that includes the completion itself (GRPO's mean, not leave-one-out), a std scaling
    the references do not apply, a nan or a raw reward for a group of one (verl's loop form hands it the raw score),
    and a degenerate group left to rounding: r = (1, 0, 0, 1) gives +-2/3, a pair (1, 0) gives +-1."""
    close(rloo.rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=F64)), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    close(rloo.rloo_advantages(torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=F64)), [[1.0, -1.0], [-3.0, 3.0]])
    flat = rloo.rloo_advantages(torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]]))
    assert torch.equal(flat, torch.zeros(2, 3))
    assert torch.equal(rloo.rloo_advantages(torch.tensor([[5.0], [1.0]])), torch.zeros(2, 1))


def test_rloo_equals_verl_and_trl():
    """Guards against drifting from the references' leave-one-out: verl's n/(n-1) form and TRL's (sum - r)/(n-1)
    baseline, on random rewards of 5 groups of 4."""
    r = randn(5, 4)
    ours = rloo.rloo_advantages(r)
    close(ours.flatten(), verl_rloo(r.flatten().tolist(), [i // 4 for i in range(20)]))
    close(ours.flatten(), trl_rloo(r.flatten(), 4))


def test_rloo_on_grpo_ma_tree():
    """Guards against the tree's RLOO leaving a thought or an answer out of the wrong set: a thought's baseline is
    the mean value of the OTHER thoughts of its prompt, an answer's the mean of the prompt's other K*M - 1 answers;
    M = 1 is plain RLOO on both levels."""
    r = randn(3, 4, 2, seed=1)
    thought, answer = rloo.grpo_ma_rloo_advantages(r)
    V = r.mean(-1)
    want_t = [[V[p, i] - (V[p].sum() - V[p, i]) / 3 for i in range(4)] for p in range(3)]
    flat = r.reshape(3, 8)
    want_a = [[flat[p, k] - (flat[p].sum() - flat[p, k]) / 7 for k in range(8)] for p in range(3)]
    close(thought, want_t)
    close(answer.reshape(3, 8), want_a)
    t1, a1 = rloo.grpo_ma_rloo_advantages(r[..., :1])
    assert torch.equal(t1, rloo.rloo_advantages(r[..., 0])) and torch.equal(a1[..., 0], t1)


# ----------------------------------------------------------------------------------------------
# Batch std (Lite PPO)


def test_batch_std_exact_values():
    """Guards against dividing by the group's std instead of the step's, a biased std, or a flat group left
    non-zero: rewards (1, 0) and (1, 1): step std of (1, 0, 1, 1) = 0.5 (unbiased), so the first group gets
    +-0.5 / (0.5 + 1e-6) and the flat one exactly 0."""
    adv = batch_std.batch_std_advantages(torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=F64))
    close(adv, [[0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)], [0.0, 0.0]])
    assert (adv[1] == 0).all()


def test_batch_std_equals_trl_and_is_split_invariant():
    """Guards against drifting from TRL's scale_rewards="batch" (same eps), and against a step statistic that
    depends on how the step is cut: two ranks' halves, their moments summed, give the whole step's advantages."""
    r = randn(6, 4, seed=2)
    close(batch_std.batch_std_advantages(r).flatten(), trl_batch_scaled(r.flatten(), 4, 1e-6))
    stats = batch_std.moments(r[:2]) + batch_std.moments(r[2:])
    pieces = torch.cat([batch_std.batch_std_advantages(r[:2], stats), batch_std.batch_std_advantages(r[2:], stats)])
    close(pieces, batch_std.batch_std_advantages(r), tol=1e-13)


def test_batch_std_on_grpo_ma_tree():
    """Guards against the tree's thought advantage using the answers' std (or the reverse): thoughts divide by the
    step's std of thought values, answers by the step's std of answer rewards; M = 1 gives one and the same."""
    r = randn(3, 4, 2, seed=3)
    thought, answer = batch_std.grpo_ma_batch_std_advantages(r)
    V = r.mean(-1)
    close(thought, (V - V.mean(-1, keepdim=True)) / (V.std() + 1e-6))
    flat = r.reshape(3, 8)
    close(answer.reshape(3, 8), (flat - flat.mean(-1, keepdim=True)) / (flat.std() + 1e-6))
    t1, a1 = batch_std.grpo_ma_batch_std_advantages(r[..., :1])
    assert torch.equal(t1, a1[..., 0]) and torch.equal(t1, batch_std.batch_std_advantages(r[..., 0]))


# ----------------------------------------------------------------------------------------------
# KL estimators


def kl_inputs():
    """Two rows, the second one token shorter (-inf / nan padding): d = logp - ref = (0.5, -1, 2) and (-0.25, 1.5)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.75, -0.5, -INF]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -2.5], [-0.5, -2.0, NAN]], dtype=F64)
    return logp, ref, torch.tensor([[True, True, True], [True, True, False]])


@pytest.mark.parametrize(
    "name, value, grad",
    [
        ("k1", lambda d: d, lambda d: 1.0),
        ("k2", lambda d: d * d / 2, lambda d: d),
        ("k3", lambda d: math.exp(-d) + d - 1, lambda d: 1 - math.exp(-d)),
        ("low_var_kl", lambda d: math.exp(-d) + d - 1, lambda d: 1 - math.exp(-d)),
    ],
)
def test_kl_estimator_values_and_gradients(name, value, grad):
    """Guards against a swapped sign of d (KL(ref || pi) instead of KL(pi || ref)), a missing 1/2 in k2, a gradient
    into the reference, and padding garbage reaching the value or the gradient: each estimator's value and
    d/d logp per token, 0 off the mask."""
    logp, ref, mask = kl_inputs()
    out = kl.token_kl(name, logp, ref, logp.detach(), mask)
    out.sum().backward()
    d = [[0.5, -1.0, 2.0], [-0.25, 1.5, None]]
    close(out.detach(), [[value(x) if x is not None else 0.0 for x in row] for row in d])
    close(logp.grad, [[grad(x) if x is not None else 0.0 for x in row] for row in d])


def test_kl_estimators_equal_verl_and_openrlhf():
    """Guards against drifting from the references: verl's kl_penalty_forward ("kl", "mse", "low_var_kl") and
    OpenRLHF's compute_approx_kl (k1, k2, k3, clamped to +-10) on random log-probs, k3 equal to losses.kl3, and
    "unbiased" equal to losses.unbiased_kl."""
    logp, ref, old = randn(4, 6, seed=4), randn(4, 6, seed=5), randn(4, 6, seed=6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    for ours, theirs in (("k1", "kl"), ("k2", "mse"), ("low_var_kl", "low_var_kl")):
        close(kl.token_kl(ours, logp, ref, old, mask), verl_kl_penalty_forward(logp, ref, theirs))
    for name in ("k1", "k2", "k3"):
        close(kl.token_kl(name, logp, ref, old, mask), openrlhf_approx_kl(logp, ref, name))
    close(kl.token_kl("k3", logp, ref, old, mask), kl3(logp, ref))
    close(kl.token_kl("unbiased", logp, ref, old, mask), unbiased_kl(logp, ref, old, mask))
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "low_var_kl", "unbiased"}  # --kl-estimator's values


def test_k3_is_trls_unclamped_and_verls_k3_is_low_var_kl_as_the_docs_say():
    """Guards against the naming error the docs once made ("verl clamps only low_var_kl", "k1/k2/k3 as verl names
    them"): verl sends "k3" and "low_var_kl" to one clamped branch, so at logp = -5, ref = 0 verl's k3 is 10.0 while
    this project's k3 (TRL's, the GRPO paper's) is e^5 - 6 = 142.4; --help and docs/algorithms.md must list every
    --kl-estimator value and say which one reproduces verl's k3."""
    T, root = torch.tensor, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    logp, ref, old, mask = T([[-5.0]]), T([[0.0]]), T([[-5.0]]), torch.ones(1, 1, dtype=torch.bool)
    assert math.isclose(kl.token_kl("k3", logp, ref, old, mask).item(), math.exp(5) - 6, rel_tol=1e-6)
    close(kl.token_kl("low_var_kl", logp, ref, old, mask), verl_kl_penalty_forward(logp, ref, "k3"))
    assert verl_kl_penalty_forward(logp, ref, "k3").item() == 10.0
    help_text = " ".join(build_parser(TrainConfig).format_help().split())
    docs = open(os.path.join(root, "docs", "algorithms.md")).read()
    for name in KL_ESTIMATORS:
        assert name in help_text.split("--kl-estimator", 1)[1][:300], name
        assert f"| `{name}`" in docs, name
    assert "verl's `k3`" in docs and "--kl-estimator low_var_kl" in docs


def test_low_var_kl_clamps_cut_the_gradient():
    """Guards against a low_var_kl without verl's clamps (k3 grows like exp(-d)), with clamps that keep a gradient,
    or without the inner clamp of -d to 20 (exp overflows at d = -800 and its gradient becomes inf * 0 = nan):
    d = -5 (k3 = e^5 - 6), d = 30 (x clamped to -20, k3 = 19 + e^-20) and d = -800 are capped at 10, gradient 0;
    d = 0.5 is plain k3."""
    logp = torch.tensor([[-6.0, 29.0, -0.5, -801.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    out = low_var_kl(logp, ref, logp.detach(), torch.ones(1, 4, dtype=torch.bool))
    out.sum().backward()
    close(out.detach(), [[10.0, 10.0, math.exp(-0.5) - 0.5, 10.0]])
    close(logp.grad, [[0.0, 0.0, 1 - math.exp(-0.5), 0.0]])


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "low_var_kl", "unbiased"])
def test_kl_estimators_send_no_gradient_to_the_reference(name):
    """Guards against an estimator that lets the gradient reach the reference's log-probs (a frozen model whose
    tensors may still carry a graph)."""
    logp, ref, mask = randn(2, 3, seed=24).requires_grad_(), randn(2, 3, seed=25).requires_grad_(), torch.ones(2, 3) > 0
    kl.token_kl(name, logp, ref, logp.detach(), mask).sum().backward()
    assert ref.grad is None and logp.grad is not None


# ----------------------------------------------------------------------------------------------
# KL in the reward


def test_kl_token_rewards_exact_and_equal_to_openrlhf():
    """Guards against the outcome placed on the wrong token (the first, or the padded last column), a KL penalty
    of the wrong sign or left on padding, and nan padding leaking: the outcome sits on each row's last trained token,
    -beta * kl on every trained token (OpenRLHF compute_reward; verl apply_kl_penalty)."""
    kl_ = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, NAN], [NAN, NAN, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    out = kl.kl_token_rewards(torch.tensor([1.0, 2.0, 3.0], dtype=F64), kl_, mask, beta=0.5)
    close(out, [[-0.05, -0.1, 1 - 0.15], [-0.2, 2 - 0.25, 0.0], [0.0, 0.0, 0.0]])
    kl_r, m, outcome = randn(5, 7, seed=7).abs(), rand_mask(5, 7, seed=7), randn(5, seed=8)
    theirs = openrlhf_compute_reward(outcome, 0.1, kl_r, m) * m
    close(kl.kl_token_rewards(outcome, kl_r, m, 0.1), theirs)


def test_reinforce_pp_equals_verl():
    """Guards against REINFORCE++'s returns or whitening drifting from verl's: token returns with gamma = 1 of the
    KL-shaped rewards, then whitened over every trained token of the step (unbiased var, rsqrt(var + 1e-8));
    with M = 1 and empty thoughts the tree's returns are the chain's."""
    B, T, beta = 6, 5, 0.2
    mask, outcome, kl_ = rand_mask(B, T, seed=9), (randn(B, seed=10) > 0).double(), randn(B, T, seed=11).abs()
    token_rewards = kl.kl_token_rewards(outcome, kl_, mask, beta)
    want, want_returns = verl_reinforce_pp(token_rewards, mask)
    thought, answer_id = torch.zeros(B, T, dtype=torch.bool), torch.where(mask, 0, -1)
    returns = reinforce_pp.reinforce_pp_returns(outcome.view(B, 1, 1), thought, answer_id, kl=kl_, beta=beta)
    close(returns, want_returns * mask)
    close(kl.reward_to_go(token_rewards, mask), want_returns * mask)
    close(reinforce_pp.whiten(returns, mask), want, tol=1e-6)


def test_reinforce_pp_baseline_equals_verl_and_openrlhf():
    """Guards against the baseline variant subtracting the wrong mean (the step's, or per thought) or whitening per
    group: without KL it is verl's compute_reinforce_plus_plus_baseline_outcome_advantage on 3 groups of 4; with the
    KL in the reward its returns are OpenRLHF's (group mean off the outcome, then the KL-shaped cumulative returns)."""
    P, G, T = 3, 4, 5
    mask, outcome = rand_mask(P * G, T, seed=12), (randn(P * G, seed=13) > 0).double()
    thought, answer_id = torch.zeros(P * G, T, dtype=torch.bool), torch.where(mask, 0, -1)
    returns = reinforce_pp.reinforce_pp_returns(outcome.view(P, G, 1), thought, answer_id, baseline=True)
    scores = kl.kl_token_rewards(outcome, torch.zeros(P * G, T, dtype=F64), mask, 0.0)
    want = verl_reinforce_pp_baseline(scores, mask, [i // G for i in range(P * G)])
    close(reinforce_pp.whiten(returns, mask), want, tol=1e-6)
    kl_ = randn(P * G, T, seed=14).abs()
    returns = reinforce_pp.reinforce_pp_returns(
        outcome.view(P, G, 1), thought, answer_id, baseline=True, kl=kl_, beta=0.3
    )
    baselined = (outcome.view(P, G) - outcome.view(P, G).mean(-1, keepdim=True)).flatten()
    want = openrlhf_cumulative_returns(openrlhf_compute_reward(baselined, 0.3, kl_, mask), mask.double()) * mask
    close(returns, want)


def test_shaped_returns_on_the_tree_exact():
    """Guards against the tree's returns mixing its segments: one thought (KL .1, .2) with answers 0 (KL .3, .4,
    R = 1) and 1 (KL .5, R = 0), beta 1, a nan KL on padding. Answer tokens: R minus the KL of the rest of their
    answer (.3, .6; -.5); thought tokens: the mean of the answers' returns (-.1) minus the rest of the thought's KL
    (-.4, -.3); completions' returns R - thought KL - answer KL: 0 and -.8."""
    thought = torch.tensor([[1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    answer_id = torch.tensor([[-1, -1, 0, 0, 1, -1]])
    kl_ = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, NAN]], dtype=F64)
    rows, seq = kl.shaped_returns(torch.tensor([[[1.0, 0.0]]], dtype=F64), thought, answer_id, kl_, 1.0)
    close(rows, [[-0.4, -0.3, 0.3, 0.6, -0.5, 0.0]])
    close(seq, [[[0.0, -0.8]]])
    plain, plain_seq = kl.shaped_returns(torch.tensor([[[1.0, 0.0]]], dtype=F64), thought, answer_id)
    close(plain, [[0.5, 0.5, 1.0, 1.0, 0.0, 0.0]])
    close(plain_seq, [[[1.0, 0.0]]])


def test_sequence_returns_are_verls_grpo_scores():
    """Guards against the group estimators' KL-shaped reward differing from verl's (GRPO and RLOO sum
    token_level_rewards into one score) and TRL RLOO's (reward - beta * sum of k1): with M = 1 each completion's
    return is the sum of its token rewards, R - beta * sum_t kl_t."""
    mask, outcome, kl_ = rand_mask(4, 6, seed=15), randn(4, seed=16), randn(4, 6, seed=17)
    _, seq = kl.shaped_returns(
        outcome.view(2, 2, 1), torch.zeros(4, 6, dtype=torch.bool), torch.where(mask, 0, -1), kl_, 0.05
    )
    close(seq.flatten(), kl.kl_token_rewards(outcome, kl_, mask, 0.05).sum(-1))
    close(seq.flatten(), outcome - 0.05 * (torch.where(mask, kl_, 0.0)).sum(-1))


def test_whiten_exact_padding_and_split_invariance():
    """Guards against whitening over padding, a biased var, nan padding leaking, a step of one token dividing by
    zero, and whole-step statistics that change with the cut: values (1, 2, 3) whiten to (-1, 0, 1); two pieces
    whose moments are summed give the whole step's result."""
    x = torch.tensor([[1.0, 2.0], [3.0, NAN]], dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    close(reinforce_pp.whiten(x, mask), [[-1 / math.sqrt(1 + 1e-8), 0.0], [1 / math.sqrt(1 + 1e-8), 0.0]])
    assert torch.equal(reinforce_pp.whiten(x, torch.tensor([[True, False], [False, False]])), torch.zeros(2, 2))
    y, m = randn(7, 5, seed=18), rand_mask(7, 5, seed=18)
    stats = batch_std.moments(y[:3], m[:3]) + batch_std.moments(y[3:], m[3:])
    pieces = torch.cat([reinforce_pp.whiten(y[:3], m[:3], stats), reinforce_pp.whiten(y[3:], m[3:], stats)])
    close(pieces, reinforce_pp.whiten(y, m), tol=1e-13)


# ----------------------------------------------------------------------------------------------
# Dual-clip PPO


def test_dual_clip_exact_values_cut_tokens_and_gradients():
    """Guards against the dual bound applied to positive advantages, a bound at the wrong ratio, or a bound that
    keeps a gradient: ratios (.5, 1, 2, 4), clip .2, C = 3. A = -1: obj (-.8, -1, -2, -3), cut at .5 (PPO) and 4
    (dual); A = +1: (.5, 1, 1.2, 1.2), cut at 2 and 4. Gradient r * A on the other tokens."""
    ratio = torch.tensor([[0.5, 1.0, 2.0, 4.0]] * 2, dtype=F64)
    logp = torch.zeros(2, 4, dtype=F64, requires_grad=True)
    adv = torch.tensor([[-1.0] * 4, [1.0] * 4], dtype=F64)
    hp = SimpleNamespace(clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    obj, cut = dual_clip.dual_clip_objective(logp, -ratio.log(), adv, torch.ones(2, 4, dtype=torch.bool), hp)
    obj.sum().backward()
    close(obj.detach(), [[-0.8, -1.0, -2.0, -3.0], [0.5, 1.0, 1.2, 1.2]])
    assert cut.tolist() == [[True, False, False, True], [False, False, True, True]]
    close(logp.grad, [[0.0, -1.0, -2.0, 0.0], [0.5, 1.0, 0.0, 0.0]])


def test_dual_clip_equals_verl_and_is_clip_when_off():
    """Guards against drifting from verl's compute_policy_loss_vanilla (loss = -obj, the dual clip's tokens its
    pg_clipfrac_lower's), and against --dual-clip 0 changing the project's clip loss on any trained token."""
    logp, old, adv = randn(5, 6, seed=19), randn(5, 6, seed=20), randn(5, 6, seed=21) * 2
    mask = torch.ones(5, 6, dtype=torch.bool)
    hp = SimpleNamespace(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    obj, cut = dual_clip.dual_clip_objective(logp, old, adv, mask, hp)
    losses, lower = verl_dual_clip_losses(old, logp, adv, 0.2, 0.28, 3.0)
    close(obj, -losses)
    assert lower.any() and torch.equal(cut & (adv < 0) & (logp - old).exp().gt(3.0), lower)
    off = SimpleNamespace(clip_low=0.2, clip_high=0.28, dual_clip=0.0)
    assert torch.equal(dual_clip.dual_clip_objective(logp, old, adv, mask, off)[0], clip(logp, old, adv, mask, off)[0])


def test_dual_clip_keeps_padding_out_and_refuses_bad_c():
    """Guards against padded -inf log-probs or nan advantages reaching the objective or its gradient, and a bound
    C <= 1 (it would cut on-policy tokens) accepted by the objective itself."""
    logp = torch.tensor([[-0.5, -INF]], dtype=F64, requires_grad=True)
    old, adv = torch.tensor([[-2.0, NAN]], dtype=F64), torch.tensor([[-1.0, NAN]], dtype=F64)
    mask = torch.tensor([[True, False]])
    obj, cut = dual_clip.dual_clip_objective(
        logp, old, adv, mask, SimpleNamespace(clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    )
    torch.where(mask, obj, 0.0).sum().backward()
    assert torch.isfinite(logp.grad).all() and not cut[~mask].any() and obj[0, 1] == 0  # 0 off the mask, as LOSSES
    close(torch.where(mask, obj, 0.0).detach(), [[-3.0, 0.0]])  # ratio e^1.5 > 3
    with pytest.raises(ValueError, match="--dual-clip must be > 1"):
        dual_clip.dual_clip_objective(logp, old, adv, mask, SimpleNamespace(clip_low=0.2, clip_high=0.2, dual_clip=0.9))


# ----------------------------------------------------------------------------------------------
# Entropy bonus


def test_entropy_bonus_value_gradient_and_padding():
    """Guards against a bonus added with the wrong sign or weight, and padded nan entropies reaching it: entropy
    (.5, 1, nan), weights (.25, .5, 0), coef .1 give .1 * (.125 + .5) = .0625 with gradient coef * weight."""
    ent = torch.tensor([[0.5, 1.0, NAN]], dtype=F64, requires_grad=True)
    w = torch.tensor([[0.25, 0.5, 0.0]], dtype=F64)
    bonus = entropy_bonus.entropy_bonus(ent, w, 0.1)
    bonus.backward()
    close(bonus.detach(), 0.0625)
    close(ent.grad, [[0.025, 0.05, 0.0]])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_entropy_bonus_equals_verl_agg_loss(mode):
    """Guards against the bonus aggregating differently from the loss: with the step's token weights of verl's
    token-mean (mask / n) or seq-mean-token-mean (mask / (row length * rows)) it is entropy_coeff * agg_loss."""
    ent, mask = randn(4, 5, seed=22).abs(), rand_mask(4, 5, seed=22)
    m = mask.double()
    w = m / m.sum() if mode == "token-mean" else m / (m.sum(-1, keepdim=True) * 4)
    close(entropy_bonus.entropy_bonus(ent, w, 0.01), 0.01 * verl_agg_loss(ent, mask, mode), tol=1e-9)  # verl: + 1e-8


def test_entropy_logit_grad_is_autograds():
    """Guards against a wrong hand-written entropy gradient for the chunked head's backward (a missing H term, or
    the temperature applied once instead of through the softmax and the chain rule): equals autograd's."""
    logits = randn(3, 11, seed=23).requires_grad_()
    for temperature in (1.0, 0.7):
        p = torch.softmax(logits / temperature, -1)
        H = -(p * p.log()).sum(-1)
        (g,) = torch.autograd.grad(H.sum(), logits)
        close(entropy_bonus.entropy_logit_grad(logits.detach(), temperature), g)


# ----------------------------------------------------------------------------------------------
# Masking truncated completions


def test_keep_untruncated_masks_only_truncated_answers():
    """Guards against masking a truncated answer's thought (it was completed, the marker appended), the other
    answers of its thought, or the wrong answer: row 0 = thought | answer 0 (cut) | answer 1; row 1 = thought |
    answer 0 | answer 1 (cut)."""
    answer_id = torch.tensor([[-1, -1, 0, 0, 1, -1], [-1, 0, 1, 1, 1, 1]])
    cut = mask_truncated.truncated(["length", "stop", "stop", "length"]).view(1, 2, 2)
    keep = mask_truncated.keep_untruncated(cut, answer_id)
    assert keep.int().tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]]


def test_mask_truncated_with_one_answer_is_trls_row_mask():
    """Guards against the M = 1 case differing from TRL's mask_truncated_completions: a completion whose last token is
    neither the stop token nor padding (finish "length") loses its whole row, the others keep theirs."""
    eos, pad = 9, 0
    completions = [[3, 4, eos], [5, 6, 7], [8, eos]]
    is_truncated = torch.tensor([ids[-1] not in (eos, pad) for ids in completions])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    trl = completion_mask * (~is_truncated).unsqueeze(1).int()
    finish = ["length" if ids[-1] != eos else "stop" for ids in completions]
    answer_id = torch.where(completion_mask.bool(), 0, -1)
    keep = mask_truncated.keep_untruncated(mask_truncated.truncated(finish).view(3, 1), answer_id)
    assert torch.equal((keep & completion_mask.bool()).int(), trl)


# ----------------------------------------------------------------------------------------------
# Flags: presets and refusals

MODULES = (rloo, batch_std, reinforce_pp, kl, dual_clip, entropy_bonus, mask_truncated)


def cfg(**kw) -> dict:
    """Flags for TrainConfig: its defaults (plain GRPO), changed by kw."""
    return kw


def errors(flags: dict) -> list[str]:
    """The sentence TrainConfig refuses these flags with (every check: the core's and each method's), [] if none."""
    try:
        TrainConfig(**flags)
    except ValueError as e:
        return [str(e)]
    return []


def test_presets_pass_the_checks_with_and_without_the_tree():
    """Guards against a preset that its own checks refuse, or one that cannot run with GRPO-MA's tree (--answers 4)."""
    presets = {k: v for m in MODULES for k, v in getattr(m, "PRESETS", {}).items()}
    assert set(presets) == {"rloo", "reinforce_pp", "reinforce_pp_baseline", "lite_ppo"}
    for name, preset in presets.items():
        for answers in (1, 4):
            assert errors(cfg(**preset, answers=answers, thoughts=4)) == [], name
    for ok in (
        dict(dual_clip=3.0),
        dict(entropy_coef=1e-3),
        dict(mask_truncated=True),
        dict(beta=0.1, kl_estimator="k2"),
    ):
        assert errors(cfg(**ok, answers=4, thoughts=4)) == [], ok


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(advantage="rloo"), "--advantage rloo is unscaled"),
        (dict(advantage="reinforce_pp"), "--advantage reinforce_pp whitens"),
        (dict(advantage="reinforce_pp_baseline", std_normalize=False, entropy_gamma=0.1), "GTPO's gate, shift"),
        (dict(advantage="reinforce_pp", std_normalize=False, gtpo_conflict=True), "GTPO's gate, shift"),
        (dict(batch_std=True, std_normalize=False), "--batch-std chooses which std"),
        (dict(batch_std=True, advantage="agrae"), "--batch-std needs --advantage grpo"),
        (dict(kl_in_reward=True, advantage="rloo", std_normalize=False), "--kl-in-reward needs --beta > 0"),
        (dict(kl_estimator="low_var_kl"), "--kl-estimator low_var_kl is the KL penalty's estimator"),
        (dict(kl_in_reward=True, beta=0.1, kl_estimator="unbiased", std_normalize=False), "taken at pi_old"),
        (dict(beta=0.1, kl_estimator="k1"), "zero expected gradient"),
        (dict(kl_in_reward=True, beta=0.1), "per-group scale"),
        (dict(kl_in_reward=True, beta=0.1, advantage="two_grpo", thoughts=2, std_normalize=False), "per-group scale"),
        (dict(dual_clip=0.5), "--dual-clip must be > 1"),
        (dict(dual_clip=3.0, loss="gspo"), "needs --loss clip or clip_cov, not gspo"),
        (dict(dual_clip=3.0, sequence_ratio=True), "not gspo"),
        (dict(entropy_coef=-0.1), "--entropy-coef must be >= 0"),
    ],
)
def test_refusals_are_one_sentence_naming_the_flag(kw, message):
    """Guards against a combination that cannot work being accepted (a no-op std flag, a KL in the reward that a
    group std turns into noise, k1 in the loss, a dual clip on another objective) or refused without naming it."""
    found = errors(cfg(**kw))
    assert any(message in e for e in found), found
    assert all("\n" not in e for e in found)


def test_kl_in_reward_is_allowed_where_the_scale_is_the_steps():
    """Guards against refusing the combinations the references run: RLOO and REINFORCE++ (TRL, verl, OpenRLHF),
    Dr. GRPO and GRPO with the batch std (a scale shared by the step)."""
    for kw in (
        dict(advantage="rloo", std_normalize=False),
        dict(advantage="reinforce_pp", std_normalize=False),
        dict(advantage="reinforce_pp_baseline", std_normalize=False),
        dict(std_normalize=False),
        dict(batch_std=True),
    ):
        assert errors(cfg(kl_in_reward=True, beta=0.01, **kw)) == [], kw


# ----------------------------------------------------------------------------------------------
# The wiring: each estimator reaches the trainer's step


def test_head_logprobs_entropy_gradient_equals_autograd():
    """Guards against the chunked head's hand-written backward dropping or mis-scaling the entropy's gradient (the
    entropy bonus would then train nothing, or the wrong thing): with entropy_grad, d(a*logp + b*H) / d(hidden,
    weight) equals autograd through the full logits, over several chunks and at two temperatures; without it the
    entropy carries no gradient and the log-probs' gradient is unchanged."""
    from logprobs import head_logprobs, token_entropy, token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=g, dtype=F64)
    weight = torch.randn(11, 5, generator=g, dtype=F64)
    targets = torch.randint(0, 11, (7,), generator=g)
    a, b = torch.randn(7, generator=g, dtype=F64), torch.randn(7, generator=g, dtype=F64)
    for temperature in (1.0, 0.7):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        head = torch.nn.Linear(5, 11, bias=False).double()
        head.weight = torch.nn.Parameter(w)
        logp, ent = head_logprobs(head, h, targets, temperature, entropy=True, entropy_grad=True, chunk_vocab=7)
        got = torch.autograd.grad((a * logp + b * ent).sum(), (h, head.weight))
        h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = h2 @ w2.T
        ref = a * token_logprobs(logits, targets, temperature) + b * token_entropy(logits, temperature)
        want = torch.autograd.grad(ref.sum(), (h2, w2))
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)  # the head computes in float32
    logp, ent = head_logprobs(head, hidden.clone().requires_grad_(), targets, entropy=True, chunk_vocab=7)
    assert logp.requires_grad and not ent.requires_grad


def _one_step(tmp_path, flags: dict) -> dict:
    """One training step of the bundled model with these flags; returns its metrics row."""
    import json
    import os

    import train

    base = dict(model=BUNDLED, out=str(tmp_path / "run"), max_steps=1, prompts_per_step=4, thoughts=4)
    base |= dict(eval_every=0, eval_examples=4, eval_samples=0, samples_every=0, max_thought_tokens=40)
    train.main(TrainConfig(**{**base, **flags}))
    return [json.loads(x) for x in open(os.path.join(base["out"], "metrics.jsonl")) if '"loss"' in x][0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, module, function",
    [
        (dict(algo="rloo", **rloo.PRESETS["rloo"]), rloo, "grpo_ma_rloo_advantages"),
        (dict(algo="rloo", **rloo.PRESETS["rloo"], thoughts=2, answers=2), rloo, "grpo_ma_rloo_advantages"),
        (dict(**reinforce_pp.PRESETS["reinforce_pp"]), reinforce_pp, "whiten"),
        (dict(**reinforce_pp.PRESETS["reinforce_pp_baseline"]), reinforce_pp, "reinforce_pp_returns"),
        (dict(batch_std=True, thoughts=2, answers=2), batch_std, "grpo_ma_batch_std_advantages"),
        (dict(kl_in_reward=True, beta=0.01, std_normalize=False), kl, "shaped_returns"),
        (dict(beta=0.01, kl_estimator="k2"), None, None),
        (dict(dual_clip=3.0, mu=2), dual_clip, "dual_clip_objective"),
        (dict(entropy_coef=0.01), entropy_bonus, "entropy_bonus"),
        (dict(mask_truncated=True, max_answer_tokens=2), mask_truncated, "keep_untruncated"),
    ],
)
def test_each_estimator_reaches_the_step(tmp_path, monkeypatch, flags, module, function):
    """Guards against an estimator's flag or preset parsed but never called by the trainer (its seam not wired):
    its function runs in a real step (spied), the step's loss and gradient are finite, and with the KL in the reward
    the loss carries no KL term (policy_loss gets beta 0) while the k2 estimator reaches the loss's KL."""
    import losses
    import train

    calls = []
    if module is not None:
        real = getattr(module, function)
        monkeypatch.setattr(module, function, lambda *a, **k: calls.append(a) or real(*a, **k))
    betas, estimators = [], []
    real_loss = train.policy_loss

    def spy(tok, hp, objective):
        betas.append(hp.beta if tok.beta is None else tok.beta)
        return real_loss(tok, hp, objective)

    monkeypatch.setattr(train, "policy_loss", spy)
    real_k2 = losses.KL_ESTIMATORS["k2"]
    monkeypatch.setitem(losses.KL_ESTIMATORS, "k2", lambda *a: estimators.append("k2") or real_k2(*a))
    row = _one_step(tmp_path, flags)
    assert module is None or calls, f"{function} was never called"
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    assert set(betas) == ({0.0} if flags.get("kl_in_reward") else {flags.get("beta", 0.0)})
    if flags.get("kl_estimator") == "k2":
        assert estimators and row["kl"] is not None
