"""gpu_check.py: the checks that need a GPU, printed as one table (bench/gpu_check.sh runs it).

    bash bench/gpu_check.sh          # CUDA: Qwen2.5-0.5B's shape, random weights; under 8 minutes on one GPU
    bash bench/gpu_check.sh --cpu    # the same rows on CPU at the bundled tiny model's size, under a minute

The CUDA checkpoint has the published Qwen2.5-0.5B-Instruct configuration (bench_scale.MODELS) and
seeded random weights, built on the spot into --cache and reused; nothing is downloaded
(transformers runs offline). Rows:

1. greedy: sampler.generate at temperature 0 against transformers.generate(do_sample=False), both
   float32, same checkpoint and prompts: the rows whose tokens are identical. Where a row differs,
   the gap between our top two logits at its first differing step says whether it was a near-tie
   (random weights make many, and one rounding difference decides them).
2. logp_gap: samples of the bf16 rollout copy (model.cast_copy, train.py --rollout-dtype bfloat16)
   scored by the float32 model without autocast: mean |logp_bf16_sampler - logp_fp32_trainer| over
   the sampled tokens (train.py logs the same quantity as logp_gap).
3. tok/s and ms per step at each batch size, new tokens only, temperature 1, no stop, in train.py's
   rollout dtype (the fused bf16 copy on CUDA, float32 on CPU), for each decode path: eager (the
   reference); CUDA graphs with the copy's small functions and the token draw compiled (graphs.py,
   fused.py: train.py's default on CUDA); CUDA graphs alone; CUDA graphs over the compiled step
   (--compile); and transformers.generate, with each path's ratio to it. A path's first call (captures,
   compiles) is timed on its own, then the best of a few; its tokens are compared with eager's.
4. the decode step's profile at each batch size (decode_profile.py): kernels per step and GPU-busy
   ms per step (torch.profiler), eager against the default path, and the step's wall time as a % of
   the HBM floor (weights + KV read once per step, at the copy bandwidth measured in the same run).
5. greedy, each path against eager in bf16: the rows identical and the first differing position.
6. GRPO-MA: one step of train.py --algo grpo_ma in a subprocess on the same checkpoint (its second
   step: the first warms up), by default (--micro-batch-rows auto on CUDA) and with the old default
   of 64 rows: update and sampling time, sampling's share of the step and peak memory from its
   metrics.jsonl (mem/update_gib: CUDA's peak allocated memory, or the peak RSS on CPU).

Each row reports its own failure (an exception, out of memory) instead of stopping the table. On
CPU the graphs' static code runs eagerly and the compile uses dynamo's eager backend (no code
generation), so those rows check that the static step matches eager and traces as one graph, in
seconds; their speed says nothing about CUDA graphs, and kernels become aten ops per step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_profile import copy_bandwidth, first_differences, floor_ms, step_profile  # noqa: E402

from fused import fuse_for_sampling  # noqa: E402
from graphs import StaticDecode, decode_runner  # noqa: E402
from hf import load_model  # noqa: E402
from logprobs import head_logprobs  # noqa: E402
from model import Transformer, cast_copy  # noqa: E402
from sampler import Generation, decode_step_static, generate  # noqa: E402

TINY = ROOT / "assets" / "tiny-model"


@dataclass
class Sizes:
    """What each row runs: the CUDA sizes, or the CPU ones (--cpu)."""

    batches: tuple[int, ...]  # sampler rows (one prompt each) for the tok/s rows
    new_tokens: int  # tokens sampled per row
    prompt_tokens: int  # every prompt's length (equal lengths: no padding on either side)
    greedy_rows: int  # prompts in the greedy and logp_gap rows
    repeats: int  # timed calls per tok/s figure; the best is kept
    grpo: tuple[int, int, int, int, int]  # GRPO-MA step: prompts, thoughts, answers, thought and answer tokens


CUDA = Sizes(batches=(64, 256), new_tokens=256, prompt_tokens=64, greedy_rows=16, repeats=2, grpo=(16, 4, 4, 256, 64))
CPU = Sizes(batches=(4, 8), new_tokens=16, prompt_tokens=8, greedy_rows=4, repeats=2, grpo=(2, 2, 2, 12, 6))


@dataclass
class Row:
    check: str
    result: str
    detail: str = ""


def run_row(rows: list[Row], check: str, fn: Callable[..., tuple[str, str]], *args) -> None:
    """Append fn(*args)'s (result, detail) as a row; an exception becomes the row's result, and the table goes on."""
    t = time.perf_counter()
    try:
        result, detail = fn(*args)
    except Exception as e:  # any failure is this row's result: the next rows still run
        result, detail = f"FAILED: {type(e).__name__}", str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        if os.environ.get("GPU_CHECK_TRACEBACK"):
            traceback.print_exc()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # an out-of-memory row leaves nothing behind for the next
    rows.append(Row(check, result, detail))
    print(f"[{time.perf_counter() - t:6.1f} s] {check}: {result}  {detail}", flush=True)


def print_table(rows: list[Row], header: str) -> None:
    w1, w2 = max(len(r.check) for r in rows), max(len(r.result) for r in rows)
    print(f"\n{header}\n{'check':<{w1}}  {'result':<{w2}}  detail\n{'-' * (w1 + w2 + 40)}")
    for r in rows:
        print(f"{r.check:<{w1}}  {r.result:<{w2}}  {r.detail}")


# ----------------------------------------------------------------------------- the checkpoint


def build_checkpoint(cache: Path, seed: int) -> Path:
    """The random Qwen2.5-0.5B checkpoint of bench_scale.py (built once into cache, then reused)."""
    import bench_scale

    path, _ = bench_scale.checkpoint(cache, "qwen2.5-0.5b", seed)
    return path


def make_prompts(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """rows random prompts of `length` ids below min(vocab, 128000) (no special ids of a real vocabulary)."""
    g = torch.Generator().manual_seed(seed + rows)
    return torch.randint(0, min(vocab, 128000), (rows, length), generator=g).tolist()


def load_hf(path: Path, device: torch.device, dtype: torch.dtype):
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bars would cut the table
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None  # no stop: every row makes all its tokens
    return hf


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- 1. greedy


def check_greedy(ours: Transformer, path: Path, sizes: Sizes, seed: int) -> tuple[str, str]:
    device = next(ours.parameters()).device
    hf = load_hf(path, device, torch.float32)
    prompts = make_prompts(sizes.greedy_rows, sizes.prompt_tokens, ours.config.vocab_size, seed)
    mine = generate(ours, prompts, max_new_tokens=sizes.new_tokens, temperature=0.0).tokens
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=sizes.new_tokens,
            min_new_tokens=sizes.new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    theirs = out[:, ids.shape[1] :].tolist()
    differ = [i for i in range(len(prompts)) if mine[i] != theirs[i]]
    result = f"{len(prompts) - len(differ)}/{len(prompts)} rows identical"
    detail = f"float32, {len(prompts)} prompts x {sizes.new_tokens} tokens"
    if differ:
        gaps = [top2_gap(ours, prompts[i], mine[i], theirs[i]) for i in differ]
        detail += f"; differing rows: top-2 logit gap at the first difference <= {max(gaps):.2e}"
    return result, detail


@torch.no_grad()
def top2_gap(model: Transformer, prompt: list[int], a: list[int], b: list[int]) -> float:
    """The gap between the model's two largest logits at the first step where a and b differ."""
    s = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    ids = torch.tensor([prompt + a[:s]], device=next(model.parameters()).device)
    top = model(ids, logits_to_keep=1)[0, -1].float().topk(2).values
    return float(top[0] - top[1])


# ----------------------------------------------------------------------------- 2. logp_gap


def check_logp_gap(ours: Transformer, fast: Transformer, sizes: Sizes, seed: int) -> tuple[str, str]:
    prompts = make_prompts(sizes.greedy_rows, sizes.prompt_tokens, ours.config.vocab_size, seed + 1)
    gen = generate(fast, prompts, max_new_tokens=sizes.new_tokens, temperature=1.0, seed=seed)
    sampler_lp = torch.tensor(gen.logprobs)  # (B, N): no stop ids, so every row has all N tokens
    trainer_lp = score(ours, prompts, gen.tokens).cpu()
    gap = (sampler_lp - trainer_lp).abs()
    detail = f"{gap.numel()} sampled tokens; median {gap.median():.2e}, max {gap.max():.2e}"
    return f"{gap.mean():.2e} nats", detail


@torch.no_grad()
def score(model: Transformer, prompts: list[list[int]], completions: list[list[int]], rows: int = 8) -> torch.Tensor:
    """float32 log-probs (B, N) of each completion after its prompt (equal lengths), as the trainer
    computes them: hidden states through lm_head chunk by chunk, never the whole (B, T, V) logits."""
    device, P = next(model.parameters()).device, len(prompts[0])
    out = []
    for i in range(0, len(prompts), rows):
        ids = torch.tensor([p + c for p, c in zip(prompts[i : i + rows], completions[i : i + rows])], device=device)
        hidden = model(ids, hidden=True)[:, P - 1 : -1]  # the positions that predict the completion
        out.append(head_logprobs(model, hidden, ids[:, P:])[0])
    return torch.cat(out)


# ----------------------------------------------------------------------------- 3. tok/s


def best_time(
    fn: Callable[[], object], repeats: int, device: torch.device, warmup: bool = True
) -> tuple[float, object]:
    """(best seconds of `repeats` calls, after one untimed warm-up call unless warmup=False; the last call's result)."""
    out = fn() if warmup else None
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        out = fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def sample_call(model: Transformer, prompts: list[list[int]], sizes: Sizes, static_step) -> Callable[[], Generation]:
    return lambda: generate(
        model, prompts, max_new_tokens=sizes.new_tokens, temperature=1.0, seed=0, static_step=static_step
    )


def check_eager(fast: Transformer, prompts: list[list[int]], sizes: Sizes, runs: dict) -> tuple[str, str]:
    device = next(fast.parameters()).device
    t, runs["eager"] = best_time(sample_call(fast, prompts, sizes, None), sizes.repeats, device)
    runs["eager_s"] = t
    return f"{len(prompts) * sizes.new_tokens / t:,.0f} tok/s", f"{1e3 * t / sizes.new_tokens:.2f} ms per step"


def decode_paths(
    device: torch.device, compiled: Transformer | None
) -> dict[str, tuple[Transformer | None, StaticDecode]]:
    """The decode paths besides eager, by name, each with the model it samples from (None: the eager rows'):
    train.py's default on CUDA first (CUDA graphs, with the copy's small functions and the draw compiled: the
    `compiled` copy), the graphs alone, and --compile's. On CPU the graphs' static code runs eagerly, and the
    compile traces with dynamo's eager backend."""
    if device.type == "cuda":
        return {
            "CUDA graphs + compiled kernels": (compiled, decode_runner(device)),
            "CUDA graphs alone": (None, StaticDecode(capture=True)),
            "CUDA graphs + --compile": (compiled, decode_runner(device, compile=True)),
        }
    step = torch.compile(decode_step_static, backend="eager", dynamic=True, fullgraph=True)
    return {
        "static step": (None, StaticDecode()),
        "static step + compile (dynamo, eager backend)": (None, StaticDecode(step)),
    }


def check_path(
    fast: Transformer, prompts: list[list[int]], sizes: Sizes, runs: dict, name: str, path: StaticDecode
) -> tuple[str, str]:
    device = next(fast.parameters()).device
    t_first, first = best_time(sample_call(fast, prompts, sizes, path), 1, device, warmup=False)  # captures here
    t, gen = best_time(sample_call(fast, prompts, sizes, path), sizes.repeats, device, warmup=False)
    runs[f"{name}_s"] = t
    detail = f"{1e3 * t / sizes.new_tokens:.2f} ms per step; first call {t_first:.1f} s; "
    detail += same_as_eager(gen, runs.get("eager"))
    if first.tokens != gen.tokens:
        detail += "; NOT repeatable (two calls with the same seeds differ)"
    if "eager_s" in runs:
        detail += f"; {runs['eager_s'] / t:.2f}x eager"
    return f"{len(prompts) * sizes.new_tokens / t:,.0f} tok/s", detail


def same_as_eager(gen: Generation, eager: Generation | None) -> str:
    """How many rows have eager's tokens, and the largest log-prob difference over those rows."""
    if eager is None:
        return "no eager run to compare with"
    same = [i for i, (a, b) in enumerate(zip(gen.tokens, eager.tokens)) if a == b]
    diff = max((abs(x - y) for i in same for x, y in zip(gen.logprobs[i], eager.logprobs[i])), default=0.0)
    return f"tokens equal to eager in {len(same)}/{len(gen.tokens)} rows (max |logp diff| there {diff:.1e})"


def check_hf(path: Path, like: Transformer, prompts: list[list[int]], sizes: Sizes, runs: dict) -> tuple[str, str]:
    """transformers.generate on the same checkpoint, on the device and in the dtype of `like`."""
    device, dtype = next(like.parameters()).device, next(like.parameters()).dtype
    hf = load_hf(path, device, dtype)
    ids = torch.tensor(prompts, device=device)

    def run():
        with torch.no_grad():
            return hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=sizes.new_tokens,
                min_new_tokens=sizes.new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )

    t, out = best_time(run, sizes.repeats, device)
    assert out.shape == (len(prompts), ids.shape[1] + sizes.new_tokens), f"HF made {tuple(out.shape)} tokens"
    detail = f"{1e3 * t / sizes.new_tokens:.2f} ms per step"
    for key, t_ours in runs.items():
        if key.endswith("_s"):
            detail += f"; {key[:-2]} {t / t_ours:.2f}x HF"
    return f"{len(prompts) * sizes.new_tokens / t:,.0f} tok/s", detail


# ----------------------------------------------------------------------------- 4. GRPO-MA step


def check_profile(
    fast: Transformer, prompts: list[list[int]], sizes: Sizes, runs: dict, paths: dict, bandwidth: float
) -> tuple[str, str]:
    """Kernels (aten ops on CPU) per step and GPU-busy ms per step, eager against the default path, and the
    default path's wall time per step as a % of the HBM floor."""
    name, (model, path) = next(iter(paths.items()))
    steps = dict(short=8, long=40) if bandwidth else dict(short=2, long=6)  # CPU: counting ops is slow
    eager, graphs = step_profile(fast, prompts, None, **steps), step_profile(model or fast, prompts, path, **steps)
    unit = "kernels" if bandwidth else "aten ops"
    result = f"{graphs['per_step']:.0f} {unit} per step ({name}); eager {eager['per_step']:.0f}"
    if not bandwidth:
        return result, "CPU: no kernels, GPU time or HBM floor"
    ms = {k: 1e3 * runs[f"{k}_s"] / sizes.new_tokens for k in ("eager", name) if f"{k}_s" in runs}
    detail = f"GPU busy {graphs['busy_ms']:.2f} ms per step ({name}), {eager['busy_ms']:.2f} (eager)"
    floor = floor_ms(fast, len(prompts), sizes.prompt_tokens + sizes.new_tokens / 2, bandwidth)
    detail += f"; HBM floor {floor:.3f} ms at {bandwidth / 1e12:.2f} TB/s (copy)"
    for k, v in ms.items():
        detail += f"; {k} {v:.2f} ms = {100 * floor / v:.0f}% of the floor"
    return result, detail


def check_greedy_paths(fast: Transformer, prompts: list[list[int]], sizes: Sizes, paths: dict) -> tuple[str, str]:
    """Greedy tokens of each path against eager's, in the rollout dtype: rounding parts greedy paths somewhere."""

    def call(model: Transformer, path: StaticDecode | None):
        return generate(model, prompts, max_new_tokens=sizes.new_tokens, temperature=0.0, static_step=path)

    eager = call(fast, None).tokens
    parts = [f"{name}: {first_differences(call(m or fast, path).tokens, eager)}" for name, (m, path) in paths.items()]
    return parts[0].split(": ", 1)[1], "; ".join(parts)


def check_grpo_ma(path: Path, sizes: Sizes, device: torch.device, seed: int, *extra: str) -> tuple[str, str]:
    P, K, M, Tt, Ta = sizes.grpo
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as out:
        flags = dict(
            model=path,
            algo="grpo_ma",
            device=str(device),
            prompts_per_step=P,
            thoughts=K,
            answers=M,
            max_thought_tokens=Tt,
            max_answer_tokens=Ta,
            max_steps=2,
            lr=1e-6,
            eval_every=0,
            eval_examples=1,
            eval_samples=0,
            samples_every=0,
            seed=seed,
            out=out,
        )
        argv = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()] + list(extra)
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
            raise RuntimeError(f"train.py exited with {proc.returncode}: {lines[-1]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [row for row in map(json.loads, f) if "time/update_s" in row]
    last = steps[-1]
    step_s = sum(v for k, v in last.items() if k.startswith("time/") and k.endswith("_s") and k != "time/step_s")
    share = last["time/sample_s"] / step_s if step_s else 0.0
    result = f"update {last['time/update_s']:.2f} s, sampling {last['time/sample_s']:.2f} s ({share:.0%} of the step)"
    result += f", peak {last['mem/update_gib']:.2f} GiB"
    chose = re.search(r"micro-batch rows auto: [^;)\n]*", proc.stdout)
    detail = f"P={P} x K={K} x M={M}, thoughts <= {Tt} + answers <= {Ta} tokens"
    return result, detail + (f"; {chose.group(0)}" if chose else "")


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU at the bundled tiny model's size")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "bench_scale"), help="checkpoint dir")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device is available; pass --cpu for the CPU run at the tiny model's size")
    for var in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "TRANSFORMERS_VERBOSITY=error"):
        os.environ.setdefault(*var.split("="))
    device = torch.device("cpu" if args.cpu else "cuda")
    sizes = CPU if args.cpu else CUDA
    rows: list[Row] = []
    t_start = time.perf_counter()
    path = TINY if args.cpu else build_checkpoint(Path(args.cache), args.seed)
    ours = load_model(path, device=device).eval()
    fast = fuse_for_sampling(cast_copy(ours, torch.bfloat16))  # the rollout copy, uncompiled: the eager reference
    # the copy train.py samples from on CUDA: its small functions compiled (fused.py)
    compiled = fuse_for_sampling(cast_copy(ours, torch.bfloat16), compile=True) if device.type == "cuda" else None
    run_row(rows, "greedy == transformers.generate", check_greedy, ours, path, sizes, args.seed)
    run_row(rows, "bf16 rollout logp_gap", check_logp_gap, ours, fast, sizes, args.seed)
    # the tok/s rows sample in train.py's rollout dtype on this device (--rollout-dtype auto)
    sampler, dtype = (fast, "bf16") if device.type == "cuda" else (ours, "fp32")
    paths = decode_paths(device, compiled)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else 0.0
    for B in sizes.batches:
        prompts = make_prompts(B, sizes.prompt_tokens, sampler.config.vocab_size, args.seed + 2)
        runs: dict = {}  # each path's samples and time, for the later rows
        run_row(rows, f"B={B} sampler eager, {dtype}", check_eager, sampler, prompts, sizes, runs)
        for name, (model, runner) in paths.items():
            row = f"B={B} sampler {name}, {dtype}"
            run_row(rows, row, check_path, model or sampler, prompts, sizes, runs, name, runner)
        run_row(rows, f"B={B} transformers.generate, {dtype}", check_hf, path, sampler, prompts, sizes, runs)
        run_row(rows, f"B={B} decode step profile", check_profile, sampler, prompts, sizes, runs, paths, bandwidth)
    prompts = make_prompts(sizes.batches[0], sizes.prompt_tokens, sampler.config.vocab_size, args.seed + 3)
    run_row(rows, f"greedy vs eager, {dtype}", check_greedy_paths, sampler, prompts, sizes, paths)
    del ours, fast, compiled, sampler, paths
    run_row(rows, "GRPO-MA step (train.py)", check_grpo_ma, path, sizes, device, args.seed)
    if device.type == "cuda":  # against the default before --micro-batch-rows auto (which is 64 on CPU)
        old = ("--micro-batch-rows=64",)
        run_row(rows, "GRPO-MA step --micro-batch-rows 64", check_grpo_ma, path, sizes, device, args.seed, *old)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print_table(
        rows,
        f"gpu_check: {path.name} on {name}, torch {torch.__version__}; "
        f"{sizes.new_tokens} new tokens, prompts of {sizes.prompt_tokens}; "
        f"{time.perf_counter() - t_start:.0f} s in all",
    )
    if any(r.result.startswith("FAILED") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
