"""checkpoint.py: a run's checkpoints, written atomically and found again, and its output directory.

A checkpoint is a directory in Hugging Face layout (config.json, model.safetensors and the
tokenizer files, loadable by hf.load_model and by transformers) plus train_config.json (the
run's flags) and trainer_state.pt: the optimizer, the learning-rate schedule, the trainer's own
state and, when the weights are written in a lower precision than the float32 masters, the masters
themselves, so that a resumed run equals the uninterrupted one bit for bit. It is written to a
temporary directory and renamed into place, so a run killed mid-save leaves the previous
checkpoint whole; the temporary directories of killed saves are removed when the run restarts.

One process writes a run: it holds a lock on OUT/.lock (fcntl.flock) for the run's life, which the
kernel releases however the process ends, so a killed run leaves no stale lock; a --resume of a locked
run names the process holding it. A write that fails is one sentence naming the file and the advice
its cause calls for (write_failure). A resume skips a newest checkpoint any file of which is missing
or unreadable, with one warning naming that file. Checkpoints get the permissions the umask allows.
check_replace guards an --out that a write replaces whole (lora.py --merge).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from typing import IO

import torch
from safetensors import SafetensorError, safe_open

from cli import UserError
from hf import copy_tokenizer, plain_permissions, save_model

CONFIG = "train_config.json"  # the run's flags, beside each checkpoint's weights
STATE = "trainer_state.pt"
LOGS = ("metrics.jsonl", "samples.jsonl")  # one JSON row per line, each with a "step"
LOCK = ".lock"  # in --out: locked by the process that writes the run


def save_checkpoint(
    path: str,
    model,
    tokenizer_dir: str,
    state: dict,
    config: dict,
    weights: dict | None = None,
    dtype=None,
    write_model: Callable[[str], None] | None = None,
) -> None:
    """Write a checkpoint at `path`. weights: the full state dict when the model's own parameters are
    sharded (FSDP); dtype: of the written weights (None = the dtype the model was loaded in); write_model: writes
    the model's files into a directory instead (LoRA: the adapters), the tokenizer files are copied beside them."""
    tmp = path.rstrip("/") + ".tmp"
    if not os.path.isdir(os.path.dirname(os.path.abspath(tmp))):  # save_model would make it again, lock-less
        raise UserError(write_failure(path, FileNotFoundError(errno.ENOENT, "missing"), "the checkpoint "))
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        if write_model is None:
            save_model(model, tmp, tokenizer_dir=tokenizer_dir, state_dict=weights, dtype=dtype)
        else:
            os.makedirs(tmp)
            write_model(tmp)
            copy_tokenizer(tokenizer_dir, tmp)
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        torch.save(state, os.path.join(tmp, STATE))
        plain_permissions(tmp)  # the umask's permissions, also for the tokenizer files copied with their source's
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk surfaces as any of them, by writer
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(write_failure(path, e, "the checkpoint ", intact="previous checkpoint is")) from None
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)  # a run killed before this line leaves the previous checkpoint intact


def write_failure(
    path: str, error: BaseException, what: str = "", intact: str = "checkpoints already written are"
) -> str:
    """The sentence for a failed write of `path` (`what` names it, e.g. "the checkpoint "): the reason, the advice its
    cause calls for (a run directory removed or moved meanwhile, a read-only file system, no write permission, a full
    disk: the space left on its file system) and, when the run has a complete checkpoint, that it is intact."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(where):
        return (
            f"could not write {what}{path}: {where} no longer exists (it was removed or moved while the run wrote to "
            f"it); start the run again, or continue it with --resume from where it was moved"
        )
    kept = f" (the {intact} intact)" if has_checkpoint(where) else ""
    code = error.errno if isinstance(error, OSError) and error.errno else None
    found = re.search(r"\(os error (\d+)\)|\[Errno (\d+)\]", str(error))  # safetensors' and torch's errors carry it
    code = code or (int(found.group(1) or found.group(2)) if found else None)
    if code == errno.EROFS:
        advice = "its file system is read-only: remount it writable or choose another --out"
    elif code in (errno.EACCES, errno.EPERM):
        advice = f"this user may not write in {where}: give it write permission or choose another --out"
    elif code in (None, errno.ENOSPC, errno.EDQUOT):  # no code: torch's "unexpected pos", its full-disk error
        advice = f"{free_space(path)} free on its file system: free some space or choose another --out"
    else:
        advice = "choose another --out"
    return f"could not write {what}{path} ({reason}); {advice}{kept}"


def has_checkpoint(out: str) -> bool:
    """Whether the run directory `out` holds a complete checkpoint (a step-N or final with its trainer state)."""
    return any(os.path.isfile(os.path.join(d, STATE)) for d in checkpoint_dirs(out))


def checkpoint_dirs(out: str) -> list[str]:
    """The step-N and final directories in `out`, newest first (final after every step: it is the last)."""
    names = [d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))] if os.path.isdir(out) else []
    names = [d for d in names if d == "final" or (d.startswith("step-") and d[5:].isdigit())]
    return [os.path.join(out, d) for d in sorted(names, key=lambda d: 1 << 62 if d == "final" else int(d[5:]))][::-1]


def free_space(path: str) -> str:
    """The space left on the file system holding `path` (or its nearest existing parent), e.g. "3.2 MiB"."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        free = float(shutil.disk_usage(path).free)
    except OSError:
        return "an unknown amount"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
        free /= 1024
    raise AssertionError("unreachable")


@contextlib.contextmanager
def writing(path: str):
    """Around a write of the run's file `path` (a log row, config.json): an OSError becomes write_failure's sentence."""
    try:
        yield
    except OSError as e:
        raise UserError(write_failure(path, e)) from None


def append_row(path: str, row: dict) -> None:
    """One JSON line appended to the log `path`; a failed write is one sentence (writing)."""
    with writing(path), open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def damaged_file(ckpt: str) -> tuple[str, str] | None:
    """(file, why) for the first file of checkpoint `ckpt` that is missing or cannot be read, else None.
    The JSON files are parsed, each safetensors file's header is checked against the file's length, and
    the trainer state is opened memory-mapped: its structure is read without reading the tensors."""
    weights = sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))) or [os.path.join(ckpt, "model.safetensors")]
    checks = [(os.path.join(ckpt, STATE), lambda f: torch.load(f, mmap=True, weights_only=False)["trainer"]["step"])]
    checks += [(os.path.join(ckpt, CONFIG), lambda f: read_run_config(ckpt))]  # older checkpoints: in the state
    model = "adapter_config.json" if os.path.isfile(os.path.join(ckpt, "adapter_config.json")) else "config.json"
    checks += [(os.path.join(ckpt, name), _read_json_object) for name in (model, "tokenizer.json")]
    checks += [(f, _read_safetensors_header) for f in weights]
    for file, read in checks:
        try:
            if not os.path.isfile(file) and not file.endswith(CONFIG):
                raise FileNotFoundError("missing")
            read(file)
        except Exception as e:  # truncated, empty, garbage: whatever the reader raises
            return file, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'unreadable'}"
    return None


def _read_json_object(file: str) -> None:
    with open(file, encoding="utf-8") as f:
        if not isinstance(json.load(f), dict):
            raise ValueError("not a JSON object")


def _read_safetensors_header(file: str) -> None:
    with safe_open(file, framework="pt") as f:  # checks the header, and that the file holds every tensor's bytes
        f.keys()


_warned: set[str] = set()  # warnings already shown by this process (a resume looks for its checkpoint twice)


def find_checkpoint(path: str) -> str:
    """`path` itself if it is a checkpoint, else its newest intact step-N (or final): a newest checkpoint
    with a missing or unreadable file (damaged_file) is skipped, with one warning naming that file, for
    the previous intact one."""
    if os.path.isfile(os.path.join(path, STATE)):
        candidates = [path]
    elif os.path.isdir(path):
        refuse_if_locked(path, f"--resume {path}")  # a run still being written: its holder, not "no checkpoint"
        candidates = checkpoint_dirs(path)
    else:
        raise UserError(f"--resume {path}: no such directory")
    if not candidates:
        raise UserError(f"--resume {path}: no complete checkpoint (a directory with {STATE}) found")
    for i, ckpt in enumerate(candidates):
        damage = damaged_file(ckpt)
        if damage is None:
            return ckpt
        file, why = damage
        if i + 1 == len(candidates):
            raise UserError(
                f"--resume {path}: {file} cannot be read ({why}) and there is no earlier complete checkpoint"
            )
        message = f"{file} cannot be read ({why}); resuming from {candidates[i + 1]}"
        if message not in _warned:
            _warned.add(message)
            warnings.warn(message, stacklevel=2)
    raise AssertionError("unreachable")


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
    changed = [k for k, v in flags.items() if k not in resumable and v != run[k]]
    diff = [f"--{k.replace('_', '-')} {flags[k]!r} (the run has {run[k]!r})" for k in changed]
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
    --overwrite, and a resumed run writes into the run it continues (or an empty directory).
    The lock file (LOCK) is not a file of a run."""
    entries = sorted(e for e in os.listdir(out) if e != LOCK) if os.path.isdir(out) else []
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} is a file, not a directory")
    own_run = resuming_from and os.path.realpath(os.path.dirname(resuming_from.rstrip("/"))) == os.path.realpath(out)
    if not entries or own_run:
        return
    if not overwrite:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        if resuming_from:
            what = "leave out --out to write into the run"
        elif any(os.path.isfile(os.path.join(out, e, STATE)) for e in entries):
            what = "continue its run with --resume " + out
        else:
            what = "its run stopped before its first save, so there is no checkpoint to resume"
        raise UserError(f"--out {out} holds files ({shown}): pass --out NEW_DIR for a new run; {what}; or --overwrite")
    if not ({"config.json", "metrics.jsonl"} & set(entries)):
        raise UserError(
            f"--overwrite: {out} does not look like a run directory (no config.json or metrics.jsonl); not deleting it"
        )
    for entry in entries:  # the directory itself stays: this process holds its lock file
        path = os.path.join(out, entry)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


RUN_FILES = (*LOGS, CONFIG, STATE, LOCK)  # a directory holding any of them is a run's or a checkpoint


def check_replace(out: str, sources: dict[str, str], overwrite: bool) -> None:
    """Refuse an --out that a write replacing it whole (hf.save_model: lora.py --merge) must not replace: a file; a
    directory that is or holds one of `sources` (what the write reads, e.g. {"adapter directory": path}) or a run,
    even with --overwrite; any other non-empty directory unless --overwrite."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} is a file, not a directory; choose another --out")
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if not entries:
        return
    real = os.path.realpath(out)
    for name, src in [(k, v) for k, v in sources.items() if v]:
        inside = os.path.realpath(src)
        if inside == real or inside.startswith(real.rstrip(os.sep) + os.sep):
            how = f"is the {name} itself" if inside == real else f"holds the {name} {src}"
            raise UserError(f"--out {out} {how}; writing there would delete it: choose another --out")
    for root, _, files in os.walk(out):
        if set(files) & set(RUN_FILES):
            how = "is a training run" if root == out else f"holds a training run ({root})"
            raise UserError(f"--out {out} {how}; writing there would delete it: choose another --out")
    if not overwrite:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UserError(f"--out {out} already holds files ({shown}); choose another --out, or pass --overwrite")


def prepare_out(out: str, step: int) -> None:
    """Check that --out is writable, remove temporary directories of interrupted saves, and, when
    resuming at `step`, drop log rows past it so that each step is logged once (a row cut short by a
    kill or a full disk, the last line, is dropped too)."""
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
                keep = [row for row in map(_parse_row, f) if row is not None and row.get("step", 0) <= step]
            with writing(file + ".tmp"), open(file + ".tmp", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in keep)
            os.replace(file + ".tmp", file)  # atomic: the log is either the old one or the truncated one


def _parse_row(line: str) -> dict | None:
    """A log line's row; None for a blank line or one cut short (only the last line can be: rows are appended)."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def eval_rows(out: str) -> list[dict]:
    """The held-out evaluation rows of the run in `out` (metrics.jsonl), in step order."""
    file = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(file):
        return []
    with open(file) as f:
        rows = [row for row in map(_parse_row, f) if row is not None and "eval/accuracy" in row]
    return sorted(rows, key=lambda r: r["step"])


# -----------------------------------------------------------------------------
# One writer per run: an exclusive lock, released by the kernel when the process ends

_locks: dict[str, IO] = {}  # real path of a locked file -> its open file, held by this process


def hold_lock(path: str, what: str) -> IO:
    """Lock the file `path` (created if missing) for this process: an exclusive fcntl.flock, released
    when the returned file is closed or the process ends, however it ends (kill -9 included), so no
    stale lock survives a crash. Another process holding it is a UserError naming that process; this
    process holding it already (a run started again in one interpreter) takes it over."""
    key = os.path.realpath(path)
    if key in _locks:
        _locks.pop(key).close()
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(f)
            f.close()
            raise UserError(f"{what} is in use by {holder}; wait for it to end, or choose another --out") from None
        except OSError as e:  # a file system without locks: run unguarded rather than not at all
            warnings.warn(f"{path}: cannot lock ({e.strerror or e}); nothing stops a second writer", stacklevel=2)
            break
        try:  # the file may have been removed (and made again) between open and flock: lock the one at `path`
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    _locks[key] = f
    return f


def refuse_if_locked(out: str, what: str) -> None:
    """Refuse, as hold_lock does, when another process holds the lock of the run directory `out` (nothing is made)."""
    file = os.path.join(out, LOCK)
    if os.path.realpath(file) in _locks:  # this process's own run
        return
    try:
        f = open(file)
    except OSError:  # no lock file: no run holds it
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{what} is in use by {lock_holder(f)}; wait for it to end") from None
        except OSError:  # a file system without locks
            return


def lock_holder(f: IO) -> str:
    """The process holding a flock on the open file f, from /proc/locks (Linux): "process PID (command)"."""
    ino = os.fstat(f.fileno()).st_ino
    try:
        with open("/proc/locks") as locks:  # "1: FLOCK  ADVISORY  WRITE 4242 00:2f:1234567 0 EOF"
            found = re.finditer(r"FLOCK\s+\S+\s+WRITE\s+(\d+)\s+\S+:(\d+)\s", locks.read())
            pids = [m.group(1) for m in found if int(m.group(2)) == ino]
        with open(f"/proc/{pids[0]}/cmdline", "rb") as cmd:
            command = cmd.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return "another process"
    return f"process {pids[0]} ({command[:120] + ('...' if len(command) > 120 else '')})"


def lock_run_dir(out: str) -> None:
    """Make --out if needed and lock it for this run: a second train.py on the same --out (or --resume)
    is refused while this one lives. Released by release_run_dir, or at exit, where an --out this
    process made and left empty (a run that failed before writing anything) is removed."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} is a file, not a directory")
    made = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create or write the directory ({e.strerror or e})") from None
    with writing(os.path.join(out, LOCK)):
        hold_lock(os.path.join(out, LOCK), f"--out {out}")
    atexit.register(release_run_dir, out, made)


def release_run_dir(out: str, remove_if_empty: bool = False) -> None:
    """Remove the lock file and release the lock (in that order: a process that opened the file meanwhile
    finds it gone and locks a new one); with remove_if_empty, then remove --out if nothing else is in it."""
    f = _locks.pop(os.path.realpath(os.path.join(out, LOCK)), None)
    if f is None:
        return
    with contextlib.suppress(OSError):
        os.remove(os.path.join(out, LOCK))
    f.close()
    if remove_if_empty:
        with contextlib.suppress(OSError):
            os.rmdir(out)  # only an empty directory


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


def saves_masters(cfg, torch_dtype: str) -> bool:
    """Whether a checkpoint carries the float32 masters: with the optimizer, when its weights are written in less
    (torch_dtype: the model's, what --save-dtype auto writes)."""
    dtype = getattr(torch, torch_dtype if cfg.save_dtype == "auto" else cfg.save_dtype)
    return cfg.save_optimizer and not cfg.lora_rank and dtype != torch.float32


def saved_text(cfg, torch_dtype: str) -> str:
    """The end summary's account of OUT/final: its size on disk and what takes it."""
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(cfg.out, "final")) for f in fs)
    held = ("LoRA adapters" if cfg.lora_rank else "weights") + ", float32 masters" * saves_masters(cfg, torch_dtype)
    held += " and AdamW moments; --no-save-optimizer leaves them out" * cfg.save_optimizer
    return (f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB") + f": {held}"
