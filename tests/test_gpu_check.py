"""bench/gpu_check.sh, the GPU check, run as CI can: on CPU at the bundled model's size (--cpu)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_every_row_on_cpu():
    """Guards the GPU check rotting between GPU runs (a renamed function, a changed signature, a
    flag train.py no longer takes): every row of its table runs without failing, greedy decoding
    equals transformers', and the static decode step that CUDA graphs capture, eager and traced by torch.compile,
    samples what the eager path does."""
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout[r.stdout.index("\ngpu_check: ") :]
    rows = table.splitlines()[4:]  # after the blank line, the title, the column names and the rule
    checks = ["greedy == transformers.generate", "bf16 rollout logp_gap"]
    for B in (4, 8):
        checks += [f"B={B} sampler eager", f"B={B} sampler static step, ", f"B={B} sampler static step + compile"]
        checks += [f"B={B} transformers.generate", f"B={B} decode step profile"]
    checks += ["greedy vs eager", "GRPO-MA step (train.py)"]
    assert len(rows) == len(checks) and all(row.startswith(c) for row, c in zip(rows, checks)), table
    assert "4/4 rows identical" in table and "FAILED" not in table
    assert table.count("tokens equal to eager in 4/4 rows") == table.count("tokens equal to eager in 8/8 rows") == 2
    assert "static step: 4/4 rows identical; static step + compile (dynamo, eager backend): 4/4 rows identical" in table
    assert "micro-batch rows auto: 64" in table
