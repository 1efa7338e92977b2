"""Evaluation: unbiased pass@k, the held-out report, the CLI and the plots."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from itertools import combinations

import pytest

from eval import decode_completion, evaluate, pass_at_k, plot_runs
from model import load_model, load_tokenizer
from tasks import get_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "assets", "tiny-model")


@pytest.mark.parametrize("n, c, k", [(4, 1, 1), (4, 2, 2), (10, 3, 4), (16, 0, 16), (16, 16, 1), (7, 5, 3)])
def test_pass_at_k_equals_its_definition(n, c, k):
    """Guards against the biased estimator 1-(1-c/n)^k or an off-by-one in the product form: the
    value must equal the probability that a random k-subset of the n samples holds a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    exact = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), exact, rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(pass_at_k(n, c, k), 1 - math.comb(n - c, k) / math.comb(n, k), abs_tol=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    """Guards against silently returning a number for c > n or k > n."""
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(n, c, k)


def test_decode_completion_stops_at_the_first_stop_token():
    """Guards against rewards seeing text after the end-of-turn token (or the token itself)."""
    tok = load_tokenizer(BUNDLED)
    ids = tok.encode("<think>1+2=3\n</think>3") + [tok.stop_ids[0]] + tok.encode("99")
    assert decode_completion(tok, ids) == "<think>1+2=3\n</think>3"


def test_evaluate_reports_consistent_metrics():
    """Guards against greedy/sampled metrics that disagree with the task's own correctness check,
    or pass@k that is not monotone in k."""
    model, tok, task = load_model(BUNDLED), load_tokenizer(BUNDLED), get_task("synthetic")
    examples = task.test(12, 0)
    res = evaluate(model, tok, task, examples, n=4, ks=(1, 2, 4), max_new_tokens=40, seed=3)
    assert res["examples"] == 12 and 0 <= res["greedy_accuracy"] <= 1
    assert math.isclose(res["pass@1"], res["mean@4"], abs_tol=1e-12)  # pass@1 is the mean accuracy
    assert res["pass@1"] <= res["pass@2"] <= res["pass@4"] <= 1
    assert res == evaluate(model, tok, task, examples, n=4, ks=(1, 2, 4), max_new_tokens=40, seed=3)  # seeded


def test_plot_writes_a_png(tmp_path):
    """Guards against the plot command crashing on runs with missing metrics (e.g. kl = null)."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": s, "reward/mean": s / 10, "entropy": 1.0, "grad_norm": 0.5, "len/completion_mean": 20, "kl": None}
        for s in range(1, 5)
    ] + [{"step": 4, "eval/accuracy": 0.5, "eval/mean@4": 0.4}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    out = plot_runs([str(run)], str(tmp_path / "p.png"))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_groups_seeds_and_maps_steps_to_time_and_tokens(tmp_path):
    """Guards against seed runs not being averaged, or eval points landing at the wrong time/tokens."""
    pytest.importorskip("matplotlib")
    from eval import run_label, x_of_step

    assert run_label("runs/exp/grpo_t4a1-s2/") == "grpo_t4a1" and run_label("runs/my-s0x") == "my-s0x"
    rows = [{"step": 0, "eval/accuracy": 0.1}]
    rows += [{"step": s, "loss": 0.0, "time/step_s": 0.5 * s, "tokens/generated": 100} for s in (1, 2, 3)]
    rows += [{"step": 3, "eval/accuracy": 0.4}]
    assert x_of_step(rows, "time") == {0: 0.0, 1: 0.5, 2: 1.5, 3: 3.0}
    assert x_of_step(rows, "tokens") == {0: 0.0, 1: 100.0, 2: 200.0, 3: 300.0}
    assert x_of_step(rows, "step") == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}
    runs = []
    for seed in (0, 1):
        run = tmp_path / f"cfg-s{seed}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
        runs.append(str(run))
    out = plot_runs(runs, str(tmp_path / "t.png"), x="time", keys=["eval/accuracy"])
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="--x must be one of"):
        plot_runs(runs, str(tmp_path / "u.png"), x="wall")


def test_cli_prints_a_table_and_writes_json(tmp_path):
    """Guards against the documented `eval.py --model ... --n --k --out` command breaking."""
    out = tmp_path / "r.json"
    r = subprocess.run(
        [sys.executable, "eval.py", "--model", BUNDLED, "--examples", "8", "--n", "2", "--k", "1,2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "greedy_accuracy" in r.stdout and "pass@2" in r.stdout
    assert json.loads(out.read_text())["results"]["examples"] == 8
