"""Shared pytest setup: the repo root on sys.path (so `import model` works however pytest is
started), transformers kept offline and quiet, a factory fixture for tiny HF checkpoints (the plain
functions live in tests/helpers.py), the math checker's two paths (`checker`), and a check that the code
sandbox leaves nothing on the host."""

import os
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(params=["built-in", "math-verify"])
def checker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each math test runs twice: with the built-in checker alone and with math-verify (skipped without it)."""
    if request.param == "built-in":
        monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    else:
        pytest.importorskip("math_verify")
    return request.param


@pytest.fixture(scope="session", autouse=True)
def no_sandbox_residue():
    """Guards against code run in the sandbox leaving anything on the host once its run is over: keys or
    keyrings of a sandbox uid (the kernel keeps them), System V objects, processes, temp dirs, mounts
    (tests/residue.py lists them). Checked over the whole session, after every test that ran code."""
    from residue import new_residue, residue

    before = residue()
    yield
    left = new_residue(before)
    assert not left, f"the code sandbox left these on the host: {sorted(left)}"


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module (pytestmark = pytest.mark.usefixtures("one_thread")): tiny models gain
    nothing from a second thread, OpenMP's spinning threads on a shared 2-core machine can make runs 10x slower,
    and a multi-threaded CPU sum may add in a run-dependent order where a test needs bit equality."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
