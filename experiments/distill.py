"""experiments/distill.py: teachers in the loop on the bundled task (docs/results.md, "Teachers in the loop").

    python experiments/distill.py                 # the teacher, then 3 seeds of GRPO, OPD, RLSD and SDPO
    python experiments/distill.py --steps 5 --seeds 0 --out runs/distill-quick   # a smoke run

1. The teacher: the bundled default (GRPO-MA) for 200 steps from assets/tiny-model, a stronger checkpoint.
2. The students, each from assets/tiny-model on the same budget (16 prompts x 16 samples, --steps steps):
   grpo (--algo grpo), opd (--algo opd --teacher the teacher: pure distillation), rlsd and sdpo (self-distillation,
   no teacher checkpoint). The tiny model's vocabulary holds only the task's characters, so RLSD's and SDPO's
   teacher prompts are written in it: RLSD_TEMPLATE puts the reference sum after the question, SDPO_TEMPLATE a
   successful sibling's completion before it (the methods' English templates would be unknown tokens to it).
3. A summary table (OUT/summary.md): held-out greedy accuracy (200 prompts) at step 0 and at step --steps (mean and
   spread over seeds), the teacher's, and the per-token reverse-KL estimate to the teacher over the first and last
   5 steps. --methods runs some of them (the table reads every method whose runs exist, at step --steps).
A run whose final/ exists is skipped; two runs at a time (--jobs), one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RLSD_TEMPLATE = "{prompt}={answer}\n{prompt}"
SDPO_TEMPLATE = "{demo}\n{prompt}"
METHODS = {
    "grpo": ["--algo", "grpo"],
    "opd": ["--algo", "opd", "--teacher", "{teacher}"],
    "rlsd": ["--algo", "rlsd", "--teacher-template", RLSD_TEMPLATE],
    "sdpo": ["--algo", "sdpo", "--teacher-template", SDPO_TEMPLATE],
}


def train(argv: list[str], out: str, log: str) -> None:
    if os.path.isfile(os.path.join(out, "final", "config.json")):
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as f:
        cmd = [sys.executable, "train.py", *argv, "--out", out, "--overwrite", "--samples-every", "0"]
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)


def rows(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def ms(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def summary(out: str, seeds: list[int], steps: int) -> str:
    """The table: each method's held-out greedy accuracy at step 0 and at step `steps` (its evaluation there)."""
    lines = [f"| method | greedy acc. step 0 | step {steps} | reverse KL, steps 1-5 | steps {steps - 4}-{steps} |"]
    lines.append("|---|---|---|---|---|")
    teacher = [
        r["teacher/eval/accuracy"] for s in seeds for r in rows(f"{out}/opd-s{s}") if "teacher/eval/accuracy" in r
    ]
    for name in [m for m in METHODS if os.path.isdir(f"{out}/{m}-s{seeds[0]}")]:
        start, end, kl0, kl1 = [], [], [], []
        for s in seeds:
            rs = rows(f"{out}/{name}-s{s}")
            at = {r["step"]: r["eval/greedy_accuracy"] for r in rs if "eval/greedy_accuracy" in r}
            start, end = start + [at[0]], end + [at[steps]]
            kl = [r["teacher/reverse_kl"] for r in rs if "teacher/reverse_kl" in r and r["step"] <= steps]
            kl0, kl1 = (kl0 + [statistics.mean(kl[:5])], kl1 + [statistics.mean(kl[-5:])]) if kl else (kl0, kl1)
        row = [name, ms(start), ms(end), ms(kl0) if kl0 else "-", ms(kl1) if kl1 else "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(f"\nteacher: held-out greedy accuracy {ms(teacher)} (each OPD run's start, on its seed's prompts)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/distill")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--teacher-steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--eval-every", type=int, default=20)
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    teacher = os.path.join(out, "teacher")
    train(["--max-steps", str(args.teacher_steps), "--eval-every", "0"], teacher, f"{out}/teacher.log")
    jobs = []
    for name in args.methods:
        for s in args.seeds:
            argv = [os.path.join(teacher, "final") if f == "{teacher}" else f for f in METHODS[name]]
            argv += ["--max-steps", str(args.steps), "--seed", str(s), "--eval-every", str(args.eval_every)]
            jobs.append((argv, f"{out}/{name}-s{s}", f"{out}/{name}-s{s}.log"))
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda j: train(*j), jobs))
    text = summary(out, args.seeds, args.steps)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
