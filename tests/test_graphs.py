"""Tests of graphs.py, the static decode path that CUDA replays as graphs: its buckets, its static buffers, and
that its static-shape code, run eagerly on CPU, samples exactly what the eager path does (generate, trees, text
markers, a cache decoded again after an extend, a compiled step). Tiny random models, CPU, float32."""

import copy
import json
import os
import subprocess
from collections import Counter

import pytest
import torch

import fused
import graphs
import sampler
from graphs import StaticDecode, batch_bucket, decode_runner, span_bucket
from helpers import tiny_transformer
from kvcache import KVCache, decode_step_static, extend, prefill
from model import Transformer, cast_copy
from sampler import decode, generate, sample_tree

PROMPTS = [[5, 9, 17, 3, 44, 2, 7, 60], [11, 12], [99, 100, 101, 4, 8]]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int = 0, layers: int = 2, family: str = "qwen2", scale: float = 4.0) -> Transformer:
    """A random qwen2-shaped model; lm_head scaled up for peaked distributions (stop ids and markers get hit)."""
    model = tiny_transformer(family, layers, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale / 0.02 * 0.05)
    return model


def recording() -> tuple[list[tuple[int, int]], StaticDecode]:
    """An eager StaticDecode whose step records the (batch, span) of every call."""
    shapes = []

    def step(model, cache, tok, alive):
        shapes.append((len(tok), cache.span))
        return decode_step_static(model, cache, tok, alive)

    return shapes, StaticDecode(step)


def stand_in_graphs(monkeypatch) -> list:
    """CUDA graphs stood in for on CPU: the warm-up runs the step, capturing runs nothing, a replay runs the recorded
    step again on the captured buffers. Returns the list of recorded steps."""
    captures = []
    monkeypatch.setattr(graphs, "warm_up", lambda fn: fn())
    monkeypatch.setattr(graphs, "record", lambda fn, pool: captures.append(fn) or fn)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    return captures


def test_buckets():
    """Guards the shapes a CUDA graph is captured for: batches run at powers of two, attention spans are powers
    of two from MIN_SPAN, capped at the buffers' slots (so a run sees log2 x log2 shapes, not one per size)."""
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 5, 64, 65, 200)] == [1, 1, 2, 4, 8, 64, 128, 256]
    assert graphs.MIN_SPAN == 64
    assert [span_bucket(n, 512) for n in (0, 10, 63, 64, 100, 127, 128, 300, 511, 600)] == [64] * 3 + [128] * 3 + [
        256,
        512,
        512,
        512,
    ]


def test_adopt_pads_rows_and_slots_and_keeps_the_cache():
    """Guards the static buffers: adopting a cache copies it into buffers of power-of-two rows and slots
    (keys, values, valid slots, positions kept; the padding rows never fully masked, so never NaN), the cache
    becomes a view of them (writes land where the graphs read), and the slot tensor points at the next slot.
    A second, bigger cache grows the buffers; the first, still alive, keeps its contents."""
    cache = KVCache(2, 3, 2, 70, 4, dtype=torch.float32, device=torch.device("cpu"))
    cache.k.normal_(), cache.v.normal_()
    cache.key_valid[:, :5], cache.length, cache.next_pos[:] = True, 5, torch.tensor([5, 3, 4])
    k, v, valid = cache.k.clone(), cache.v.clone(), cache.key_valid.clone()
    static = StaticDecode()
    static.adopt(cache)
    assert static.k.shape == (2, 4, 2, 128, 4) and cache.k.shape == (2, 4, 2, 128, 4)
    assert cache.k.data_ptr() == static.k.data_ptr() and cache.slot is static.slot and cache.slot.tolist() == [5]
    assert torch.equal(cache.k[:, :3, :, :70], k) and torch.equal(cache.v[:, :3, :, :70], v)
    assert torch.equal(cache.key_valid[:3, :70], valid) and not cache.key_valid[:3, 70:].any()
    assert cache.key_valid[3].tolist() == [True] + [False] * 127 and cache.next_pos.tolist() == [5, 3, 4, 0]
    assert cache.batch == 3 and cache.rows.tolist() == [0, 1, 2]
    big = KVCache(2, 5, 2, 200, 4, dtype=torch.float32, device=torch.device("cpu"))
    static.adopt(big)
    assert static.k.shape == (2, 8, 2, 256, 4) and big.k.data_ptr() == static.k.data_ptr()
    assert cache.k.data_ptr() != static.k.data_ptr() and torch.equal(cache.k[:, :3, :, :70], k)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_path_samples_what_eager_does(temperature):
    """Guards the captured path's code (static buffers, batch buckets, span buckets, shrinking) drifting from
    the eager reference: same tokens, finish reasons and log-probs, in float32. Rows finish on stop ids, so the
    batch shrinks, and only ever to a power of two that holds the live rows; the attention span grows from 64
    to 128 slots as the cache fills."""
    model = tiny()
    args = dict(max_new_tokens=80, n=4, temperature=temperature, seed=[4, 5, 6])
    probe = generate(model, PROMPTS, **args).tokens
    args["stop_ids"] = [probe[0][3]] if temperature == 0 else [probe[0][3], probe[4][12]]  # some rows, not all
    ref = generate(model, PROMPTS, **args)
    assert "stop" in ref.finish and "length" in ref.finish
    shapes, static = recording()
    out = generate(model, PROMPTS, static_step=static, **args)
    assert out.tokens == ref.tokens and out.finish == ref.finish
    for a, b in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    batches = [b for b, _ in shapes]
    assert batches[0] == 16 and all(b & (b - 1) == 0 for b in batches) and batches == sorted(batches, reverse=True)
    assert min(batches) < 16 and [s for _, s in shapes] == sorted(s for _, s in shapes)
    assert {s for _, s in shapes} == {64, 128} and static.k.shape[3] == 128


def test_static_path_tree_sampling_and_text_marker(monkeypatch):
    """Guards tree sampling (K thoughts x M answers, forks of a cache living in the static buffers) on the
    static path: thoughts ended by a text marker, cut off ones, answers ended by stop ids, checked every step
    (CPU) and every SYNC_EVERY steps (GPU, markers found late are cut back) equal the eager path's."""
    from stop_text import StopText

    model = tiny(seed=1)
    args = dict(k=4, m=3, max_thought_tokens=30, max_answer_tokens=12, temperature=1.0, seed=[1, 2])
    probe = sample_tree(model, PROMPTS[:2], end_of_thought=[0, 0, 0], **args)
    counts = Counter(t for th in probe.thoughts for t in set(th[:-3]))
    common = [t for t, _ in counts.most_common(6)]
    text = StopText("m", [common[0]], lambda ids: "".join("m" if i == common[0] else "x" for i in ids), 128)
    args |= dict(end_of_thought=text, stop_ids=common[1:4])
    for every in (1, 8):
        monkeypatch.setattr(sampler, "host_sync_every", lambda device, every=every: every)
        ref = sample_tree(model, PROMPTS[:2], **args)
        assert 0 < sum(ref.thought_truncated) < 8 and "stop" in ref.answer_finish
        out = sample_tree(model, PROMPTS[:2], static_step=StaticDecode(), **args)
        assert out.thoughts == ref.thoughts and out.answers == ref.answers
        assert out.thought_truncated == ref.thought_truncated and out.answer_finish == ref.answer_finish
        for a, b in zip(out.answer_logprobs + out.thought_logprobs, ref.answer_logprobs + ref.thought_logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@torch.inference_mode()
def test_decode_extend_decode_on_one_cache():
    """Guards a cache decoded, extended (a tool's output) and decoded again through the same StaticDecode:
    it stays in the buffers (no stale copy) and gives the eager path's tokens."""
    model = tiny(seed=2)
    runs = []
    for static in (None, StaticDecode()):
        cache, logits = prefill(model, PROMPTS)
        cache = cache.fork(torch.arange(3), cache.length + 30)
        u = torch.rand(3, 10, generator=torch.Generator().manual_seed(0))
        kw = dict(temperature=1.0, top_k=0, top_p=1.0, static_step=static)
        first = decode(model, cache, logits, u, 10, **kw)
        cache.restore_order()
        chunk = torch.tensor([[7, 8, 9]] * 3)
        logits = extend(model, cache, chunk, torch.ones_like(chunk, dtype=torch.bool))[:, -1]
        second = decode(model, cache, logits, u.flip(1), 10, **kw)
        runs.append((first.tokens.tolist(), second.tokens.tolist()))
    assert runs[0] == runs[1]


def test_buffers_serve_inference_mode_and_no_grad_callers():
    """Guards the static buffers becoming inference tensors when generate (inference_mode) makes them first:
    a later caller decoding under no_grad (multiturn's tool rollouts) could not write into them
    ("Inplace update to inference tensor outside InferenceMode")."""
    model, static = tiny(seed=4), StaticDecode()
    generate(model, PROMPTS, max_new_tokens=5, static_step=static, seed=0)
    with torch.no_grad():
        cache, logits = prefill(model, PROMPTS)
        cache = cache.fork(torch.arange(3), cache.length + 10)
        kw = dict(temperature=1.0, top_k=0, top_p=1.0)
        u = torch.rand(3, 5, generator=torch.Generator().manual_seed(0))
        ref = decode(model, cache.fork(torch.arange(3), cache.length + 10), logits, u, 5, **kw)
        out = decode(model, cache, logits, u, 5, static_step=static, **kw)
    assert torch.equal(out.tokens, ref.tokens)


def test_capture_bookkeeping_with_a_stand_in_for_cuda_graphs(monkeypatch):
    """Guards the CUDA path's bookkeeping, run on CPU with a stand-in for CUDA graphs (capturing runs nothing; a
    replay runs the recorded step again on the captured buffers, at the span it was recorded with): the
    warm-up's advanced positions are put back, each (batch, span) bucket is captured once and replayed after,
    the graphs serve every later cache of the same buffers (once warmed up, a call captures nothing), a new
    model gets new graphs, and the tokens equal the eager path's, tree and text marker included."""
    from stop_text import StopText

    captures = stand_in_graphs(monkeypatch)
    model = tiny(seed=1)
    args = dict(k=4, m=3, max_thought_tokens=30, max_answer_tokens=40, temperature=1.0, seed=[1, 2])
    probe = sample_tree(model, PROMPTS[:2], end_of_thought=[0, 0, 0], **args)
    common = [t for t, _ in Counter(t for th in probe.thoughts for t in set(th[:-3])).most_common(6)]
    text = StopText("m", [common[0]], lambda ids: "".join("m" if i == common[0] else "x" for i in ids), 128)
    args |= dict(end_of_thought=text, stop_ids=common[1:4])
    ref = sample_tree(model, PROMPTS[:2], **args)
    static = StaticDecode(capture=True)
    out = sample_tree(model, PROMPTS[:2], static_step=static, **args)
    assert out.thoughts == ref.thoughts and out.answers == ref.answers and out.answer_finish == ref.answer_finish
    assert 0 < sum(ref.thought_truncated) < 8 and "stop" in ref.answer_finish
    # the thoughts' graphs, then the answers' (more rows: larger buffers, so the thoughts' graphs are dropped)
    assert len(captures) > len(static.graphs) > 2 and {key[1] for key in static.graphs} == {64, 128}
    sample_tree(model, PROMPTS[:2], static_step=static, **args)  # the thoughts' buckets again, in the grown buffers
    n = len(captures)
    again = sample_tree(model, PROMPTS[:2], static_step=static, **args)
    assert again.answers == ref.answers and len(captures) == n  # warmed up: no shape is new
    other = tiny(seed=2)
    assert (
        sample_tree(other, PROMPTS[:2], static_step=static, **args).answers
        == sample_tree(other, PROMPTS[:2], **args).answers
    )
    assert len(captures) > n


def test_compiled_static_step_samples_what_eager_does():
    """Guards --compile's step (torch.compile of decode_step_static with dynamic shapes, which the graphs then
    capture) failing to trace as one graph over the buckets, or sampling differently: traced here with
    dynamo's eager backend (no code generation), it gives the eager path's tokens."""
    model = tiny(seed=3)
    args = dict(max_new_tokens=12, n=2, temperature=1.0, stop_ids=[3, 17, 50], seed=[4, 5, 6])
    ref = generate(model, PROMPTS, **args)
    torch._dynamo.reset()
    step = torch.compile(decode_step_static, backend="eager", dynamic=True, fullgraph=True)
    out = generate(model, PROMPTS, static_step=StaticDecode(step), **args)
    assert out.tokens == ref.tokens and out.finish == ref.finish


def test_decode_runner_by_device(monkeypatch):
    """Guards the default: CUDA graphs on CUDA (unless turned off: the eager reference), nothing on CPU unless
    --compile asks for the compiled static step."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: ("compiled", kw))
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert decode_runner(cpu) is None and decode_runner(cuda, graphs=False) is None
    runner = decode_runner(cuda)
    assert runner.capture and runner.step is decode_step_static and runner.compiled_draw
    runner = decode_runner(cpu, compile=True)
    assert not runner.capture and runner.step == ("compiled", dict(dynamic=True, fullgraph=True))
    assert not runner.compiled_draw
    # the small functions compile on CUDA with graphs where Triton is: never on CPU, never for the eager reference
    assert graphs.can_compile(cuda) and not graphs.can_compile(cuda, graphs=False) and not graphs.can_compile(cpu)
    # Triton builds its launchers with a C compiler: without one, the small functions stay plain (review #2)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(graphs.shutil, "which", lambda name: None)
    assert not graphs.can_compile(cuda)
    monkeypatch.setenv("CC", "/usr/bin/gcc")
    assert graphs.can_compile(cuda)
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: False)
    assert not graphs.can_compile(cuda) and not decode_runner(cuda).compiled_draw


@pytest.mark.slow
def test_compiled_small_functions_sample_what_eager_does():
    """Guards the CUDA default's compiled small functions (graphs.compiled through inductor, here generating CPU
    code): the fused copy with rope, silu_mul and rms_norm compiled, drawing through a compiled sample_next,
    samples the plain copy's tokens in float32 (trees and stop ids included), log-probs within float32
    rounding; and --compile's whole-step compile traces through them as one graph."""
    base = tiny(seed=3)
    plain = fused.fuse_for_sampling(cast_copy(base, torch.float32))
    fast = fused.fuse_for_sampling(cast_copy(base, torch.float32), compile=True)
    assert fast.model.layers[0].mlp.silu_mul is graphs.compiled(fused.silu_mul)
    args = dict(temperature=1.0, stop_ids=[3, 17, 50], seed=[4, 5, 6])
    gen = dict(max_new_tokens=12, n=2)
    tree = dict(k=2, m=2, end_of_thought=[7], max_thought_tokens=6, max_answer_tokens=5)
    whole = torch.compile(decode_step_static, backend="eager", dynamic=True, fullgraph=True)
    for step in (decode_step_static, whole):
        ref = generate(plain, PROMPTS, static_step=StaticDecode(), **gen, **args)
        out = generate(fast, PROMPTS, static_step=StaticDecode(step, compiled_draw=True), **gen, **args)
        assert out.tokens == ref.tokens and out.finish == ref.finish
        gaps = [abs(a - b) for r, s in zip(out.logprobs, ref.logprobs) for a, b in zip(r, s)]
        assert max(gaps) < 1e-5
        ref = sample_tree(plain, PROMPTS, static_step=StaticDecode(), **tree, **args)
        out = sample_tree(fast, PROMPTS, static_step=StaticDecode(step, compiled_draw=True), **tree, **args)
        assert (out.thoughts, out.answers) == (ref.thoughts, ref.answers)


def failing(what: str):
    """A stand-in stage that raises as a broken capture, compiler or driver would."""

    def fail(*args, **kw):
        raise RuntimeError(f"{what} failed: operation not permitted when stream is capturing")

    return fail


@pytest.mark.parametrize("stage", ["warm_up", "record", "replay", "buffers"])
def test_a_failing_cuda_path_falls_back_to_eager_with_one_line(monkeypatch, capsys, stage):
    """Guards a run against a GPU path that fails on the user's card, torch or driver: whichever stage raises
    (the warm-up that compiles, the capture, the first replay, the static buffers), the run prints one line naming
    it and --no-cuda-graphs, and goes on eager for the rest of the run: the same tokens as the eager path, tree
    and later calls included, never a traceback; the end summary's decode path says eager and why."""
    monkeypatch.setattr(graphs, "FELL_BACK", {})
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(graphs, "warm_up", failing("warm-up") if stage == "warm_up" else lambda fn: fn())
    replay = (lambda fn, pool: failing("replay")) if stage == "replay" else (lambda fn, pool: fn)
    monkeypatch.setattr(graphs, "record", failing("capture") if stage == "record" else replay)
    if stage == "buffers":
        monkeypatch.setattr(StaticDecode, "_make_room", failing("allocation"))
    model = tiny(seed=1)
    args = dict(k=4, m=3, end_of_thought=[7], max_thought_tokens=20, max_answer_tokens=12, temperature=1.0)
    ref = sample_tree(model, PROMPTS[:2], seed=[1, 2], **args)
    static = StaticDecode(capture=True)
    for seed in ([1, 2], [1, 2]):  # the second call runs on the path the first fell back to
        out = sample_tree(model, PROMPTS[:2], seed=seed, static_step=static, **args)
        assert (out.thoughts, out.answers, out.answer_finish) == (ref.thoughts, ref.answers, ref.answer_finish)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "failed" in lines[0] and "continuing eager (--no-cuda-graphs silences this)" in lines[0]
    assert static.failed and not static.capture and not static.graphs
    assert graphs.decode_path(static).startswith("eager; decode: ") and "RuntimeError" in graphs.decode_path(static)


def test_compiled_functions_that_fail_fall_back_on_their_own(monkeypatch, capsys):
    """Guards the compiled small functions and the compiled draw: a compile (or Triton) failure makes each run its
    plain version from then on, one line per kind, the same tokens; the static step itself stays in use."""
    monkeypatch.setattr(graphs, "FELL_BACK", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: failing("compile"))
    graphs.compiled.cache_clear()
    try:
        base = tiny(seed=3)
        plain = fused.fuse_for_sampling(cast_copy(base, torch.float32))
        fast = fused.fuse_for_sampling(cast_copy(base, torch.float32), compile=True)
        args = dict(max_new_tokens=12, n=2, temperature=1.0, stop_ids=[3, 17, 50], seed=[4, 5, 6])
        ref = generate(plain, PROMPTS, static_step=StaticDecode(), **args)
        static = StaticDecode(compiled_draw=True)
        out = generate(fast, PROMPTS, static_step=static, **args)
    finally:
        graphs.compiled.cache_clear()
    assert out.tokens == ref.tokens and out.logprobs == ref.logprobs
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and {line.split(" failed")[0] for line in lines} == {
        "the compiled small functions",
        "the compiled draw",
    }
    assert not static.failed and graphs.decode_path(static).startswith("static shapes; the compiled small functions")


def test_the_oldest_supported_torch_has_every_api_the_cuda_path_calls():
    """Guards the torch a GPU user already has: every API the CUDA path and FSDP call exists here and appeared no
    later than the floor (TORCH_FLOOR, which requirements.txt and the README state); a torch older than it is one
    sentence at the start, not an AttributeError mid-run."""
    import importlib

    for name, since in graphs.TORCH_APIS.items():
        module, _, attr = ("torch." + name).rpartition(".")
        assert hasattr(importlib.import_module(module), attr), name
        assert graphs.release(since) <= graphs.release(graphs.TORCH_FLOOR), name
    assert graphs.release("2.11.0+cu128") == (2, 11) and graphs.release(graphs.TORCH_FLOOR) <= (2, 11)
    graphs.check_torch("2.11.0+cu128")
    graphs.check_torch(graphs.TORCH_FLOOR + ".0")
    with pytest.raises(ValueError, match=r"^torch 2\.5\.1 is older than 2\.6, the oldest this project supports"):
        graphs.check_torch("2.5.1")
    root = __file__.rsplit("/tests/", 1)[0]
    assert f"torch >= {graphs.TORCH_FLOOR}" in open(f"{root}/requirements.txt").read()
    assert f"torch ({graphs.TORCH_FLOOR} or newer" in open(f"{root}/README.md").read()


@pytest.mark.parametrize("has_torch", [True, False])
def test_make_keeps_the_users_torch_and_pins_only_what_is_missing(tmp_path, has_torch):
    """Guards the torch a GPU user installed: requirements.txt pinned torch==2.13.0 and every make target installed
    it (the CUDA build on Linux), replacing theirs. Requirements state floors, and pyproject the same; CI's exact
    versions live in constraints.txt, which make's installs take less its torch line when the environment has a torch
    at or above the floor; `make train` installs the runtime packages only, the test tier the rest (a stub python
    in an active environment records what make runs)."""
    root = __file__.rsplit("/tests/", 1)[0]
    runtime = [line.split("#")[0].strip() for line in open(f"{root}/requirements.txt") if line[0].isalpha()]
    assert f"torch>={graphs.TORCH_FLOOR}" in runtime and not [r for r in runtime if "==" in r]
    assert not [line for line in open(f"{root}/requirements-dev.txt") if "==" in line.split("#")[0]]
    assert f"dependencies = {json.dumps(runtime)}" in open(f"{root}/pyproject.toml").read()
    pins = [line.strip() for line in open(f"{root}/constraints.txt") if line[0].isalpha()]
    assert "torch==2.13.0" in pins and "ruff==0.17.6" in pins
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "python"
    stub.write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/log\ncase "$*" in *check_torch*) exit {int(not has_torch)};; esac\n'
    )
    stub.chmod(0o755)
    env = {**os.environ, "VIRTUAL_ENV": str(tmp_path), "PATH": f"{tmp_path}/bin:{os.environ['PATH']}"}
    subprocess.run(["make", "-s", "train"], cwd=root, env=env, check=True, capture_output=True)
    used = open(tmp_path / ".nanorl-constraints.txt").read().split()
    assert ("torch==2.13.0" in used) == (not has_torch) and "ruff==0.17.6" in used
    log = open(tmp_path / "log").read()
    assert f"-m pip install -q -r requirements.txt -c {tmp_path}/.nanorl-constraints.txt" in log
    assert "requirements-dev.txt" not in log and log.splitlines()[-1] == "train.py"
    subprocess.run(["make", "-s", "install"], cwd=root, env=env, check=True, capture_output=True)
    assert (
        f"-m pip install -q -r requirements-dev.txt -c {tmp_path}/.nanorl-constraints.txt"
        in open(tmp_path / "log").read()
    )


@torch.inference_mode()
def test_each_bucket_writes_logits_in_its_own_dtype(monkeypatch):
    """Guards review #8: the graphs' logits buffer took its dtype from the first capture, so a bucket captured later
    in another state (here float32 logits after bfloat16 ones under autocast, in the same buffers) had its logits
    rounded to bfloat16 by the copy into it: log-probs off the eager path's by bf16 rounding. Each capture's dtype
    now has its own buffer."""
    stand_in_graphs(monkeypatch)
    model = tiny(seed=5)

    def step(model, cache, tok, alive):  # a float32 step whose logits follow autocast, as a bf16 head's would
        with torch.autocast("cpu", enabled=False):
            logits = decode_step_static(model, cache, tok, alive)
        return logits.to(torch.bfloat16) if torch.is_autocast_enabled("cpu") else logits

    def run(static: StaticDecode | None, autocast: bool):
        cache, logits = prefill(model, PROMPTS)
        cache = cache.fork(torch.arange(3), cache.length + 10)
        u = torch.rand(3, 10, generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return decode(model, cache, logits, u, 10, temperature=1.0, top_k=0, top_p=1.0, static_step=static)

    static = StaticDecode(step, capture=True)
    run(static, autocast=True)
    out, ref = run(static, autocast=False), run(None, autocast=False)
    assert torch.equal(out.tokens, ref.tokens) and out.logp.dtype == torch.float32
    torch.testing.assert_close(out.logp, ref.logp, atol=1e-5, rtol=0)
    assert {dtype for dtype, _ in static.logits} == {torch.bfloat16, torch.float32}
    assert {key[2] for key in static.graphs} == {torch.bfloat16, None}


def test_adoption_is_decided_by_the_cache_not_its_address():
    """Guards review #10: "already adopted" was decided by the keys' address alone, so a second cache aliasing the
    buffers' start (a shallow fork with state of its own) was taken for the adopted one and its own valid slots and
    positions never reached the buffers the graphs read. Adoption now asks which cache object lives there."""
    cache = KVCache(2, 3, 2, 70, 4, dtype=torch.float32, device=torch.device("cpu"))
    cache.key_valid[:, :5], cache.length, cache.next_pos[:] = True, 5, torch.tensor([5, 3, 4])
    static = StaticDecode()
    static.adopt(cache)
    alias = copy.copy(cache)  # the same keys and values, its own valid slots and positions
    alias.key_valid, alias.next_pos = cache.key_valid.clone(), cache.next_pos + 2
    alias.key_valid[0, :5] = False
    assert alias.k.data_ptr() == static.k.data_ptr()
    static.adopt(alias)
    assert static.owner() is alias and alias.key_valid.data_ptr() == static.key_valid.data_ptr()
    assert static.next_pos[:3].tolist() == [7, 5, 6] and not static.key_valid[0, :5].any()
    assert cache.k.data_ptr() != static.k.data_ptr() and cache.next_pos.tolist() == [5, 3, 4, 0]  # kept, copied out
    static.adopt(alias)  # the same cache again (decode, extend, decode): stays, nothing copied
    assert static.owner() is alias and alias.k.data_ptr() == static.k.data_ptr()


def test_a_compile_inside_capture_is_refused_and_falls_back(monkeypatch, capsys):
    """Guards review #3: a compiled step whose guards miss between the warm-up and the capture would compile inside
    stream capture (Inductor's autotuning and syncs there: a crash). Capture runs under the stance
    fail_on_recompile, so that compile is an error the static path falls back on, in one line, same tokens. Here the
    warm-up runs the step without compiling it, as a missed guard would leave it."""
    monkeypatch.setattr(graphs, "FELL_BACK", {})
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)

    def warm_up(fn):
        with torch.compiler.set_stance("force_eager"):
            return fn()

    monkeypatch.setattr(graphs, "warm_up", warm_up)
    monkeypatch.setattr(graphs, "record", lambda fn, pool: fn())  # capturing runs the step: it would compile
    model = tiny(seed=3)
    args = dict(max_new_tokens=12, n=2, temperature=1.0, stop_ids=[3, 17, 50], seed=[4, 5, 6])
    ref = generate(model, PROMPTS, **args)
    torch._dynamo.reset()
    step = torch.compile(decode_step_static, backend="eager", dynamic=True, fullgraph=True)
    static = StaticDecode(step, capture=True)
    out = generate(model, PROMPTS, static_step=static, **args)
    assert out.tokens == ref.tokens and static.failed
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "capturing the decode step" in lines[0] and "recompile" in lines[0]


def test_the_compiled_draw_compiles_once_for_every_temperature_and_batch(monkeypatch):
    """Guards review #4: the compiled draw (graphs.compiled(sample_next), dynamic shapes) recompiled for another
    temperature (a branch on temperature == 1), for a batch of one row (dynamo specializes size 1), and between the
    prefill's logits (inference tensors) and the graphs' (normal ones): each a compile of seconds on a GPU, and past
    dynamo's recompile limit a silent eager draw. Traced with dynamo's eager backend: after the first decode, other
    temperatures and batch sizes (one row included) add no frame compile, and the tokens are the eager path's."""
    from torch._dynamo.utils import counters

    stand_in_graphs(monkeypatch)
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", **kw))
    graphs.compiled.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    model, static = tiny(seed=3), None
    try:
        static = StaticDecode(capture=True, compiled_draw=True)
        calls = [(PROMPTS, 4, 1.0), (PROMPTS[:2], 3, 0.7), (PROMPTS[:1], 5, 1.3), (PROMPTS[1:2], 1, 0.9)]
        frames = []
        for prompts, n, temperature in calls:
            args = dict(max_new_tokens=20, n=n, temperature=temperature, stop_ids=[3, 17, 50], seed=1)
            out = generate(model, prompts, static_step=static, **args)
            assert out.tokens == generate(model, prompts, **args).tokens
            frames.append(counters["frames"]["total"])
    finally:
        graphs.compiled.cache_clear()
    assert frames == [1] * 4, frames  # one compile: the first decode's
