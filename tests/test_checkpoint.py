"""Runs you can trust: a resume continues the run it names (its flags, model and tokenizer), an
output directory never mixes two runs, logs hold each step once, interrupted and corrupt
checkpoints are handled, and a user's mistakes end in one sentence before any model loads."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import checkpoint
import train
from cli import UserError
from helpers import SMALL_RUN, lock_held_elsewhere
from hf import load_model
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_error_mid_run_leaves_a_checkpoint_that_resumes_bit_for_bit(tmp_path, monkeypatch, capsys):
    """Guards against an unexpected exception losing the run (a RecursionError from a policy's text ended one after
    2 steps with no checkpoint under the default --save-every 0): as for SIGTERM, a checkpoint of the last completed
    step is written first, the last line says so, and resuming from it gives the uninterrupted run bit for bit. An
    error mid-update writes none (its weights may be half-stepped); a user's error stays one sentence."""
    a, b, c, d = (tmp_path / x for x in "abcd")
    run(a, max_steps=3)
    real_score, real_step = train.score, train.optimizer_step

    def fail_at(n, real, error):
        calls = []

        def fails(*args, **kw):
            calls.append(1)
            if len(calls) == n:
                raise error
            return real(*args, **kw)

        return fails

    monkeypatch.setattr(train, "score", fail_at(3, real_score, RecursionError("maximum recursion depth exceeded")))
    with pytest.raises(SystemExit) as e:
        run(b, max_steps=3)
    err = capsys.readouterr().err
    assert e.value.code == 1 and "RecursionError: maximum recursion depth exceeded" in err
    last = f"error: the run stopped on an error in step 3 of 3; {b}/step-2 holds step 2: python train.py --resume {b}"
    assert err.rstrip().splitlines()[-1] == last
    monkeypatch.setattr(train, "score", real_score)
    train.main(resume_config(TrainConfig(resume=str(b)), typed={"resume"}))
    assert steps_logged(b) == [1, 2, 3] == steps_logged(a)
    wa, wb = load_model(str(a / "final")).state_dict(), load_model(str(b / "final")).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    monkeypatch.setattr(train, "optimizer_step", fail_at(2, real_step, RuntimeError("CUDA error: an illegal access")))
    with pytest.raises(SystemExit):
        run(c, max_steps=3)
    assert "during the update, whose weights are not saved: no checkpoint was written" in capsys.readouterr().err
    assert not checkpoint.checkpoint_dirs(str(c))
    monkeypatch.setattr(train, "optimizer_step", real_step)
    monkeypatch.setattr(train, "score", fail_at(2, real_score, ValueError("a reward function refused its input")))
    said = r"^a reward function refused its input; the run stopped on an error in step 2 of 3; .*step-1 holds step 1"
    with pytest.raises(UserError, match=said):
        run(d, max_steps=3)
    assert checkpoint.checkpoint_dirs(str(d)) == [str(d / "step-1")]


@pytest.mark.slow
def test_fresh_run_into_a_used_out_is_refused_unless_overwrite(tmp_path):
    """Guards against a second run into the same --out overwriting the first run's checkpoints and
    interleaving both runs' rows in metrics.jsonl."""
    a = tmp_path / "a"
    run(a)
    with pytest.raises(UserError, match=r"holds files .*--out NEW_DIR .*--resume .*--overwrite"):
        run(a)
    run(a, overwrite=True)
    assert steps_logged(a) == [1, 2]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("x")
    with pytest.raises(UserError, match="does not look like a run directory"):
        run(tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "thesis.tex").exists()


@pytest.mark.slow
def test_stale_temp_directories_are_removed_at_start(tmp_path):
    """Guards against the temporary directories of interrupted saves piling up in --out forever."""
    a = tmp_path / "a"
    run(a, save_every=1)
    for name in ("step-3.tmp", ".step-3.tmp-abc123", ".final.tmp-x"):
        (a / name).mkdir()
    train.main(resume_config(TrainConfig(resume=str(a / "step-1")), typed={"resume"}))
    assert not [d for d in os.listdir(a) if ".tmp" in d]


@pytest.mark.slow
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


@pytest.mark.slow
def test_full_disk_during_a_save_is_one_sentence(tmp_path, monkeypatch):
    """Guards against a full disk surfacing as torch's `enforce fail at inline_container.cc` with
    no path named, and against a half-written checkpoint replacing the previous one."""
    a = tmp_path / "a"

    def full(*args, **kw):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0\nmore lines")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    written = r"could not write the checkpoint .*final \(\[enforce fail.*\); .* free on its file system: free some"
    with pytest.raises(UserError, match=written):
        run(a)
    assert not (a / "final").exists() and not (a / "final.tmp").exists()


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_tracebacks_come_back_with_an_environment_variable(tmp_path):
    """Guards against the one-line errors hiding a traceback a developer needs."""
    r = cli("--resume", "/nonexistent-run", env={"NANORL_TRACEBACK": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


# -----------------------------------------------------------------------------
# Runs that survive their users: two writers, signals, kills at the last evaluation, full disks, damaged files


def argv_of(out, **kw) -> list[str]:
    """train.py flags of the SMALL run into `out` (kw overrides)."""
    flags = {**SMALL, "out": str(out), **kw}
    flag = lambda k, v: [f"--{'' if v else 'no-'}{k}"] if isinstance(v, bool) else [f"--{k}", str(v)]
    return [a for k, v in flags.items() for a in flag(k.replace("_", "-"), v)]


class Output:
    """A subprocess's stderr, read line by line in a thread, so that a test can wait for a line."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(proc.stderr), daemon=True)
        self.thread.start()

    def text(self) -> str:
        self.thread.join(timeout=600)
        return "".join(self.lines)


def wait_for(condition, what: str, timeout: float = 600) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


def start_run(out, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "train.py", *argv_of(out, **kw)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_case1_two_writers_on_one_run_directory_are_refused(tmp_path):
    """Guards against a second train.py (another seed, or --resume of the same run) writing into a run
    directory while the first one runs: checkpoints renamed from under each other, metrics.jsonl mixing
    both runs, config.json and checkpoints disagreeing. The second is refused in one sentence naming the
    process that holds the directory; a killed holder leaves no stale lock."""
    out = tmp_path / "run"
    first = start_run(out, max_steps=50, save_every=1)
    try:
        wait_for(lambda: (out / "step-1" / "trainer_state.pt").is_file(), "the first run's step-1 checkpoint")
        config = (out / "config.json").read_text()
        for argv in (argv_of(out, seed=4), argv_of(out, seed=4, overwrite=True), ["--resume", str(out)]):
            r = cli(*argv)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
            flag = "--resume" if argv[0] == "--resume" else "--out"  # a resume is refused as it looks for a checkpoint
            assert (
                lines[0].startswith(f"error: {flag} {out} is in use by process {first.pid} (")
                and "train.py" in lines[0]
            )
        assert (out / "config.json").read_text() == config and (out / "step-1").is_dir()
    finally:
        first.kill()  # SIGKILL: the kernel releases its lock
        first.wait()
    checkpoint.lock_run_dir(str(out))  # free again
    checkpoint.release_run_dir(str(out))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_case2_a_signal_stops_the_run_at_a_step_boundary_with_a_resumable_checkpoint(tmp_path, sig):
    """Guards against Ctrl-C (SIGINT) or a cluster's preemption (SIGTERM) ending in a 60-line traceback with
    nothing resumable (--save-every 0): the run finishes its step, writes step-N, prints one line with the
    command that resumes it and exits with 128 + the signal; that command continues the run, each step once."""
    out = tmp_path / "run"
    proc = start_run(out, max_steps=50)
    output = Output(proc)
    wait_for(lambda: steps_logged(out) if (out / "metrics.jsonl").exists() else False, "a first step")
    proc.send_signal(sig)
    proc.wait(timeout=600)
    err = output.text()
    assert proc.returncode == 128 + sig and "Traceback" not in err, err[-3000:]
    match = re.search(rf"^stopped at step (\d+) of 50 by {sig.name}; {out}/step-(\d+) holds it: (.*)$", err, re.M)
    assert match and match[1] == match[2] and match[3] == f"python train.py --resume {out}", err[-3000:]
    n = int(match[1])
    assert checkpoint.find_checkpoint(str(out)) == f"{out}/step-{n}" and steps_logged(out) == list(range(1, n + 1))
    if sig == signal.SIGINT:  # the printed command continues the run (here to one more step)
        r = cli("--resume", str(out), "--max-steps", str(n + 1))
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.splitlines()[0].startswith(f"train: --algo grpo, model {BUNDLED}, task synthetic, on cpu, ")
        assert f"; steps {n + 1}-{n + 1}, resuming {out}/step-{n} at step {n}, into {out}; " in r.stdout
        assert steps_logged(out) == list(range(1, n + 2))


@pytest.mark.slow
def test_case2_a_second_ctrl_c_stops_at_once_keeping_the_last_checkpoint(tmp_path):
    """Guards against a second Ctrl-C being ignored (a user must wait for the step) or ending in a traceback:
    it stops the run at once, in one line, and the last complete checkpoint stays resumable."""
    out = tmp_path / "run"
    proc = start_run(out, max_steps=50, save_every=1)
    output = Output(proc)
    wait_for(lambda: (out / "step-1" / "trainer_state.pt").is_file(), "the step-1 checkpoint")
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: any("SIGINT: stopping after this step" in line for line in output.lines), "the first SIGINT")
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=600)
    err = output.text()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    expected = [
        f"stopped at once by a second signal; the last complete checkpoint is intact: python train.py --resume {out}"
    ]
    expected += [
        f"stopped at step {n} of 50 by SIGINT; {out}/step-{n} holds it: python train.py --resume {out}" for n in (2, 3)
    ]
    assert set(err.splitlines()) & set(expected), err[-3000:]  # the second signal may come after the step ended
    load_model(checkpoint.find_checkpoint(str(out)))


def test_case2_a_second_signal_inside_a_generators_close_ends_the_run_at_once():
    """Guards against the race the slow tier met: the second Ctrl-C landed while the loop's progress bar (a
    generator) was being closed as Stopped unwound the loop; the KeyboardInterrupt the handler raised there was
    printed by Python as 'Exception ignored in: <generator ...>' with a traceback, and the run went on winding
    down. The second signal ends the process at once, wherever it lands: one line, status 130."""
    code = """if True:
        import os, signal, time
        from cli import stop_signals
        def bar():
            try:
                yield 1
            finally:  # tqdm's close: where the second signal landed
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)
        with stop_signals("python train.py --resume RUN") as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            for _ in bar():
                break  # the loop left, the generator closed
            time.sleep(2)
            print("not stopped")
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 130 and "Traceback" not in r.stderr and "not stopped" not in r.stdout, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("stopped at once by a second signal")


def test_case2_a_second_signal_while_a_stopped_run_winds_down_ends_it_at_once():
    """Guards against the race CI met: the second Ctrl-C lands after the step's checkpoint, once the loop
    has left the signal block; it must still end the process with status 130 and one line, not with
    Python's default KeyboardInterrupt (killed by SIGINT, status -2)."""
    code = """if True:
        import os, signal, time
        from cli import stop_signals
        with stop_signals("python train.py --resume RUN") as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert stop.signum == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)  # the run is winding down (saving, closing logs)
        time.sleep(5)
        print("not stopped")
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 130 and "Traceback" not in r.stderr and "not stopped" not in r.stdout, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "stopped at once by a second signal; the last complete checkpoint is intact: python train.py --resume RUN"
    )
    # ... and during the interpreter's shutdown, which puts back the default handler: the signal is ignored there,
    # and the stopped run exits with its own status (CI met this one too)
    late = """if True:
        import os, signal, sys, time
        from cli import stop_signals
        class Teardown:  # freed with the module's globals, after the interpreter has reset its signal handlers
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)
        keep = Teardown()
        with stop_signals("python train.py --resume RUN"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        sys.exit(130)  # what cli.Stopped does
    """
    r = subprocess.run([sys.executable, "-c", late], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 130 and "Traceback" not in r.stderr, (r.returncode, r.stderr)


DIE_AT = """
import os, train
from train import TrainConfig
log, save = train.log, train.save
def dying_log(run, row, file="metrics.jsonl"):
    log(run, row, file)
    if {moment!r} == "after the last evaluation row" and "eval/accuracy" in row and row["step"] == run.cfg.max_steps:
        os._exit(9)
def dying_save(run, path):
    if {moment!r} == "before final/ is written" and path.endswith("final"):
        os._exit(9)
    save(run, path)
train.log, train.save = dying_log, dying_save
train.main(TrainConfig(**{config!r}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["after the last evaluation row", "before final/ is written"])
def test_case3_a_kill_at_the_last_evaluation_logs_it_once(tmp_path, moment):
    """Guards against the final evaluation row appearing twice (three times after two kills): a run killed
    after its last evaluation is logged but before final/ is written was resumed from the step-N checkpoint
    saved BEFORE that evaluation, and evaluated again. Every row of a step is now logged before its checkpoint."""
    out = tmp_path / "run"
    script = DIE_AT.format(moment=moment, config={**SMALL, "out": str(out), "save_every": 1})
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 9 and not (out / "final").exists(), r.stderr[-3000:]
    train.main(resume_config(TrainConfig(resume=str(out)), typed={"resume"}))
    evals = [json.loads(line)["step"] for line in open(out / "metrics.jsonl") if "eval/accuracy" in line]
    assert evals == [0, 2] and steps_logged(out) == [1, 2]


@pytest.mark.slow
def test_case4_a_full_disk_is_one_sentence_and_keeps_the_previous_checkpoint(tmp_path):
    """Guards against a full disk while the weights are written ending in safetensors' SafetensorError and a
    traceback (save_checkpoint caught only OSError and RuntimeError): on a 10 MiB tmpfs the second
    checkpoint does not fit; the error is one line naming the checkpoint and the free space, and step-1 stays."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN); the injected errors below still run")
    try:
        out = disk / "run"
        r = cli(*argv_of(out, save_every=1))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert re.fullmatch(
            rf"error: could not write the checkpoint {out}/step-2 \(.*No space left on device.*\); \d+\.\d (KiB|MiB) "
            r"free on its file system: free some space or choose another --out \(the previous checkpoint is intact\)",
            lines[-1],
        ), lines[-1]
        assert checkpoint.find_checkpoint(str(out)) == f"{out}/step-1" and not glob.glob(f"{out}/*tmp*")
        load_model(str(out / "step-1"))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_failed_log_or_config_write_is_one_sentence(tmp_path):
    """Guards against a failed write of a log row or config.json being a bare OSError (a traceback): one sentence
    naming the file and the error; an error without advice of its own (here EISDIR) says to choose another --out
    (the causes with their own advice: test_a_failed_write_gives_the_advice_its_cause_calls_for)."""
    blocked = tmp_path / "metrics.jsonl"
    blocked.mkdir()  # appending to it fails (IsADirectoryError)
    with pytest.raises(UserError) as e:
        checkpoint.append_row(str(blocked), {"step": 1})
    assert str(e.value) == f"could not write {blocked} ([Errno 21] Is a directory: '{blocked}'); choose another --out"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished SMALL run with a checkpoint per step: step-1, step-2 and final (= step 2)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run(out, save_every=1)
    return out


@pytest.mark.parametrize(
    "file, damage",
    [
        ("model.safetensors", "truncated"),
        ("model.safetensors", "deleted"),
        ("config.json", "garbage"),
        ("train_config.json", "garbage"),
        ("tokenizer.json", "truncated"),
        ("trainer_state.pt", "deleted"),
    ],
)
def test_case7_a_damaged_newest_checkpoint_falls_back_whatever_file_is_damaged(finished, tmp_path, file, damage):
    """Guards against a truncated or deleted final/model.safetensors or a garbage final/config.json stopping
    --resume where the intact step-2 was there to continue from, and against a garbage train_config.json
    being reported as trainer_state.pt, twice: one warning, naming the damaged file."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    target = out / "final" / file
    data = target.read_bytes()
    if damage == "deleted":
        target.unlink()
    else:
        target.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checkpoint.find_checkpoint(str(out)) == f"{out}/step-2"
        cfg = resume_config(TrainConfig(resume=str(out)), typed={"resume"})  # looks again, as train.py does
        assert checkpoint.find_checkpoint(cfg.resume) == f"{out}/step-2"
    assert [str(w.message).split(" cannot be read (")[0] for w in caught] == [str(target)]
    assert str(caught[0].message).endswith(f"; resuming from {out}/step-2")


@pytest.mark.slow
def test_case12_a_failed_start_leaves_no_directory_and_the_refusal_fits_what_is_there(tmp_path):
    """Guards against a run that fails at the start (a bad --model, --device cuda without a GPU) leaving an
    empty --out behind, and against the refusal of a used --out suggesting --resume where no checkpoint is."""
    for argv, message in (
        (["--model", str(tmp_path / "no-model")], "no-model: model directory not found."),
        (["--device", "cuda"], "--device cuda was asked for, but torch sees no CUDA device"),
    ):
        if "cuda" in argv and torch.cuda.is_available():
            continue
        r = cli(*argv, "--out", str(tmp_path / "out"))
        assert r.returncode == 2 and r.stderr.strip().endswith(message), r.stderr[-3000:]
        assert not (tmp_path / "out").exists()
    failed = tmp_path / "failed"  # a run that stopped before its first checkpoint
    failed.mkdir()
    (failed / "config.json").write_text("{}")
    (failed / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    with pytest.raises(UserError) as e:
        checkpoint.check_out_dir(str(failed), "", overwrite=False)
    assert str(e.value) == (
        f"--out {failed} holds files (config.json, metrics.jsonl): pass --out NEW_DIR for a new run; its run "
        "stopped before its first save, so there is no checkpoint to resume; or --overwrite"
    )
    (failed / "step-1").mkdir()
    (failed / "step-1" / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(UserError, match=f"for a new run; continue its run with --resume {failed}; or --overwrite"):
        checkpoint.check_out_dir(str(failed), "", overwrite=False)


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_checkpoints_get_the_permissions_the_umask_allows(tmp_path, umask):
    """Guards against checkpoints other users cannot read: a full-weight step-N/ (and lora.py's merged directory)
    was made 0700 by tempfile.mkdtemp, model.safetensors and adapter_model.safetensors 0600 (safetensors' save_file,
    tempfile.mkstemp), and copied tokenizer files kept their source's mode, whatever the umask. Every file and
    directory of a full-weight checkpoint, a LoRA checkpoint and a merged directory gets 0666 / 0777 less the umask."""
    import functools

    import lora

    old = os.umask(umask)
    try:
        model = load_model(BUNDLED)
        (tmp_path / "full").mkdir()
        (tmp_path / "lora").mkdir()  # a run's directory: made (and locked) at its start
        checkpoint.save_checkpoint(str(tmp_path / "full" / "step-1"), model, BUNDLED, {"step": 1}, {})
        lora.add_lora(model, 2, 4.0, ("q", "v"))
        adapters = lora.adapter_tensors(model, BUNDLED)
        write = functools.partial(lora.write_adapters, adapters, lora.adapter_config(model, BUNDLED))
        checkpoint.save_checkpoint(str(tmp_path / "lora" / "final"), model, BUNDLED, {}, {}, write_model=write)
        lora.main(lora.MergeConfig(merge=str(tmp_path / "lora" / "final"), out=str(tmp_path / "merged")))
    finally:
        os.umask(old)
    written = {"full": "model.safetensors", "lora": "adapter_model.safetensors", "merged": "model.safetensors"}
    for top, weights in written.items():
        paths = [tmp_path / top, *(tmp_path / top).rglob("*")]
        assert any(p.name == weights for p in paths) and any(p.name == "tokenizer.json" for p in paths)
        modes = {str(p): oct(p.stat().st_mode & 0o777) for p in paths}
        assert modes == {str(p): oct((0o777 if p.is_dir() else 0o666) & ~umask) for p in paths}


def test_a_run_directory_removed_mid_run_is_said_so(tmp_path, monkeypatch):
    """Guards against a run whose --out was removed (or moved) while it ran being told "68.1 GiB free on its file
    system: free some space", and against a checkpoint then written into a directory made again without the run's
    lock and logs: the next write names the directory that is gone, and nothing makes it again."""
    out = tmp_path / "run"
    passes = []

    def remove_out_at_step_2(*args, **kw):  # between the first and the second step's log rows
        passes.append(1)
        if len(passes) == 2:
            shutil.rmtree(out)
        return real(*args, **kw)

    real = train.score_pass
    monkeypatch.setattr(train, "score_pass", remove_out_at_step_2)
    gone = f"{out} no longer exists (it was removed or moved while the run wrote to it); start the run again, or "
    gone += "continue it with --resume from where it was moved"
    with pytest.raises(UserError) as e:
        run(out)
    assert str(e.value) == f"could not write {out}/metrics.jsonl: {gone}"
    with pytest.raises(UserError) as e:
        checkpoint.save_checkpoint(str(out / "step-2"), load_model(BUNDLED), BUNDLED, {}, {})
    assert str(e.value) == f"could not write the checkpoint {out}/step-2: {gone}" and not out.exists()


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM"])
def test_a_failed_write_gives_the_advice_its_cause_calls_for(tmp_path, monkeypatch, code):
    """Guards against every failed write being advised to "free some space" (a read-only file system, a directory
    without write permission), and against a full disk at the first checkpoint saying "the previous checkpoint is
    intact" when there is none: the advice follows the error's errno, and what is intact is said only when the run
    has a complete checkpoint. The errors are injected: as root, chmod does not stop a write."""
    number = getattr(__import__("errno"), code)
    error = OSError(number, os.strerror(number))

    def fail(*args, **kw):
        raise error

    where = str(tmp_path)
    advice = {
        "EROFS": "its file system is read-only: remount it writable or choose another --out",
        "EACCES": f"this user may not write in {where}: give it write permission or choose another --out",
        "EPERM": f"this user may not write in {where}: give it write permission or choose another --out",
    }.get(code, r"\d+\.\d (MiB|GiB) free on its file system: free some space or choose another --out")
    reason = re.escape(f"[Errno {number}] {os.strerror(number)}")
    model = load_model(BUNDLED)
    for intact in ("", " (the previous checkpoint is intact)"):
        step = f"{where}/step-{2 if intact else 1}"
        with monkeypatch.context() as m, pytest.raises(UserError) as e:
            m.setattr(checkpoint.torch, "save", fail)
            checkpoint.save_checkpoint(step, model, BUNDLED, {}, {})
        said = rf"could not write the checkpoint {step} \({reason}\); {advice}{re.escape(intact)}"
        assert re.fullmatch(said, str(e.value)), str(e.value)
        with monkeypatch.context() as m, pytest.raises(UserError) as e:
            m.setattr(checkpoint, "open", fail, raising=False)
            checkpoint.append_row(f"{where}/metrics.jsonl", {"step": 1})
        kept = intact and " (the checkpoints already written are intact)"
        said = rf"could not write {where}/metrics.jsonl \({reason}\); {advice}{re.escape(kept)}"
        assert re.fullmatch(said, str(e.value)), str(e.value)
        checkpoint.save_checkpoint(f"{where}/step-1", model, BUNDLED, {}, {})  # a complete one for the second pass


def test_resume_of_a_run_being_written_names_its_process(tmp_path):
    """Guards against `--resume OUT` while another process is mid-way through a fresh run into OUT (no checkpoint
    yet) saying "no complete checkpoint found": the run-directory lock is checked first, and its holder named."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    with lock_held_elsewhere(str(out / checkpoint.LOCK)) as holder:
        for how in ("train.py's command line", "train.main"):  # resume_config looks for the checkpoint, then setup
            with pytest.raises(UserError) as e:
                if how == "train.main":
                    run(out, resume=str(out))
                else:
                    resume_config(TrainConfig(resume=str(out)), typed={"resume"})
            assert str(e.value).startswith(f"--resume {out} is in use by process {holder.pid} (")
            assert str(e.value).endswith("); wait for it to end")
    assert sorted(os.listdir(out)) == [".lock", "config.json", "metrics.jsonl"]
    with pytest.raises(UserError, match="no complete checkpoint"):  # once it ends
        checkpoint.find_checkpoint(str(out))


def test_a_completion_longer_than_the_context_is_refused_before_the_memory_check(tmp_path, monkeypatch):
    """Guards against `--max-thought-tokens 10000000 --gradient-checkpointing` being refused by the memory estimate,
    advised to pass --gradient-checkpointing: the completion limit is checked against config.json's
    max_position_embeddings first, before any weights are read and before --out is made."""
    import run as run_py

    monkeypatch.setattr(run_py, "load_model", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(UserError) as e:
        run(tmp_path / "out", max_thought_tokens=10_000_000, gradient_checkpointing=True)
    assert str(e.value) == (
        "--max-thought-tokens + --max-answer-tokens (10000006) leave no room for a prompt in the model's context of "
        "256 tokens"
    )
    assert not (tmp_path / "out").exists()


def test_a_lora_adapter_as_model_says_how_to_use_it(tmp_path):
    """Guards against `train.py --model ADAPTER_DIR` (a LoRA run's final/) saying only "config.json missing": the
    refusal, made where a model's config is read (hf.read_model_config, so every entry point gives it), says it is a
    LoRA adapter directory, how to merge it and how to continue its run; eval.py still loads the adapters."""
    import eval as eval_py
    import lora

    adapters = tmp_path / "lora-run" / "final"
    lora.save_adapters(lora.add_lora(load_model(BUNDLED), 2, 4.0, ("q", "v")), adapters, BUNDLED)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(BUNDLED, name), adapters / name)
    (adapters / checkpoint.STATE).write_bytes(b"")  # a run's checkpoint: its run can be continued
    with pytest.raises(FileNotFoundError) as e:
        run(tmp_path / "out", model=str(adapters))
    assert str(e.value) == (
        f"{adapters} is a LoRA adapter directory (adapter_config.json, no config.json), not a full model: merge it "
        f"with `python lora.py --merge {adapters} --out MERGED` and pass --model MERGED, or continue its run with "
        f"--model {BUNDLED} --lora-rank 2 --resume {adapters.parent}."
    )
    res = eval_py.main(eval_py.EvalConfig(model=str(adapters), examples=2, n=0, max_new_tokens=8))
    assert res["examples"] == 2
