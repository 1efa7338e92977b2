"""RLSD, self-distilled RLVR (arXiv 2604.03128; --algo rlsd): the GRPO advantage rescaled per token by how much more
likely a teacher finds the token once it has seen the task's reference answer. The teacher is the policy itself
(methods/teacher.py: its initial weights by default, as the authors' code, iie-ycx/RLSD, ships
freeze_teacher_model: true; --self-teacher live is ms-swift's dynamic mode; --teacher PATH its --teacher_model), on
the same completion tokens after the teacher prompt (--teacher-template, default TEMPLATE: the question, "Here is a
reference solution:", the reference answer, an instruction to solve it independently; docs/algorithms.md).

    delta_t = sg(T_t - S_t)
    A_t = A * sg((1 - l) + l * clip(exp(sign(A) * delta_t), 1 - e, 1 + e))      l = --rlsd-lambda, e = --rlsd-eps

A's sign is never flipped: the teacher only rescales its magnitude, by a factor in [1 - l e, 1 + l e]. S is pi_old,
the score pass's log-probs (ms-swift's batch-time recompute; the authors' code takes each PPO micro-step's current
log-probs: at mu = 1 they are equal). The loss is the run's (--loss clip). Defaults are both peers': l 0.5, e 0.2,
no warm-up or decay of l, negative_only off. Edge cases: A = 0 (an all-equal group) gives A_t = 0 for any l; l = 0 is
plain GRPO; l = 1 gives a factor in [0.8, 1.2]. With GRPO-MA's tree (--answers > 1) each token's A is its own
(thought or answer) advantage. The reference answer is the example's "answer" field, which every task has: the
synthetic task's sum, GSM8K's and MATH's final answer, countdown's expression, a jsonl file's answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError, UserError
from losses import on_mask
from methods.teacher import prompted, signal_metrics
from methods.teacher import score as teacher_score

TEMPLATE = (
    "{prompt}\n\nHere is a reference solution:\n{answer}\n\n"
    "After understanding the reference solution, solve the original problem on your own."
)


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- teachers
    rlsd_lambda: float = 0.0  # RLSD: l, the teacher's share of each token's advantage scale (0 = off; rlsd: 0.5)
    rlsd_eps: float = 0.2  # RLSD: e, the per-token factor exp(sign(A) delta) clipped to [1 - e, 1 + e]


PRESETS = {"rlsd": dict(rlsd_lambda=0.5)}


def enabled(cfg) -> bool:
    return cfg.rlsd_lambda > 0


def check(cfg) -> Iterator[FlagError]:
    if not 0 <= cfg.rlsd_lambda <= 1:
        yield FlagError(("rlsd_lambda",), f"must be in [0, 1], got {cfg.rlsd_lambda}")
    if not 0 <= cfg.rlsd_eps < 1:
        yield FlagError(("rlsd_eps",), f"must be in [0, 1), got {cfg.rlsd_eps}")
    if cfg.rlsd_lambda > 0 and getattr(cfg, "sdpo_weight", 0) > 0:
        yield FlagError(("rlsd_lambda",), "and --sdpo-weight each set the teacher prompt: choose one", ("sdpo_weight",))
    if cfg.rlsd_lambda > 0 and cfg.teacher_template:
        try:
            cfg.teacher_template.format(prompt="", answer="")
        except (KeyError, IndexError, ValueError):
            yield FlagError(("teacher_template",), "for RLSD may name only {prompt} and {answer}")


def check_data(task, cfg, examples: list[dict]) -> None:
    if cfg.rlsd_lambda > 0 and not all(ex.get("answer") not in (None, "") for ex in examples):
        raise UserError(f"--algo rlsd needs each example's reference answer; task {task.name} has one without")


def needs_scores(cfg) -> bool:
    """S is pi_old: the score pass measures the policy."""
    return True


def teacher_texts(template: str, examples: list[dict]) -> list[str]:
    """Each group's teacher user message: the template filled with the example's prompt and reference answer."""
    return [template.format(prompt=ex["prompt"], answer=ex["answer"]) for ex in examples]


def scores(run, batch, micro: list, groups: list):
    """The teacher on the same completion tokens, each group's prompt replaced by its teacher prompt."""
    texts = teacher_texts(run.cfg.teacher_template or TEMPLATE, [g.example for g in groups])
    batch.teacher_logp = teacher_score(run, batch, micro, prompted(run, groups, texts))
    return batch


def rlsd_advantages(
    adv: Tensor, teacher_logp: Tensor, student_logp: Tensor, mask: Tensor, lam: float = 0.5, eps: float = 0.2
) -> Tensor:
    """A_t = A * sg((1 - lam) + lam * clip(exp(sign(A) * sg(T_t - S_t)), 1 - eps, 1 + eps)) on the mask, 0 elsewhere;
    all [B, T] (A: each token's advantage)."""
    delta = (teacher_logp - student_logp).detach()
    factor = (1 - lam) + lam * torch.exp(torch.sign(adv) * delta).clamp(1 - eps, 1 + eps)
    return on_mask(adv * factor.detach(), mask.bool())


def token_advantages(run, adv: Tensor, groups: list, batch, mask: Tensor, reward: Tensor, metrics: dict) -> Tensor:
    cfg = run.cfg
    student = batch.score_logp
    out = rlsd_advantages(adv, batch.teacher_logp, student, mask, cfg.rlsd_lambda, cfg.rlsd_eps)
    signal = on_mask((batch.teacher_logp - student).detach(), mask.bool())
    metrics |= signal_metrics(run, signal, out, mask, out - on_mask(adv, mask.bool()))
    return out
