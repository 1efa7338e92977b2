"""Rollout precision and the memory knobs: the sampler's --rollout-dtype copy follows the float32
masters, its sampler/trainer gap is measured and corrected (truncated importance weights), and
--optimizer-offload gives the same update, resumed or not."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_train import BUNDLED, small, weights

import train
from hf import load_model
from model import cast_copy, copy_weights_


def metrics(out: str) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]


def test_cast_copy_keeps_ties_and_follows_the_masters():
    """Guards against a rollout copy that breaks the tied head, stays at the starting weights, or
    keeps float32 tensors (no bandwidth saved)."""
    policy = load_model(BUNDLED)
    copy = cast_copy(policy, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy.parameters())
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # the bundled model ties its head
    want = {k: v.to(torch.bfloat16) for k, v in policy.state_dict().items()}
    assert all(torch.equal(copy.state_dict()[k], want[k]) for k in want)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    copy_weights_(copy, policy)
    assert all(torch.equal(copy.state_dict()[k], v.to(torch.bfloat16)) for k, v in policy.state_dict().items())


@pytest.mark.slow
def test_bf16_rollouts_measure_and_correct_the_gap(tmp_path):
    """Guards against bf16 rollouts that silently stay on-policy in the bookkeeping: a float32 run's
    sampler and trainer agree (gap ~1e-7, no correction), a bf16 copy's do not (gap logged, truncated
    importance weights logged within the cap), and the correction changes the update (--tis-cap 0 differs)."""
    runs = {}
    for name, kw in {"fp32": {}, "bf16": dict(rollout_dtype="bfloat16"),
                     "bf16-nocap": dict(rollout_dtype="bfloat16", tis_cap=0.0)}.items():  # fmt: skip
        out = str(tmp_path / name)
        train.main(small(BUNDLED, out, **kw))
        runs[name] = (metrics(out), weights(os.path.join(out, "final")))
    fp32, bf16, nocap = runs["fp32"][0], runs["bf16"][0], runs["bf16-nocap"][0]
    assert all(r["logp_gap"] < 1e-4 and "tis/mean" not in r for r in fp32)
    assert all(r["logp_gap"] > 10 * fp32[0]["logp_gap"] for r in bf16)
    assert all(0 < r["tis/mean"] <= 2.0 and 0 <= r["tis/capped_frac"] < 1 and r["tis/mean"] != 1.0 for r in bf16)
    assert all("tis/mean" not in r for r in nocap)
    assert bf16[0]["reward/mean"] == nocap[0]["reward/mean"]  # same rollouts at step 0 ...
    w_tis, w_plain = runs["bf16"][1], runs["bf16-nocap"][1]
    assert any(not torch.equal(w_tis[k], w_plain[k]) for k in w_tis)  # ... but another update


@pytest.mark.slow
def test_optimizer_offload_gives_the_same_update_and_resumes(tmp_path):
    """Guards against the CPU copies drifting from the weights (a missed copy back, a stale gradient,
    state not restored on resume): offloaded runs equal the plain run bit for bit, also when a plain
    run's checkpoint is resumed with --optimizer-offload."""
    a, b, c = (str(tmp_path / n) for n in "abc")
    kw = dict(max_steps=4, mu=2)
    train.main(small(BUNDLED, a, save_every=2, **kw))
    train.main(small(BUNDLED, b, optimizer_offload=True, **kw))
    train.main(small(BUNDLED, c, resume=os.path.join(a, "step-2"), optimizer_offload=True, **kw))
    wa = weights(os.path.join(a, "final"))
    assert any(not torch.equal(wa[k], weights(BUNDLED)[k]) for k in wa)
    for other in (b, c):
        wo = weights(os.path.join(other, "final"))
        assert all(torch.equal(wa[k], wo[k]) for k in wa), other
    assert [r["loss"] for r in metrics(a)] == [r["loss"] for r in metrics(b)]
