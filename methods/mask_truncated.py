"""Masking truncated completions (DAPO's overlong filtering, arXiv 2503.14476 §3.4; TRL's
mask_truncated_completions): a completion cut at its length limit, without a stop token, leaves the loss, so a sound
but unfinished reasoning is not punished for its length (--mask-truncated).

Seam: advantages and weights, before the token weights: mask = mask & keep_untruncated(...), as the trainer already
narrows the mask for dynamic sampling. The dropped tokens carry neither loss nor gradient and leave token-mean
normalisers (TRL counts num_items_in_batch over the masked completion mask); a per-sequence mean over the step's
rows still counts them, as TRL's per-sequence .mean() does. Their rewards STAY in the group statistics (TRL computes
the advantages from every completion's reward): masking changes which tokens train, not any advantage.

GRPO-MA's tree: the sampler appends the end-of-thought marker to a thought cut at its limit (pack.Thought.truncated)
and samples its M answers from it; those answers are finished answers to a complete (if forced) thought, so their
rewards measure the thought's value as any other's. Chosen: a thought cut at its limit stays in the loss, and only an
ANSWER that hits its limit without a stop token (pack.Answer.finish == "length") is masked, its tokens only; the
thought's other answers and the thought itself keep training. With --answers 1 the thought is empty and the answer is
the whole completion: this is TRL's rule exactly (the last token is neither a stop token nor padding).

Reference read: TRL v1.9.0+26 (f2cd577) trl/trainer/grpo_trainer.py and rloo_trainer.py (is_truncated = the last
completion token not in (eos, pad); completion_mask * ~is_truncated), trl/trainer/grpo_config.py
(mask_truncated_completions, default False). With DAPO's soft overlong penalty (--overlong-buffer) both apply: a
masked completion's penalised reward still shapes its group's advantages.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- loss
    mask_truncated: bool = False  # DAPO overlong filtering: answers cut at their limit (no stop token) leave the loss


def enabled(cfg) -> bool:
    return cfg.mask_truncated


def check(cfg) -> Iterator[FlagError]:
    return iter(())  # composes with every other flag, the tree included


def truncated(finish: list[str] | Tensor) -> Tensor:
    """[N] bool: the completions that hit their length limit without a stop token (pack.Answer.finish == "length";
    a tensor of bools passes through)."""
    if isinstance(finish, Tensor):
        return finish.bool()
    return torch.tensor([f == "length" for f in finish], dtype=torch.bool)


def keep_untruncated(answer_truncated: Tensor, answer_id: Tensor) -> Tensor:
    """The tokens that stay in the loss: answer_truncated [B, M] (or [P, K, M]) bool, answer j of row b cut at its
    limit; answer_id [B, T] (pack.Batch's: j on answer j's tokens, -1 elsewhere) -> keep [B, T] bool, False exactly
    on the tokens of truncated answers (thought tokens and padding stay True: the caller ANDs keep into its mask)."""
    B, M = answer_id.shape[0], answer_truncated.shape[-1]
    cut = answer_truncated.reshape(B, M).bool()
    is_answer = answer_id >= 0
    return ~(is_answer & cut.gather(1, answer_id.clamp(min=0).long()))


def trained_mask(run, mask: Tensor, groups: list, batch) -> Tensor:
    """The answers that hit their length limit leave the trained tokens (their thoughts stay)."""
    cut = truncated([a.finish for g in groups for t in g.thoughts for a in t.answers]).to(mask.device)
    return mask & keep_untruncated(cut.view(len(groups), run.cfg.thoughts, run.cfg.answers), batch.answer_id)
