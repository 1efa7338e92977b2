"""The claims suite (experiments/run.py): every job's flags parse, and an interrupted suite skips
finished jobs, resumes interrupted runs and redoes stale ones. No training runs here."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import pytest

from cli import parse_config
from eval import EvalConfig
from train import PRESETS, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("suite_run", os.path.join(ROOT, "experiments", "run.py"))
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)


def suite_args(out, quick: bool = False) -> argparse.Namespace:
    return suite.parse_args(["--out", str(out), "--jobs", "1"] + (["--quick"] if quick else []))


@pytest.mark.parametrize("quick", [False, True])
def test_every_job_parses_as_its_script_would(tmp_path, quick):
    """A renamed or mistyped flag in CONFIGS or EVALS would fail hours into the suite: parse them all now."""
    prep, train_jobs, eval_jobs = suite.plan(suite_args(tmp_path, quick))
    seeds = 1 if quick else 3
    assert len(train_jobs) == len(suite.CONFIGS) * seeds
    for job in train_jobs:
        assert job["argv"][1] == "train.py" and suite.RATES not in job["argv"]  # the pass-rate file is filled in
        cfg, _ = parse_config(TrainConfig, job["argv"][2:], presets=PRESETS, preset_field="algo")
        name = job["name"].rsplit("-s", 1)[0]
        assert cfg.max_steps == suite.steps_of(name, quick) and cfg.out == job["run"]
    for job in prep + eval_jobs:
        if job["argv"][1] == "eval.py":
            parse_config(EvalConfig, job["argv"][2:])
    # each evaluation names configurations that exist, and every seed's end model is evaluated
    for configs, _ in suite.EVALS.values():
        assert set(configs) <= set(suite.CONFIGS)
    assert set(suite.VARIANCE) <= set(suite.CONFIGS)
    passk64 = [j for j in eval_jobs if j["name"].endswith(".passk64") and not j["name"].startswith("base")]
    assert len(passk64) == len(suite.EVALS["passk64"][0]) * seeds


def fake_job(tmp_path, name: str, text: str = "x") -> dict:
    done = tmp_path / f"{name}.out"
    argv = [sys.executable, "-c", f"open({str(done)!r}, 'w').write({text!r})"]
    return dict(name=name, argv=argv, done=str(done), inputs=[])


def test_finished_jobs_are_skipped_and_changed_ones_rerun(tmp_path):
    args = suite_args(tmp_path)
    for sub in ("logs", "jobs"):
        os.makedirs(tmp_path / sub)
    jobs_dir = str(tmp_path / "jobs")
    a, b = fake_job(tmp_path, "a"), fake_job(tmp_path, "b")
    assert suite.run_all([a, b], args, "test") == []
    assert suite.is_done(a, jobs_dir) and suite.is_done(b, jobs_dir)
    stamp = os.path.getmtime(a["done"])
    assert suite.run_all([a, b], args, "test") == []  # nothing to do: nothing is run again
    assert os.path.getmtime(a["done"]) == stamp
    # other flags: the record no longer matches, so the job is stale (and its old output removed first)
    a2 = fake_job(tmp_path, "a", text="y")
    assert not suite.is_done(a2, jobs_dir)
    assert suite.run_all([a2, b], args, "test") == []
    assert open(a2["done"]).read() == "y" and suite.is_done(a2, jobs_dir)
    # an input newer than the output (a re-trained model) makes the evaluation stale
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    c = dict(fake_job(tmp_path, "c"), inputs=[str(model)])
    suite.run_all([c], args, "test")
    assert suite.is_done(c, jobs_dir)
    later = os.path.getmtime(c["done"]) + 10
    os.utime(model / "config.json", (later, later))
    assert not suite.is_done(c, jobs_dir)
    # a job that fails is reported, and not recorded as finished
    bad = dict(fake_job(tmp_path, "bad"), argv=[sys.executable, "-c", "raise SystemExit(3)"])
    assert suite.run_all([bad], args, "test") == ["bad"]
    assert json.load(open(tmp_path / "jobs" / "bad.json"))["finished"] is False


def test_an_interrupted_run_resumes_and_a_stale_one_starts_again(tmp_path):
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    run = tmp_path / "r-s0"
    job = dict(name="r-s0", argv=[sys.executable, "train.py", "--max-steps", "4", "--out", str(run)],
               done=str(run / "final" / "trainer_state.pt"), inputs=[], run=str(run))  # fmt: skip
    assert suite.command(job, str(jobs_dir)) == job["argv"]  # never started: a fresh run
    (run / "step-2").mkdir(parents=True)
    (run / "step-2" / "trainer_state.pt").write_bytes(b"")
    # started with these flags and interrupted: train.py --resume from its newest checkpoint
    assert suite.command(job, str(jobs_dir)) == [sys.executable, "train.py", "--resume", str(run)]
    assert not suite.is_done(job, str(jobs_dir))
    # the suite's flags changed since: the old run's directory is overwritten, not resumed
    changed = dict(job, argv=job["argv"][:3] + ["5"] + job["argv"][4:])
    assert suite.command(changed, str(jobs_dir)) == changed["argv"] + ["--overwrite"]


report_spec = importlib.util.spec_from_file_location("suite_report", os.path.join(ROOT, "experiments", "report.py"))
report = importlib.util.module_from_spec(report_spec)
report_spec.loader.exec_module(report)


def fake_run(runs, name: str, seed: int, greedy: float, steps: int = 300, thoughts: int = 8, evaluated: float = -1):
    """A finished run as report.py reads it: config.json, metrics.jsonl, final/, and optionally its pass@64 eval."""
    run = runs / f"{name}-s{seed}"
    (run / "final").mkdir(parents=True)
    (run / "final" / "trainer_state.pt").write_bytes(b"")
    cfg = {"max_steps": steps, "prompts_per_step": 16, "thoughts": thoughts, "answers": 1}
    (run / "config.json").write_text(json.dumps(cfg))
    train = {
        "loss": 0.1,
        "grad_norm": 1.0,
        "time/step_s": 2.0,
        "tokens/generated": 1000,
        "gss10_frac": 0.0,
        "gss": 1.0,
        "entropy": 0.5,
        "reward/mean": 0.5,
        "accuracy": 0.5,
        "frac_zero_std_groups": 0.2,
    }
    evals = {"eval/accuracy": greedy, "eval/greedy_accuracy": greedy, "eval/mean@4": greedy}
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [evals, train, train, evals]) + "\n")
    if evaluated >= 0:
        (runs / "evals").mkdir(exist_ok=True)
        res = {"greedy_accuracy": evaluated, **{f"pass@{k}": evaluated for k in report.KS64}}
        (runs / "evals" / f"{name}-s{seed}.passk64.json").write_text(json.dumps({"results": res}))


def test_ranking_orders_every_configuration_at_the_reference_budget(tmp_path):
    """The loss ranking: only configurations at grpo_t8's budget, best eval.py greedy accuracy first (those without
    the evaluation last), mean +- sd over seeds, and it says it is a toy-scale ranking."""
    for seed, (a, b) in enumerate([(0.70, 0.60), (0.74, 0.64)]):
        fake_run(tmp_path, "grpo_t8", seed, greedy=0.9, evaluated=a)  # the in-run figure must not decide the order
        fake_run(tmp_path, "sapo_t8", seed, greedy=0.1, evaluated=b + 0.2)
        fake_run(tmp_path, "gpg_t8", seed, greedy=0.5)  # no pass@64 evaluation yet
        fake_run(tmp_path, "grpo_t16a1", seed, greedy=0.99, steps=100, thoughts=16, evaluated=0.99)  # another budget
    names = ["grpo_t8", "sapo_t8", "gpg_t8", "grpo_t16a1"]
    S = {n: [report.summarise(r) for r in report.seeds_of(str(tmp_path), n)] for n in names}
    text = report.ranking(str(tmp_path), S)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("| 1", "sapo_t8"), ("| 2", "grpo_t8"), ("| 3", "gpg_t8")]
    assert rows[0][3] == "82.0 ± 2.8" and rows[1][3] == "72.0 ± 2.8" and rows[2][3] == "-"
    assert "300 steps of 128 rollouts" in text and "TOY-SCALE ranking" in text
    assert report.ranking(str(tmp_path), {n: S[n] for n in names if n != "grpo_t8"}) == ""
