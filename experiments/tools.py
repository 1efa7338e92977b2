"""experiments/tools.py: does the tiny model learn to call the Python tool? (issue 39; docs/results.md, section 10)

    python experiments/tools.py                      # 3 seeds x (GRPO with the tool, GRPO without it)
    python experiments/tools.py --seeds 0 --steps 4  # a smoke run

The model is assets/tiny-tool-model (make tiny-tool-model): the tiny shape warm-started on two-digit products,
30% of its demonstrations solved with the Python tool, 70% by hand. Each seed trains GRPO on synthetic-mul with
--tools python, and the same without the tool (--tools off: a call gets no output, so the model must multiply by
hand); each final model is evaluated with and without the tool. Runs land in runs/tools/NAME-s<seed>/; finished
runs are skipped. Prints the markdown table of docs/results.md. Every run goes through train.py and eval.py flags.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "assets", "tiny-tool-model")
COMMON = "--algo grpo --task synthetic-mul --thoughts 8 --prompts-per-step 8 --max-thought-tokens 48"
COMMON += " --max-answer-tokens 16 --eval-examples 100 --eval-samples 4 --samples-every 0 --eval-every 10"
EVAL = "--task synthetic-mul --examples 100 --n 4 --max-new-tokens 64"


def sh(cmd: str) -> None:
    print("+", cmd, flush=True)
    subprocess.run(cmd, shell=True, check=True, cwd=ROOT)


def evaluate(model: str, tools: str, out: str) -> dict:
    if not os.path.isfile(out):
        sh(f"{sys.executable} eval.py --model {model} {EVAL} --tools {tools} --out {out}")
    return json.load(open(out))["results"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "tools"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = {"start": [evaluate(MODEL, t, os.path.join(args.out, f"start-{t}.json")) for t in ("python", "off")]}
    logs = {}
    for name, tools in (("grpo_tool", "python"), ("grpo_no_tool", "off")):
        for seed in map(int, args.seeds.split(",")):
            run = os.path.join(args.out, f"{name}-s{seed}")
            if not os.path.isdir(os.path.join(run, "final")):
                sh(
                    f"{sys.executable} train.py --model {MODEL} {COMMON} --tools {tools} --max-steps {args.steps}"
                    f" --seed {seed} --out {run} --overwrite"
                )
            final = os.path.join(run, "final")
            rows.setdefault(name, []).append(
                [evaluate(final, t, os.path.join(run, f"eval-{t}.json")) for t in ("python", "off")]
            )
            logs.setdefault(name, []).append([json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))])
    print(table(rows, logs))


def mean(xs: list[float]) -> str:
    return f"{100 * sum(xs) / len(xs):.1f}" + (f" ({', '.join(f'{100 * x:.0f}' for x in xs)})" if len(xs) > 1 else "")


def table(rows: dict, logs: dict) -> str:
    """Held-out greedy accuracy and mean@4 with and without the tool, and the tool's use over training."""
    out = ["| model | greedy, tool | greedy, no tool | mean@4, tool | mean@4, no tool |", "|---|---|---|---|---|"]
    start = rows["start"]
    out.append(
        f"| start | {mean([start[0]['greedy_accuracy']])} | {mean([start[1]['greedy_accuracy']])} | "
        f"{mean([start[0]['mean@4']])} | {mean([start[1]['mean@4']])} |"
    )
    for name in ("grpo_tool", "grpo_no_tool"):
        runs = rows.get(name, [])
        cells = [mean([r[i][k] for r in runs]) for k in ("greedy_accuracy", "mean@4") for i in (0, 1)]
        out.append(f"| {name} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} |")
    out += [
        "",
        "| run | steps | tool calls per completion (first 5 steps -> last 5) | tool error rate (first 5 -> last 5) |"
        " train accuracy (first 5 -> last 5) | step time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, seeds in logs.items():
        for seed, log in enumerate(seeds):
            train = [r for r in log if "accuracy" in r]

            def avg(key, part):
                xs = [r.get(key, 0.0) for r in part]
                return sum(xs) / max(len(xs), 1)

            cells = [
                f"{avg(k, train[:5]):.2f} -> {avg(k, train[-5:]):.2f}"
                for k in ("tool/calls_per_completion", "tool/error_rate", "accuracy")
            ]
            out.append(f"| {name}-s{seed} | {len(train)} | {' | '.join(cells)} | {avg('time/step_s', train):.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
