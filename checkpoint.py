"""checkpoint.py: a run's checkpoints, written atomically and found again.

A checkpoint is a directory in Hugging Face layout (config.json, model.safetensors and the
tokenizer files, loadable by model.load_model and by transformers) plus trainer_state.pt: the
optimizer, the learning-rate schedule, the trainer's own state and the run's config. It is
written to a temporary directory and renamed into place, so a run killed mid-save leaves the
previous checkpoint whole.
"""

from __future__ import annotations

import os
import shutil

import torch

from model import save_model


def save_checkpoint(path: str, model, tokenizer_dir: str, state: dict, weights: dict | None = None) -> None:
    """weights: the full state dict when the model's own parameters are sharded (FSDP)."""
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp, tokenizer_dir=tokenizer_dir, state_dict=weights)
    torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)  # a run killed before this line leaves the previous checkpoint intact


def find_checkpoint(path: str) -> str:
    """`path` itself if it is a complete checkpoint, else its newest complete step-N."""
    if os.path.isfile(os.path.join(path, "trainer_state.pt")):
        return path
    steps = (
        [d for d in os.listdir(path) if d.startswith("step-") and not d.endswith(".tmp")] if os.path.isdir(path) else []
    )
    steps = [d for d in steps if os.path.isfile(os.path.join(path, d, "trainer_state.pt"))]
    if not steps:
        raise SystemExit(f"--resume {path}: no complete checkpoint (a directory with trainer_state.pt) found")
    return os.path.join(path, max(steps, key=lambda d: int(d.split("-")[1])))


def gather_full_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """FSDP: full (unsharded) model and optimizer state dicts, on CPU, on rank 0 (empty on the other
    ranks); the optimizer's is keyed by parameter name. Collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_trainer_state(resume_dir: str, policy, optimizer, scheduler, fsdp: bool) -> dict:
    """Load the optimizer and schedule state of the checkpoint a run continues from (each FSDP rank
    keeps its own shard); returns the trainer state saved with it."""
    saved = torch.load(os.path.join(resume_dir, "trainer_state.pt"), weights_only=False)
    if fsdp != isinstance(saved["optimizer"]["param_groups"][0]["params"][0], str):
        raise SystemExit(
            f"--resume {resume_dir}: its optimizer state was saved {'without' if fsdp else 'with'} "
            f"--fsdp under torchrun; resume it the same way (with --fsdp any world size works)"
        )
    if fsdp:  # full, keyed by parameter name (gather_full_state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(policy, optimizer, saved["optimizer"], options=opts)
    else:
        optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    return saved["trainer"]
