"""FSDP2 (--fsdp) under torchrun on CPU (gloo): the update equals one process, rank 0 writes a plain
HF checkpoint that load_model reads, and resume under FSDP continues bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hf import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "assets", "tiny-model")  # tied embeddings: the shared Parameter sits in the root's group
# test_train.py::test_two_processes_equal_one's flags, plus what only FSDP does differently: three micro-batches
# per rank (gradient accumulation without reduce-scatter), mu = 2 (the no-grad scoring pass), a clip below the
# gradient norm (the norm over sharded DTensor gradients), a checkpoint every step. eval-examples 4 makes rank 0
# alone run greedy evaluation, which hangs unless the weights are gathered first.
ARGS = [
    "--algo",
    "grpo",
    "--model",
    BUNDLED,
    "--max-steps",
    "2",
    "--prompts-per-step",
    "4",
    "--thoughts",
    "4",
    "--max-thought-tokens",
    "40",
    "--max-answer-tokens",
    "8",
    "--eval-every",
    "0",
    "--eval-examples",
    "4",
    "--eval-samples",
    "0",
    "--save-every",
    "1",
    "--micro-batch-rows",
    "3",
    "--mu",
    "2",
    "--grad-clip",
    "0.1",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

pytestmark = [  # every test here runs torchrun: the slow tier
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch build has no torch.distributed"),
]


def torchrun(out: str, port: int, *extra: str, fsdp: bool = True) -> None:
    """2 ranks of train.py --fsdp (fsdp=False: DDP); a hang (ranks out of step in a collective) fails after 150 s."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master-port",
            str(port),
            "train.py",
            *(["--fsdp"] if fsdp else []),
            *ARGS,
            *extra,
            "--out",
            out,
        ],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _, err = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        p.terminate()  # SIGTERM: the launcher stops both ranks (each runs in its own session) before it exits
        p.communicate()
        pytest.fail("torchrun --fsdp hung: the ranks fell out of step in a collective")
    assert p.returncode == 0, err[-3000:]


def steps(out: str) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    """The same 2 steps in one process and under FSDP on 2 ranks."""
    d = tmp_path_factory.mktemp("fsdp")
    one, fsdp = str(d / "one"), str(d / "fsdp")
    subprocess.run(
        [sys.executable, "train.py", *ARGS, "--out", one], cwd=ROOT, env=ENV, check=True, capture_output=True
    )
    torchrun(fsdp, 29534)
    return dict(one=one, fsdp=fsdp, dir=str(d))


def test_fsdp_equals_one_process_and_saves_plain_checkpoints(runs):
    """Guards against FSDP changing the update (gradient averaging on top of our global-sum loss, a
    per-shard gradient norm, lost micro-batch gradients) and against rank 0 saving its shard only: every
    checkpoint is a full HF directory that load_model reads, equal to one process's within 1e-5."""
    start = load_model(BUNDLED).state_dict()
    for ckpt in ("step-1", "step-2", "final"):
        w1, w2 = (
            load_model(os.path.join(runs["one"], ckpt)).state_dict(),
            load_model(os.path.join(runs["fsdp"], ckpt)).state_dict(),
        )
        assert w1.keys() == w2.keys()
        assert any(not torch.equal(w1[k], start[k]) for k in w1)  # the steps did move the weights
        for k in w1:
            torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=0)
    assert sorted(os.listdir(runs["fsdp"])) == sorted(os.listdir(runs["one"]))  # no shard files, no leftover .tmp
    one, fsdp = steps(runs["one"]), steps(runs["fsdp"])
    assert all(r["grad_norm"] > 0.1 for r in one)  # the clip was active
    assert [r["grad_norm"] for r in fsdp] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)


def test_fsdp_resume_is_bitwise(runs):
    """Guards against resume under FSDP losing or mis-sharding the optimizer state: 2 steps straight equal
    resuming step-1 for 1 step, bit for bit (weights, optimizer state, metrics)."""
    out = os.path.join(runs["dir"], "resumed")
    torchrun(out, 29535, "--resume", os.path.join(runs["fsdp"], "step-1"))
    wa, wb = (load_model(os.path.join(d, "final")).state_dict() for d in (runs["fsdp"], out))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = (
        torch.load(os.path.join(d, "final", "trainer_state.pt"), weights_only=False)["optimizer"]
        for d in (runs["fsdp"], out)
    )
    assert oa["state"].keys() == ob["state"].keys()
    assert all(torch.equal(oa["state"][p][s], ob["state"][p][s]) for p in oa["state"] for s in oa["state"][p])
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "mem/")) and k != "tokens_per_s"}
    assert [drop(r) for r in steps(out)] == [drop(steps(runs["fsdp"])[1])]


def test_fsdp_checkpoint_resumed_without_fsdp_is_one_clear_error(runs):
    """Guards against a name-keyed (FSDP) optimizer state being fed to a plain optimizer: a clear message."""
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            *ARGS,
            "--resume",
            os.path.join(runs["fsdp"], "step-1"),
            "--out",
            os.path.join(runs["dir"], "plain"),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2  # a user error: one line, exit status 2
    assert "saved with --fsdp" in r.stderr and "Traceback" not in r.stderr


def test_fsdp_with_shared_prompts_equals_one_process(tmp_path):
    """Guards --share-prompt under FSDP2: two forwards of the sharded model (prompts, then the rows
    attending to them) before one backward give the single-process update."""
    one, fsdp = str(tmp_path / "one"), str(tmp_path / "fsdp")
    extra = ["--share-prompt", "--max-steps", "1"]
    subprocess.run(
        [sys.executable, "train.py", *ARGS, *extra, "--out", one], cwd=ROOT, env=ENV, check=True, capture_output=True
    )
    torchrun(fsdp, 29536, *extra)
    w1, w2 = load_model(os.path.join(one, "final")).state_dict(), load_model(os.path.join(fsdp, "final")).state_dict()
    start = load_model(BUNDLED).state_dict()
    assert any(not torch.equal(w1[k], start[k]) for k in w1)  # the step did move the weights
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-5, rtol=0)


def test_fsdp_with_bf16_rollouts_equals_one_process(tmp_path):
    """Guards the --rollout-dtype copy under FSDP2: each rank all-gathers the sharded masters into its
    own bf16 copy after every update (a collective outside the sampling forwards), so sampling needs
    no gathered weights, and 2 steps (the second sampled from the refreshed copy) equal one process."""
    one, fsdp = str(tmp_path / "one"), str(tmp_path / "fsdp")
    extra = ["--rollout-dtype", "bfloat16"]
    subprocess.run(
        [sys.executable, "train.py", *ARGS, *extra, "--out", one], cwd=ROOT, env=ENV, check=True, capture_output=True
    )
    torchrun(fsdp, 29538, *extra)
    a, b = steps(one), steps(fsdp)
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]  # the same rollouts at both steps
    assert all(r["tis/mean"] > 0 for r in b)
    # The refreshed bf16 copies come from float32 masters a few 1e-7 apart (other reduction orders), and a
    # master that close to a rounding boundary lands on the neighbouring bf16 value: the sampler's
    # log-probs, and so the IS weights, move by bf16 quanta (4e-5 in the mean on an AMD EPYC, under 1e-5
    # on the machine this test was written on). The rollouts themselves are compared exactly above.
    torch.testing.assert_close([r["tis/mean"] for r in a], [r["tis/mean"] for r in b], atol=1e-4, rtol=0)
    w1, w2 = load_model(os.path.join(one, "final")).state_dict(), load_model(os.path.join(fsdp, "final")).state_dict()
    # The second update trains on those IS weights, so a weight may move by part of one AdamW step differently
    # (lr 3e-4; seen: one element of 45k, 1e-5 to 8e-5 apart on an AMD EPYC, from run to run). A stale or
    # wrong copy would change the step-2 rollouts above and every weight by whole steps.
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=3e-4, rtol=0)


def adapters(out: str, ckpt: str = "final") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, ckpt, "adapter_model.safetensors"))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_lora_runs_under_torchrun_equal_one_process_and_resume_bit_for_bit(mode, tmp_path):
    """Guards --lora-rank through the whole trainer on 2 ranks: DDP over a frozen base and FSDP2 over layers
    holding frozen and trainable parameters must train the one-process adapters (the KL reference being the
    base with its adapters off on every rank), every rank's checkpoint must be the PEFT adapter files gathered
    whole (no model.safetensors), and resuming step-1 under torchrun must continue bit for bit."""
    extra = ["--lora-rank", "4", "--lora-alpha", "8", "--beta", "0.01", "--lr", "3e-3"]
    one, two, resumed = (str(tmp_path / n) for n in ("one", "two", "resumed"))
    subprocess.run(
        [sys.executable, "train.py", *ARGS, *extra, "--out", one], cwd=ROOT, env=ENV, check=True, capture_output=True
    )
    port = {"ddp": 29539, "fsdp": 29540}[mode]
    torchrun(two, port, *extra, fsdp=mode == "fsdp")
    start = adapters(two, "step-1")
    for ckpt in ("step-1", "step-2", "final"):
        a, b = adapters(one, ckpt), adapters(two, ckpt)
        assert not os.path.exists(os.path.join(two, ckpt, "model.safetensors"))
        assert a.keys() == b.keys()
        # Two ranks reduce gradients in another order (float32, ~1e-7 apart); Adam divides by sqrt(v), so an
        # element whose gradient is near zero can move by part of a step differently (seen: 1 element of 512,
        # 1.5e-5 apart on an AVX-512 EPYC, under 1e-5 on AVX2). A wrong update moves them by whole steps (lr 3e-3).
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=0)
    assert any(not torch.equal(start[k], adapters(two)[k]) for k in start)  # the second step moved them
    assert [r["kl"] for r in steps(two)] == pytest.approx([r["kl"] for r in steps(one)], abs=1e-6)
    torchrun(resumed, port + 2, "--resume", os.path.join(two, "step-1"), fsdp=mode == "fsdp")
    a, b = adapters(two), adapters(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
