"""methods: one file per paper or method family. train.py is plain GRPO with GRPO-MA's tree; a method changes a
step only through the seams below, each an explicit call chain over the enabled methods in ORDER. A method file
holds its flags (a `Flags` dataclass that config.TrainConfig gathers), its presets (`PRESETS`), its flag checks
(`check(cfg)`), `enabled(cfg)`, and the hooks it needs, each a module-level function of the name below:

  seam (where it is called)       hook                                                   e.g.
  choose the data (setup)         choose_data(task, cfg) -> task                         hard_examples
  extra prompt streams (setup)    streams(task, cfg) -> {name: examples}                 dapo's top-ups
                                  stream_size(cfg) -> int: their examples, before drawing  dapo (memory.py)
  run state (memory.py)           held_bytes(cfg, tokens per step) -> int: what it holds   staleness's queue
  check the data (setup)          check_data(task, cfg, examples) -> None                dagrpo's references
  start (setup, models loaded)    start(run) -> None: checks and state                   noise's rates, gtpo's gate
  the sampler's dtype (setup)     check_rollout_dtype(cfg, rollout) -> None              mismatch
  score pass (needs)              needs_scores(cfg) -> bool                              gtpo, cov, entropy_mask, kl
  weights held (memory.py)        weight_bytes(cfg, rollout_bytes) -> int: a teacher's   teacher

The step's seams that transform one value are each one call, chain(run, seam, value, *context), which passes the
value through every enabled method's hook(run, value, *context) -> value in ORDER. counts: a dict the hook adds its
counts to (this rank's), for its metrics; metrics: a dict of the step's row.

  rewards (score)                 rewards(run, reward [N], step: Scored)                 noise, dagrpo, dapo, components
  resample (after scoring)        resample(run, groups, step, slots, redraw, counts)     dapo ("resampled")
  rollouts (before packing)       rollouts(run, groups, counts)                          dagrpo's anchors
  the lag (before packing)        queue(run, (groups, accuracy), step, counts) -> the same, to train  staleness
  advantage rewards (advantages)  advantage_rewards(run, reward [P, K, M], batch)        noise, kl in the reward
  sequence advantages             sequence_advantages(run, adv [B], batch, mask)         gtpo's entropy control
  trained tokens                  trained_mask(run, mask [B, T], groups, batch)          dapo, mask_truncated
  more scored models (score pass) scores(run, batch, micro, groups): batch.teacher_logp  opd, rlsd, sdpo
  token advantages                token_advantages(run, adv [B, T], groups, batch, mask, reward, metrics)  opd
  token weights                   token_weights(run, weight [B, T], groups, batch, raw [B], mask, metrics)  gtpo, gpg
  micro-batch (update)            micro_batch(run, tok, mb, sampled, sums, epoch)        mismatch, dsv32, kl
  extra loss terms (update)       loss_terms(run, loss, tok, entropy); needs_entropy_grad(cfg) -> bool  entropy_bonus

The rest have functions of their own here:
  sample (train.sample)           sample(run, examples, seeds) -> (prompts, tree): a method's own rollouts  tools
  evaluation (train.evaluate_heldout)  evaluator(cfg, tokenizer, task) -> heldout.evaluate's rollout      tools
  advantages (advantages)         ADVANTAGES = {--advantage value: fn(run, groups, reward [P, K, M], batch_accuracy)
                                  -> (thought [P, K] or None, answer [P, K, M] or None)}  two_grpo, agrae, rloo
                                  advantages(run, groups, reward, batch_accuracy) -> the same  dagrpo, batch_std
  selections (over the step)      select(run, batch, adv, mask) -> (keep, selected, metrics): into batch.keep,
                                  batch.selected                                         cov, entropy_mask
  the loss                        LOSSES = {--loss value: losses.Objective}              gspo, gmpo, ...
                                  objective(cfg, entry) -> entry                         dual_clip
                                  off_policy_objective(cfg, entry) -> entry: after them  dagrpo (LUFFY)
  metrics (log)                   metrics(run, sums, counts) -> dict                     noise, dagrpo
  the end summary (train.finish)  eval_flags(cfg) -> str: eval.py's flags to evaluate as the run trained  tools

Deleting a method's file (and its tests) leaves a working trainer: ORDER names the files, and those missing are
skipped. The model, the sampler and the RL core (advantage.py, losses.py, pack.py) never import this package.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from distributed import all_sum
from losses import CLIP, loss_name

# The order of every call chain: rewards are flipped (noise) before the overlong penalty (dapo), and so on.
ORDER = ("hard_examples", "noise", "dagrpo", "dapo", "grpo_ma", "dr_grpo", "two_grpo", "agrae", "rloo", "maxrl")
ORDER += ("components", "gdpo", "batch_std", "kl", "reinforce_pp", "teacher", "opd", "rlsd", "sdpo", "gtpo")
ORDER += ("mask_truncated", "entropy_mask", "cov", "gpg", "staleness", "m2po", "mismatch", "dsv32", "gspo", "cispo")
ORDER += ("sapo", "gmpo", "dppo", "dual_clip", "entropy_bonus", "tools")

_present = {m.name for m in pkgutil.iter_modules(__path__)}
METHODS: tuple[ModuleType, ...] = tuple(importlib.import_module(f"{__name__}.{n}") for n in ORDER if n in _present)


@dataclass
class Scored:
    """A step's completions as the rewards seam sees them: each one's text, example, length in tokens, and the
    rollout seed of each prompt (its group)."""

    answers: list  # [N] pack.Answer: the records a method may annotate (DaGRPO's credit)
    texts: list[str]
    examples: list[dict]
    lengths: torch.Tensor  # [N] long
    seeds: list[int]  # [P]
    groups: int  # P


def gathered(name: str) -> dict:
    """The union of every method's dict attribute `name` (PRESETS, LOSSES, ADVANTAGES, CHOICES)."""
    return {k: v for m in METHODS for k, v in getattr(m, name, {}).items()}


def enabled(cfg) -> Iterator[ModuleType]:
    """The methods this run uses, in ORDER."""
    return (m for m in METHODS if m.enabled(cfg))


def hooks(cfg, name: str) -> list:
    """The enabled methods' hooks of this name, in ORDER."""
    return [getattr(m, name) for m in METHODS if hasattr(m, name) and m.enabled(cfg)]


def check(cfg) -> Iterator:
    """Every method's flag checks (each runs whether or not its method is on: a bad value is refused anyway)."""
    for m in METHODS:
        yield from m.check(cfg)


def choose_data(task, cfg):
    for hook in hooks(cfg, "choose_data"):
        task = hook(task, cfg)
    return task


def streams(task, cfg) -> dict[str, list[dict]]:
    return {k: v for hook in hooks(cfg, "streams") for k, v in hook(task, cfg).items()}


def stream_size(cfg) -> int:
    """How many examples the methods' streams will hold (the memory estimate counts them before they are drawn)."""
    return sum(hook(cfg) for hook in hooks(cfg, "stream_size"))


def held_bytes(cfg, tokens: int) -> int:
    """The memory the methods' run state holds (the staleness queue), for `tokens` completion tokens per step."""
    return sum(hook(cfg, tokens) for hook in hooks(cfg, "held_bytes"))


def check_data(task, cfg, examples: list[dict]) -> None:
    """Refusals that need the training data (every prompt a run may draw), before any model is loaded."""
    for hook in hooks(cfg, "check_data"):
        hook(task, cfg, examples)


def start(run) -> None:
    for hook in hooks(run.cfg, "start"):
        hook(run)


def chain(run, seam: str, value, *context):
    """`value` through the enabled methods' hooks `seam`, in ORDER: value = hook(run, value, *context). The step's
    seams that transform one thing are each this call (the table above: rewards, resample, rollouts, advantage
    rewards, sequence and token advantages, the trained mask, token weights, a micro-batch's Tokens, the loss)."""
    for hook in hooks(run.cfg, seam):
        value = hook(run, value, *context)
    return value


def needs(cfg, seam: str) -> bool:
    """Whether an enabled method's predicate `seam` says yes (needs_scores, needs_entropy_grad)."""
    return any(hook(cfg) for hook in hooks(cfg, seam))


def sample(run, examples: list[dict], seeds: list[int]) -> tuple | None:
    """(prompts, tree) from a method's own rollouts (tools: multi-turn, pausing for a tool), or None: the core's."""
    for hook in hooks(run.cfg, "sample"):
        return hook(run, examples, seeds)
    return None


def evaluator(run):
    """heldout.evaluate's rollout when a method samples its own (tools), else None: the plain sampler."""
    for hook in hooks(run.cfg, "evaluator"):
        return hook(run.cfg, run.tokenizer, run.task)
    return None


def eval_flags(cfg) -> str:
    """The flags eval.py needs to evaluate the run as it trained (the end summary's command): tools' --tools."""
    return "".join(hook(cfg) for hook in hooks(cfg, "eval_flags"))


def advantages(run, groups: list, reward: torch.Tensor, batch_accuracy: float) -> tuple:
    """(thought [P, K] or None, answer [P, K, M] or None) replacing the core's GRPO-MA advantages, None where the
    core's stays: --advantage's entry (ADVANTAGES), or one method's hook (the checks keep them exclusive)."""
    if run.cfg.advantage != "grpo":
        return ADVANTAGES[run.cfg.advantage](run, groups, reward, batch_accuracy)
    for hook in hooks(run.cfg, "advantages"):
        return hook(run, groups, reward, batch_accuracy)
    return None, None


def select(run, batch, adv: torch.Tensor, mask: torch.Tensor) -> dict:
    """The step's token selections, into batch.keep ((B, T) bool, or None) and batch.selected (KL-Cov's, or None);
    returns their metrics, with the share of the step's trained tokens they keep (token_select/kept_frac)."""
    keep, selected, metrics = None, None, {}
    for hook in hooks(run.cfg, "select"):
        k, s, m = hook(run, batch, adv, mask)
        keep = k if keep is None else keep & k
        selected, metrics = s if s is not None else selected, metrics | m
    if keep is not None:
        kept, trained = all_sum((keep & mask).sum(), run.world), all_sum(mask.sum(), run.world)
        metrics["token_select/kept_frac"] = (kept.float() / trained.float().clamp(min=1)).item()
    batch.keep, batch.selected = keep, selected
    return metrics


def metrics(run, sums: dict, counts: dict) -> dict:
    """The methods' entries of the step's row; counts: what the resample and rollouts hooks counted (this rank's)."""
    return {k: v for hook in hooks(run.cfg, "metrics") for k, v in hook(run, sums, counts).items()}


def weight_bytes(cfg, rollout_bytes: int) -> int:
    """The bytes of the models the methods hold beside the policy (a teacher), for memory.py's estimate."""
    return sum(hook(cfg, rollout_bytes) for hook in hooks(cfg, "weight_bytes"))


def check_rollout_dtype(cfg, rollout: str) -> None:
    """Refusals that need the sampler's dtype (known once the device is), before anything is loaded; like check(),
    every method's, on or off (a mode of a correction that has nothing to correct is refused)."""
    for m in METHODS:
        if hasattr(m, "check_rollout_dtype"):
            m.check_rollout_dtype(cfg, rollout)


def objective(cfg):
    """--loss's entry of the loss table (--sequence-ratio: GSPO's), as a method may modify it (the dual clip); then
    the off-policy tokens' objective (DaGRPO's anchors: LUFFY's shaping) wraps whatever the others chose."""
    entry = LOSSES[loss_name(cfg)]
    for hook in hooks(cfg, "objective") + hooks(cfg, "off_policy_objective"):
        entry = hook(cfg, entry)
    return entry


PRESETS = gathered("PRESETS")
LOSSES = {"clip": CLIP, **gathered("LOSSES")}
ADVANTAGES = gathered("ADVANTAGES")
