"""SDPO, self-distillation policy optimization (arXiv 2601.20802; --algo sdpo): the policy is its own teacher once it
has seen a sibling that succeeded. Each sample's teacher prompt holds the first successful completion of its group
other than its own row (reward >= --sdpo-threshold; the sample itself excluded, lasgroup/SDPO's
dont_reprompt_on_self_success), in the authors' template (TEMPLATE, docs/algorithms.md):
    "{prompt}\nCorrect solution:\n\n{demo}\n\n" + "" (no feedback) + "\n\nCorrectly solve the original question."
The teacher scores the sample's own completion tokens (methods/teacher.py); a row with no successful sibling carries
no distillation signal (TRL's self_distillation_mask 0).

TRL's experimental/sdpo defaults (distillation_mode sampled_token, distillation_weight 1, IS clip 2):
    per-token loss   sg(s_t - T_t) * s_t * min(exp(sg(s_t - o_t)), 2)           (sdpo_loss, the exact form)
    aggregation      the token mean of each row over mask * sd_mask, then the mean over ALL B rows (rows without a
                     demo dilute it)
Here it is an advantage, A_t = w * sd_b * (T_t - s_t) + (1 - w) * A_task,t (w = --sdpo-weight), trained by the
run's loss (clip) with --aggregation seq_mean_token_mean (the preset): at mu = 1 the ratio is 1 and
the IS factor min(1, 2) = 1, so at w = 1 the gradient equals TRL's exactly (tests/test_distill.py). s is pi_old (the
score pass): at mu = 1 TRL's current log-prob. For 0 < w < 1 TRL aggregates its GRPO term by its own loss_type (dapo);
here both terms share the run's aggregation. The teacher is the live policy by default (rlhf-book's; TRL and the
authors use an EMA of it at rate 0.05, left out: --self-teacher initial is the other end); the full-logit and top-k
modes of TRL and the authors (alpha 0.5: a JSD, not a reverse KL) are left out.
With GRPO-MA's tree each row (a thought and its M answers) gets one teacher prompt: its demo comes from another row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError
from losses import on_mask
from methods.teacher import prompted, signal_metrics
from methods.teacher import score as teacher_score

TEMPLATE = "{prompt}\nCorrect solution:\n\n{demo}\n\n\n\nCorrectly solve the original question."


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- teachers
    sdpo_weight: float = 0.0  # SDPO: w in (1 - w) A_task + w A_distill (0 = off; sdpo: 1, pure self-distillation)
    sdpo_threshold: float = 1.0  # SDPO: a sibling with reward >= this is a demonstration (TRL's; the authors' 0.5)


PRESETS = {"sdpo": dict(sdpo_weight=1.0, aggregation="seq_mean_token_mean")}


def enabled(cfg) -> bool:
    return cfg.sdpo_weight > 0


def check(cfg) -> Iterator[FlagError]:
    if not 0 <= cfg.sdpo_weight <= 1:
        yield FlagError(("sdpo_weight",), f"must be in [0, 1], got {cfg.sdpo_weight}")
    if cfg.sdpo_weight > 0 and cfg.teacher_template:
        try:
            cfg.teacher_template.format(prompt="", demo="")
        except (KeyError, IndexError, ValueError):
            yield FlagError(("teacher_template",), "for SDPO may name only {prompt} and {demo}")


def needs_scores(cfg) -> bool:
    """s is pi_old: the score pass measures the policy."""
    return True


def demos(groups: list, threshold: float) -> list[str | None]:
    """Each row's demonstration: the text of the first completion of its group, in row order, outside the row
    itself whose reward is >= threshold; None where there is none."""
    out = []
    for g in groups:
        for i, _ in enumerate(g.thoughts):
            wins = [a.text for j, t in enumerate(g.thoughts) if j != i for a in t.answers if a.reward >= threshold]
            out.append(wins[0] if wins else None)
    return out


def scores(run, batch, micro: list, groups: list):
    """The policy on each row's completion tokens after its teacher prompt (the plain prompt where no demo)."""
    template = run.cfg.teacher_template or TEMPLATE
    rows = [(g, d) for g, d in zip((g for g in groups for _ in g.thoughts), demos(groups, run.cfg.sdpo_threshold))]
    texts = [g.example["prompt"] if d is None else template.format(prompt=g.example["prompt"], demo=d) for g, d in rows]
    batch.teacher_logp = teacher_score(run, batch, micro, prompted(run, groups, texts, per_row=True))
    return batch


def sdpo_advantages(
    task_adv: Tensor, teacher_logp: Tensor, student_logp: Tensor, mask: Tensor, has_demo: Tensor, weight: float = 1.0
) -> Tensor:
    """A_t = weight * has_demo_b * sg(T_t - s_t) + (1 - weight) * A_task,t on the mask, 0 elsewhere; [B, T] each,
    has_demo [B] bool (TRL's self_distillation_mask)."""
    m = mask.bool()
    signal = on_mask((teacher_logp - student_logp).detach(), m & has_demo.bool()[:, None])
    return weight * signal + (1 - weight) * on_mask(task_adv, m)


def sdpo_loss(
    logp: Tensor, teacher_logp: Tensor, mask: Tensor, sd_mask: Tensor, old_logp: Tensor | None = None, is_clip=2.0
) -> Tensor:
    """TRL's sampled_token self-distillation loss: per token sg(s - T) * s (times min(exp(sg(s - o)), is_clip) with
    old log-probs), the token mean of each row over mask * sd_mask, then the mean over all B rows. [B, T] each,
    sd_mask [B]. No trained token: a graph-attached 0."""
    m = (mask.bool() & sd_mask.bool()[:, None]).float()
    per = on_mask((logp - teacher_logp).detach(), m.bool()) * logp
    if old_logp is not None:
        per = per * torch.exp(on_mask((logp - old_logp).detach(), m.bool())).clamp(max=is_clip)
    return ((per * m).sum(1) / m.sum(1).clamp(min=1)).mean()


def token_advantages(run, adv: Tensor, groups: list, batch, mask: Tensor, reward: Tensor, metrics: dict) -> Tensor:
    cfg = run.cfg
    has = torch.tensor([d is not None for d in demos(groups, cfg.sdpo_threshold)], device=adv.device)
    out = sdpo_advantages(adv, batch.teacher_logp, batch.score_logp, mask, has, cfg.sdpo_weight)
    signal = on_mask((batch.teacher_logp - batch.score_logp).detach(), mask.bool() & has[:, None])
    metrics |= signal_metrics(run, signal, out, mask, cfg.sdpo_weight * signal)
    metrics["teacher/sdpo_demo_frac"] = has.float().mean().item()
    return out
