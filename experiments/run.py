"""experiments/run.py: the papers' claims, side by side on the bundled task, in one command.

    python experiments/run.py             # 3 seeds x 100 steps: 47 minutes on 2 CPU cores
    python experiments/run.py --quick     # 1 seed x 20 steps, 50 eval prompts: under 4 minutes
    python experiments/run.py --jobs 4    # runs at a time (default: one per CPU core)

Every run goes through train.py and eval.py flags only; nothing here changes an algorithm.
Runs land in runs/exp/ (runs/exp-quick/ with --quick) as NAME-s<seed>/; a finished run (its
final/ checkpoint, or its eval JSON) is skipped, so an interrupted suite continues where it
stopped. experiments/report.py then writes the tables and plots (docs/results.md links them).

Claims and the runs that test them (same task, model, lengths and base learning rate throughout):
  GRPO-MA   grpo_t16a1 grpo_t4a1 grpo_ma_t4a4 grpo_ma_t4a8 (TkAm: k thoughts, m answers each),
            plus experiments/variance.py on the start and end policies
  2-GRPO    two_grpo_lr8x (its recipe: prompts x8, lr x8, steps / 8, so the same prompts as
            grpo_t16a1), two_grpo_lr1x (same, base lr), two_grpo_p16 (16 prompts, 100 steps)
  A-GRAE    {grpo, dr_grpo, dapo} with and without --advantage agrae, then pass@1..16
  GTPO      gtpo against grpo_t16a1, then accuracy on synthetic-hard (4-digit operands: OOD)
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> train.py flags. Most expensive first, so the last jobs to start are short ones.
CONFIGS = {
    "grpo_t16a1": ["--algo", "grpo"],  # GRPO, 16 samples
    "dapo": ["--algo", "dapo"],
    "dapo_agrae": ["--algo", "dapo", "--advantage", "agrae"],
    "grpo_agrae": ["--algo", "agrae"],
    "dr_grpo": ["--algo", "dr_grpo"],
    "dr_grpo_agrae": ["--algo", "dr_grpo", "--advantage", "agrae"],
    "gtpo": ["--algo", "gtpo"],
    "grpo_ma_t4a8": ["--algo", "grpo_ma", "--answers", "8"],
    "grpo_ma_t4a4": ["--algo", "grpo_ma"],  # GRPO-MA, 4 thoughts x 4 answers
    "grpo_t4a1": ["--algo", "grpo", "--thoughts", "4"],  # GRPO, 4 samples
    "two_grpo_lr8x": ["--algo", "two_grpo"],  # 128 prompts x 2, lr 2.4e-3
    "two_grpo_lr1x": ["--algo", "two_grpo", "--lr", "3e-4"],  # 128 prompts x 2, lr 3e-4
    "two_grpo_p16": ["--algo", "two_grpo", "--prompts-per-step", "16", "--lr", "3e-4"],  # 16 prompts x 2
}
MATCHED_PROMPTS = ("two_grpo_lr8x", "two_grpo_lr1x")  # 8x prompts per step, so 1/8 of the steps
PASSK = ("grpo_t16a1", "grpo_agrae", "dr_grpo", "dr_grpo_agrae", "dapo", "dapo_agrae")  # eval.py --n 16
OOD = ("grpo_t16a1", "gtpo")  # eval.py --task synthetic-hard
VARIANCE = ("grpo_ma_t4a4", "grpo_t16a1")  # end policies for the variance measurement


def plan(args) -> tuple[list[tuple], list[tuple]]:
    """(training jobs, evaluation jobs); a job is (name, argv, file that exists once it is done,
    checkpoints it reads)."""
    py, out = sys.executable, args.out
    train_jobs, eval_jobs = [], []
    for name, flags in CONFIGS.items():
        steps = math.ceil(args.steps / 8) if name in MATCHED_PROMPTS else args.steps
        for seed in args.seeds:
            run = os.path.join(out, f"{name}-s{seed}")
            argv = [
                py,
                "train.py",
                *flags,
                "--max-steps",
                str(steps),
                "--seed",
                str(seed),
                "--out",
                run,
                "--eval-every",
                str(max(1, steps // 4)),
                "--eval-examples",
                str(args.eval_examples),
                "--samples-every",
                "0",
            ]
            train_jobs.append((f"{name}-s{seed}", argv, os.path.join(run, "final", "trainer_state.pt"), []))
    models = {"base": os.path.join(ROOT, "assets", "tiny-model")}
    models.update({f"{n}-s{s}": os.path.join(out, f"{n}-s{s}", "final") for n in CONFIGS for s in args.seeds})
    ev = [py, "eval.py", "--examples", str(args.eval_examples), "--n", "16", "--seed", "0"]
    evals = os.path.join(out, "evals")
    ends = [models[f"{c}-s{args.seeds[0]}"] for c in VARIANCE]
    dst = os.path.join(evals, "variance.json")
    eval_jobs.append(
        (
            "variance",
            [
                py,
                "experiments/variance.py",
                "--models",
                models["base"],
                *ends,
                "--prompts",
                str(args.variance_prompts),
                "--out",
                dst,
            ],
            dst,
            [models["base"], *ends],
        )
    )
    for key, path in models.items():
        config = key.rsplit("-s", 1)[0]
        if key == "base" or config in PASSK:
            dst = os.path.join(evals, f"{key}.passk.json")
            eval_jobs.append((f"{key}.passk", ev + ["--model", path, "--k", "1,2,4,8,16", "--out", dst], dst, [path]))
        if key == "base" or config in OOD:
            dst = os.path.join(evals, f"{key}.ood.json")
            eval_jobs.append(
                (
                    f"{key}.ood",
                    ev + ["--model", path, "--task", "synthetic-hard", "--k", "1,4,16", "--out", dst],
                    dst,
                    [path],
                )
            )
    return train_jobs, eval_jobs


def run_all(jobs, n_jobs: int, log_dir: str) -> list[str]:
    """Run jobs n_jobs at a time, one thread each; skip finished ones; return the names that failed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n_jobs)))
    todo = [j for j in jobs if not os.path.exists(j[2])]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} already done; running {len(todo)}, {n_jobs} at a time", flush=True)

    def one(job) -> str | None:
        name, argv = job[:2]
        t0 = time.time()
        with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
            rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"{'done' if rc == 0 else 'FAILED'} {name} in {time.time() - t0:.0f} s", flush=True)
        return None if rc == 0 else name

    with ThreadPoolExecutor(n_jobs) as pool:
        return [f for f in pool.map(one, todo) if f]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--quick", action="store_true", help="1 seed x 20 steps, 50 eval prompts (a smoke test of the suite)"
    )
    p.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (each gets cores / jobs threads)"
    )
    p.add_argument("--out", default="", help="run directory (default runs/exp or runs/exp-quick)")
    args = p.parse_args()
    args.steps, args.seeds = (20, [0]) if args.quick else (100, [0, 1, 2])
    args.eval_examples, args.variance_prompts = (50, 16) if args.quick else (200, 64)
    args.out = os.path.abspath(args.out or os.path.join(ROOT, "runs", "exp-quick" if args.quick else "exp"))
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    os.makedirs(os.path.join(args.out, "evals"), exist_ok=True)
    t0 = time.time()
    train_jobs, eval_jobs = plan(args)
    failed = run_all(train_jobs, args.jobs, os.path.join(args.out, "logs"))
    # an evaluation whose checkpoint is missing belongs to a training run that failed (already reported)
    failed += run_all(
        [j for j in eval_jobs if all(os.path.isfile(os.path.join(m, "config.json")) for m in j[3])],
        args.jobs,
        os.path.join(args.out, "logs"),
    )
    print(f"suite: {time.time() - t0:.0f} s", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} job(s) failed: {', '.join(failed)}; logs in {args.out}/logs")
    report = os.path.join(ROOT, "docs", "results") if not args.quick else os.path.join(args.out, "report")
    subprocess.run([sys.executable, "experiments/report.py", "--runs", args.out, "--out", report], cwd=ROOT, check=True)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from cli import user_errors

    with user_errors():  # a bad flag, path or file: one line, exit 2
        main()
