"""Hard Examples (Pikus, Tiwari, Ye, arXiv 2508.14094): train only on the examples the starting model finds
hardest. The wiring of the "choose the data" seam (the rule itself: advantage.select_hard_examples):
- eval.py --pass-rates rates the first N training examples, k samples each, into a resumable file: one settings
  header line {"pass_rates": {...}}, then one row {"index", "prompt", "pass_rate"} per example;
- train.py --select MODE --select-fraction F --pass-rates FILE cuts the task's training split to that fraction
  of the rated examples (choose_data), before the data streams are drawn."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from advantage import SELECTIONS, select_hard_examples
from cli import FlagError, out_of_range
from sampler import generate
from tasks import Task, render_prompt, restrict_train
from tokenizer import decode_completion


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- rollouts
    select: str = ""  # Hard Examples: draw prompts only from the hardest|medium|easiest|random --pass-rates ("" = off)
    select_fraction: float = 0.1  # fraction of the rated examples that --select keeps, in (0, 1] (the paper: 0.1)
    pass_rates: str = ""  # JSONL of the starting model's per-example pass rates (eval.py --pass-rates --out FILE)


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(select_fraction="(0, 1]"))
    if cfg.select not in ("", *SELECTIONS):
        yield FlagError(("select",), f"must be one of {', '.join(SELECTIONS)} or empty (off), got {cfg.select!r}")
    if bool(cfg.select) != bool(cfg.pass_rates):
        yield FlagError(("select", "pass_rates"), "go together", subject="--select and --pass-rates FILE")


def enabled(cfg) -> bool:
    return bool(cfg.select)


def choose_data(task: Task, cfg) -> Task:
    """The task, its training split cut by --select (unchanged without it)."""
    return select_examples(task, cfg.pass_rates, cfg.select, cfg.select_fraction, cfg.seed) if cfg.select else task


PASS_RATE_CHUNK = 16  # prompts sampled together; fixed, so a resumed pass batches (and samples) as an uninterrupted one


def pass_rate_examples(task: Task, n: int) -> list[dict]:
    """The examples a pass-rate file rates: the first n of the training split in its fixed (seed 0) order,
    whatever a run's --seed (task.train is prefix-stable in n), so row index i is example i here and in train.py."""
    return task.train(n, 0)


def read_pass_rates(path: str) -> tuple[dict | None, list[dict]]:
    """(settings header or None, rows sorted by index) of a pass-rate file; a bad line is a ValueError naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such pass-rate file; write one with eval.py --pass-rates --out {path}")
    header, rows = None, []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path} line {line_no}: not valid JSON (an interrupted pass? rerun it)") from None
            if line_no == 1 and isinstance(row, dict) and isinstance(row.get("pass_rates"), dict):
                header = row["pass_rates"]
                continue
            get = row.get if isinstance(row, dict) else {}.get
            rate_ok = type(get("pass_rate")) in (int, float) and 0 <= get("pass_rate") <= 1
            if not (type(get("index")) is int and get("index") >= 0 and isinstance(get("prompt"), str) and rate_ok):
                raise ValueError(f'{path} line {line_no}: expected {{"index": I, "prompt": TEXT, "pass_rate": 0..1}}')
            rows.append(row)
    rows.sort(key=lambda r: r["index"])
    for a, b in zip(rows, rows[1:]):
        if a["index"] == b["index"]:
            raise ValueError(f"{path}: example {a['index']} has two rows; keep one")
    return header, rows


def resume_pass_rates(path: str, settings: dict, examples: list[dict]) -> dict[int, float]:
    """The rates an interrupted pass left in `path` (index -> rate; {} when the file is absent or empty), after
    cutting a torn last line. A file made with other settings, or for other examples, is a ValueError."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return {}
    with open(path, "rb+") as f:  # a pass killed mid-write leaves a line without its newline: drop it
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)
    header, rows = read_pass_rates(path)
    if header != settings:
        old = header or {}
        diff = "; ".join(f"{k} {v!r} here, {old.get(k)!r} in the file" for k, v in settings.items() if old.get(k) != v)
        raise ValueError(
            f"--out {path} holds pass rates made with other settings ({diff}); pass another --out or delete the file"
        )
    for r in rows:
        if r["index"] >= len(examples) or examples[r["index"]]["prompt"] != r["prompt"]:
            raise ValueError(f"--out {path}: row {r['index']} is not this task's training example {r['index']}")
    return {r["index"]: r["pass_rate"] for r in rows}


@torch.no_grad()
def write_pass_rates(
    model, tokenizer, task, examples: list[dict], path: str, settings: dict, done: dict, *, k: int, seed: int = 0, **kw
) -> list[float]:
    """Per example, the fraction of k samples that task.correct accepts, appended to `path` as it goes (after the
    settings header, for a new file); the examples in `done` (resume_pass_rates) are skipped. Example i samples
    with seed + i in its fixed chunk of PASS_RATE_CHUNK, so a resumed pass writes an uninterrupted one's rows.
    kw: sampler.generate's max_new_tokens (required), temperature, top_p, static_step."""
    rates = dict(done)
    bar = tqdm(total=len(examples), initial=len(done), desc="pass rates", dynamic_ncols=True)
    with open(path, "a") as f, bar:
        if f.tell() == 0:
            f.write(json.dumps({"pass_rates": settings}) + "\n")
        for start in range(0, len(examples), PASS_RATE_CHUNK):
            chunk = examples[start : start + PASS_RATE_CHUNK]
            if all(start + j in done for j in range(len(chunk))):
                continue
            prompts = [render_prompt(tokenizer, ex, task.system_prompt) for ex in chunk]
            out = generate(
                model,
                prompts,
                n=k,
                stop_ids=tokenizer.stop_ids,
                seed=[seed + start + j for j in range(len(chunk))],
                **kw,
            )
            for j, ex in enumerate(chunk):
                if start + j not in done:
                    texts = [decode_completion(tokenizer, t) for t in out.tokens[j * k : (j + 1) * k]]
                    rates[start + j] = sum(task.correct(t, ex) for t in texts) / k
                    row = {"index": start + j, "prompt": ex["prompt"], "pass_rate": rates[start + j]}
                    f.write(json.dumps(row) + "\n")
                    bar.update(1)
            f.flush()
    return [rates[i] for i in range(len(examples))]


def select_examples(task: Task, path: str, mode: str, fraction: float, seed: int) -> Task:
    """train.py --select: `task` with its training split cut to the `mode` `fraction` of the examples rated in the
    pass-rate file `path` (advantage.select_hard_examples: ties in index order; random: a draw seeded by `seed`).
    Rows are matched to pass_rate_examples by index and checked by prompt; a mismatch, or an unfinished pass,
    is a ValueError."""
    header, rows = read_pass_rates(path)
    if header is not None and len(rows) < header.get("examples", 0):
        raise ValueError(
            f"--pass-rates {path} rates {len(rows)} of its {header['examples']} examples: the pass was interrupted; "
            "rerun the same eval.py --pass-rates command to finish it"
        )
    if not rows:
        raise ValueError(f"--pass-rates {path} has no rows; write it with python eval.py --pass-rates --out {path}")
    n = rows[-1]["index"] + 1
    if task.n_train is not None and n > task.n_train:
        raise ValueError(
            f"--pass-rates {path} rates example {n - 1} but {task.train_source} has {task.n_train} training "
            "examples; it was made for another task or data file"
        )
    examples = pass_rate_examples(task, n)
    bad = next((r["index"] for r in rows if examples[r["index"]]["prompt"] != r["prompt"]), None)
    if bad is not None:
        raise ValueError(
            f"--pass-rates {path}: row {bad}'s prompt is not training example {bad}'s "
            f"({examples[bad]['prompt'][:40]!r}); it was made for another task or data file"
        )
    rates = torch.tensor([r["pass_rate"] for r in rows], dtype=torch.float64)
    idx = select_hard_examples(rates, fraction, mode=mode, generator=torch.Generator().manual_seed(seed))
    chosen = [examples[rows[i]["index"]] for i in idx.tolist()]
    return restrict_train(task, chosen, f"the --select {mode} {fraction:g} of {path}")
