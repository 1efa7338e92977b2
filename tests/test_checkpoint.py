"""Runs you can trust: a resume continues the run it names (its flags, model and tokenizer), an
output directory never mixes two runs, logs hold each step once, interrupted and corrupt
checkpoints are handled, and a user's mistakes end in one sentence before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import checkpoint
import train
from cli import UserError
from helpers import SMALL_RUN
from model import load_model
from train import TrainConfig, resume_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "assets", "tiny-model")
SMALL = {"algo": "grpo", **SMALL_RUN}


def run(out, **kw) -> dict:
    return train.main(TrainConfig(**{**SMALL, "out": str(out), **kw}))


def steps_logged(out) -> list[int]:
    return [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl")) if "loss" in line]


def cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})  # fmt: skip


def test_resume_without_model_takes_the_runs_model_and_tokenizer(tmp_path):
    """Guards against --resume without --model silently using the default model's tokenizer,
    reference model and tokenizer files: the run's config is the source of truth."""
    other = tmp_path / "model-copy"
    load_model(BUNDLED)  # the run's model lives elsewhere than the default
    import shutil

    shutil.copytree(BUNDLED, other)
    (other / "tokenizer_config.json").write_text(json.dumps({"marker": "run-model"}))
    a = tmp_path / "a"
    run(a, model=str(other), save_every=1)
    cfg = resume_config(TrainConfig(resume=str(a / "step-1")), typed={"resume"})
    assert cfg.model == str(other) and cfg.out == str(a) and cfg.max_steps == 2 and cfg.algo == "grpo"
    train.main(cfg)
    assert json.loads((a / "final" / "tokenizer_config.json").read_text()) == {"marker": "run-model"}


def test_resume_with_flags_that_change_the_run_is_refused(tmp_path):
    """Guards against a resume silently mixing two configurations (another rollout shape, task or
    learning rate recorded in config.json without effect): each differing flag is named."""
    a = tmp_path / "a"
    run(a, save_every=1)
    for typed, shown in [({"thoughts": 8}, "--thoughts 8 (the run has 4)"), ({"task": "countdown"}, "--task"),
                         ({"lr": 1e-6}, "--lr 1e-06 (the run has 0.0003)")]:  # fmt: skip
        cfg = resume_config(TrainConfig(resume=str(a), **typed), typed={"resume", *typed})
        with pytest.raises(UserError, match="would change what the run computes") as e:
            train.main(cfg)
        assert shown in str(e.value)
    before = (a / "config.json").read_text()
    assert json.loads(before)["thoughts"] == 4  # the refused resumes recorded nothing


def test_resume_extends_a_run_and_logs_each_step_once(tmp_path):
    """Guards against a resume repeating metrics rows (the step-0 eval, and steps replayed after the
    checkpoint) and against a larger --max-steps being refused: the continued run's metrics.jsonl
    holds each step once, equal to an uninterrupted run's, and its weights are equal bit for bit."""
    a, b = tmp_path / "a", tmp_path / "b"
    run(a, max_steps=4)
    run(b, save_every=1, max_steps=4)
    (b / "final").rename(tmp_path / "gone")  # as if killed after step 4's checkpoint... resume from step-3
    import shutil

    shutil.rmtree(b / "step-4")
    cfg = resume_config(TrainConfig(resume=str(b)), typed={"resume"})
    train.main(cfg)
    assert steps_logged(b) == [1, 2, 3, 4] == steps_logged(a)
    evals = [json.loads(line)["step"] for line in open(b / "metrics.jsonl") if "eval/accuracy" in line]
    assert evals == [0, 4]
    wa, wb = load_model(str(a / "final")).state_dict(), load_model(str(b / "final")).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    cfg = resume_config(TrainConfig(resume=str(b), max_steps=6), typed={"resume", "max_steps"})
    train.main(cfg)  # a larger --max-steps extends the run and is recorded
    assert steps_logged(b) == [1, 2, 3, 4, 5, 6] and json.loads((b / "config.json").read_text())["max_steps"] == 6


def test_fresh_run_into_a_used_out_is_refused_unless_overwrite(tmp_path):
    """Guards against a second run into the same --out overwriting the first run's checkpoints and
    interleaving both runs' rows in metrics.jsonl."""
    a = tmp_path / "a"
    run(a)
    with pytest.raises(UserError, match=r"already holds files .*--resume .*--overwrite"):
        run(a)
    run(a, overwrite=True)
    assert steps_logged(a) == [1, 2]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("x")
    with pytest.raises(UserError, match="does not look like a run directory"):
        run(tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "thesis.tex").exists()


def test_stale_temp_directories_are_removed_at_start(tmp_path):
    """Guards against the temporary directories of interrupted saves piling up in --out forever."""
    a = tmp_path / "a"
    run(a, save_every=1)
    for name in ("step-3.tmp", ".step-3.tmp-abc123", ".final.tmp-x"):
        (a / name).mkdir()
    train.main(resume_config(TrainConfig(resume=str(a / "step-1")), typed={"resume"}))
    assert not [d for d in os.listdir(a) if ".tmp" in d]


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    """Guards against a truncated, empty or garbage trainer_state.pt ending in a raw unpickling
    error: the newest one is skipped with a warning naming it; with none left, one sentence."""
    a = tmp_path / "a"
    run(a, save_every=1)
    state = a / "final" / "trainer_state.pt"
    data = state.read_bytes()
    for ckpt in ("final", "step-2"):
        f = a / ckpt / "trainer_state.pt"
        f.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": os.urandom(300)}[damage])
    with pytest.warns(UserWarning, match=r"step-2/trainer_state.pt cannot be read .* resuming from .*step-1"):
        assert checkpoint.find_checkpoint(str(a)).endswith("step-1")
    (a / "step-1" / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(UserError, match=r"step-1/trainer_state.pt cannot be read"):  # the skips: warned once, above
        checkpoint.find_checkpoint(str(a))


def test_full_disk_during_a_save_is_one_sentence(tmp_path, monkeypatch):
    """Guards against a full disk surfacing as torch's `enforce fail at inline_container.cc` with
    no path named, and against a half-written checkpoint replacing the previous one."""
    a = tmp_path / "a"

    def full(*args, **kw):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0\nmore lines")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(UserError, match=r"could not write the checkpoint .*final \(\[enforce fail.*free disk"):
        run(a)
    assert not (a / "final").exists() and not (a / "final.tmp").exists()


def test_no_save_optimizer_checkpoints_are_smaller_and_not_resumable(tmp_path):
    """Guards against --no-save-optimizer checkpoints being resumed with a fresh optimizer (not the
    run they claim to continue), and checks that they drop the optimizer state's bytes."""
    a, b = tmp_path / "a", tmp_path / "b"
    run(a, save_every=1)
    run(b, save_every=1, save_optimizer=False)
    size = lambda d: os.path.getsize(d / "step-1" / "trainer_state.pt")
    assert size(b) < size(a) / 2
    with pytest.raises(UserError, match="saved without its optimizer state"):
        train.main(resume_config(TrainConfig(resume=str(b / "step-1")), typed={"resume"}))


def test_bf16_checkpoints_resume_exactly_from_float32_masters(tmp_path):
    """Guards against --save-dtype bfloat16 making resume inexact: the step checkpoint keeps the
    float32 masters beside its bf16 weights, so the resumed run equals the uninterrupted one."""
    a, b = tmp_path / "a", tmp_path / "b"
    run(a, max_steps=3, save_dtype="bfloat16")
    run(b, max_steps=3, save_dtype="bfloat16", save_every=2)
    assert load_model(str(b / "step-2")).config.torch_dtype == "bfloat16"
    import shutil

    shutil.rmtree(b / "final")
    train.main(resume_config(TrainConfig(resume=str(b / "step-2")), typed={"resume"}))
    sa, sb = (torch.load(d / "final" / "trainer_state.pt", weights_only=False)["master_weights"] for d in (a, b))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "inf"], "--lr must be > 0 and finite"),
        (["--max-steps", "-3"], "--max-steps must be >= 1, got -3"),
        (["--top-p", "0"], "--top-p must be > 0 and finite"),
        (["--top-k", "-1"], "--top-k must be >= 0, got -1"),
        (["--eval-examples", "0"], "--eval-examples must be >= 1, got 0"),
        (["--out", "/proc/nanorl-test"], "--out /proc/nanorl-test: cannot create or write the directory"),
        (["--resume", "/nonexistent-run"], "--resume /nonexistent-run: no such directory"),
        (["--task", "gsm8k", "--data", "tests"], "is a directory, not a data file"),
    ],
)
def test_user_errors_are_one_line_before_any_model_loads(tmp_path, argv, message):
    """Guards against user errors ending in a traceback, naming the wrong flag, or surfacing only
    after the model has loaded (the model path here does not exist: reaching it would say so)."""
    r = cli(*argv, "--model", str(tmp_path / "no-model"), *([] if "--out" in argv else ["--out", str(tmp_path / "o")]))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr[-2000:]


def test_bad_data_file_names_file_and_line_before_the_model_loads(tmp_path):
    """Guards against a non-UTF-8 byte in a data file being a raw UnicodeDecodeError after the
    model has loaded."""
    data = tmp_path / "d.jsonl"
    rows = [json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(20)]
    data.write_bytes(("\n".join(rows[:3]) + "\n").encode() + b'{"question": "caf\xe9"}\n')
    r = cli("--task", "gsm8k", "--data", str(data), "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{data} line 4" in r.stderr and "UTF-8" in r.stderr
    data.write_text("\n".join(rows[:5]) + "\n")  # too small for 16 prompts per step
    r = cli("--task", "gsm8k", "--data", str(data), "--test-data", str(data), "--out", str(tmp_path / "p"))
    assert r.returncode == 2 and "--prompts-per-step 16 needs 16 distinct training examples" in r.stderr


def test_tracebacks_come_back_with_an_environment_variable(tmp_path):
    """Guards against the one-line errors hiding a traceback a developer needs."""
    r = cli("--resume", "/nonexistent-run", env={"NANORL_TRACEBACK": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr
