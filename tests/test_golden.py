"""Golden runs: a few fixed steps of three presets on the bundled model, whose per-step reward,
loss and grad_norm, evaluation accuracy and final-weight checksum are pinned in
tests/golden/golden_runs.json. Any change that moves one of these numbers fails here; a change
that means to move them regenerates the file in the same commit and says why:

    python tests/test_golden.py --update

The runs are subprocesses with one thread (OMP_NUM_THREADS=1): with two threads a multi-threaded
CPU kernel may sum in a run-dependent order and change the last bits, and a golden file must be
bit-stable. The numbers are kept per machine kind: the torch version, the CPU capability torch
dispatches on, the CPU vendor (its BLAS picks other kernels on AMD and Intel) and the vector
extensions it has. A machine kind with no entry is compared with an entry made without vendor and
extensions if one matches its torch and capability, and skipped otherwise, never compared loosely.
`--update` writes this machine's entry and drops the others, which it cannot regenerate.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import machine

pytestmark = pytest.mark.slow  # whole training runs: the slow tier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "golden_runs.json")
COMMON = [
    "--max-steps",
    "3",
    "--eval-every",
    "0",
    "--eval-examples",
    "16",
    "--eval-samples",
    "2",
    "--samples-every",
    "0",
]
RUNS = {  # the default preset (GRPO-MA tree), the gated path (GTPO), the resampling path (DAPO)
    "grpo_ma": [],
    "gtpo": ["--algo", "gtpo", "--prompts-per-step", "8"],
    "dapo": ["--algo", "dapo", "--prompts-per-step", "8"],
}
STEP_KEYS = ("reward/mean", "loss", "grad_norm", "resampled")
EVAL_KEYS = ("eval/greedy_accuracy", "eval/mean@2", "eval/len_mean")


def golden_entry(golden: dict, here: dict) -> dict | None:
    """This machine's entry: the exact kind, else one made without vendor and extensions on the same torch and
    capability (None: no entry can be compared here)."""
    coarse = {k: here[k] for k in ("torch", "cpu")}
    exact = [e for e in golden["machines"] if e["machine"] == here]
    legacy = [e for e in golden["machines"] if e["machine"] == coarse]
    return (exact or legacy or [None])[0]


def weight_checksum(path: str) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(load_file(os.path.join(path, "model.safetensors")).items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def golden_run(name: str, out: str) -> dict:
    """Run one configuration through the command line and return the numbers the golden file pins."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *COMMON, *RUNS[name], "--out", out]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    return {
        "steps": [{k: r[k] for k in STEP_KEYS} for r in steps],
        "evals": [{"step": r["step"], **{k: r[k] for k in EVAL_KEYS}} for r in evals],
        "weights_sha256": weight_checksum(os.path.join(out, "final")),
    }


def load_golden() -> dict:
    with open(GOLDEN) as f:
        return json.load(f)


@pytest.mark.parametrize("name", list(RUNS))
def test_golden_run(name, tmp_path):
    """Guards against a change (a refactor, a reordered reduction, a new default) silently altering
    what a run computes: per-step reward, loss, grad_norm, eval accuracy and final weights, bit for bit."""
    golden, here = load_golden(), machine()
    entry = golden_entry(golden, here)
    if entry is None:
        made_on = [e["machine"] for e in golden["machines"]]
        pytest.skip(f"golden numbers made on {made_on}, this is {here}: regenerate to compare here")
    got = golden_run(name, str(tmp_path / name))
    want = entry["runs"][name]
    assert got["steps"] == want["steps"], f"{name}: per-step numbers moved"
    assert got["evals"] == want["evals"], f"{name}: evaluation moved"
    assert got["weights_sha256"] == want["weights_sha256"], f"{name}: final weights moved"


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] not in (["--update"], ["--add"]):
        raise SystemExit(
            "usage: python tests/test_golden.py --update   (numbers meant to move: this machine's entry only)\n"
            "       python tests/test_golden.py --add      (same code, a new machine kind: beside the others)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: golden_run(name, os.path.join(tmp, name)) for name in RUNS}
    here = machine()
    others = [e for e in load_golden()["machines"] if e["machine"] != here] if sys.argv[1] == "--add" else []
    with open(GOLDEN, "w") as f:
        entries = [*others, {"machine": here, "runs": runs}]
        json.dump({"command": COMMON, "configs": RUNS, "machines": entries}, f, indent=1)
        f.write("\n")
    print(f"wrote {GOLDEN}")


def test_two_processes_at_two_threads_are_bitwise_equal(tmp_path):
    """Guards against a run-dependent reduction order: two identical runs in separate processes with
    2 threads each used to end 1e-8 apart (the backward of x[index] with repeated indices, a shared
    prompt's keys/values gathered by its K rows, sums with racy atomic adds on a multi-threaded CPU;
    pack.py gathers with index_select, whose backward sums in a fixed order)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    sums = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--max-steps", "3", "--eval-every", "0",
               "--eval-examples", "8", "--eval-samples", "0", "--samples-every", "0", "--out", out]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        sums.append(weight_checksum(os.path.join(out, "final")))
    assert sums[0] == sums[1]
