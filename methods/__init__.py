"""methods: one file per paper or method family. train.py is plain GRPO with GRPO-MA's tree; a method changes a
step only through the seams below, each an explicit call chain over the enabled methods in ORDER. A method file
holds its flags (a `Flags` dataclass that config.TrainConfig gathers), its presets (`PRESETS`), its flag checks
(`check(cfg)`), `enabled(cfg)`, and the hooks it needs, each a module-level function of the name below:

  seam (train.py calls it in)     hook                                                   e.g.
  choose the data (setup)         choose_data(task, cfg) -> task                         hard_examples
  extra prompt streams (setup)    streams(task, cfg) -> {name: examples}                 dapo's top-ups
                                  stream_size(cfg) -> int: their examples, before drawing  dapo (memory.py)
  check the data (setup)          check_data(task, cfg, examples) -> None                dagrpo's references
  start (setup, models loaded)    start(run) -> None: checks and state                   noise's rates, gtpo's gate
  rewards (score)                 rewards(run, reward [N], step: Scored) -> reward        noise, dagrpo, dapo
  resample (after scoring)        resample(run, groups, step, slots, redraw) -> (groups, n)  dapo
  rollouts (before packing)       rollouts(run, groups) -> (groups, metrics)             dagrpo's anchors
  advantage rewards (advantages)  advantage_rewards(run, reward [P, K, M], batch) -> reward  noise, kl in the reward
  advantages (advantages)         ADVANTAGES = {--advantage value: fn(run, groups, reward [P, K, M], batch_accuracy)
                                  -> (thought [P, K] or None, answer [P, K, M] or None)}  two_grpo, agrae, rloo
                                  advantages(run, groups, reward, batch_accuracy) -> the same  dagrpo, batch_std
  sequence advantages             sequence_advantages(run, adv [B], batch, mask) -> [B]   gtpo's entropy control
  token advantages                token_advantages(run, groups, batch, mask, adv, reward) -> adv [B, T]  reinforce_pp
  trained tokens                  trained_mask(run, groups, batch, mask) -> mask          dapo's flat groups
  token weights                   token_weights(run, groups, batch, weight, raw [B], mask) -> (weight, metrics)
  selections (over the step)      select(run, batch, adv, mask) -> (keep, selected, metrics)  cov, entropy_mask
  the loss                        LOSSES = {--loss value: losses.Objective}              gspo, gmpo, ...
                                  objective(cfg, entry) -> entry                         dual_clip
  micro-batch (update)            micro_batch(run, tok, mb, sampled, sums, epoch) -> tok  mismatch, dsv32, dagrpo
  extra loss terms (update)       loss_terms(run, tok, entropy, loss) -> loss; needs_entropy_grad(cfg)  entropy_bonus
  score pass                      needs_scores(cfg) -> bool                              gtpo, cov, entropy_mask, kl
  metrics (log)                   metrics(run, sums, rollouts) -> dict                   noise, dagrpo
  the sampler's dtype (setup)     check_rollout_dtype(cfg, rollout) -> None              mismatch

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
ORDER = ("hard_examples", "noise", "dagrpo", "dapo", "grpo_ma", "dr_grpo", "two_grpo", "agrae", "rloo", "batch_std")
ORDER += ("kl", "reinforce_pp", "gtpo", "mask_truncated", "entropy_mask", "cov", "gpg", "mismatch", "dsv32", "gspo")
ORDER += ("cispo", "sapo", "gmpo", "dppo", "dual_clip", "entropy_bonus")

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


def check_data(task, cfg, examples: list[dict]) -> None:
    """Refusals that need the training data (every prompt a run may draw), before any model is loaded."""
    for hook in hooks(cfg, "check_data"):
        hook(task, cfg, examples)


def start(run) -> None:
    for hook in hooks(run.cfg, "start"):
        hook(run)


def rewards(run, reward: torch.Tensor, step: Scored) -> torch.Tensor:
    for hook in hooks(run.cfg, "rewards"):
        reward = hook(run, reward, step)
    return reward


def resample(run, groups: list, step: int, slots: list[int], redraw) -> tuple[list, int]:
    n = 0
    for hook in hooks(run.cfg, "resample"):
        groups, k = hook(run, groups, step, slots, redraw)
        n += k
    return groups, n


def rollouts(run, groups: list) -> tuple[list, dict]:
    metrics = {}
    for hook in hooks(run.cfg, "rollouts"):
        groups, m = hook(run, groups)
        metrics |= m
    return groups, metrics


def advantage_rewards(run, reward: torch.Tensor, batch) -> torch.Tensor:
    for hook in hooks(run.cfg, "advantage_rewards"):
        reward = hook(run, reward, batch)
    return reward


def advantages(run, groups: list, reward: torch.Tensor, batch_accuracy: float) -> tuple:
    """(thought [P, K] or None, answer [P, K, M] or None) replacing the core's GRPO-MA advantages, None where the
    core's stays: --advantage's entry (ADVANTAGES), or one method's hook (the checks keep them exclusive)."""
    if run.cfg.advantage != "grpo":
        return ADVANTAGES[run.cfg.advantage](run, groups, reward, batch_accuracy)
    for hook in hooks(run.cfg, "advantages"):
        return hook(run, groups, reward, batch_accuracy)
    return None, None


def token_advantages(run, groups: list, batch, mask: torch.Tensor, adv: torch.Tensor, reward: torch.Tensor):
    """Token-level estimators (REINFORCE++) replace the per-token advantages [B, T] outright."""
    for hook in hooks(run.cfg, "token_advantages"):
        adv = hook(run, groups, batch, mask, adv, reward)
    return adv


def sequence_advantages(run, adv: torch.Tensor, batch, mask: torch.Tensor) -> torch.Tensor:
    for hook in hooks(run.cfg, "sequence_advantages"):
        adv = hook(run, adv, batch, mask)
    return adv


def trained_mask(run, groups: list, batch, mask: torch.Tensor) -> torch.Tensor:
    for hook in hooks(run.cfg, "trained_mask"):
        mask = hook(run, groups, batch, mask)
    return mask


def token_weights(run, groups: list, batch, weight: torch.Tensor, raw: torch.Tensor, mask: torch.Tensor):
    metrics = {}
    for hook in hooks(run.cfg, "token_weights"):
        weight, m = hook(run, groups, batch, weight, raw, mask)
        metrics |= m
    return weight, metrics


def select(run, batch, adv: torch.Tensor, mask: torch.Tensor):
    """The step's token selections: (keep (B, T) bool or None, KL-Cov's selected or None, metrics), with the
    share of the step's trained tokens they keep (token_select/kept_frac)."""
    keep, selected, metrics = None, None, {}
    for hook in hooks(run.cfg, "select"):
        k, s, m = hook(run, batch, adv, mask)
        keep = k if keep is None else keep & k
        selected, metrics = s if s is not None else selected, metrics | m
    if keep is not None:
        kept, trained = all_sum((keep & mask).sum(), run.world), all_sum(mask.sum(), run.world)
        metrics["token_select/kept_frac"] = (kept.float() / trained.float().clamp(min=1)).item()
    return keep, selected, metrics


def micro_batch(run, tok, mb, sampled: torch.Tensor, sums: dict, epoch: int):
    for hook in hooks(run.cfg, "micro_batch"):
        tok = hook(run, tok, mb, sampled, sums, epoch)
    return tok


def needs_entropy_grad(cfg) -> bool:
    """A loss term of a method needs the token entropy with its gradient in every epoch (the entropy bonus)."""
    return any(hook(cfg) for hook in hooks(cfg, "needs_entropy_grad"))


def loss_terms(run, tok, entropy: torch.Tensor | None, loss: torch.Tensor) -> torch.Tensor:
    """The policy loss plus the methods' own terms on this micro-batch (the entropy bonus)."""
    for hook in hooks(run.cfg, "loss_terms"):
        loss = hook(run, tok, entropy, loss)
    return loss


def needs_scores(cfg) -> bool:
    return any(hook(cfg) for hook in hooks(cfg, "needs_scores"))


def metrics(run, sums: dict, rollouts: dict) -> dict:
    """The methods' entries of the step's row; rollouts: what the rollouts seam returned (this rank's counts)."""
    return {k: v for hook in hooks(run.cfg, "metrics") for k, v in hook(run, sums, rollouts).items()}


def check_rollout_dtype(cfg, rollout: str) -> None:
    """Refusals that need the sampler's dtype (known once the device is): before anything is loaded."""
    for hook in hooks(cfg, "check_rollout_dtype"):
        hook(cfg, rollout)


def objective(cfg):
    """--loss's entry of the loss table (--sequence-ratio: GSPO's), as a method may modify it (the dual clip)."""
    entry = LOSSES[loss_name(cfg)]
    for hook in hooks(cfg, "objective"):
        entry = hook(cfg, entry)
    return entry


PRESETS = gathered("PRESETS")
LOSSES = {"clip": CLIP, **gathered("LOSSES")}
ADVANTAGES = gathered("ADVANTAGES")
