"""GDPO (arXiv 2601.05242): each reward component z-scored within its group, a weighted sum, then the sum normalised
over the whole step's batch (--advantage gdpo, or --algo gdpo). Normalising components one by one keeps a rare one
(a format term every completion already earns, a bonus few earn) from being drowned by, or drowning, the others.

Seam: advantages. The task's reward components (Task.components, one value per completion in pack.Answer.components)
[P, G, C] -> advantages [P, G]; with GRPO-MA's tree [P, K, M, C] -> (thought [P, K], answer [P, K, M]).

--gdpo-form picks the peer whose rule is reproduced (docs/algorithms.md):
  trl    TRL multi_objective_aggregation="normalize_then_sum" (the default): group (r - mean) / (unbiased std + 1e-4),
         a group of one gives 0; batch (s - mean) / (unbiased std + 1e-4).
  swift  ms-swift scale_rewards="gdpo": as trl with eps 1e-8 at both steps.
  verl   verl adv_estimator=gdpo: group (r - mean) / (unbiased std + 1e-6), a group of one gives r itself; batch
         masked_whiten over the response TOKENS: token-weighted mean, unbiased token variance, (s - mean) *
         rsqrt(var + 1e-8), so longer completions weigh more.
  nemo   NeMo-RL gdpo (leave-one-out, its class default): baseline the mean of the OTHER rewards of the group, std
         the population std of the others (sqrt(mean of squares - baseline^2), nan -> 0), (r - baseline) divided by
         (std + 1e-6) only where std > 0; batch (s - mean) / unbiased std, only the mean subtracted where std is 0.
Every form: the weights (--reward-weights name=w,..., default 1 each) multiply the NORMALISED components, as in all
four peers; all-equal rewards give exactly 0; a component constant within a group contributes exactly 0 there (an
explicit mask: the formulas give 0 up to rounding, except nemo's, whose leave-one-out std can be a rounding residue).
A group whose every component is constant sums to 0 before the batch step, which then shifts it by -mean/std, as
the peers do: trl and swift centre groups whose scores sum to 0, so the shift is rounding and is masked to exactly
0; verl's token-weighted mean and nemo's leave-one-out scores make it a real shift, kept as those peers have it.
Batch statistics are over every rank's rows (distributed.gather_rows), so the world size cannot change them.
With the tree: thought advantage = GDPO over the K thought values (each component's mean over the thought's M
answers), answer advantage = GDPO over the prompt's K*M answers (GRPO-MA's groups); each batch step over its own
rows (verl: thought tokens, answer tokens). M = 1 gives plain GDPO over the K completions.
Refused: a task without components, reward transforms the components do not see (noise, DAPO's overlong penalty,
DaGRPO, the KL in the reward). Left out: TRL's rows where every reward is None (no reward here returns None).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cli import FlagError
from distributed import gather_rows

FORMS = ("trl", "swift", "verl", "nemo")
GROUP_EPS = {"trl": 1e-4, "swift": 1e-8, "verl": 1e-6, "nemo": 1e-6}
BATCH_EPS = {"trl": 1e-4, "swift": 1e-8, "verl": 1e-8, "nemo": 0.0}
# flags whose reward changes the components do not see: GDPO would ignore them
SHAPING = (("reward_noise", "--reward-noise"), ("noise_correct", "--noise-correct"))
SHAPING += (("overlong_buffer", "--overlong-buffer"), ("kl_in_reward", "--kl-in-reward"), ("anchors", "--anchors"))


@dataclass
class Flags:
    """The flags of this method (config.TrainConfig gathers them; a trailing comment is the --help text)."""

    # -- advantages
    reward_weights: str = ""  # GDPO: weights of the normalised reward components, name=w,... (default 1 each)
    gdpo_form: str = "trl"  # GDPO as trl (eps 1e-4), swift (1e-8), verl (token-weighted batch), nemo (leave-one-out)


CHOICES = {"gdpo_form": FORMS}
PRESETS = {"gdpo": dict(advantage="gdpo")}


def enabled(cfg) -> bool:
    return cfg.advantage == "gdpo"


def parse_weights(spec: str) -> dict[str, float]:
    """'correct=1,format=0.5' -> {"correct": 1.0, "format": 0.5}; a ValueError names the malformed item."""
    weights = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = item.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--reward-weights: '{item}' is not name=number") from None
        if not name.strip() or not math.isfinite(weights[name.strip()]):
            raise ValueError(f"--reward-weights: '{item}' is not name=number")
    return weights


def check(cfg) -> Iterator[FlagError]:
    on, me = cfg.advantage == "gdpo", "--advantage gdpo"
    for field, spelled in SHAPING if on else ():
        if getattr(cfg, field, False) not in (False, 0, "", None):
            why = f"normalises the task's reward components, which {spelled} does not change: drop it"
            yield FlagError(("advantage",), why, (field,), me)
    if on and getattr(cfg, "pair_delta", -1) >= 0:
        yield FlagError(("advantage",), "replaces DaGRPO's advantages: drop --pair-delta", ("pair_delta",), me)
    if on and not cfg.std_normalize:
        yield FlagError(("advantage",), "divides by its own stds: drop --no-std-normalize", ("std_normalize",), me)
    for field in ("reward_weights", "gdpo_form"):
        if not on and getattr(cfg, field) != Flags.__dataclass_fields__[field].default:
            yield FlagError((field,), "needs --advantage gdpo (or --algo gdpo)", ("advantage",))
    try:
        parse_weights(cfg.reward_weights)
    except ValueError as e:
        yield FlagError(("reward_weights",), str(e).split(": ", 1)[1])


def start(run) -> None:
    """The task's components and --reward-weights' names, known once the task is."""
    if run.cfg.advantage != "gdpo":
        return
    parts = run.task.components
    if not parts:
        raise ValueError(f"--advantage gdpo needs a reward with named components, and task '{run.task.name}' has none.")
    unknown = sorted(set(parse_weights(run.cfg.reward_weights)) - set(parts))
    if unknown:
        have, name = ", ".join(parts), run.task.name
        raise ValueError(f"--reward-weights names {', '.join(unknown)}, not a component of task '{name}' ({have}).")


def group_scores(x: Tensor, form: str = "trl") -> Tensor:
    """Each component normalised within its group as `form`'s peer does: x [P, G, C] -> [P, G, C]. A component
    constant within a group gives exactly 0 there (verl's group of one excepted: it keeps r)."""
    x = x if x.is_floating_point() else x.float()
    G = x.shape[1]
    if form == "nemo":
        keep = 1 - torch.eye(G, dtype=x.dtype) if G > 1 else torch.ones(1, 1, dtype=x.dtype)  # leave one out
        n = max(G - 1, 1)
        base = torch.einsum("ij,pjc->pic", keep, x) / n
        square = torch.einsum("ij,pjc->pic", keep, x.square()) / n
        if G == 1:  # no other reward: the baseline is the reward itself
            base, square = x, torch.zeros_like(x)
        std = (square - base.square()).sqrt().nan_to_num(0.0)
        z = torch.where(std > 0, (x - base) / (std + GROUP_EPS[form]), x - base)
    elif G == 1:
        return x.clone() if form == "verl" else torch.zeros_like(x)
    else:
        z = (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + GROUP_EPS[form])
    return z.masked_fill(x.amax(1, keepdim=True) == x.amin(1, keepdim=True), 0.0)


def batch_normalise(s: Tensor, form: str = "trl", tokens: Tensor | None = None) -> Tensor:
    """The summed scores normalised over the whole batch as `form`'s peer does: s [N] (any shape) -> same shape.
    verl weighs each entry by its token count `tokens` (same shape). Fewer than 2 entries (tokens): std 0."""
    if form == "verl":
        w = tokens.to(s.dtype)
        total = w.sum()
        mean = (s * w).sum() / total
        var = ((s - mean).square() * w).sum() / total * (total / (total - 1) if total > 1 else 0.0)
        return (s - mean) * torch.rsqrt(var + BATCH_EPS[form])
    mean = s.mean()
    std = s.std() if s.numel() > 1 else torch.zeros_like(mean)
    if form == "nemo":
        return torch.where(std > 0, (s - mean) / std, s - mean)
    return (s - mean) / (std + BATCH_EPS[form])


def gdpo_advantages(x: Tensor, weights: Tensor, form: str = "trl", tokens: Tensor | None = None) -> Tensor:
    """GDPO of one process's whole batch: components x [P, G, C], weights [C] (tokens [P, G] for verl) -> [P, G]."""
    return finish(weighted(x, weights, form), form, tokens, x)


def weighted(x: Tensor, weights: Tensor, form: str) -> Tensor:
    """sum_c w_c * group_scores(x)[..., c]: [P, G, C] -> [P, G]."""
    return (group_scores(x, form) * weights.to(x.dtype)).sum(-1)


def finish(s: Tensor, form: str, tokens: Tensor | None, x: Tensor) -> Tensor:
    """The batch step of the summed scores s [P, G]; trl and swift: groups whose components are all constant
    (components x [P, G, C]) exactly 0."""
    adv = batch_normalise(s, form, tokens)
    if form in ("trl", "swift"):
        adv = adv.masked_fill((x.amax(1) == x.amin(1)).all(-1, keepdim=True), 0.0)
    return adv


def step_advantages(x: Tensor, weights: Tensor, form: str, tokens: Tensor, rank: int, world: int) -> Tensor:
    """GDPO of this rank's groups x [P_r, G, C] (tokens [P_r, G]), the batch step over every rank's rows."""
    s, mine = gather_rows(weighted(x, weights, form), rank, world)
    full_tokens = gather_rows(tokens.to(s.dtype), rank, world)[0]
    full_x = gather_rows(x.flatten(1), rank, world)[0].view(-1, *x.shape[1:])
    return finish(s, form, full_tokens, full_x)[mine]


def advantages(run, groups: list, reward: Tensor, batch_accuracy: float) -> tuple[Tensor, Tensor]:
    """--advantage gdpo: the groups' reward components -> (thought [P, K], answer [P, K, M])."""
    cfg, names = run.cfg, list(run.task.components)
    given = parse_weights(cfg.reward_weights)
    w = torch.tensor([given.get(n, 1.0) for n in names])
    x = torch.tensor([[[[a.components[n] for n in names] for a in t.answers] for t in g.thoughts] for g in groups])
    P, K, M, C = x.shape
    answer_tokens = torch.tensor([[[len(a.tokens) for a in t.answers] for t in g.thoughts] for g in groups])
    thought_tokens = torch.tensor([[len(t.tokens) for t in g.thoughts] for g in groups])
    if M == 1:  # the completion is the answer: its tokens are the thought's (none) and the answer's
        answer_tokens = answer_tokens + thought_tokens[..., None]
    kw = dict(form=cfg.gdpo_form, rank=run.rank, world=run.world)
    answer = step_advantages(x.view(P, K * M, C), w, tokens=answer_tokens.view(P, K * M), **kw).view(P, K, M)
    if M == 1:  # no thought tokens: the thought advantage is the completion's (GRPO-MA's M = 1 reduction)
        return answer.view(P, K), answer
    return step_advantages(x.mean(2), w, tokens=thought_tokens, **kw), answer


ADVANTAGES = {"gdpo": advantages}
