"""grpo_minimal.py, the reader's one-file GRPO: that it computes train.py's numbers, that it stays out of the
framework, and that its generated tour (docs/tour.md, `make tour`) is current."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re

import pytest
import torch

import grpo_minimal
import train
from config import TrainConfig
from helpers import BUNDLED, machine, make_hybrid_run_checkpoint
from hf import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, P, K, THOUGHT, ANSWER = 3, 4, 4, 32, 16  # the minimal file's one limit is train.py's two added


def digit_share(text: str, example: dict) -> float:
    """A reward a random model earns unevenly: the share of digits in its completion."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


@pytest.mark.parametrize("beta, model", [(0.0, "bundled"), (0.04, "bundled"), (0.0, "hybrid")])
def test_grpo_minimal_computes_train_py_grpo_bit_for_bit(tmp_path, one_thread, beta, model, monkeypatch):
    """Guards the claim at the top of grpo_minimal.py: STEPS steps of it and of `train.py --algo grpo
    --no-share-prompt --lr-schedule constant --warmup-steps 0` (same seed, prompts, group size and completion limit)
    give equal losses, mean rewards and gradient norms at every step and equal final weights, to the bit, with the
    KL penalty off and on. A change to either trainer that moves a number (the sampler call, the seeds, the data
    order, the advantage, the row layout, the loss's operation order, the optimizer) fails here.

    The flags are the minimal file's simplifications: plain padded rows prompt | completion (train.py's default
    runs each prompt once and lets its K rows attend to it: the same gradient to rounding, not to the bit) and a
    constant learning rate. One micro-batch holds the step (64 rows >= P*K). Bit equality needs one more thing,
    which grpo_minimal.make_rows says: its rows run shortest first, the order of train.py's micro-batches
    (pack.split_rows); in another order the weights differ by ~1e-6 after three steps. The same on a Qwen3.5
    hybrid (its DeltaNet layers under the same right-padded rows)."""
    if model == "hybrid":  # random weights earn no synthetic reward: both trainers score digits instead
        import run
        from tasks import get_task

        task = dataclasses.replace(get_task("synthetic"), reward=digit_share)
        for module in (run, grpo_minimal):
            monkeypatch.setattr(module, "get_task", lambda *a, **k: task)
    model = BUNDLED if model == "bundled" else make_hybrid_run_checkpoint(tmp_path)
    out = str(tmp_path / "train")
    cfg = TrainConfig(
        algo="grpo",
        model=model,
        out=out,
        max_steps=STEPS,
        prompts_per_step=P,
        thoughts=K,
        answers=1,
        max_thought_tokens=THOUGHT,
        max_answer_tokens=ANSWER,
        beta=beta,
        share_prompt=False,
        lr_schedule="constant",
        warmup_steps=0,
        eval_every=0,
        eval_examples=1,
        eval_samples=1,
        samples_every=0,
    )
    train.main(cfg)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    kw = dict(max_steps=STEPS, prompts_per_step=P, group_size=K, max_new_tokens=THOUGHT + ANSWER, beta=beta)
    log, policy = grpo_minimal.main(grpo_minimal.Config(model=model, **kw))

    assert [r["reward/mean"] for r in rows] == [m["reward"] for m in log]
    assert [r["loss"] for r in rows] == [m["loss"] for m in log]
    assert [r["grad_norm"] for r in rows] == [m["grad_norm"] for m in log]
    final, mine = load_model(os.path.join(out, "final")).state_dict(), policy.state_dict()
    start = load_model(model).state_dict()
    assert any(not torch.equal(start[k], final[k]) for k in final)  # the steps did move the weights
    assert final.keys() == mine.keys()
    unequal = [k for k in final if not torch.equal(final[k], mine[k])]
    assert not unequal, f"final weights differ in {unequal[:3]} ... (max {max_diff(final, mine):.2e})"


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_grpo_minimal_imports_nothing_of_the_framework():
    """Guards the minimal file's promise to readers: plain GRPO on the project's model, sampler, tokenizer, tasks
    and rewards, without methods/, pack.py's rows, run.py's setup, checkpoints or the distributed layer (a
    reader would have to open them to follow one step), and within its ~300-line budget, as long as the README says."""
    source = open(os.path.join(ROOT, "grpo_minimal.py")).read()
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    assert not found & {"methods", "pack", "run", "checkpoint", "distributed", "train", "config", "advantage"}
    assert not found & {"losses", "metrics"}
    assert len(source.splitlines()) <= 300
    readme = open(os.path.join(ROOT, "README.md")).read()  # it said 237 lines of a 238-line file
    assert f"one file of {len(source.splitlines())} lines" in readme


def test_tour_is_current(one_thread):
    """Guards docs/tour.md against going stale: regenerated from one step of grpo_minimal.py (and the GRPO-MA
    tree), it must equal the committed file, so a change to the step's numbers or to a quoted line of code shows
    up here. The tour's numbers are those of this machine kind's CPU kernels (one thread); see docs/tour.py."""
    spec = importlib.util.spec_from_file_location("tour", os.path.join(ROOT, "docs", "tour.py"))
    tour = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tour)
    fresh = tour.tour()
    committed = open(os.path.join(ROOT, "docs", "tour.md")).read()
    made_on = json.loads(re.search(r"<!-- numbers from: (.*) -->", committed).group(1))
    if made_on != machine():  # other CPU kernels round differently: the quoted code must still be current
        quotes = re.compile(r"([^\n]*)\n\n```python\n(.*?)```", re.S)  # where each line of code is, and the line
        assert quotes.findall(fresh) == quotes.findall(committed), "docs/tour.md is stale: run `make tour`"
        return
    assert fresh == committed, "docs/tour.md is stale: run `make tour` and commit it"
