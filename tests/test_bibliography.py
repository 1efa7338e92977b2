"""The bibliography's three ideas wired into the trainer: hard-example selection from a pass-rate file
(Hard Examples), injected reward noise and its correction (noise-corrected GRPO), DaGRPO's pair mask over a
task's partial credit (a reconstruction; its anchors are tested in test_anchors.py). Partial credit has exact
hand values, the pass-rate file resumes to the same rows, selection picks the right examples, zero noise
changes nothing, and every bad flag is one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

import train
from helpers import SMALL_RUN
from hf import load_model
from methods.hard_examples import read_pass_rates, resume_pass_rates, select_examples, write_pass_rates
from rewards import calculator_partial_credit
from tasks import get_task, sft_completion, synthetic_partial_credit
from tokenizer import load_tokenizer
from train import PRESETS, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "assets", "tiny-model")  # trained: its samples are both right and wrong
SMALL = {**SMALL_RUN, "samples_every": 0}
SMALL_ARGV = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
ADDITION = {"prompt": "357+68", "answer": "425", "a": 357, "b": 68}  # reference: 7+8=15, 5+6+1=12, 3+0+1=4 -> 425
GSM8K = {
    "prompt": "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?",
    "answer": "72",
    "solution": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72 clips.\n#### 72",
}


def rows_of(out: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def write_rates(path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


# ---------------------------------------------------------------- partial credit (DaGRPO's score)


@pytest.mark.parametrize(
    "completion, credit",
    [
        (sft_completion(ADDITION), 1.0),  # the reference itself
        ("<think>7+8=15\n5+6=11\n3+0+1=4\n</think>415", 4 / 6),  # lines 1 and 3, digits 4 and 5
        ("<think>7+8=15\n5+6+1=12\n3+0+1=4\n9+9=18\n</think>1425", 6 / 8),  # an extra line and digit count against
        ("</think>425", 3 / 6),  # the answer alone: no scratchpad lines
        ("425", 0.0),  # no </think>: no answer, and "425" is not a scratchpad line
        ("", 0.0),
    ],
)
def test_synthetic_partial_credit_exact_values(completion, credit):
    """Guards against a partial credit that misaligns lines or digits (left- instead of right-aligned answers),
    ignores extra lines, or gives the reference less than 1."""
    assert synthetic_partial_credit(completion, ADDITION) == pytest.approx(credit, abs=1e-12)


@pytest.mark.parametrize(
    "completion, credit",
    [
        ("\\boxed{72}", 1.0),  # correct: full credit whatever the work shown
        ("<think>48/2 = 24, then 24+48=70</think>\\boxed{70}", 0.5),  # 24 of {24, 72}
        ("<think>half of 48 is 24 and 24 + 48 is 72</think>\\boxed{71}", 1.0),  # every result, a wrong answer
        ("<think>1,000 things</think>\\boxed{5}", 0.0),
        ("no idea", 0.0),
    ],
)
def test_calculator_partial_credit_exact_values(completion, credit):
    """Guards against GSM8K partial credit that misreads the <<a=b>> annotations, counts the expressions'
    operands instead of their results, or fails to give a correct answer full credit."""
    assert calculator_partial_credit(completion, GSM8K) == credit


def test_partial_credit_without_annotations_is_the_reward():
    """Guards against a MATH-style reference (no calculator annotations) giving credit the reward would not."""
    example = {"prompt": "1+1?", "answer": "2", "solution": "It is \\boxed{2}"}
    assert calculator_partial_credit("\\boxed{2}", example) == 1.0
    assert calculator_partial_credit("2 is close to \\boxed{3}", example) == 0.0


def test_tasks_expose_partial_credit(tmp_path):
    """Guards against the trainer's --pair-delta silently falling back to the reward on tasks that have a
    partial credit (synthetic, gsm8k), or crashing on one that has none (countdown falls back)."""
    assert get_task("synthetic").partial_credit is synthetic_partial_credit
    assert get_task("synthetic-hard").partial_credit is synthetic_partial_credit
    assert get_task("countdown").partial_credit is None
    data = tmp_path / "gsm8k.jsonl"
    row = {"question": GSM8K["prompt"], "answer": GSM8K["solution"]}
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(10)))
    assert get_task("gsm8k", str(data)).partial_credit is calculator_partial_credit


# ---------------------------------------------------------------- hard-example selection


def test_select_fraction_one_keeps_every_rated_example(tmp_path):
    """Guards against --select-fraction 1 dropping (or duplicating) an example of the rated pool."""
    examples = get_task("synthetic").train(10, 0)
    path = write_rates(tmp_path / "r.jsonl", [{"index": i, "prompt": e["prompt"], "pass_rate": i / 10}
                                              for i, e in enumerate(examples)])  # fmt: skip
    for mode in ("hardest", "medium", "easiest", "random"):
        task = select_examples(get_task("synthetic"), path, mode, 1.0, seed=0)
        assert task.n_train == 10
        assert sorted(e["prompt"] for e in task.train(10, 3)) == sorted(e["prompt"] for e in examples)


def test_selection_picks_the_right_examples_from_a_hand_written_file(tmp_path):
    """Guards against selection by file order instead of pass rate, matching rows to the wrong examples,
    a selected stream that leaks unselected examples, or a mismatched file being accepted."""
    examples = get_task("synthetic").train(6, 0)
    rates = [0.9, 0.0, 0.5, 0.1, 1.0, 0.3]
    rows = [{"index": i, "prompt": e["prompt"], "pass_rate": r} for i, (e, r) in enumerate(zip(examples, rates))]
    path = write_rates(tmp_path / "r.jsonl", rows[::-1])  # any row order: rows are matched by index
    hardest = select_examples(get_task("synthetic"), path, "hardest", 0.5, seed=0)
    assert {e["prompt"] for e in hardest.train(30, 1)} == {examples[i]["prompt"] for i in (1, 3, 5)}
    easiest = select_examples(get_task("synthetic"), path, "easiest", 1 / 3, seed=0)
    assert {e["prompt"] for e in easiest.train(8, 1)} == {examples[i]["prompt"] for i in (4, 0)}
    rows[2]["prompt"] = "1+1"
    with pytest.raises(ValueError, match="not training example 2"):
        select_examples(get_task("synthetic"), write_rates(tmp_path / "bad.jsonl", rows), "hardest", 0.5, seed=0)
    header = {"pass_rates": {"examples": 8}}
    with pytest.raises(ValueError, match="interrupted"):
        select_examples(get_task("synthetic"), write_rates(tmp_path / "cut.jsonl", [header] + rows), "hardest", 0.5, 0)


def test_pass_rate_file_resumes_to_the_same_rows(tmp_path):
    """Guards against an interrupted pass that, rerun, duplicates rows, loses a torn line's example, writes
    different rates than an uninterrupted pass (other batching or seeds), or resumes a file of other settings."""
    model, tokenizer, task = load_model(BUNDLED), load_tokenizer(BUNDLED), get_task("synthetic")
    examples = get_task("synthetic").train(20, 0)
    settings = {"k": 3, "examples": 20}
    kw = dict(k=3, max_new_tokens=18, seed=0)
    path = str(tmp_path / "rates.jsonl")
    assert resume_pass_rates(path, settings, examples) == {}  # a new file
    full = write_pass_rates(model, tokenizer, task, examples, path, settings, {}, **kw)
    whole = open(path).read()
    lines = whole.splitlines(keepends=True)
    with open(path, "w") as f:  # header + 6 rows (mid-chunk) + half of the next row, as a kill mid-write leaves it
        f.write("".join(lines[:7]) + lines[7][:9])
    done = resume_pass_rates(path, settings, examples)
    assert sorted(done) == list(range(6))
    again = write_pass_rates(model, tokenizer, task, examples, path, settings, done, **kw)
    assert again == full and open(path).read() == whole
    header, rows = read_pass_rates(path)
    assert header == settings and [r["index"] for r in rows] == list(range(20))
    with pytest.raises(ValueError, match="other settings"):
        resume_pass_rates(path, {**settings, "k": 4}, examples)


@pytest.mark.slow
def test_eval_pass_rates_command_writes_a_file_train_reads(tmp_path):
    """Guards against `eval.py --pass-rates` writing a file that `train.py --select` cannot read, or rating
    held-out instead of training examples."""
    out = str(tmp_path / "rates.jsonl")
    cmd = [sys.executable, "eval.py", "--pass-rates", "--k", "2", "--examples", "8", "--max-new-tokens", "18",
           "--out", out]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    header, rows = read_pass_rates(out)
    assert header["k"] == 2
    assert [row["prompt"] for row in rows] == [e["prompt"] for e in get_task("synthetic").train(8, 0)]
    assert all(row["pass_rate"] in (0.0, 0.5, 1.0) for row in rows)
    task = select_examples(get_task("synthetic"), out, "hardest", 0.25, seed=0)
    assert task.n_train == 2


# ---------------------------------------------------------------- the trainer


@pytest.mark.slow
def test_zero_reward_noise_is_the_identity_in_a_train_step(tmp_path):
    """Guards against --reward-noise 0,0 changing anything (a flip drawn whatever the rates must never fire at 0),
    and against the noise being applied to the wrong tensor (correctness must stay the task's own)."""
    train.main(TrainConfig(**SMALL, out=str(tmp_path / "clean")))
    train.main(TrainConfig(**SMALL, out=str(tmp_path / "zero"), reward_noise="0,0"))
    clean, zero = rows_of(str(tmp_path / "clean")), rows_of(str(tmp_path / "zero"))
    keys = ("reward/mean", "accuracy", "loss", "grad_norm", "eval/accuracy")
    assert [[r.get(k) for k in keys] for r in clean] == [[r.get(k) for k in keys] for r in zero]


@pytest.mark.slow
def test_reward_noise_flips_rewards_but_not_correctness(tmp_path):
    """Guards against flips that leak into the task's correctness (accuracy must be unchanged) or are not
    seeded from the rollout seed (two identical runs must agree)."""
    one_step = {**SMALL, "max_steps": 1}
    train.main(TrainConfig(**one_step, out=str(tmp_path / "clean")))
    for name in ("a", "b"):
        train.main(TrainConfig(**one_step, out=str(tmp_path / name), reward_noise="0.4,0.4"))
    clean, a, b = (rows_of(str(tmp_path / n))[1] for n in ("clean", "a", "b"))
    assert a == {**a, "accuracy": clean["accuracy"]} and a["reward/mean"] != clean["reward/mean"]
    assert {k: v for k, v in a.items() if not k.startswith(("time", "tokens_per", "mem/"))} == {
        k: v for k, v in b.items() if not k.startswith(("time", "tokens_per", "mem/"))
    }


@pytest.mark.slow
def test_dagrpo_preset_runs(tmp_path):
    """Guards against the dagrpo preset losing Dr. GRPO's settings, its anchors, or crashing on the pair mask
    and the anchors (at SMALL's 18-token limit these steps' references do not fit: skipped and counted)."""
    cfg = TrainConfig(**SMALL, out=str(tmp_path / "run"), **PRESETS["dagrpo"])
    assert (cfg.std_normalize, cfg.aggregation, cfg.pair_delta) == (False, "seq_mean_token_sum_norm", 0.1)
    assert (cfg.anchors, cfg.anchor_gamma) == (True, 0.1)
    train.main(cfg)
    steps = [r for r in rows_of(cfg.out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [(r["anchors"], r["anchors/too_long"] > 0) for r in steps] == [(0, True), (0, True)]


@pytest.mark.slow
def test_noise_correct_auto_runs_and_logs_its_rates(tmp_path):
    """Guards against --noise-correct auto crashing on the calibration sample or not logging the fitted rates."""
    out = str(tmp_path / "run")
    train.main(TrainConfig(**SMALL, out=out, reward_noise="0.2,0.2", noise_correct="auto", std_normalize=False))
    steps = [r for r in rows_of(out) if "loss" in r]
    assert len(steps) == 2 and 0 <= steps[0]["noise/rho_plus"] < 0.5 and 0 <= steps[0]["noise/rho_minus"] < 0.5
    assert steps[0]["noise/rho_plus"] == steps[1]["noise/rho_plus"]  # fit once


@pytest.mark.slow
def test_select_hardest_trains_only_on_selected_prompts(tmp_path):
    """Guards against --select drawing prompts from outside the selected fraction of the rated pool."""
    examples = get_task("synthetic").train(8, 0)
    rows = [{"index": i, "prompt": e["prompt"], "pass_rate": (i % 4) / 4} for i, e in enumerate(examples)]
    rates = write_rates(tmp_path / "r.jsonl", rows)
    cfg = TrainConfig(**SMALL, out=str(tmp_path / "run"), select="hardest", select_fraction=0.5, pass_rates=rates)
    pool = train.setup(cfg).pool
    assert len(pool) == 8 and {e["prompt"] for e in pool} == {examples[i]["prompt"] for i in (0, 1, 4, 5)}
    train.main(dataclasses.replace(cfg, overwrite=True))
    assert len([r for r in rows_of(cfg.out) if "loss" in r]) == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--select-fraction", "0"], "--select-fraction must be in (0, 1]"),
        (["--select-fraction", "1.5"], "--select-fraction must be in (0, 1]"),
        (["--select", "hard", "--pass-rates", "r.jsonl"], "--select must be one of"),
        (["--select", "hardest"], "--select and --pass-rates FILE go together"),
        (["--pass-rates", "r.jsonl"], "--select and --pass-rates FILE go together"),
        (["--select", "hardest", "--pass-rates", "missing.jsonl"], "no such pass-rate file"),
        (["--reward-noise", "0.6,0.5"], "RHO_PLUS + RHO_MINUS below 1"),
        (["--reward-noise", "0.2"], "--reward-noise must be RHO_PLUS,RHO_MINUS"),
        (["--reward-noise", "auto"], "--reward-noise must be RHO_PLUS,RHO_MINUS"),
        (["--noise-correct", "0.1,0.1"], "--noise-correct needs --no-std-normalize"),
        (["--noise-correct", "auto"], "--noise-correct needs --no-std-normalize"),
        (["--noise-correct", "1,0", "--no-std-normalize"], "each flip rate must be in [0, 1)"),
        (["--pair-delta", "-0.5"], "--pair-delta must be >= 0"),
        (["--pair-delta", "nan"], "--pair-delta must be >= 0"),
        (["--pair-delta", "0.1", "--answers", "2"], "--pair-delta needs --answers 1"),
        (["--algo", "dagrpo", "--advantage", "agrae"], "--algo dagrpo sets --pair-delta, which needs --advantage grpo"),
    ],
)
def test_bad_flags_are_one_sentence(tmp_path, argv, message):
    """Guards against a bad value of a new flag ending in a traceback, or being accepted."""
    argv = [a if a != "r.jsonl" else str(tmp_path / a) for a in argv]
    cmd = [sys.executable, "train.py", *SMALL_ARGV, "--out", str(tmp_path / "run"), *argv]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error:" in r.stderr and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_mismatched_rates_file_is_one_sentence(tmp_path):
    """Guards against a pass-rate file made for another task being used (or crashing) at train time."""
    rates = write_rates(tmp_path / "r.jsonl", [{"index": 0, "prompt": "not a prompt", "pass_rate": 0.0}])
    cmd = [sys.executable, "train.py", *SMALL_ARGV, "--out", str(tmp_path / "run"), "--select", "hardest",
           "--select-fraction", "1", "--pass-rates", rates]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "not training example 0" in r.stderr


def test_selection_changes_no_default_number():
    """Guards against the new flags' defaults changing a default run: all off, and the config unchanged."""
    cfg = TrainConfig()
    assert (cfg.select, cfg.pass_rates, cfg.reward_noise, cfg.noise_correct, cfg.pair_delta) == ("", "", "", "", -1.0)
    assert cfg.anchors is False
    assert dataclasses.replace(cfg) == cfg
