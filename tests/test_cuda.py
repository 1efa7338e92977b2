"""The CUDA tier (make test-cuda, pytest -m cuda): what the CPU tests can only stand in for, run on one GPU. Model
parity with transformers in float32 and bfloat16; greedy decoding through the captured CUDA graphs equal to the eager
path's; tree sampling and a tool-style extend through the captured step; one capture per bucket and no recompile once
warm; --micro-batch-rows auto within the card's memory. Every test is skipped where torch.cuda.is_available() is
False, so the file imports and collects on a CPU machine. Tiny random checkpoints (tests/helpers.py), a few seconds
each (the first compile of the small functions takes the longest)."""

import json
import os
import re
import shutil
import sys

import pytest
import torch

import fused
import graphs
from graphs import StaticDecode, decode_runner
from helpers import make_hf_checkpoint
from hf import load_model
from kvcache import extend, prefill
from model import Transformer, cast_copy
from sampler import decode, generate, sample_tree

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
PROMPTS = [[5, 9, 17, 3, 44, 2, 7, 60], [11, 12], [99, 100, 101, 4, 8], [1, 2, 3], [70] * 12, [33, 34]]
BF16_EXACT = 16  # bfloat16 captured and eager decodes may part after this many tokens (different kernels round)


@pytest.fixture(scope="module", params=["qwen2", "qwen3_5"])
def checkpoint(tmp_path_factory, request) -> str:
    """A tiny random checkpoint: Qwen2 (q/k/v biases, GQA, untied head) and a Qwen3.5 hybrid (DeltaNet states in
    the static buffers and the captured step)."""
    return str(make_hf_checkpoint(tmp_path_factory.mktemp("cuda"), request.param, False))


def policy(checkpoint: str) -> Transformer:
    """The checkpoint on the GPU, its head scaled up so greedy tokens are far from ties (as tests/test_graphs.py)."""
    model = load_model(checkpoint, device=CUDA)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


def rollout_copies(model: Transformer, dtype: torch.dtype) -> tuple[Transformer, Transformer]:
    """train.py's rollout copy two ways: for --no-cuda-graphs (plain small functions, the eager reference) and for
    the default (small functions compiled where graphs.can_compile)."""
    eager = fused.fuse_for_sampling(cast_copy(model, dtype), compile=False)
    fast = fused.fuse_for_sampling(cast_copy(model, dtype), compile=graphs.can_compile(CUDA))
    return eager, fast


def assert_captured(static: StaticDecode) -> None:
    """The run really replayed CUDA graphs: nothing fell back to eager (else a test would pass on the eager path)."""
    assert not static.failed and static.graphs and not graphs.FELL_BACK, graphs.decode_path(static)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_transformers_on_cuda(checkpoint, dtype):
    """Guards the model on the GPU's kernels (cuBLAS, SDPA's CUDA backends, bf16 rounding there): its logits equal
    transformers' on the same device and dtype, float32 within float32 rounding, bfloat16 within bf16's."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(CUDA).eval()
    ours = load_model(checkpoint, dtype=dtype, device=CUDA)
    x = torch.randint(0, 128, (3, 50), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.no_grad():
        a, b = ours(x).float(), hf(x).logits.float()
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    else:
        gap = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs()
        assert gap.mean() < 2e-2 and gap.max() < 0.25, (gap.mean().item(), gap.max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_captured_equals_eager(checkpoint, dtype):
    """Guards the captured decode (static buffers, buckets, graphs, compiled small functions and draw) drifting from
    the eager path on a GPU: greedy tokens equal, in float32 every token, in bfloat16 at least the first BF16_EXACT
    of each row (later, kernels that round differently may pick another near-tie). Reports the first difference."""
    eager, fast = rollout_copies(policy(checkpoint), dtype)
    args = dict(max_new_tokens=48, n=2, temperature=0.0, seed=0)
    ref = generate(eager, PROMPTS, **args)
    static = decode_runner(CUDA)
    out = generate(fast, PROMPTS, static_step=static, **args)
    assert_captured(static)
    firsts = [first_difference(a, b) for a, b in zip(out.tokens, ref.tokens)]
    parted = {row: i for row, i in enumerate(firsts) if i is not None}
    if dtype == torch.float32:
        assert not parted, f"captured and eager greedy tokens differ (row: first position): {parted}"
    else:
        assert all(i >= BF16_EXACT for i in parted.values()), f"bf16 tokens differ early (row: position): {parted}"


def test_tree_and_tool_extend_through_the_captured_step(checkpoint):
    """Guards the captured step under tree sampling (K thoughts x M answers: forks of a cache in the static buffers,
    the buffers growing from K to K x M rows) and under a tool's turn (decode, extend the same cache with the tool's
    output, decode again): the eager path's tokens, float32 on the GPU."""
    eager, fast = rollout_copies(policy(checkpoint), torch.float32)
    tree = dict(k=4, m=3, end_of_thought=[7], max_thought_tokens=20, max_answer_tokens=12, temperature=1.0, seed=3)
    ref = sample_tree(eager, PROMPTS[:3], stop_ids=[3, 17], **tree)
    static = decode_runner(CUDA)
    out = sample_tree(fast, PROMPTS[:3], stop_ids=[3, 17], static_step=static, **tree)
    assert_captured(static)
    assert (out.thoughts, out.answers, out.answer_finish) == (ref.thoughts, ref.answers, ref.answer_finish)
    runs = []
    for model, step in ((eager, None), (fast, static)):
        runs.append(tool_turn(model, step))
    assert_captured(static)
    assert runs[0] == runs[1]


@torch.inference_mode()
def tool_turn(model: Transformer, step: StaticDecode | None) -> tuple[list, list]:
    """multiturn's shape of a tool call, greedy: decode, extend the same cache with the tool's output, decode."""
    cache, logits = prefill(model, PROMPTS)
    cache = cache.fork(torch.arange(len(PROMPTS), device=CUDA), cache.length + 40)
    u = torch.rand(len(PROMPTS), 12, generator=torch.Generator().manual_seed(0)).to(CUDA)
    kw = dict(temperature=0.0, top_k=0, top_p=1.0, static_step=step)
    first = decode(model, cache, logits, u, 12, **kw)
    cache.restore_order()
    chunk = torch.tensor([[7, 8, 9, 10]] * len(PROMPTS), device=CUDA)  # the tool's output, fed as one chunk
    logits = extend(model, cache, chunk, torch.ones_like(chunk, dtype=torch.bool))[:, -1]
    second = decode(model, cache, logits, u, 12, **kw)
    return first.tokens.tolist(), second.tokens.tolist()


def test_one_capture_per_bucket_and_no_recompile_once_warm(checkpoint, monkeypatch):
    """Guards the hot path's promise (style.md 27): each (batch, span) bucket is captured once, and once warm a
    decode captures nothing and compiles nothing: no dynamo frame compiled by the small functions or the draw, for
    other temperatures too (torch._dynamo.utils.counters; graphs' own captures counted at graphs.record). No stop
    ids: every run sees the same buckets (two batches, spans 64 and 128), whatever it samples."""
    from torch._dynamo.utils import counters

    captures = []
    real = graphs.record
    monkeypatch.setattr(graphs, "record", lambda fn, pool: captures.append(1) or real(fn, pool))
    _, fast = rollout_copies(policy(checkpoint), torch.bfloat16)
    static = decode_runner(CUDA)
    for n in (4, 2):  # the warm-up: 24 rows (bucket 32), then 12 (bucket 16), in the same buffers
        generate(fast, PROMPTS, static_step=static, max_new_tokens=80, n=n, temperature=1.0, seed=1)
    assert_captured(static)
    assert len(captures) == len(static.graphs) == len({key[:2] for key in static.graphs}) == 4, static.graphs.keys()
    warm, frames = len(captures), counters["frames"]["total"]
    for n, temperature in ((4, 0.7), (2, 1.3), (4, 1.0)):
        generate(fast, PROMPTS, static_step=static, max_new_tokens=80, n=n, temperature=temperature, seed=2)
    assert len(captures) == warm, "a warm decode captured a bucket again"
    assert counters["frames"]["total"] == frames, "a warm decode compiled a frame (a recompile)"
    assert_captured(static)


def test_auto_micro_batch_fits_this_card(tmp_path):
    """Guards --micro-batch-rows auto (the default on CUDA) against the card it runs on: for Qwen2.5-0.5B's shape
    (no weights needed) and the default GRPO-MA step, the plan picks at least one row and its estimated peak, CUDA
    graphs' buffers and pool included, fits AUTO_MARGIN of what torch.cuda.mem_get_info says is free."""
    import memory
    from cli import parse_config
    from config import PRESETS, TrainConfig
    from hf import BUNDLED
    from tasks import get_task

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from random_checkpoint import MODELS

    for name in os.listdir(BUNDLED):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(BUNDLED, name), tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(MODELS["qwen2.5-0.5b"]))
    cfg, _ = parse_config(
        TrainConfig, ["--model", str(tmp_path), "--algo", "grpo_ma"], presets=PRESETS, preset_field="algo"
    )
    plan = memory.check_memory(cfg, get_task("synthetic"), CUDA, 1)
    free = memory.available_bytes(CUDA) / memory.GIB
    # "estimated peak memory X GiB (phase) of Y GiB available; micro-batch rows auto: R[, gradient checkpointing on]"
    peak, rows = re.match(r"estimated peak memory ([\d.]+) GiB .*micro-batch rows auto: (\d+)", plan.phrase).groups()
    assert plan.micro_batch_rows == int(rows) >= 1, plan.phrase
    assert float(peak) <= memory.AUTO_MARGIN * free + 0.01, (plan.phrase, free)
