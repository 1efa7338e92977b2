"""Shared pytest setup: the repo root on sys.path (so `import model` works however pytest is
started), transformers kept offline and quiet, and a factory fixture for tiny HF checkpoints
(the plain functions live in tests/helpers.py)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture
def hf_checkpoint(tmp_path):
    """hf_checkpoint(family, tied=False, **kw) -> Path of a tiny random HF checkpoint in tmp_path."""
    from helpers import make_hf_checkpoint

    def make(family: str, tied: bool = False, **kw) -> Path:
        return make_hf_checkpoint(tmp_path, family, tied, **kw)

    return make
