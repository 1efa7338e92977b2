"""Stale rollouts (--staleness K): the rollouts sampled at step n are trained at step n + K, as by an asynchronous
trainer whose sampler runs K steps ahead, but exactly and deterministically: a FIFO of the steps' groups (pack.Group:
tokens, rewards, correctness and the sampler's per-token log-probs, the behaviour policy mu), in the trainer state
(checkpointed, resumed bit for bit, counted by memory.py). The data order, rollout seeds and evaluation are those of
K = 0. The first K steps only sample (their rows hold the rollout metrics, no update's); they count in --max-steps,
not in the learning-rate schedule, which runs over the max_steps - K updates; the last K steps' samples are never
trained. The lag of every trained batch is exactly K (stale/lag).

Three log-probs per token: the behaviour b (the sampler's, carried in the queue: batch.sampler_logp), the proximal o
(the score pass's, forced on when K > 0: the policy at the start of the update) and the current s (the update's).
  --is-anchor old      the ratio exp(s - o), clipped, times the behaviour weight exp(o - b), truncated (TIS) or masked
                       (IcePop) by --rollout-is / --tis-cap / --tis-floor (methods/mismatch.py, token or sequence):
                       verl's decoupled mode, SkyRL's "old" anchor with TIS, NeMo-RL's and slime's correction, AReaL's
                       decoupled loss with rejection sampling (mask: IcePop; clamp: TIS); --tis-cap 0: no weight,
                       AReaL's default decoupled loss.
  --is-anchor rollout  the ratio taken against the behaviour policy directly (old_logp := b), no weight: verl's bypass
                       mode, SkyRL's "rollout" anchor, slime's --use-rollout-logprobs, TRL AsyncGRPO (PPO clip).
  --loss plain_is      exp(s - old_logp) A, unclipped: with --is-anchor rollout, plain importance sampling against mu.
M2PO's mask of the largest behaviour-proximal gaps is methods/m2po.py. Metrics: stale/lag, stale/kl_k3 (the k3
estimate of KL(mu || pi_prox) per sampled token); the share of tokens a correction bound is tis/capped_frac (TIS,
IcePop), m2po/masked_frac (M2PO) and clip_frac (the clipped ratio).
Left out: every peer's age bound (drop or throttle rollouts older than a limit: here the lag is fixed), a lag that
varies from step to step, and AReaL's approximation of the proximal log-probs without a forward (loglinear).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError, UserError, out_of_range
from distributed import all_sum
from losses import Objective, Tokens, kl3, on_mask, token_ratio

QUEUE_TOKEN_BYTES = 80  # a queued token in Python lists: its id and log-prob objects and two list slots


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- rollouts
    staleness: int = 0  # train step n's rollouts at step n + K (0 = on-policy); the first K steps only sample
    # -- loss
    is_anchor: str = "old"  # the ratio against the proximal policy (old; --tis-cap weights it) or the sampler's


CHOICES = dict(is_anchor=("old", "rollout"))


def enabled(cfg) -> bool:
    return cfg.staleness > 0 or cfg.is_anchor == "rollout"


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(staleness=">= 0"))
    if cfg.staleness >= cfg.max_steps > 0:
        yield FlagError(("staleness",), f"must be below --max-steps ({cfg.max_steps}) or no step trains")
    if cfg.is_anchor == "rollout" and cfg.tis_cap > 0:
        why = "takes the ratio against the behaviour policy, so a behaviour weight would count it twice"
        yield FlagError(("is_anchor",), f"{why}: pass --tis-cap 0", ("tis_cap",), subject="--is-anchor rollout")


def check_rollout_dtype(cfg, rollout: str) -> None:
    """The rollout anchor on-policy with a float32 sampler: the behaviour policy is the proximal one."""
    if cfg.is_anchor == "rollout" and cfg.staleness == 0 and rollout == "float32":
        raise UserError(
            "--is-anchor rollout needs a behaviour policy that differs from the trainer's: pass --staleness K > 0 "
            "or --rollout-dtype bfloat16"
        )


def needs_scores(cfg) -> bool:
    """The proximal log-probs: the policy's score pass at the start of the update."""
    return cfg.staleness > 0


def held_bytes(cfg, tokens: int) -> int:
    """The queue's memory: K steps of `tokens` completion tokens each (memory.py's estimate)."""
    return cfg.staleness * tokens * QUEUE_TOKEN_BYTES


def queue(run, value: tuple, step: int, counts: dict) -> tuple:
    """(groups, batch_accuracy) of step `step` in, those of step `step` - K out: ([], the fresh accuracy) in the first
    K steps. The queue is run.state["stale_queue"], so every checkpoint holds it."""
    K = run.cfg.staleness
    if K == 0:
        return value
    held = run.state.setdefault("stale_queue", [])
    held.append(dict(step=step, groups=value[0], batch_accuracy=value[1]))
    if len(held) <= K:
        return [], value[1]
    entry = held.pop(0)
    counts["stale_lag"] = step - entry["step"]
    return entry["groups"], entry["batch_accuracy"]


def micro_batch(run, tok: Tokens, mb, sampled: Tensor, sums: dict, epoch: int) -> Tokens:
    """The behaviour-to-proximal KL (first epoch: tok.old_logp is the proximal log-prob), then with the rollout anchor
    the ratio's denominator becomes the behaviour log-prob on the sampled tokens."""
    if epoch == 0 and run.cfg.staleness > 0:
        sums["stale_kl"] = sums.get("stale_kl", 0.0) + behaviour_kl(mb.sampler_logp, tok.old_logp, sampled).item()
        sums["stale_tokens"] = sums.get("stale_tokens", 0.0) + sampled.sum().item()
    if run.cfg.is_anchor == "rollout":
        tok.old_logp = torch.where(sampled, mb.sampler_logp, tok.old_logp)
    return tok


def behaviour_kl(behaviour_logp: Tensor, proximal_logp: Tensor, mask: Tensor) -> Tensor:
    """Sum over the mask of k3 = exp(o - b) - (o - b) - 1: [B, T] each -> scalar; per token, Schulman's unbiased
    estimate of KL(mu || pi_prox) from tokens sampled by mu (AReaL's k3 of its decoupled loss)."""
    mask = mask.bool()
    zero = torch.zeros_like(behaviour_logp)
    return on_mask(kl3(torch.where(mask, behaviour_logp, zero), torch.where(mask, proximal_logp, zero)), mask).sum()


def metrics(run, sums: dict, counts: dict) -> dict:
    if run.cfg.staleness == 0:
        return {}
    n = max(all_sum(sums.get("stale_tokens", 0.0), run.world).item(), 1)
    kl = all_sum(sums.get("stale_kl", 0.0), run.world).item() / n
    return {"stale/lag": counts.get("stale_lag", 0), "stale/kl_k3": kl}


def plain_is(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, hp) -> tuple[Tensor, Tensor]:
    """Plain importance sampling: obj = rho * A, rho = exp(logp - old_logp), unclipped (no token is cut). Its gradient
    is rho * A * grad logp, the unbiased policy gradient of samples drawn by old_logp's policy. With --is-anchor rollout
    old_logp is the behaviour's: the "no correction" arm of an async study (the unclipped IS that collapses)."""
    mask = mask.bool()
    return token_ratio(logp, old_logp, mask) * on_mask(adv, mask), torch.zeros_like(mask)


LOSSES = {"plain_is": Objective(plain_is)}
