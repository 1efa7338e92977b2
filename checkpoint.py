"""checkpoint.py: a run's checkpoints, written atomically and found again, and its output directory.

A checkpoint is a directory in Hugging Face layout (config.json, model.safetensors and the
tokenizer files, loadable by hf.load_model and by transformers) plus train_config.json (the
run's flags) and trainer_state.pt: the optimizer, the learning-rate schedule, the trainer's own
state and, when the weights are written in a lower precision than the float32 masters, the masters
themselves, so that a resumed run equals the uninterrupted one bit for bit. It is written to a
temporary directory and renamed into place, so a run killed mid-save leaves the previous
checkpoint whole; the temporary directories of killed saves are removed when the run restarts.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings

import torch

from cli import UserError
from hf import save_model

CONFIG = "train_config.json"  # the run's flags, beside each checkpoint's weights
STATE = "trainer_state.pt"
LOGS = ("metrics.jsonl", "samples.jsonl")  # one JSON row per line, each with a "step"


def save_checkpoint(
    path: str, model, tokenizer_dir: str, state: dict, config: dict, weights: dict | None = None, dtype=None
) -> None:  # fmt: skip
    """Write a checkpoint at `path`. weights: the full state dict when the model's own parameters are
    sharded (FSDP); dtype: of the written weights (None = the dtype the model was loaded in)."""
    tmp = path.rstrip("/") + ".tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(model, tmp, tokenizer_dir=tokenizer_dir, state_dict=weights, dtype=dtype)
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        torch.save(state, os.path.join(tmp, STATE))
    except (OSError, RuntimeError) as e:  # a full disk surfaces as either, depending on the writer
        shutil.rmtree(tmp, ignore_errors=True)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not write the checkpoint {path} ({reason}); free disk space or choose another "
                        f"--out (the previous checkpoint is intact)") from None  # fmt: skip
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)  # a run killed before this line leaves the previous checkpoint intact


def _readable(ckpt: str) -> str:
    """'' if the checkpoint's trainer state and config can be read, else why not. The state is
    opened memory-mapped: its structure is checked without reading the tensors."""
    try:
        torch.load(os.path.join(ckpt, STATE), mmap=True, weights_only=False)
        read_run_config(ckpt)
        return ""
    except Exception as e:  # truncated, empty, garbage: whatever the unpickler or zip reader raises
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'unreadable'}"


def find_checkpoint(path: str) -> str:
    """`path` itself if it is a checkpoint, else its newest readable step-N (or final): an unreadable
    newest checkpoint is skipped with a warning naming it, for the previous complete one."""
    if os.path.isfile(os.path.join(path, STATE)):
        candidates = [path]
    elif os.path.isdir(path):
        names = [d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, STATE))]
        names = [d for d in names if d == "final" or (d.startswith("step-") and d[5:].isdigit())]
        candidates = [os.path.join(path, d) for d in sorted(names, key=_step_of, reverse=True)]
    else:
        raise UserError(f"--resume {path}: no such directory")
    if not candidates:
        raise UserError(f"--resume {path}: no complete checkpoint (a directory with {STATE}) found")
    for i, ckpt in enumerate(candidates):
        why = _readable(ckpt)
        if not why:
            return ckpt
        if i + 1 == len(candidates):
            raise UserError(
                f"--resume {path}: {os.path.join(ckpt, STATE)} cannot be read ({why}) and there is "
                f"no earlier complete checkpoint"
            )
        warnings.warn(
            f"{os.path.join(ckpt, STATE)} cannot be read ({why}); resuming from {candidates[i + 1]}", stacklevel=2
        )
    raise AssertionError("unreachable")


def _step_of(name: str) -> int:
    """Order of checkpoint directories: step-N by N; final after every step (it is the last)."""
    return 1 << 62 if name == "final" else int(name[5:])


def read_run_config(ckpt: str) -> dict:
    """The run's flags saved with a checkpoint (train_config.json; older checkpoints: trainer_state.pt)."""
    file = os.path.join(ckpt, CONFIG)
    if os.path.isfile(file):
        with open(file) as f:
            config = json.load(f)
    else:
        config = torch.load(os.path.join(ckpt, STATE), mmap=True, weights_only=False).get("config")
    if not isinstance(config, dict):
        raise UserError(f"{file}: not a run configuration (a JSON object of flags)")
    return config


def run_flags(ckpt: str, defaults: dict) -> dict:
    """The flags of the run a checkpoint belongs to, as a full config: its saved flags (those the
    code still has), and today's defaults for flags added since it was saved."""
    saved = read_run_config(ckpt)
    return {k: saved.get(k, v) for k, v in defaults.items()}


def resume_flags(flags: dict, typed: set[str], defaults: dict) -> dict:
    """The flags of a resumed run: those of the run that flags["resume"] names, with only the ones
    typed on the command line replaced, and --out, unless typed, the run's own directory."""
    ckpt = find_checkpoint(flags["resume"])
    values = {**run_flags(ckpt, defaults), **{k: flags[k] for k in typed}}
    values.update(resume=flags["resume"], out=flags["out"] if "out" in typed else os.path.dirname(ckpt.rstrip("/")))
    return values


def check_resume(flags: dict, ckpt: str, defaults: dict, resumable: tuple[str, ...]) -> None:
    """Refuse a resume whose flags differ from the run's in anything that changes what it computes."""
    run = run_flags(ckpt, defaults)
    diff = [f"--{k.replace('_', '-')} {v!r} (the run has {run[k]!r})" for k, v in flags.items()
            if k not in resumable and v != run[k]]  # fmt: skip
    if diff:
        raise UserError(
            f"--resume {ckpt}: {'; '.join(diff)}: these flags would change what the run computes; "
            f"drop them to continue the run, or start a new run in another --out"
        )


def read_trainer_step(ckpt: str) -> int:
    """The step a checkpoint was saved at (its trainer state, opened memory-mapped)."""
    return int(torch.load(os.path.join(ckpt, STATE), mmap=True, weights_only=False)["trainer"]["step"])


def check_out_dir(out: str, resuming_from: str, overwrite: bool) -> None:
    """Refuse to mix runs in one directory: a fresh run needs an empty (or new) --out unless
    --overwrite, and a resumed run writes into the run it continues (or an empty directory)."""
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} is a file, not a directory")
    own_run = resuming_from and os.path.realpath(os.path.dirname(resuming_from.rstrip("/"))) == os.path.realpath(out)
    if not entries or own_run:
        return
    if not overwrite:
        what = "continue it with --resume " + out if not resuming_from else "leave out --out to write into the run"
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UserError(f"--out {out} already holds files ({shown}); {what}, or pass --overwrite to replace them")
    if not ({"config.json", "metrics.jsonl"} & set(entries)):
        raise UserError(
            f"--overwrite: {out} does not look like a run directory (no config.json or metrics.jsonl); not deleting it"
        )
    shutil.rmtree(out)


def prepare_out(out: str, step: int) -> None:
    """Create --out (checking that it is writable), remove temporary directories of interrupted saves,
    and, when resuming at `step`, drop log rows past it so that each step is logged once."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create or write the directory ({e.strerror or e})") from None
    for tmp in glob.glob(os.path.join(out, "*.tmp")) + glob.glob(os.path.join(out, ".*.tmp-*")):
        shutil.rmtree(tmp, ignore_errors=True)
    for name in LOGS:
        file = os.path.join(out, name)
        if step and os.path.isfile(file):
            with open(file) as f:
                keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
            with open(file + ".tmp", "w") as f:
                f.writelines(keep)
            os.replace(file + ".tmp", file)  # atomic: the log is either the old one or the truncated one


def load_trainer_state(resume_dir: str, policy, optimizer, scheduler, fsdp: bool) -> dict:
    """Load the optimizer, schedule and (if saved) float32 master weights of the checkpoint a run
    continues from (each FSDP rank keeps its own shard); returns the trainer state saved with it."""
    saved = torch.load(os.path.join(resume_dir, STATE), weights_only=False)
    if saved.get("optimizer") is None:
        raise UserError(
            f"--resume {resume_dir}: saved without its optimizer state (--no-save-optimizer), so it "
            f"cannot be continued exactly; use it as --model to start a new run from its weights"
        )
    if fsdp != isinstance(saved["optimizer"]["param_groups"][0]["params"][0], str):
        raise UserError(
            f"--resume {resume_dir}: its optimizer state was saved {'without' if fsdp else 'with'} "
            f"--fsdp under torchrun; resume it the same way (with --fsdp any world size works)"
        )
    if fsdp:  # full, keyed by parameter name (gather_full_state)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        if saved.get("master_weights") is not None:
            set_model_state_dict(policy, saved["master_weights"], options=opts)
        set_optimizer_state_dict(policy, optimizer, saved["optimizer"], options=opts)
    else:
        if saved.get("master_weights") is not None:
            policy.load_state_dict(saved["master_weights"])
        optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    return saved["trainer"]
