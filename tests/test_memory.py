"""The memory estimate: its terms equal what the code allocates, and a step that cannot fit is refused
before the data pool is built, in one sentence naming the flags to lower."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import memory
from helpers import QWEN35_08B
from kvcache import PromptKV
from model import Block, ModelConfig, Transformer, rope_cos_sin
from sampler import KVCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(family: str) -> ModelConfig:
    qwen3 = family == "qwen3"
    return ModelConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16 if qwen3 else 8,
        model_type=family,
        attention_bias=not qwen3,
        qk_norm=qwen3,
    )


def saved_bytes(c: ModelConfig, rows: int, T: int, Lp: int, layer: int = 0) -> int:
    """What autograd saves for one Block (the config's layer `layer`) over `rows` rows of T tokens attending to one
    shared prompt of Lp tokens (pack.token_stats' two passes; Lp = 0: one plainly causal pass), counted with
    saved-tensor hooks: every distinct storage (a view keeps its whole storage alive) except the weights, RoPE's
    cos/sin and the boolean masks."""
    torch.manual_seed(0)
    block = Block(c, layer)
    x = torch.randn(rows, T, c.hidden_size, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(T).expand(rows, T), c, x.dtype)
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), cos, sin)}
    seen, alive = {}, []  # alive: a freed storage's address could be reused by a later one and counted once

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            alive.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        if not Lp:
            block(x, cos, sin, None, None)
            return sum(seen.values())
        prompt = torch.randn(1, Lp, c.hidden_size, requires_grad=True)
        pcos, psin = rope_cos_sin(torch.arange(Lp)[None], c, x.dtype)
        skip |= {pcos.untyped_storage().data_ptr(), psin.untyped_storage().data_ptr()}
        kv = PromptKV()
        block(prompt, pcos, psin, kv, torch.ones(Lp, Lp, dtype=torch.bool).tril().expand(1, 1, Lp, Lp))
        block(
            x, cos, sin, kv.rows(torch.zeros(rows, dtype=torch.long)), torch.ones(rows, 1, T, Lp + T, dtype=torch.bool)
        )
    return sum(seen.values())


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("rows, T, Lp", [(3, 7, 5), (2, 9, 0)])
def test_layer_saved_bytes_equal_what_autograd_saves(family, rows, T, Lp):
    """Guards against the update's activation estimate drifting from the model: the bytes autograd keeps per layer
    (norm inputs, outputs and rstd, q, keys and values expanded to H heads, the attention's output and logsumexp,
    SDPA's float copy of the mask, gate and up, Qwen3's q/k norms) are counted exactly, in both of pack.py's
    layouts (a shared prompt with an explicit mask, and a plainly causal row)."""
    c = config(family)
    tokens, keys = rows * T + Lp, rows * (Lp + T) + Lp
    cells = rows * T * (Lp + T) + Lp * Lp if Lp else 0
    assert memory.layer_saved_bytes(c, tokens, keys, cells) == saved_bytes(c, rows, T, Lp)


# two tiny hybrids: DeltaNet key heads repeated for the value heads (2 -> 4), and as many of each (views, not copies)
HYBRIDS = {"repeated": {}, "as many": dict(linear_num_key_heads=4, linear_key_head_dim=8, linear_value_head_dim=16)}


@pytest.mark.parametrize("hybrid", HYBRIDS)
@pytest.mark.parametrize("rows, T", [(1, 64), (2, 70), (3, 10), (1, 130)])
def test_hybrid_layers_saved_bytes_equal_what_autograd_saves(hybrid, rows, T):
    """Guards the hybrid's activation estimate: a DeltaNet layer's saved bytes (memory.deltanet_saved_bytes: the
    chunked rule's per-chunk matrices and states, the convolution, the gates and norms) equal what autograd keeps,
    for rows of one chunk, of a chunk and a few tokens, of three; and a gated attention layer's are the
    transformer's (layer_saved_bytes) plus its gate's and zero-centred norms' (3 H hd per token, 2C + 2hd)."""
    import dataclasses

    from helpers import tiny_transformer

    c = tiny_transformer("qwen3_5", 4).config
    c = dataclasses.replace(c, **HYBRIDS[hybrid], num_hidden_layers=1, layer_types=("linear_attention",))
    assert memory.deltanet_saved_bytes(c, [(rows, T)]) == saved_bytes(c, rows, T, 0)
    c = dataclasses.replace(c, layer_types=("full_attention",))
    for Lp in (0, 5):
        tokens, keys = rows * T + Lp, rows * (Lp + T) + Lp
        cells = rows * T * (Lp + T) + Lp * Lp if Lp else 0
        gated = (
            tokens * 3 * c.num_attention_heads * c.head_dim * 4
            + (1 + (Lp > 0)) * (2 * c.hidden_size + 2 * c.head_dim) * 4
        )
        assert memory.layer_saved_bytes(c, tokens, keys, cells) + gated == saved_bytes(c, rows, T, Lp)


def test_kv_cache_bytes_equal_the_sampler_cache():
    """Guards against the sampling estimate counting another cache than kvcache.KVCache allocates."""
    c = config("qwen2")
    cache = KVCache(1, 6, c.num_key_value_heads, 40, c.head_dim, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert memory.kv_bytes(c, 6, 40, 2) == cache.k.nbytes + cache.v.nbytes
    # a hybrid's DeltaNet layers hold a state, not keys: Qwen3.5-0.8B's shape, its 18 states and 6 layers of keys
    hybrid = ModelConfig(**QWEN35_08B)
    with torch.device("meta"):
        model = Transformer(hybrid).to(torch.bfloat16)
    cache = KVCache.for_model(model, 6, 40)
    assert cache.k.shape[0] == 6 and cache.ssm.shape[0] == 18 and cache.ssm.dtype == torch.float32
    assert memory.kv_bytes(hybrid, 6, 40, 2) == sum(t.nbytes for t in (cache.k, cache.v, cache.conv, cache.ssm))


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, phase, advice",
    [
        (["--prompts-per-step", "100000"], "sample", "lower --prompts-per-step, --thoughts, --answers or"),
        (
            [
                "--algo",
                "grpo",
                "--prompts-per-step",
                "512",
                "--thoughts",
                "8",
                "--max-thought-tokens",
                "150",
                "--micro-batch-rows",
                "4096",
                "--max-steps",
                "1",
            ],
            "update",
            "lower --micro-batch-rows or --micro-batch-tokens, or pass --gradient-checkpointing",
        ),
    ],
)
def test_case6_a_step_that_cannot_fit_is_refused_before_the_data_pool(tmp_path, flags, phase, advice):
    """Guards against --prompts-per-step 100000 growing the process to 23 GB until the kernel killed it, 198 s in
    (exit 137, no message): the estimate comes before the data pool and the model, and names what to lower."""
    out = tmp_path / "run"
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "train.py", *flags, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: a training step needs about ") and f" at its peak ({phase}: " in lines[0]
    assert f"GiB are available on cpu: {advice}" in lines[0], lines[0]
    assert not out.exists() and time.monotonic() - start < 120


@pytest.mark.parametrize(
    "flags",
    [dict(), dict(mu=2), dict(loss="clip_cov"), dict(loss="kl_cov"), dict(top_entropy_fraction=0.2)]
    + [dict(entropy_gamma=0.1), dict(beta=0.01)],
)
def test_the_estimate_counts_the_score_pass_the_trainer_runs(monkeypatch, flags):
    """Guards against a second copy of the trainer's score-pass predicate in the estimate, which drifted: it left out
    Clip-Cov, KL-Cov and the 80/20 mask, whose selections need the policy's no-grad pass. Both ask
    config.score_pass_needs, and the estimate's phases include the pass exactly when the trainer runs it."""
    from config import TrainConfig, score_pass_needs
    from hf import BUNDLED
    from tasks import get_task

    seen = {}
    real = memory.estimate
    monkeypatch.setattr(memory, "estimate", lambda c, shape, **kw: seen.update(shape=shape) or real(c, shape, **kw))
    cfg = TrainConfig(model=BUNDLED, answers=1, **flags)
    memory.check_memory(cfg, get_task("synthetic"), torch.device("cpu"), 1)
    runs = any(score_pass_needs(cfg))
    assert seen["shape"].score_pass == runs and runs == (flags != {})


@pytest.fixture
def qwen05(tmp_path):
    """A directory with Qwen2.5-0.5B's config.json and the bundled tokenizer: all the estimate reads (no weights)."""
    import json
    import shutil

    from hf import BUNDLED

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from random_checkpoint import MODELS

    for name in os.listdir(BUNDLED):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(BUNDLED, name), tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(MODELS["qwen2.5-0.5b"]))
    return str(tmp_path)


def plan(model: str, free_gib: float, device: str, monkeypatch, *flags: str) -> memory.Plan:
    """check_memory's plan for a GRPO-MA step (16 prompts x 4 thoughts x 4 answers, 256 + 64 tokens) on a device
    with `free_gib` free."""
    from cli import parse_config
    from config import PRESETS, TrainConfig
    from tasks import get_task

    monkeypatch.setattr(memory, "available_bytes", lambda device: int(free_gib * memory.GIB))
    argv = ["--model", model, "--algo", "grpo_ma", "--prompts-per-step", "16", "--thoughts", "4", "--answers", "4"]
    argv += ["--max-thought-tokens", "256", "--max-answer-tokens", "64", *flags]
    cfg, _ = parse_config(TrainConfig, argv, presets=PRESETS, preset_field="algo")
    return memory.check_memory(cfg, get_task("synthetic"), torch.device(device), 1)


def test_auto_micro_batch_picks_the_most_rows_that_fit(qwen05, monkeypatch):
    """Guards --micro-batch-rows auto, the default on CUDA: the default 0.5B GRPO-MA step fits a 24 GiB card
    (the plain 64 rows would need ~49 GiB by the estimate) with the largest micro-batch whose estimate fits
    AUTO_MARGIN of the free memory (twice as many rows would not); with too little memory for any micro-batch
    it turns on gradient checkpointing; the start line says what it chose; on CPU it is the plain 64."""
    from cli import UserError

    free = 23.5  # a 24 GiB card less the CUDA context
    with pytest.raises(UserError, match="needs about"):
        plan(qwen05, free, "cuda", monkeypatch, "--micro-batch-rows", "64")
    auto = plan(qwen05, free, "cuda", monkeypatch)
    rows = auto.micro_batch_rows
    assert 1 <= rows < 64 and not auto.gradient_checkpointing
    assert auto.phrase.endswith(f"micro-batch rows auto: {rows}")
    plan(qwen05, memory.AUTO_MARGIN * free, "cuda", monkeypatch, "--micro-batch-rows", str(rows))  # fits
    with pytest.raises(UserError):
        plan(qwen05, memory.AUTO_MARGIN * free, "cuda", monkeypatch, "--micro-batch-rows", str(2 * rows))
    small = plan(qwen05, 13, "cuda", monkeypatch)
    assert small.gradient_checkpointing and small.phrase.endswith(", gradient checkpointing on")
    cpu = plan(qwen05, 200, "cpu", monkeypatch)
    assert (cpu.micro_batch_rows, cpu.gradient_checkpointing) == (memory.CPU_AUTO_ROWS, False) == (64, False)
    assert plan(qwen05, 200, "cpu", monkeypatch, "--micro-batch-rows", "8").micro_batch_rows == 8


def test_the_cuda_graphs_pool_is_counted_and_auto_leaves_room_for_it(qwen05, monkeypatch):
    """Guards review #7: the plan counted the graphs' static KV buffers and logits but not their memory pool (each
    captured step's intermediates, the lm_head's (rows, V) output first, held while the graphs live), so auto
    micro-batching could fill the card and the first capture run out of memory. With graphs on, every phase holds
    the pool's estimate (at least the largest bucket's lm_head output, 256 rows here: train.py's evaluation, 64
    prompts x 4 samples, shares the buffers), the estimated peak grows, and auto picks no more rows than without."""
    import json

    seen = []
    real = memory.estimate
    monkeypatch.setattr(memory, "estimate", lambda c, shape, **kw: seen.append(kw["fixed"]) or real(c, shape, **kw))
    on = plan(qwen05, 23.5, "cuda", monkeypatch)
    fixed_on = seen[-1]
    off = plan(qwen05, 23.5, "cuda", monkeypatch, "--no-cuda-graphs")
    fixed_off = seen[-1]
    V = json.load(open(os.path.join(qwen05, "config.json")))["vocab_size"]
    assert "cuda_graph_pool" not in fixed_off and fixed_on["cuda_graph_pool"] > 256 * V * 2
    assert sum(fixed_on.values()) - sum(fixed_off.values()) == fixed_on["decode_buffers"] + fixed_on["cuda_graph_pool"]
    assert on.micro_batch_rows <= off.micro_batch_rows
    peak = lambda *flags: float(
        plan(qwen05, 23.5, "cuda", monkeypatch, "--micro-batch-rows", "8", *flags).phrase.split()[3]
    )
    assert peak() > peak("--no-cuda-graphs")  # "estimated peak memory X GiB ...", at the same micro-batch


def test_auto_leaves_a_margin_on_cpu_and_a_plan_above_it_gets_one_warning(qwen05, monkeypatch):
    """Guards against the 0.8B report: on CPU --micro-batch-rows auto took the plain 64 rows whatever the memory
    (an estimated 22.78 of 23.2 GiB, no word, and the measured peak left 345 MiB). Auto now keeps to AUTO_MARGIN of
    the available memory on CPU as on CUDA; a plan that fits above that share gets one warning line naming this run's
    knobs (on CPU neither --optimizer-offload nor --rollout-dtype, which save nothing there); below it, none."""
    monkeypatch.setattr(memory, "process_bytes", lambda: 0)  # the available figure is then exactly the fake one
    need = float(plan(qwen05, 200, "cpu", monkeypatch, "--micro-batch-rows", "64").phrase.split()[3])  # GiB
    free = need / 0.95  # 64 rows fit, at 95% of it
    full = plan(qwen05, free, "cpu", monkeypatch, "--micro-batch-rows", "64")
    assert full.warning.startswith("warning: the estimated peak is 95% of the available memory, above the 85% ")
    assert full.warning.endswith(
        ": lower --micro-batch-rows or --micro-batch-tokens, or pass --gradient-checkpointing or --lora-rank N"
    )
    auto = plan(qwen05, free, "cpu", monkeypatch)
    assert 1 <= auto.micro_batch_rows < 64 and auto.warning == ""
    assert float(auto.phrase.split()[3]) <= memory.AUTO_MARGIN * free
    assert plan(qwen05, 200, "cpu", monkeypatch).micro_batch_rows == 64  # room to spare: the plain default
    assert plan(qwen05, 200, "cpu", monkeypatch, "--micro-batch-rows", "64").warning == ""
    flags = ("--micro-batch-rows", "2", "--gradient-checkpointing")
    warned = plan(
        qwen05,
        float(plan(qwen05, 200, "cuda", monkeypatch, *flags).phrase.split()[3]) / 0.9,
        "cuda",
        monkeypatch,
        *flags,
    )
    assert warned.warning.endswith("or pass --lora-rank N or --optimizer-offload or --rollout-dtype float32")


def test_the_per_phase_peak_is_its_own_and_outside_tools_then_under_report():
    """Guards docs/memory.md's account of distributed.memory_peak on CPU: each phase's peak must be its own (a
    256 MiB spike in one phase is not carried into the next, which a never-reset VmHWM would do), and that costs the
    kernel's lifetime high-water mark, which /usr/bin/time -v reads (ru_maxrss): it then under-reports the run."""
    import resource

    from distributed import memory_peak

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("Linux with a writable clear_refs only: elsewhere the peak is the process's lifetime peak")
    cpu = torch.device("cpu")
    memory_peak(cpu)
    spike = bytearray(b"\1") * (256 << 20)  # written, so resident
    del spike
    phase1, phase2 = memory_peak(cpu), memory_peak(cpu)
    assert phase1 - phase2 > 0.24  # GiB: the spike is the first phase's, not the second's
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 < phase1 - 0.2  # what outside tools see
