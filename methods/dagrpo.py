"""DaGRPO (arXiv 2512.06337), a RECONSTRUCTION (no official code, no readable method text; docs/algorithms.md
says what is stated and what is inferred): the wiring of its two stated mechanisms (formulas: advantage.py).
- advantages: the distinctiveness mask (--pair-delta) drops the pairs of completions whose fine-grained scores
  differ by less than delta (advantage.pairwise_distinct_advantages); the score is the task's partial credit;
- transform rollouts: anchors (--anchors). In each group with no correct rollout the last rollout is replaced
  by the example's reference solution, trained off-policy: LUFFY's shaping (luffy_shaped, --anchor-gamma) wraps
  whichever objective --loss chose."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from advantage import pairwise_distinct_advantages, splice_anchor_rewards
from cli import FlagError, UserError, out_of_range
from distributed import all_sum
from losses import Objective, need
from pack import Answer, Group, per_group
from rewards import score_batch
from tokenizer import decode_completion


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- advantages
    pair_delta: float = -1.0  # DaGRPO pair mask, a RECONSTRUCTION: drop pairs with |credit gap| < DELTA (-1 = off)
    # DaGRPO anchors: the last rollout of a group with no correct one is replaced by the example's reference solution
    # (task.reference; reward 1, top credit), trained off-policy: f(p) * A with f(p) = p / (p + GAMMA), no ratio clip
    anchors: bool = False  # DaGRPO anchors, a RECONSTRUCTION: all-wrong groups train on the reference solution
    anchor_gamma: float = 0.1  # anchor tokens' objective f(p) * A, f(p) = p / (p + GAMMA), unclipped (LUFFY's 0.1)


# Dr. GRPO + the pair mask at the third-party delta 0.1 + reference-solution anchors on groups with no correct rollout,
# trained with LUFFY's off-policy shaping (gamma 0.1)
PRESETS = {"dagrpo": dict(std_normalize=False, aggregation="seq_mean_token_sum_norm", pair_delta=0.1, anchors=True)}


ANCHOR = "--anchors (an anchor is a whole reference completion, not a thought and its answers)"


def check(cfg) -> Iterator[FlagError]:
    yield from out_of_range(cfg, dict(anchor_gamma="> 0"))
    if not (cfg.pair_delta == -1 or 0 <= cfg.pair_delta < math.inf):
        yield FlagError(("pair_delta",), f"must be >= 0 (-1 = off), got {cfg.pair_delta}")
    if cfg.pair_delta >= 0 and cfg.advantage != "grpo":
        yield FlagError(("pair_delta",), "needs --advantage grpo (the pair mask is its own advantage)", ("advantage",))
    if cfg.kl_estimator == "unbiased" and cfg.anchors:
        why = "needs pi_old on every token; anchor tokens were not sampled by it"
        yield FlagError(("kl_estimator",), why, ("anchors",), "--kl-estimator unbiased")
    for field, subject, used in (("pair_delta", "", cfg.pair_delta >= 0), ("anchors", ANCHOR, cfg.anchors)):
        if used and cfg.answers > 1:
            yield FlagError((field,), "needs --answers 1", ("answers",), subject)


def enabled(cfg) -> bool:
    return cfg.pair_delta >= 0 or cfg.anchors


def check_data(task, cfg, examples: list[dict]) -> None:
    """--anchors: refused when no training prompt (the pool and every stream) has a reference solution."""
    if cfg.anchors:
        check_references(task, examples)


def rewards(run, reward: torch.Tensor, step) -> torch.Tensor:
    """--pair-delta: each completion's credit, the task's partial credit (the reward where the task has none)."""
    if run.cfg.pair_delta < 0:
        return reward
    score = credit(run.task, step.texts, step.examples, run.cfg)
    score = reward if score is None else score
    for a, s in zip(step.answers, score.tolist()):
        a.credit = s
    return reward


def rollouts(run, groups: list[Group], counts: dict) -> list[Group]:
    """--anchors: the groups with no correct rollout train on the reference solution (this rank's counts)."""
    if not run.cfg.anchors:
        return groups
    groups, anchors = splice_anchors(groups, run.task, run.tokenizer, run.cfg.completion_limit)
    counts.update(anchors)
    return groups


def advantages(run, groups: list[Group], reward: torch.Tensor, batch_accuracy: float) -> tuple:
    """--pair-delta, a RECONSTRUCTION: pairs whose credits differ by < delta cancel (answer advantages, M = 1)."""
    if run.cfg.pair_delta < 0:
        return None, None
    kw = dict(std_normalize=run.cfg.std_normalize)
    adv = pairwise_distinct_advantages(
        reward.view(len(reward), -1), per_group(groups, "credit"), run.cfg.pair_delta, **kw
    )
    return None, adv.view(reward.shape)


def check_references(task, examples: list[dict]) -> None:
    """--anchors: refused when no training example has a reference solution (some may lack one: no anchor there)."""
    if all(task.reference(ex) is None for ex in examples):
        raise UserError(
            f"--anchors needs reference solutions but no training example of task '{task.name}' has one "
            "(synthetic: the SFT completion; gsm8k, math: the 'solution' field); drop --anchors (or pass --no-anchors)"
        )


def credit(task, texts: list[str], examples: list[dict], cfg) -> torch.Tensor | None:
    """--pair-delta: each completion's fine-grained score, the task's partial credit (None: the task has none)."""
    if task.partial_credit is None:
        return None
    return torch.tensor(score_batch(task.partial_credit, texts, examples, max_workers=cfg.reward_workers))


def splice_anchors(groups: list[Group], task, tokenizer, limit: int) -> tuple[list[Group], dict[str, int]]:
    """In each group with no correct rollout (M = 1), the last rollout becomes the example's reference solution:
    task.reference(example) tokenised and ended by the end-of-turn token, reward 1 (splice_anchor_rewards),
    correct 1 and the top credit 1 (the pair mask then compares every wrong rollout with it), Answer.sampled
    False (no sampler log-probs: 0 here, and no old log-probs needed). A group gets no anchor when its example
    has no reference, or the reference fails the task's own check or exceeds `limit` tokens (never truncated).

    groups: the policy's own rollouts, left unchanged. Returns the rollouts to train on and counts: anchors
    (groups that got one), anchors/too_long and anchors/no_reference (groups that needed one but could not)."""
    spliced, anchor = splice_anchor_rewards(per_group(groups, "reward"), per_group(groups, "correct"))
    out, counts = list(groups), {"anchors": 0, "anchors/too_long": 0, "anchors/no_reference": 0}
    for p in anchor[:, -1].nonzero().flatten().tolist():
        text, example = task.reference(groups[p].example), groups[p].example
        ids = [] if text is None else tokenizer.encode(text) + ([] if tokenizer.end_id is None else [tokenizer.end_id])
        completion = decode_completion(tokenizer, ids)
        outcome = "anchors" if len(ids) <= limit else "anchors/too_long"
        outcome = "anchors/no_reference" if not ids or task.correct(completion, example) != 1 else outcome
        counts[outcome] += 1
        if outcome == "anchors":  # M = 1: the last thought is empty, its one answer is the completion
            reward, last = spliced[p, -1].item(), groups[p].thoughts[-1]
            reference = Answer(ids, [0.0] * len(ids), "stop", completion, reward, 1.0, 1.0, sampled=False)
            out[p] = replace(groups[p], thoughts=[*groups[p].thoughts[:-1], replace(last, answers=[reference])])
    return out, counts


def off_policy_objective(cfg, entry: Objective) -> Objective:
    """--anchors: the anchors' tokens (Tokens.off_policy) take LUFFY's shaping with --anchor-gamma."""
    return luffy_shaped(entry, cfg.anchor_gamma) if cfg.anchors else entry


def luffy_shaped(entry: Objective, gamma: float) -> Objective:
    """`entry`'s objective, and LUFFY's policy shaping (arXiv 2504.14945; its code's off_policy_reshape="p_div_p_0.1")
    on the tokens the policy did not sample (policy_loss's Tokens.off_policy, passed by `takes`): obj = f(p) * A with
    f(p) = p / (p + gamma), p = exp(logp), gradient through p (d f / d logp = gamma p / (p + gamma)^2, so
    low-probability expert tokens still learn); no ratio, no clip, old_logp unused there (it may be garbage).
    `entry` sees only the other tokens (they are left out of GSPO's sequence mean); the KL term still covers them."""
    need(gamma > 0, f"luffy_shaped: gamma (--anchor-gamma) must be > 0, got {gamma}.")
    return replace(entry, fn=functools.partial(_shaped, entry.fn, gamma=gamma), takes=(*entry.takes, "off_policy"))


def _shaped(fn, logp, old_logp, adv, mask, hp, off_policy=None, *, gamma: float, **takes):
    if off_policy is None:  # no anchor in this micro-batch
        return fn(logp, old_logp, adv, mask, hp, **takes)
    off = off_policy.bool() & mask
    obj, cut = fn(logp, old_logp, adv, mask & ~off, hp, **takes)
    p = torch.exp(torch.where(off, logp, torch.zeros_like(logp)))  # (B, T), with grad; 1 off these tokens
    return torch.where(off, p / (p + gamma) * adv, obj), cut & ~off


def metrics(run, sums: dict, counts: dict[str, int]) -> dict:
    """The step's anchor counts over ranks, and anchors/p_mean: the anchor tokens' mean probability under the
    policy (the update's sums over its off-policy tokens)."""
    if not run.cfg.anchors:
        return {}
    world = run.world
    row = {k: int(all_sum(v, world).item()) for k, v in counts.items() if k.startswith("anchors")}
    n_off = all_sum(sums["off_tokens"], world).item()
    return row | {"anchors/p_mean": all_sum(sums["off_p"], world).item() / max(n_off, 1)}
