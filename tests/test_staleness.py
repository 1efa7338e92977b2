"""Stale rollouts (--staleness K, methods/staleness.py) and their corrections: the queue trains step n's rollouts at
step n + K and resumes bit for bit; on a frozen policy the behaviour, proximal and current log-probs agree; the
three-policy loss, plain IS, the behaviour weight and M2PO's mask equal the references' formulas (values and
gradients); the combinations that do not compose are refused in one sentence."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

import config
import memory
import train
from hf import BUNDLED
from losses import CLIP, Tokens, policy_loss
from methods import m2po, mismatch, staleness
from methods.m2po import m2po_mask
from methods.mismatch import mismatch_is_weights
from methods.staleness import behaviour_kl, plain_is


def small(out: str, **kw) -> config.TrainConfig:
    """A few-second GRPO run on the bundled model: 4 prompts x 4 completions, no evaluation but the last."""
    base = dict(model=BUNDLED, out=out, algo="grpo", prompts_per_step=4, thoughts=4, max_thought_tokens=12)
    base |= dict(max_answer_tokens=6, eval_every=0, eval_examples=4, eval_samples=1, samples_every=0)
    return config.TrainConfig(**(base | kw))


def rows(out: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def weights(path: str) -> dict[str, torch.Tensor]:
    from hf import load_model

    return load_model(path).state_dict()


@pytest.mark.slow
def test_staleness_resumes_bit_for_bit_from_a_checkpoint_mid_queue(tmp_path):
    """Guards against a queue left out of the checkpoint (a resumed run would train fresh rollouts, or none), against
    the lag drifting, and against the first K steps updating: --staleness 2 stopped after step 3 (two steps queued)
    and resumed equals the uninterrupted run bit for bit, rows and weights; steps 1-2 only sample, the rest train
    at lag 2 with a behaviour-to-proximal KL that grows once the weights move."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train.main(small(a, max_steps=5, staleness=2, save_every=1))
    queued = torch.load(os.path.join(a, "step-3", "trainer_state.pt"), weights_only=False)["trainer"]["stale_queue"]
    assert [e["step"] for e in queued] == [1, 2] and len(queued[0]["groups"]) == 4
    train.main(config.resume_config(config.TrainConfig(resume=os.path.join(a, "step-3"), out=b), {"resume", "out"}))
    wa, wb = weights(os.path.join(a, "final")), weights(os.path.join(b, "final"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], weights(BUNDLED)[k]) for k in wa)
    steps = [r for r in rows(a) if "reward/mean" in r]
    assert ["loss" in r for r in steps] == [False, False, True, True, True]
    assert [r["stale/lag"] for r in steps[2:]] == [2, 2, 2]
    assert abs(steps[2]["stale/kl_k3"]) < 1e-6 < steps[4]["stale/kl_k3"]  # step 3 trains step 1's: no update between
    drop = {"time/", "mem/", "tokens_per_s"}
    clean = lambda r: {k: v for k, v in r.items() if not any(k.startswith(d) for d in drop)}  # noqa: E731
    assert [clean(r) for r in rows(b) if r["step"] > 3] == [clean(r) for r in rows(a) if r["step"] > 3]


def test_a_frozen_policy_gives_equal_behaviour_proximal_and_current_log_probs(tmp_path, monkeypatch):
    """Guards against misaligned log-probs in the queue or the score pass (a shifted row, the wrong step's tokens, the
    behaviour log-probs of another group): with the learning rate at 0 in effect (1e-30: --lr must be > 0; no weight
    moves in float32) the sampler's log-probs of K steps ago, the score pass's (proximal) and the update's (current)
    agree to rounding on every trained token."""
    seen = []
    real = staleness.micro_batch

    def spy(run, tok, mb, sampled, sums, epoch):
        seen.append((mb.sampler_logp[sampled], tok.old_logp[sampled], tok.logp.detach()[sampled]))
        return real(run, tok, mb, sampled, sums, epoch)

    monkeypatch.setattr(staleness, "micro_batch", spy)
    train.main(small(str(tmp_path / "r"), max_steps=4, staleness=2, lr=1e-30, mu=2, tis_cap=0.0))
    assert len(seen) >= 4  # 2 updates x 2 epochs
    for b, o, s in seen:
        assert b.numel() > 0
        torch.testing.assert_close(o, b, atol=2e-5, rtol=0)
        torch.testing.assert_close(s, o, atol=2e-5, rtol=0)


def test_the_queue_delays_by_k_steps_and_is_run_state():
    """Guards against an off-by-one lag or a queue outside the trainer state: K = 2 returns nothing for 2 steps, then
    step n - 2's groups with their own batch accuracy; K = 0 passes the step's own through."""
    run = types.SimpleNamespace(cfg=types.SimpleNamespace(staleness=2), state={})
    out = [staleness.queue(run, ([f"g{n}"], n / 10), n, counts := {}) + (counts,) for n in range(5)]
    assert out[:2] == [([], 0.0, {}), ([], 0.1, {})]
    assert out[2:] == [
        (["g0"], 0.0, {"stale_lag": 2}),
        (["g1"], 0.1, {"stale_lag": 2}),
        (["g2"], 0.2, {"stale_lag": 2}),
    ]
    assert [e["step"] for e in run.state["stale_queue"]] == [3, 4]
    run.cfg.staleness = 0
    assert staleness.queue(run, (["g"], 0.5), 9, {}) == (["g"], 0.5)


def three(seed: int = 0):
    torch.manual_seed(seed)
    s = (torch.randn(2, 5) * 0.3 - 1).requires_grad_()
    o, b = s.detach() + torch.randn(2, 5) * 0.2, s.detach() + torch.randn(2, 5) * 0.6
    adv = torch.tensor([[1.0] * 5, [-0.5] * 5])
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    return s, o, b, adv, mask


def test_the_decoupled_loss_equals_verls_clipped_ratio_times_the_truncated_behaviour_weight():
    """Guards against the behaviour weight taken against the current policy, applied to the KL, or left out of the
    gradient's scale: --is-anchor old is verl's decoupled loss, loss = -sum(weight * w * min(r A, clip(r) A)) with
    r = exp(s - o) and w = min(exp(o - b), 2) (TIS) or exp(o - b) inside [0.5, 5], else 0 (IcePop); values and
    gradient against the formula written out."""
    s, o, b, adv, mask = three()
    weight = mask.float() / mask.sum()
    hp = types.SimpleNamespace(clip_low=0.2, clip_high=0.2, beta=0.0, kl_estimator="k3")
    for mode, low, high in (("token_truncate", 0.0, 2.0), ("token_mask", 0.5, 5.0)):
        w = mismatch_is_weights(o, b, mask, mode=mode, low=low, high=high)
        rho = torch.exp(o - b)
        ref_w = rho.clamp(max=2.0) if mode == "token_truncate" else torch.where((rho >= 0.5) & (rho <= 5), rho, 0)
        assert torch.equal(w, torch.where(mask, ref_w, 1.0))
        loss, _ = policy_loss(Tokens(s, o, adv, weight, mask=mask, is_weight=w), hp, CLIP)
        (g,) = torch.autograd.grad(loss, s)
        s2 = s.detach().clone().requires_grad_()
        r = torch.exp(s2 - o)
        ref = -(weight * ref_w * torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv))[mask].sum()
        (g2,) = torch.autograd.grad(ref, s2)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(g, g2)


def test_the_rollout_anchor_and_plain_is_take_the_ratio_against_the_behaviour_policy():
    """Guards against a ratio left against the proximal policy (the rollout anchor would be the on-policy loss) and a
    clip in the "no correction" arm: --is-anchor rollout is min(r A, clip(r) A) with r = exp(s - b) (SkyRL's rollout
    anchor, verl's bypass); --loss plain_is is exp(s - b) A with gradient exp(s - b) A on every token."""
    s, _, b, adv, mask = three(1)
    hp = types.SimpleNamespace(clip_low=0.2, clip_high=0.2)
    obj, cut = plain_is(s, b, adv, mask, hp)
    r = torch.exp(s.detach() - b)
    torch.testing.assert_close(obj[mask], (r * adv)[mask])
    assert not cut.any() and obj[~mask].abs().sum() == 0
    (g,) = torch.autograd.grad(obj.sum(), s)
    torch.testing.assert_close(g, torch.where(mask, r * adv, 0.0))
    clipped, cut = CLIP(s, b, adv, mask, hp)
    torch.testing.assert_close(clipped[mask], torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)[mask])
    assert cut.any() and not cut[~mask].any()  # lag 0.6 in log space: some tokens are outside the trust region


def test_behaviour_kl_is_k3_of_the_proximal_over_the_behaviour_policy():
    """Guards against the KL's direction or padding in the stale/kl_k3 metric: sum of exp(o - b) - (o - b) - 1."""
    b = torch.tensor([[-1.0, -2.0, float("-inf")]])
    o = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    d = torch.tensor([-0.5, 1.0])
    assert torch.isclose(behaviour_kl(b, o, mask), (d.exp() - d - 1).sum())


def reference_m2po(b: torch.Tensor, o: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """AReaL's loop as the reference describes it: mask the largest m2 = (b - o)^2 until the mean of the rest is
    below the threshold, keeping at least one (ties: the earlier token first)."""
    vals = [((b - o) ** 2)[i, j].item() for i, j in mask.nonzero().tolist()]
    where = mask.nonzero().tolist()
    alive = list(range(len(vals)))
    while len(alive) > 1 and sum(vals[i] for i in alive) / len(alive) >= threshold:
        alive.remove(max(alive, key=lambda i: (vals[i], -i)))
    keep = torch.ones_like(mask)
    for i, (r, c) in enumerate(where):
        keep[r, c] = i in alive
    return keep


def test_m2po_masks_the_largest_second_moments_until_the_rest_is_below_the_threshold():
    """Guards against masking by another order (absolute log-ratio of one sign, the smallest first), a mean over the
    padding, an empty keep, or ties broken arbitrarily: the example of the docstring, a tie, and random steps
    against the reference loop."""
    b = torch.tensor([[0.5, -0.4, 0.1, 0.0, 0.3, 9.0]])
    o, mask = torch.zeros(1, 6), torch.tensor([[True] * 5 + [False]])
    # m2 = 0.25, 0.16, 0.01, 0, 0.09: mean 0.102; without 0.25: 0.065; without 0.16 too: 0.0333 < 0.05
    assert m2po_mask(b, o, mask, 0.05).tolist() == [[False, False, True, True, True, True]]
    assert m2po_mask(b, o, mask, 0.2).all()  # the whole mean is below: nothing masked
    tie = torch.tensor([[0.2, -0.2, 0.2]])
    assert m2po_mask(tie, torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), 0.01).tolist() == [
        [False, False, True]
    ]
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        b, o = torch.randn(3, 7, generator=g) * 0.3, torch.randn(3, 7, generator=g) * 0.3
        mask = torch.rand(3, 7, generator=g) > 0.3
        assert torch.equal(m2po_mask(b, o, mask, 0.04), reference_m2po(b, o, mask, 0.04))


def test_m2po_masks_only_the_surrogate_of_a_stale_run(tmp_path):
    """Guards against M2PO's mask computed on the wrong log-probs or never applied in a run: a tiny threshold masks
    a share of the tokens (m2po/masked_frac) once the policy has moved, and the run finishes."""
    out = str(tmp_path / "m")
    train.main(small(out, max_steps=4, staleness=1, m2po_threshold=1e-6, rollout_is="token_mask", tis_cap=5.0))
    masked = [r["m2po/masked_frac"] for r in rows(out) if "m2po/masked_frac" in r]
    assert len(masked) == 3 and 0 < masked[-1] < 1


@pytest.mark.parametrize(
    "flags, says",
    [
        (dict(staleness=-1), "--staleness must be >= 0"),
        (dict(staleness=5, max_steps=5), "--staleness must be below --max-steps (5)"),
        (dict(staleness=2, is_anchor="rollout"), "--is-anchor rollout takes the ratio against the behaviour policy"),
        (dict(m2po_threshold=0.04), "--m2po-threshold needs --staleness K > 0"),
        (dict(m2po_threshold=-1.0, staleness=1), "--m2po-threshold must be >= 0"),
        (dict(is_anchor="proximal"), "--is-anchor must be one of old, rollout"),
    ],
)
def test_combinations_that_do_not_compose_are_refused(flags, says):
    """Guards against a silent no-op or double counting: each refusal is one sentence naming the flags."""
    with pytest.raises(ValueError, match="^" + pytest.importorskip("re").escape(says)):
        config.TrainConfig(**flags)


def test_the_sampler_dtype_checks_know_stale_rollouts():
    """Guards against the rollout anchor on-policy with a float32 sampler (its behaviour policy is the proximal one)
    and against the mismatch modes refused on stale rollouts, which they now correct."""
    from cli import UserError

    with pytest.raises(UserError, match="^--is-anchor rollout needs a behaviour policy that differs"):
        staleness.check_rollout_dtype(config.TrainConfig(is_anchor="rollout", tis_cap=0.0), "float32")
    staleness.check_rollout_dtype(config.TrainConfig(is_anchor="rollout", tis_cap=0.0, staleness=1), "float32")
    icepop = dict(rollout_is="token_mask", tis_floor=0.5, tis_cap=5.0)
    with pytest.raises(UserError, match="pass --rollout-dtype bfloat16 or --staleness K"):
        mismatch.check_rollout_dtype(config.TrainConfig(**icepop), "float32")
    mismatch.check_rollout_dtype(config.TrainConfig(staleness=1, **icepop), "float32")
    assert mismatch.enabled(config.TrainConfig(staleness=1)) and not mismatch.enabled(config.TrainConfig())
    assert not m2po.enabled(config.TrainConfig()) and config.score_pass_needs(config.TrainConfig(staleness=1))[0]


def test_the_memory_estimate_counts_the_queue(monkeypatch):
    """Guards against a queue the estimate leaves out (K steps of rollouts held in memory): its term is K x the
    step's completion tokens x the bytes of a queued token, and absent on-policy."""
    from tasks import get_task

    seen = []
    real = memory.estimate
    monkeypatch.setattr(memory, "estimate", lambda c, shape, **kw: seen.append(kw["fixed"]) or real(c, shape, **kw))
    for k in (0, 3):
        cfg = config.TrainConfig(model=BUNDLED, algo="grpo", answers=1, thoughts=8, staleness=k, max_steps=10)
        memory.check_memory(cfg, get_task("synthetic"), torch.device("cpu"), 1)
    assert "run_state" not in seen[0]
    tokens = 16 * 8 * (cfg.max_answer_tokens + cfg.max_thought_tokens)
    assert seen[-1]["run_state"] == 3 * tokens * staleness.QUEUE_TOKEN_BYTES
