"""On-policy distillation (OPD): the student samples, a frozen teacher (--teacher, methods/teacher.py) scores the
student's own tokens, and the teacher-student log-ratio is a per-token training signal (--algo opd; the flags below
let any preset add it to its task advantage).

Sampled-token form (the default; the Thinking Machines recipe, tinker-cookbook's train_on_policy):
    signal_t = T_t - s_t                 T: the teacher's log-prob of the sampled token, s: the student's
    A_t = A_task,t + c * signal_t        c = --teacher-coef (1); no discount (every peer's default)
    A_t = c * signal_t                   --distill-only (pure distillation, --algo opd): no task reward
A_task is the run's group-normalised advantage, and the signal is added after normalisation (slime, ms-swift).
Which student log-prob s is (--teacher-student): `sampler`, what the sampler computed when it drew the token
(tinker, TRL IW-OPD); `old`, the score pass's pi_old (slime, SkyRL, NeMo-RL, ms-swift). On one optimizer step per
batch (mu = 1) in float32 they agree. The loss is the run's --loss: `clip` (slime's and ms-swift's PPO loss; at
mu = 1 the ratio is 1 and the clip never binds) or `plain_is` (methods/staleness.py), exp(s - o) * A unclipped
(SkyRL's and tinker's importance_sampling, o = pi_old). At mu = 1 both give the gradient -A_t grad s_t per token;
with the aggregation's weights (token_mean: / #tokens) the step equals tinker's and SkyRL's.

Full-vocabulary form (--teacher-kl full; TRL's DistillationTrainer with beta = 1, GKD's reverse case): the per-token
reverse KL over the whole vocabulary, KL_t = sum_v p_S(v) (log p_S(v) - log p_T(v)) at --temperature, differentiated
directly and added to the loss as c * sum_t weight_t KL_t (weight: the run's aggregation). Never a (rows, T, V)
tensor of either model: the logits are made chunk by chunk (reverse_kl), each chunk recomputed in backward. It costs
one more forward of the student per micro-batch (and of the teacher); one process only (a second forward would be a
second DDP/FSDP forward per backward). With --distill-only the task advantage is 0, so the KL is the whole
loss (the logged `loss` is the surrogate's; the KL's gradient is in grad_norm).

Edge cases: a teacher equal to the student gives signal 0 on every token, so in pure OPD advantage, loss and
gradient are exactly 0; an empty mask gives a graph-attached 0 (policy_loss's sum over no token).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from cli import FlagError
from losses import on_mask
from methods.teacher import score as teacher_score
from methods.teacher import self_distilled, signal_metrics
from pack import token_stats


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- teachers
    teacher: str = ""  # a frozen teacher checkpoint, same tokenizer (OPD; with RLSD/SDPO: their teacher model)
    self_teacher: str = "auto"  # RLSD/SDPO's teacher: live policy | initial weights (auto: the authors' code's)
    teacher_template: str = ""  # RLSD/SDPO's teacher prompt: {prompt}, {answer} | {demo} ("" = the method's)
    teacher_coef: float = 1.0  # OPD: c in A_t = A_task + c (T_t - s_t), or of the full-vocabulary KL term
    distill_only: bool = False  # OPD: the advantage is the teacher's signal alone (no task reward)
    teacher_student: str = "sampler"  # OPD: the student log-prob in the signal: sampler | old (pi_old)
    teacher_kl: str = "sampled"  # OPD: sampled (the sampled token's log-ratio) | full (reverse KL, all the vocab)


CHOICES = dict(
    teacher_student=("sampler", "old"), teacher_kl=("sampled", "full"), self_teacher=("auto", "live", "initial")
)
PRESETS = {"opd": dict(distill_only=True, aggregation="token_mean")}  # tinker's recipe: pure distillation


def enabled(cfg) -> bool:
    return bool(cfg.teacher) and not self_distilled(cfg)


def check(cfg) -> Iterator[FlagError]:
    if cfg.distill_only and not cfg.teacher:
        yield FlagError(("distill_only",), "needs --teacher PATH (the model to distill from)", ("teacher",))
    if cfg.teacher_coef <= 0:
        yield FlagError(("teacher_coef",), f"must be > 0, got {cfg.teacher_coef}")


def start(run) -> None:
    if run.cfg.teacher_kl == "full" and run.world > 1:
        raise FlagError(("teacher_kl",), "full runs a second student forward per micro-batch: one process only")


def needs_scores(cfg) -> bool:
    """--teacher-student old: the score pass measures pi_old."""
    return cfg.teacher_student == "old"


def scores(run, batch, micro: list, groups: list):
    """The teacher on the batch's own rows."""
    batch.teacher_logp = teacher_score(run, batch, micro)
    return batch


def opd_signal(teacher_logp: Tensor, student_logp: Tensor, mask: Tensor) -> Tensor:
    """T_t - s_t on the mask, 0 elsewhere, no gradient: the teacher-student log-ratio of each sampled token."""
    return on_mask((teacher_logp - student_logp).detach(), mask.bool())


def opd_advantages(
    task_adv: Tensor, teacher_logp: Tensor, student_logp: Tensor, mask: Tensor, coef: float = 1.0, distill_only=False
) -> Tensor:
    """A_t = A_task,t + coef * (T_t - s_t) (slime, ms-swift, tinker with kl_discount_factor 0); distill_only: A_t =
    coef * (T_t - s_t) (tinker with task reward 0, SkyRL). All [B, T]; 0 off the mask."""
    signal = coef * opd_signal(teacher_logp, student_logp, mask)
    return signal if distill_only else on_mask(task_adv, mask.bool()) + signal


def token_advantages(run, adv: Tensor, groups: list, batch, mask: Tensor, reward: Tensor, metrics: dict) -> Tensor:
    cfg = run.cfg
    student = batch.sampler_logp if cfg.teacher_student == "sampler" else batch.score_logp
    signal = opd_signal(batch.teacher_logp, student, mask)
    if cfg.teacher_kl == "full":  # the KL is a loss term (micro_batch); the signal is only measured
        out = adv * 0 if cfg.distill_only else adv
        metrics |= signal_metrics(run, signal, out, mask, torch.zeros_like(signal))
        return out
    out = opd_advantages(adv, batch.teacher_logp, student, mask, cfg.teacher_coef, cfg.distill_only)
    metrics |= signal_metrics(run, signal, out, mask, cfg.teacher_coef * signal)
    return out


def _chunk_kl(hs: Tensor, ht: Tensor, ws: Tensor, wt: Tensor, temperature: float) -> Tensor:
    ls = F.log_softmax((hs @ ws.T).float() / temperature, -1)
    lt = F.log_softmax((ht @ wt.T).float() / temperature, -1)
    return (ls.exp() * (ls - lt)).sum(-1)


def reverse_kl(
    student_head, h_student: Tensor, teacher_head, h_teacher: Tensor, temperature: float = 1.0, chunk_tokens=None
) -> Tensor:
    """KL(p_S || p_T) per token (N,) float32 over the whole vocabulary, p = softmax(lm_head(h) / temperature),
    differentiable w.r.t. h_student and the student's lm_head; chunk_tokens rows of logits at a time (default
    2**24 // V), each chunk recomputed in backward, so no (N, V) tensor of either model is ever held."""
    ws = getattr(student_head, "lm_head", student_head).weight
    wt = getattr(teacher_head, "lm_head", teacher_head).weight.detach()
    step, h_teacher = chunk_tokens or max(1, 2**24 // ws.shape[0]), h_teacher.detach()
    parts = [
        checkpoint(
            _chunk_kl, h_student[i : i + step], h_teacher[i : i + step], ws, wt, temperature, use_reentrant=False
        )
        for i in range(0, h_student.shape[0], step)
    ]
    return torch.cat(parts) if parts else h_student.new_zeros(0) + 0 * ws.sum()


def micro_batch(run, tok, mb, sampled: Tensor, sums: dict, epoch: int):
    """--teacher-kl full: c * sum_t weight_t KL_t of this micro-batch, back-propagated here (its gradient adds to
    the surrogate's in the same optimizer step)."""
    if run.cfg.teacher_kl != "full":
        return tok
    cfg = run.cfg
    with torch.no_grad(), run.precision():
        h_t, _ = token_stats(run.teacher, mb, cfg.temperature, states=True)
    with run.precision():
        h_s, _ = token_stats(run.policy, mb, cfg.temperature, states=True)
        kl = reverse_kl(run.policy, h_s, run.teacher, h_t, cfg.temperature)
    rows, cols = (mb.to_logical >= 0).nonzero(as_tuple=True)
    flat = mb.to_logical[rows, cols]
    (cfg.teacher_coef * (tok.weight.flatten()[flat] * kl).sum()).backward()  # weight: 0 off the trained tokens
    return tok
