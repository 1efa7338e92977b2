"""Teachers in the loop: the pieces on-policy distillation (methods/opd.py) and self-distillation (methods/rlsd.py,
methods/sdpo.py) share. A teacher is a model scored on the step's completion tokens, one more no-grad forward of the
score pass (methods.scores), its log-probs (B, T) in the batch's logical layout (batch.teacher_logp):
  - `--teacher PATH`: a frozen checkpoint sharing the student's tokenizer, loaded once in the rollout dtype and
    never trained, scored on the very rows the policy trains on (packed GRPO-MA rows, shared prompts, tool turns,
    hybrids: pack.token_stats). Under LoRA it is its own model, not the base; under DDP and FSDP every rank holds a
    whole copy and scores its own rows.
  - a self-teacher (RLSD, SDPO): the policy after a teacher prompt that adds privileged context, on the same
    completion tokens. `--self-teacher live` scores the policy as it is; `initial` its starting weights (the
    reference model: under LoRA the base with adapters off; otherwise a frozen copy). With `--teacher` the
    checkpoint takes the self-teacher's place (ms-swift's --teacher_model).
The flags are in opd.py's Flags (--teacher, --self-teacher, --teacher-template); this file's hooks run at setup.
The teacher prompt re-renders the example's user message through `--teacher-template` (the method's template by
default, docs/algorithms.md), and the step's groups are re-packed with it (pack.pack): the completion tokens and the
logical layout are unchanged, so the teacher's log-probs align with the student's.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import replace

import torch

from checkpoint import append_row
from cli import FlagError, UserError
from distributed import all_sum, derive_seed, rollout_dtype
from hf import config_from_hf, load_model
from pack import Group, pack, select_rows, token_stats
from tasks import render_prompt
from tokenizer import load_tokenizer


def self_distilled(cfg) -> bool:
    """RLSD or SDPO: the teacher is the policy (or --teacher) after a teacher prompt."""
    return getattr(cfg, "rlsd_lambda", 0) > 0 or getattr(cfg, "sdpo_weight", 0) > 0


def enabled(cfg) -> bool:
    """A teacher is scored: --teacher, or a self-teacher (its hooks: start and weight_bytes, at setup)."""
    return bool(cfg.teacher) or self_distilled(cfg)


def check(cfg) -> Iterator[FlagError]:
    """The teacher's flags (opd.py's Flags hold them, for --help's family)."""
    if cfg.teacher and not os.path.isfile(os.path.join(cfg.teacher, "config.json")):
        yield FlagError(("teacher",), f"{cfg.teacher!r} is not a checkpoint directory (no config.json)")
    if (cfg.teacher_template or cfg.self_teacher != "auto") and not self_distilled(cfg):
        yield FlagError(("teacher_template", "self_teacher"), "are for --algo rlsd or sdpo (a teacher prompt)")


def weight_bytes(cfg, nbytes: int) -> int:
    """The teacher's weights, in the rollout dtype (`nbytes` per parameter), for memory.py's estimate; a frozen
    initial copy (--self-teacher initial, no LoRA, no --beta reference to share) in float32."""
    from memory import n_params  # memory imports methods

    path = cfg.teacher or (cfg.model if own_initial_copy(cfg) else "")
    if not path:
        return 0
    with open(os.path.join(path, "config.json")) as f:
        return n_params(config_from_hf(json.load(f))) * (nbytes if cfg.teacher else 4)


def own_initial_copy(cfg) -> bool:
    """A self-teacher of initial weights needs a frozen copy of its own: not under LoRA (the base, adapters off),
    nor with --beta (the reference copy is that model)."""
    initial = self_distilled(cfg) and not cfg.teacher and teacher_kind(cfg) == "initial"
    return initial and not cfg.lora_rank and not cfg.beta


def teacher_kind(cfg) -> str:
    """live | initial: --self-teacher, or the authors' code's choice (RLSD: frozen theta_0; SDPO: the live policy,
    the nearest of the two to its EMA teacher)."""
    if cfg.self_teacher != "auto":
        return cfg.self_teacher
    return "initial" if getattr(cfg, "rlsd_lambda", 0) > 0 else "live"


def check_tokenizer(student, path: str) -> None:
    """A teacher must read and write the student's tokens: the same vocabulary, special tokens and stop ids."""
    other = load_tokenizer(path)
    same = student.tok.get_vocab(with_added_tokens=True) == other.tok.get_vocab(with_added_tokens=True)
    if not same or student.pad_id != other.pad_id or set(student.stop_ids) != set(other.stop_ids):
        raise UserError(f"--teacher {path}: its vocabulary or special tokens differ from the student's tokenizer")


def start(run) -> None:
    """Load the teacher (or the initial copy) frozen; --teacher: its held-out greedy accuracy, once, logged as the
    step-0 row's teacher/eval/accuracy (rank 0)."""
    cfg = run.cfg
    if cfg.teacher:
        check_tokenizer(run.tokenizer, cfg.teacher)
        dtype = getattr(torch, rollout_dtype(cfg, run.device.type == "cuda"))
        run.teacher = load_model(cfg.teacher, dtype=dtype, device=run.device).requires_grad_(False)
    elif own_initial_copy(cfg):
        run.teacher = load_model(cfg.model, device=run.device).requires_grad_(False)
    if cfg.teacher and run.rank == 0 and run.state["step"] == 0 and cfg.eval_examples:
        from heldout import evaluate

        kw = dict(n=0, temperature=cfg.temperature, max_new_tokens=cfg.completion_limit)
        with run.precision():
            res = evaluate(run.teacher, run.tokenizer, run.task, run.heldout, seed=derive_seed(cfg.seed, 10**9), **kw)
        print(f"teacher {cfg.teacher}: held-out greedy accuracy {res['accuracy']:.3f}")
        append_row(os.path.join(cfg.out, "metrics.jsonl"), {"step": 0, "teacher/eval/accuracy": res["accuracy"]})


@contextlib.contextmanager
def model(run):
    """The model that teaches: --teacher's, else the self-teacher (the live policy, or its initial weights)."""
    if run.teacher is not None:
        yield run.teacher
    elif teacher_kind(run.cfg) == "live":
        yield run.policy
    else:
        with run.reference_model() as m:  # LoRA: the base, adapters off; a --beta run's reference copy
            yield m


def score(run, batch, micro: list, groups: list[Group] | None = None) -> torch.Tensor:
    """The teacher's log-probs of the step's completion tokens (B, T), no grad: on the batch's own rows, or, given
    `groups` (the step's groups with teacher prompts, one per row or per group, in row order), on those re-packed."""
    if groups is not None:
        batch = pack(groups, run.tokenizer.pad_id, run.device, run.cfg.share_prompt)
        micro = [(rows, select_rows(batch, rows)) for rows, _ in micro]
    out = torch.zeros(batch.ids.shape, device=run.device)
    with torch.no_grad(), run.precision(), model(run) as m:
        for rows, mb in micro:
            out[rows] = token_stats(m, mb, run.cfg.temperature)[0]
    return out


def prompted(run, groups: list[Group], texts: list[str], per_row: bool = False) -> list[Group]:
    """The groups with their user message replaced by `texts` (one per group, or per row: each thought its own
    group of one), rendered as the student's prompt is (chat template, system prompt)."""
    task, tok = run.task, run.tokenizer
    render = lambda g, text: render_prompt(tok, {**g.example, "prompt": text}, task.system_prompt)  # noqa: E731
    if not per_row:
        return [replace(g, prompt=render(g, text)) for g, text in zip(groups, texts)]
    rows = [(g, t) for g in groups for t in g.thoughts]
    return [Group(g.example, render(g, text), [t]) for (g, t), text in zip(rows, texts)]


def signal_metrics(run, signal: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, share: torch.Tensor) -> dict:
    """teacher/reverse_kl: the mean over trained tokens of s_t - T_t (the sampled-token estimate of KL(student ||
    teacher)); teacher/adv_share: sum |teacher's part of the advantage| / sum |advantage| over trained tokens."""
    m = mask.float()
    sums = all_sum(
        torch.stack([(-signal * m).sum(), m.sum(), (share.abs() * m).sum(), (adv.abs() * m).sum()]), run.world
    )
    kl, n, part, whole = sums.tolist()
    return {"teacher/reverse_kl": kl / max(n, 1.0), "teacher/adv_share": part / whole if whole > 0 else 0.0}
