"""bench_qwen35.py: a Qwen3.5 hybrid at Qwen3.5-0.8B's published shape (random weights), measured side by side.

    python bench/bench_qwen35.py                      # about 10 minutes on 2 CPU cores
    python bench/bench_qwen35.py --layers 4 --new 16  # a quick look (the first 4 layers: 3 DeltaNet, 1 attention)
    python bench/bench_trl.py --model DIR --system-words 235 --max-completion-tokens 64 ...  # the step vs TRL

1. Logits: ours against transformers' Qwen3_5ForCausalLM on the same checkpoint (float32), max abs difference.
2. Decode: greedy sampler.generate against transformers.generate (its torch fallback of the delta rule and the
   convolution, no flash-linear-attention on CPU), the same prompts and new tokens, one process, the sides in turns;
   tokens/s and the ratio. The tokens must agree (both greedy, float32).
3. A GRPO step: train.py, one step of --prompts-per-step 1 --thoughts 16 (16 rows), prompts of --prompt-tokens and
   completions of --new tokens, float32; its time split and its peak memory (the process's RSS high-water mark)
   against memory.py's estimate, which train.py prints in its start line.
The checkpoint is built once (random_checkpoint.py --shape qwen3.5-0.8b) in --cache. A comparison to read, not a
test: nothing asserts on a time.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from random_checkpoint import build, tokenizer_dir  # noqa: E402

from hf import load_model  # noqa: E402
from sampler import generate  # noqa: E402


def checkpoint(cache: Path, layers: int) -> Path:
    path = cache / f"qwen3.5-0.8b-layers{layers or 24}"
    if not (path / "model.safetensors").is_file():
        print(f"building {path} ...", flush=True)
        tok, _ = tokenizer_dir(cache, "qwen3.5-0.8b")
        build("qwen3.5-0.8b", path, tok, seed=0, layers=layers)
    return path


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def decode(path: Path, rows: int, prompt_tokens: int, new: int, rounds: int) -> dict:
    import transformers

    ours = load_model(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 150000, (rows, prompt_tokens), generator=g)
    with torch.no_grad():
        diff = (ours(prompts[:1, :128]) - theirs(input_ids=prompts[:1, :128]).logits).abs().max().item()
    kw = dict(max_new_tokens=new, do_sample=False, min_new_tokens=new, eos_token_id=None, pad_token_id=0)
    t_ours, t_theirs = [], []
    for _ in range(rounds):
        t, a = timed(lambda: generate(ours, prompts.tolist(), max_new_tokens=new, temperature=0.0).tokens)
        t_ours.append(t)
        with torch.no_grad():
            t, b = timed(lambda: theirs.generate(prompts, attention_mask=torch.ones_like(prompts), **kw))
        t_theirs.append(t)
    same = a == b[:, prompt_tokens:].tolist()
    tokens = rows * new
    ours_tps, theirs_tps = tokens / min(t_ours), tokens / min(t_theirs)
    return dict(
        logits_max_abs=diff, greedy_equal=same, ours_tok_s=ours_tps, hf_tok_s=theirs_tps, ratio=ours_tps / theirs_tps
    )


def grpo_step(path: Path, out: Path, prompt_tokens: int, new: int, rows: int) -> dict:
    """One train.py step in a process of its own: its time/* metrics, its estimate and its peak RSS."""
    data = out / "prompts.jsonl"
    words = " ".join(["seven"] * prompt_tokens)  # one token per word in the Qwen vocabularies: the prompt's length
    example = json.dumps({"question": words[: 6 * prompt_tokens - 40], "answer": "so 7\n#### 7"})
    data.write_text((example + "\n") * 20)
    run = out / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), "--model", str(path), "--out", str(run), "--algo", "grpo"]
    cmd += ["--task", "gsm8k", "--data", str(data), "--max-steps", "1", "--prompts-per-step", "1", "--thoughts", "16"]
    limits = ["--max-thought-tokens", str(new - 8), "--max-answer-tokens", "8"]  # answers 1: completions of `new`
    cmd += [*limits, "--eval-every", "0", "--eval-examples", "1", "--eval-samples", "1"]
    cmd += ["--save-every", "0", "--micro-batch-rows", str(rows)]
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    row = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x)
    estimate = re.search(r"estimated peak memory ([\d.]+ GiB \(\w+\))", p.stdout + p.stderr).group(1)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # GiB (kilobytes on Linux)
    times = {k: row[k] for k in row if k.startswith("time/")}
    return dict(wall_s=wall, peak_rss_gib=peak, estimate=estimate, **times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", default="/tmp/bench-qwen35", help="where the random checkpoint is built once")
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0 = all 24)")
    p.add_argument("--rows", type=int, default=4, help="decode: prompts in the batch")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (decode and the GRPO step)")
    p.add_argument("--new", type=int, default=64, help="new tokens per row (decode and the GRPO step)")
    p.add_argument("--rounds", type=int, default=2, help="decode: runs per side, in turns (the fastest counts)")
    p.add_argument("--micro-batch-rows", type=int, default=4, help="the GRPO step's rows per forward/backward")
    p.add_argument("--no-step", action="store_true", help="skip the GRPO step")
    p.add_argument("--no-decode", action="store_true", help="skip the logits and decode comparison")
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    path = checkpoint(cache, args.layers)
    print(f"checkpoint: {path} ({sum(t.numel() for t in load_model(path).parameters()) / 1e9:.2f}B parameters)")
    result = {}
    if not args.no_decode:
        result["decode"] = decode(path, args.rows, args.prompt_tokens, args.new, args.rounds)
        print(json.dumps(result, indent=1), flush=True)
    if not args.no_step:
        step_dir = cache / f"step-{time.strftime('%H%M%S')}"
        step_dir.mkdir()
        result["grpo_step"] = grpo_step(path, step_dir, args.prompt_tokens, args.new, args.micro_batch_rows)
        print(json.dumps(result["grpo_step"], indent=1))


if __name__ == "__main__":
    main()
