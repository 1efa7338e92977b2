"""experiments/run.py: the papers' claims, side by side on the bundled task, in one command.

    python experiments/run.py             # 3 seeds: about 2.3 hours on 2 CPU cores (times below)
    python experiments/run.py --quick     # 1 seed, a tenth of the steps, 50 eval prompts: under 15 minutes
    python experiments/run.py --jobs 1 --threads 1   # runs at a time, threads each (default: one run per core)

Every run goes through train.py and eval.py flags only; nothing here changes an algorithm.
Runs land in runs/exp/ (runs/exp-quick/ with --quick) as NAME-s<seed>/, evaluations in evals/.
experiments/report.py then writes the tables and plots (docs/results.md links them).

Finished work is skipped, so an interrupted suite continues where it stopped: each job records
what it runs in OUT/jobs/NAME.json when it starts, and is done when that record equals what it
would run now (flags and SUITE) and its output exists, newer than every checkpoint it reads. An
interrupted training run continues from its last step-N checkpoint (train.py --resume); anything
else (no record, another record, no checkpoint) starts again with --overwrite. A finished run
keeps only final/. Bump SUITE when a code change invalidates finished runs.

Claims and the runs that test them (same task, model, lengths and base learning rate throughout):
  GRPO-MA   grpo_t16a1 grpo_t4a1 grpo_ma_t4a4 grpo_ma_t4a8 (TkAm: k thoughts, m answers each),
            plus experiments/variance.py on the start and end policies
  spikes    stress_grpo_t4a1 against stress_grpo_ma_t3a3: 2 prompts per step, temperature 0.5,
            200 steps, where GRPO's gradient norm does spike (GSS@10 0.015, 0.010, 0.020 in 3 probe
            seeds); T3A3 generates as many tokens as T4A1 (36-37k against 35-50k per run in the probes).
            A hostile setting: most steps are all ties (zero gradient), GRPO's greedy accuracy falls to
            about 10%, and a spike is a step where one group carries the whole gradient
  2-GRPO    two_grpo_lr8x (its recipe: prompts x8, lr x8, steps / 8, so the same prompts as
            grpo_t16a1), two_grpo_lr1x (same, base lr), two_grpo_p16 (16 prompts, 100 steps)
  A-GRAE    agrae_t8_a1, agrae_t8_a05 (alpha 1 and 0.5, the paper's two values) against grpo_t8 and
            dr_grpo_t8: 300 steps, groups of 8 (A-GRAE's rollout.n), then pass@1..64 (eval.py --n 64)
  GTPO      gtpo against grpo_t16a1 (re-run: the conflict weights now take the raw advantage's sign),
            then pass@k in distribution and on synthetic-vertical (out of distribution: the same sums in
            column layout, where the start model scores 13.5% greedy; every 4-digit sum scores 0%)
  Hard      select_hardest10, select_random10 (10% of 2000 rated training examples, from eval.py
  Examples  --pass-rates --k 10 on the start model) against grpo_t16a1 (all data), 100 steps each
  noise     dr_grpo (clean) against dr_grpo_noisy (--reward-noise 0.2,0.2), dr_grpo_noisy_corrected
            (--noise-correct 0.2,0.2) and dr_grpo_noisy_lr_scaled (lr x 1/(1 - 0.2 - 0.2)); Dr. GRPO
            because a std normalisation cancels the correction
  DaGRPO    dagrpo_t8 (the reconstruction, --algo dagrpo) against grpo_t8 and dr_grpo_t8: accuracy,
            gradient spikes, pass@1..64
  Losses    one ranking of every method at the 300-step budget of grpo_t8 (16 prompts x 8 rollouts): the
            losses of losses.py (sapo_t8, gmpo_t8, clip_cov_t8, kl_cov_t8, dppo_t8, gpg_t8, dsv32_t8,
            top_entropy20_t8), the rollout-mismatch corrections on a bf16 sampler copy (*_bf16, against
            grpo_t8_bf16 without one and tis_t8_bf16 with today's truncation), grpo_t8_mu2 (the baseline of the
            presets with mu = 2: SAPO, GMPO, KL-Cov, DPPO and V3.2's mask only differ from GRPO off-policy), and
            the methods that had no run at this budget (dapo_t8, gspo_t8, gtpo_t8, grpo_ma_t4a2, two_grpo_p64)
  Stale     stale_k0 and stale_k{1,2,4,8}_{plain_is,clip_rollout,tis,icepop,m2po}: --staleness K with each
            correction (no correction, the clipped ratio against the behaviour policy, TIS, IcePop, M2PO), 30 steps
            of 8 prompts x 8, greedy held-out accuracy only: 63 runs of 150-330 s on a loaded 2-core VM
  MaxRL,    maxrl_t8 and gdpo_t8 join that ranking (GDPO on the task's components, correct and format, weights 1);
  GDPO      grpo_t8_50, maxrl_t8_50 and gdpo_t8_50 are the same three at 50 steps, the budget docs/results.md reports
Left out since the previous round: A-GRAE at 100 steps on GRPO, Dr. GRPO and DAPO, and dapo (the
300-step A-GRAE runs replace them).

Time of the full suite: seconds of one job at one thread, 2 jobs at a time on 2 otherwise idle cores,
measured in the suite's run at commit 4480a95 and in quiet re-runs of single jobs at the final commit
(each with its start-up and in-run evaluations of 200 prompts). Jobs marked * were only timed while
benchmarks shared the cores; their figure is that of the quiet jobs of the same shape:

  | jobs (x 3 seeds)                                                     | each s | jobs | total s |
  |----------------------------------------------------------------------|--------|------|---------|
  | 300 steps, 16 prompts x 8: agrae_t8_a1*, _a05*, grpo_t8, dr_grpo_t8, dagrpo_t8* | 445 | 15 | 6675 |
  | 100 steps, 16 x 16: gtpo*, grpo_t16a1, dr_grpo*, and the 3 noise arms | 250   | 18   | 4500    |
  | 100 steps, 16 x 16 on the selected 10%: select_hardest10, _random10* | 260    | 6    | 1560    |
  | 100 steps: grpo_ma_t4a8 (175), grpo_ma_t4a4 (195), grpo_t4a1 (98)    | 156    | 9    | 1404    |
  | two_grpo_lr8x (92), _lr1x (51) (13 steps), two_grpo_p16 (56, 100 steps) | 66  | 9    | 597     |
  | 200 steps, 2 x 4 or 2 x 3x3: stress_grpo_t4a1, stress_grpo_ma_t3a3   | 56     | 6    | 333     |
  | eval.py: pass rates (2000 x 10), 25 pass@16, 16 pass@64, 13 OOD; variance | 13-56 | 56 | 1160  |
  | all 119 jobs, 2 at a time                                            |        |      | 16229 / 2 = 2.3 h |

The loss ranking's 20 configurations (60 runs of 300 steps, 60 pass@64 evaluations) have not been timed: at
445 s a run (more with mu = 2, which doubles the update, and with a bf16 sampler on the CPU) they add at
least 60 x 445 + 60 x 56 = 30,060 s, about 4.2 h at 2 jobs at a time, to the suite.

A degenerate run costs more: A-GRAE alpha 1 seed 0 collapsed, its completions grew long, and it took
1309 s under load (the others 525-564 s).

--quick (1 seed, a tenth of the steps, 50 eval prompts, 200 rated examples) took 13 min 19 s at
--jobs 1 --threads 1 (about 7 minutes at 2 jobs).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = "16"  # bump when a code change makes finished runs stale (16: GTPO's conflict-weight signs)
RATES = "{rates}"  # stands for the pass-rate file of this suite (OUT/evals/pass_rates.jsonl)
NOISE = ["--algo", "dr_grpo", "--reward-noise", "0.2,0.2"]
STRESS = ["--prompts-per-step", "2", "--temperature", "0.5"]
SELECT = ["--select-fraction", "0.1", "--pass-rates", RATES]
T8 = ["--thoughts", "8"]  # 16 prompts x 8 rollouts, the loss comparisons' budget
BF16 = ["--algo", "grpo", *T8, "--rollout-dtype", "bfloat16"]  # a bf16 sampler copy: pi_sampler != pi_old on a CPU

# name -> (train.py flags, steps of the full suite). Most expensive first, so the last jobs to start are short ones.
CONFIGS = {
    "agrae_t8_a1": (["--algo", "agrae", "--thoughts", "8"], 300),
    "agrae_t8_a05": (["--algo", "agrae", "--thoughts", "8", "--agrae-alpha", "0.5"], 300),
    "grpo_t8": (["--algo", "grpo", "--thoughts", "8"], 300),
    "dr_grpo_t8": (["--algo", "dr_grpo", "--thoughts", "8"], 300),
    "dagrpo_t8": (["--algo", "dagrpo", "--thoughts", "8"], 300),
    # the losses of losses.py, each with its preset (paper or reference-code defaults)
    "sapo_t8": (["--algo", "sapo", *T8], 300),
    "gmpo_t8": (["--algo", "gmpo", *T8], 300),
    "clip_cov_t8": (["--algo", "clip_cov", *T8], 300),
    "kl_cov_t8": (["--algo", "kl_cov", *T8], 300),
    "dppo_t8": (["--algo", "dppo", *T8], 300),
    "gpg_t8": (["--algo", "gpg", *T8], 300),
    "cispo_t8": (["--algo", "cispo", *T8], 300),
    "dsv32_t8": (["--algo", "dsv32", *T8], 300),  # DeepSeek-V3.2: off-policy sequence mask + unbiased KL
    "top_entropy20_t8": (["--algo", "grpo", *T8, "--top-entropy-fraction", "0.2"], 300),
    "grpo_t8_mu2": (["--algo", "grpo", *T8, "--mu", "2"], 300),
    # rollout/trainer mismatch corrections (TRL's modes at its clip_max 3; IcePop [0.5, 5])
    "grpo_t8_bf16": ([*BF16, "--tis-cap", "0"], 300),
    "tis_t8_bf16": (BF16, 300),  # per-token truncation at 2, the trainer's default
    "is_token_mask_t8_bf16": ([*BF16, "--rollout-is", "token_mask", "--tis-cap", "3"], 300),
    "is_seq_truncate_t8_bf16": ([*BF16, "--rollout-is", "sequence_truncate", "--tis-cap", "3"], 300),
    "is_seq_mask_t8_bf16": ([*BF16, "--rollout-is", "sequence_mask", "--tis-cap", "3"], 300),
    "icepop_t8_bf16": ([*BF16, "--rollout-is", "token_mask", "--tis-floor", "0.5", "--tis-cap", "5"], 300),
    # methods with no run at this budget yet: GRPO-MA with 8 answers (4 thoughts x 2), 2-GRPO with 64 x 2 rollouts
    "dapo_t8": (["--algo", "dapo", *T8], 300),
    "gspo_t8": (["--algo", "gspo", *T8], 300),
    "gtpo_t8": (["--algo", "gtpo", *T8], 300),
    "grpo_ma_t4a2": (["--algo", "grpo_ma", "--answers", "2"], 300),
    "two_grpo_p64": (["--algo", "two_grpo", "--prompts-per-step", "64", "--lr", "3e-4"], 300),
    # the estimators the big frameworks ship, at their presets' (references') defaults, and LoRA at two ranks
    "rloo_t8": (["--algo", "rloo", *T8], 300),
    "reinforce_pp_t8": (["--algo", "reinforce_pp", *T8], 300),
    "reinforce_pp_baseline_t8": (["--algo", "reinforce_pp_baseline", *T8], 300),
    "lite_ppo_t8": (["--algo", "lite_ppo", *T8], 300),
    "maxrl_t8": (["--algo", "maxrl", *T8], 300),  # MaxRL: (r - mean) / mean
    "gdpo_t8": (["--algo", "gdpo", *T8], 300),  # GDPO on the task's components: correct and format, weights 1
    # the same three at 50 steps (what docs/results.md reports for MaxRL and GDPO so far)
    "grpo_t8_50": (["--algo", "grpo", *T8], 50),
    "maxrl_t8_50": (["--algo", "maxrl", *T8], 50),
    "gdpo_t8_50": (["--algo", "gdpo", *T8], 50),
    "k2_t8": (["--algo", "grpo", *T8, "--beta", "0.01", "--kl-estimator", "k2"], 300),
    "kl_in_reward_t8": (["--algo", "dr_grpo", *T8, "--beta", "0.01", "--kl-in-reward"], 300),
    "dual_clip_t8": (["--algo", "grpo", *T8, "--mu", "2", "--dual-clip", "3"], 300),
    "entropy_bonus_t8": (["--algo", "grpo", *T8, "--entropy-coef", "0.001"], 300),
    "mask_truncated_t8": (["--algo", "grpo", *T8, "--mask-truncated"], 300),
    # LoRA on every linear layer, alpha = 2 x rank, lr x10 (adapters start at zero and move little at 3e-4)
    "lora_r1_t8": (["--algo", "grpo", *T8, "--lora-rank", "1", "--lora-alpha", "2", "--lr", "3e-3"], 300),
    "lora_r16_t8": (["--algo", "grpo", *T8, "--lora-rank", "16", "--lora-alpha", "32", "--lr", "3e-3"], 300),
    "select_hardest10": (["--algo", "grpo", "--select", "hardest", *SELECT], 100),
    "select_random10": (["--algo", "grpo", "--select", "random", *SELECT], 100),
    "gtpo": (["--algo", "gtpo"], 100),
    "grpo_t16a1": (["--algo", "grpo"], 100),  # GRPO, 16 samples
    "dr_grpo": (["--algo", "dr_grpo"], 100),
    "dr_grpo_noisy": (NOISE, 100),
    "dr_grpo_noisy_corrected": ([*NOISE, "--noise-correct", "0.2,0.2"], 100),
    "dr_grpo_noisy_lr_scaled": ([*NOISE, "--lr", "5e-4"], 100),  # 3e-4 / (1 - 0.2 - 0.2)
    "grpo_ma_t4a8": (["--algo", "grpo_ma", "--answers", "8"], 100),
    "grpo_ma_t4a4": (["--algo", "grpo_ma"], 100),  # GRPO-MA, 4 thoughts x 4 answers
    "grpo_t4a1": (["--algo", "grpo", "--thoughts", "4"], 100),  # GRPO, 4 samples
    "two_grpo_lr8x": (["--algo", "two_grpo"], 13),  # 128 prompts x 2, lr 2.4e-3, ceil(100 / 8) steps
    "two_grpo_lr1x": (["--algo", "two_grpo", "--lr", "3e-4"], 13),  # 128 prompts x 2, lr 3e-4
    "two_grpo_p16": (["--algo", "two_grpo", "--prompts-per-step", "16", "--lr", "3e-4"], 100),  # 16 prompts x 2
    "stress_grpo_t4a1": (["--algo", "grpo", "--thoughts", "4", *STRESS], 200),
    "stress_grpo_ma_t3a3": (["--algo", "grpo_ma", "--thoughts", "3", "--answers", "3", *STRESS], 200),
}
# stale rollouts: each correction at each lag K (--staleness), 30 steps of 8 prompts x 8, greedy held-out accuracy
# only (the budget of --quick's runs on a loaded CPU); K = 0 is on-policy GRPO, the start of every arm
STALE = ["--algo", "grpo", *T8, "--prompts-per-step", "8", "--eval-samples", "0"]
STALE_ARMS = {
    "plain_is": ["--loss", "plain_is", "--is-anchor", "rollout", "--tis-cap", "0"],  # exp(s - b) A, unclipped
    "clip_rollout": ["--is-anchor", "rollout", "--tis-cap", "0"],  # the clipped ratio against the behaviour policy
    "tis": [],  # the decoupled loss: ratio against the proximal policy, times min(exp(o - b), 2)
    "icepop": ["--rollout-is", "token_mask", "--tis-floor", "0.5", "--tis-cap", "5"],
    "m2po": ["--m2po-threshold", "0.04", "--rollout-is", "token_mask", "--tis-cap", "5"],  # AReaL's example
}
STALE_LAGS = (1, 2, 4, 8)
CONFIGS["stale_k0"] = (STALE, 30)
for _k in STALE_LAGS:
    CONFIGS.update({f"stale_k{_k}_{a}": ([*STALE, "--staleness", str(_k), *f], 30) for a, f in STALE_ARMS.items()})
# configurations added for the loss ranking (experiments/report.py ranks every configuration at grpo_t8's budget)
LOSS_RANKING = (
    ("sapo_t8", "gmpo_t8", "clip_cov_t8", "kl_cov_t8", "dppo_t8", "gpg_t8", "dsv32_t8", "top_entropy20_t8")
    + ("cispo_t8", "grpo_t8_mu2", "grpo_t8_bf16", "tis_t8_bf16", "is_token_mask_t8_bf16", "is_seq_truncate_t8_bf16")
    + ("is_seq_mask_t8_bf16", "icepop_t8_bf16", "dapo_t8", "gspo_t8", "gtpo_t8", "grpo_ma_t4a2", "two_grpo_p64")
    + ("rloo_t8", "reinforce_pp_t8", "reinforce_pp_baseline_t8", "lite_ppo_t8", "k2_t8", "kl_in_reward_t8")
    + ("dual_clip_t8", "entropy_bonus_t8", "mask_truncated_t8", "lora_r1_t8", "lora_r16_t8", "maxrl_t8", "gdpo_t8")
)
# evaluations of the end models (eval.py on the same held-out prompts for every checkpoint): kind -> (configs, flags)
EVALS = {
    "passk": (
        ("grpo_t16a1", "gtpo", "dr_grpo", "select_hardest10", "select_random10")
        + ("dr_grpo_noisy", "dr_grpo_noisy_corrected", "dr_grpo_noisy_lr_scaled"),
        ["--n", "16", "--k", "1,2,4,8,16"],
    ),
    "passk64": (
        ("agrae_t8_a1", "agrae_t8_a05", "grpo_t8", "dr_grpo_t8", "dagrpo_t8") + LOSS_RANKING,
        ["--n", "64", "--k", "1,2,4,8,16,32,64"],
    ),
    "ood": (
        ("grpo_t16a1", "gtpo", "select_hardest10", "select_random10"),
        ["--task", "synthetic-vertical", "--n", "16", "--k", "1,4,16"],
    ),
}
VARIANCE = ("grpo_ma_t4a4", "grpo_t16a1")  # end policies for the variance measurement


def steps_of(name: str, quick: bool) -> int:
    flags, steps = CONFIGS[name]
    lag = int(flags[flags.index("--staleness") + 1]) if "--staleness" in flags else 0  # its first K steps only sample
    return max(2 + lag, steps // 10) if quick else steps


def plan(args) -> tuple[list[dict], list[dict], list[dict]]:
    """(preparation, training, evaluation) jobs. A job: name, argv, done (the file that exists once it is
    finished), inputs (checkpoints it reads) and, for training, run (its directory)."""
    py, out = sys.executable, args.out
    evals = os.path.join(out, "evals")
    rates = os.path.join(evals, "pass_rates.jsonl")
    base = os.path.join(ROOT, "assets", "tiny-model")
    ev = [py, "eval.py", "--examples", str(args.eval_examples), "--seed", "0"]
    prep = [
        dict(
            name="pass_rates",
            argv=[py, "eval.py", "--pass-rates", "--k", "10", "--examples", str(args.rated_examples)]
            + ["--model", base, "--out", rates],
            done=rates,
            inputs=[base],
        )
    ]
    train_jobs = []
    for name, (flags, _) in CONFIGS.items():
        steps = steps_of(name, args.quick)
        for seed in args.seeds:
            run = os.path.join(out, f"{name}-s{seed}")
            argv = [py, "train.py", *[rates if f == RATES else f for f in flags]]
            argv += ["--max-steps", str(steps), "--seed", str(seed), "--out", run]
            argv += ["--eval-every", str(max(1, steps // 4)), "--eval-examples", str(args.eval_examples)]
            argv += ["--save-every", str(max(1, steps // 4)), "--samples-every", "0"]
            inputs = [rates] if RATES in flags else []
            done = os.path.join(run, "final", "trainer_state.pt")
            train_jobs.append(dict(name=f"{name}-s{seed}", argv=argv, done=done, inputs=inputs, run=run))
    models = {"base": base}
    models.update({f"{n}-s{s}": os.path.join(out, f"{n}-s{s}", "final") for n in CONFIGS for s in args.seeds})
    ends = [models[f"{c}-s{args.seeds[0]}"] for c in VARIANCE]
    dst = os.path.join(evals, "variance.json")
    argv = [py, "experiments/variance.py", "--models", base, *ends, "--prompts", str(args.variance_prompts)]
    eval_jobs = [dict(name="variance", argv=argv + ["--out", dst], done=dst, inputs=[base, *ends])]
    for kind, (configs, flags) in EVALS.items():
        for key, path in models.items():
            if key == "base" or key.rsplit("-s", 1)[0] in configs:
                dst = os.path.join(evals, f"{key}.{kind}.json")
                argv = ev + flags + ["--model", path, "--out", dst]
                eval_jobs.append(dict(name=f"{key}.{kind}", argv=argv, done=dst, inputs=[path]))
    return prep, train_jobs, eval_jobs


def record_of(job: dict) -> dict:
    """What a job runs, as its OUT/jobs/NAME.json keeps it (with "finished"): the flags, not the interpreter."""
    return {"suite": SUITE, "argv": job["argv"][1:]}


def read_record(job: dict, jobs_dir: str) -> dict:
    path = os.path.join(jobs_dir, job["name"] + ".json")
    return json.load(open(path)) if os.path.isfile(path) else {}


def write_record(job: dict, jobs_dir: str, finished: bool) -> None:
    with open(os.path.join(jobs_dir, job["name"] + ".json"), "w") as f:
        json.dump({**record_of(job), "finished": finished}, f)


def stamp_of(path: str) -> str:
    """The file whose existence and time say that `path` (a file, a run's checkpoint or a model) is written."""
    state = os.path.join(path, "trainer_state.pt")
    if os.path.isfile(state):
        return state
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def is_done(job: dict, jobs_dir: str) -> bool:
    """The job finished with these flags under this SUITE, and its output is newer than what it reads."""
    record = read_record(job, jobs_dir)
    if record != {**record_of(job), "finished": True} or not os.path.isfile(job["done"]):
        return False
    return os.path.getmtime(job["done"]) >= max((os.path.getmtime(stamp_of(p)) for p in job["inputs"]), default=0)


def command(job: dict, jobs_dir: str) -> list[str]:
    """What to run for an unfinished job: a training run continues from its newest checkpoint when it is
    the run this job started (same record), else starts again (--overwrite); an evaluation started with
    other flags starts again (its output removed first: eval.py --pass-rates would refuse the old file)."""
    record = read_record(job, jobs_dir)
    same = {k: record.get(k) for k in ("suite", "argv")} == record_of(job)
    if "run" in job:
        if same and glob.glob(os.path.join(job["run"], "step-*", "trainer_state.pt")):
            argv = [job["argv"][0], "train.py", "--resume", job["run"]]
        else:
            argv = job["argv"] + (["--overwrite"] if os.path.isdir(job["run"]) and os.listdir(job["run"]) else [])
    else:
        if not same and os.path.isfile(job["done"]):
            os.remove(job["done"])
        argv = job["argv"]
    write_record(job, jobs_dir, finished=False)
    return argv


def run_all(jobs: list[dict], args, phase: str) -> list[str]:
    """Run the unfinished jobs args.jobs at a time, args.threads threads each; return the names that failed.
    A finished training run's step-N checkpoints (kept only to resume it) are removed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    log_dir, jobs_dir = os.path.join(args.out, "logs"), os.path.join(args.out, "jobs")
    todo = [j for j in jobs if not is_done(j, jobs_dir)]
    done = len(jobs) - len(todo)
    print(f"{phase}: {done} of {len(jobs)} done; running {len(todo)}, {args.jobs} at a time", flush=True)

    def one(job: dict) -> str | None:
        t0, argv = time.time(), command(job, jobs_dir)
        with open(os.path.join(log_dir, f"{job['name']}.log"), "a") as log:
            rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc == 0:
            write_record(job, jobs_dir, finished=True)
            for ckpt in glob.glob(os.path.join(job["run"], "step-*")) if "run" in job else []:
                shutil.rmtree(ckpt)
        resumed = " (resumed)" if "--resume" in argv else ""
        print(f"{'done' if rc == 0 else 'FAILED'} {job['name']}{resumed} in {time.time() - t0:.0f} s", flush=True)
        return None if rc == 0 else job["name"]

    with ThreadPoolExecutor(args.jobs) as pool:
        return [f for f in pool.map(one, todo) if f]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, and what they imply: seeds, evaluation sizes, threads per job, the output directory."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--quick", action="store_true", help="1 seed, a tenth of the steps, 50 eval prompts (a smoke test of the suite)"
    )
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    p.add_argument("--threads", type=int, default=0, help="threads per run (default: cores / jobs, at least 1)")
    p.add_argument("--out", default="", help="run directory (default runs/exp or runs/exp-quick)")
    p.add_argument(
        "--only", default="", help="comma-separated configurations to run (default: all); report in OUT/report"
    )
    p.add_argument("--seeds", default="", help="comma-separated seeds (default: 0,1,2; --quick: 0)")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.threads < 0:
        raise SystemExit(f"--jobs must be >= 1 and --threads >= 0, got {args.jobs} and {args.threads}")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    args.seeds = [int(s) for s in args.seeds.split(",") if s] or ([0] if args.quick else [0, 1, 2])
    args.only = [n for n in args.only.split(",") if n]
    unknown = [n for n in args.only if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--only: no configuration named {', '.join(unknown)}; see CONFIGS in experiments/run.py")
    args.eval_examples, args.variance_prompts, args.rated_examples = (50, 16, 200) if args.quick else (200, 64, 2000)
    args.out = os.path.abspath(args.out or os.path.join(ROOT, "runs", "exp-quick" if args.quick else "exp"))
    return args


def main() -> None:
    args = parse_args()
    for sub in ("logs", "evals", "jobs"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    t0 = time.time()
    prep, train_jobs, eval_jobs = plan(args)
    if args.only:  # those configurations' runs and evaluations (and the start model's), what they need first
        picked = lambda name: name.split(".")[0].rsplit("-s", 1)[0] in args.only  # noqa: E731
        train_jobs = [j for j in train_jobs if picked(j["name"])]
        kinds = {j["name"].split(".", 1)[1] for j in eval_jobs if picked(j["name"])}  # the start model's of these
        eval_jobs = [j for j in eval_jobs if picked(j["name"]) or j["name"] in {f"base.{k}" for k in kinds}]
        prep = [j for j in prep if any(j["done"] in t["inputs"] for t in train_jobs)]
    failed = run_all(prep, args, "preparation")
    ready = lambda jobs: [j for j in jobs if all(os.path.exists(stamp_of(m)) for m in j["inputs"])]  # noqa: E731
    # a job whose input is missing belongs to a job that failed (already reported)
    failed += run_all(ready(train_jobs), args, "training")
    failed += run_all(ready(eval_jobs), args, "evaluation")
    print(f"suite: {time.time() - t0:.0f} s", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} job(s) failed: {', '.join(failed)}; logs in {args.out}/logs")
    partial = args.quick or args.only or args.seeds != [0, 1, 2]
    report = os.path.join(args.out, "report") if partial else os.path.join(ROOT, "docs", "results")
    subprocess.run([sys.executable, "experiments/report.py", "--runs", args.out, "--out", report], cwd=ROOT, check=True)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from cli import user_errors

    with user_errors():  # a bad flag, path or file: one line, exit 2
        main()
