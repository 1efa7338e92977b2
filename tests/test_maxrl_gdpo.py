"""Tests for MaxRL (methods/maxrl.py), GDPO (methods/gdpo.py) and the reward components GDPO reads (tasks.py,
rewards.py). Each formula is checked on hand-made tensors (exact values), against a short transcription of each
peer's rule (prime-rl and rlhf-book, SkyRL; TRL, ms-swift, verl, NeMo-RL: the same operations restated here, as
docs/algorithms.md cites them) on random inputs, for its edge cases, and for what GRPO-MA's tree and several ranks
make of it. The flag checks refuse what cannot work in one sentence."""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from config import PRESETS, TrainConfig
from methods import gdpo, maxrl
from metrics import rollout_metrics
from pack import Answer, Group, Thought
from rewards import code_reward, components, countdown_numbers_reward, countdown_reward, math_reward
from tasks import get_task

F64 = torch.float64


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def binary(*shape: int, seed: int = 0) -> torch.Tensor:
    return (rand(*shape, seed=seed) < 0.4).to(F64)


# ----------------------------------------------------------------------------------------------
# The peers' rules, transcribed


def prime_rl_maxrl(r: torch.Tensor) -> torch.Tensor:
    """prime-rl max_rl / rlhf-book: where(mean > 0, (r - mean) / mean, 0) per group (last dim)."""
    mean = r.mean(-1, keepdim=True)
    return torch.where(mean > 0, (r - mean) / mean, torch.zeros_like(r))


def skyrl_maxrl(r: torch.Tensor) -> torch.Tensor:
    """SkyRL maxrl: (r - mean) / (mean + 1e-6); a group of one returns r."""
    if r.shape[-1] == 1:
        return r.clone()
    mean = r.mean(-1, keepdim=True)
    return (r - mean) / (mean + 1e-6)


def trl_normalize_then_sum(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """TRL normalize_then_sum on rewards_per_func [B*G, C] viewed [B, G, C]: group z-scores (unbiased std + eps),
    weighted nansum, then z-score over the whole batch (unbiased std + eps)."""
    z = (x - x.nanmean(1, keepdim=True)) / (x.std(1, keepdim=True) + eps)
    s = (z * w).nansum(-1)
    return (s - s.nanmean()) / (s.std() + eps)


def swift_gdpo(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """ms-swift scale_rewards="gdpo": nan_to_num((r - nanmean) / (nanstd + 1e-8)), weighted sum, then
    (s - mean) / (unbiased std + 1e-8)."""
    z = ((x - x.nanmean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-8)).nan_to_num()
    s = (z * w).sum(-1)
    return (s - s.mean()) / (s.std() + 1e-8)


def verl_gdpo(x: torch.Tensor, w: torch.Tensor, lengths: torch.Tensor, T: int) -> torch.Tensor:
    """verl adv_estimator=gdpo: per component verl GRPO ((r - mean) / (std + 1e-6)), weighted sum broadcast to every
    response token, masked_whiten over the response mask (token mean, unbiased token variance, rsqrt(var + 1e-8))."""
    z = (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-6)
    s = (z * w).sum(-1).flatten()
    mask = (torch.arange(T)[None, :] < lengths.flatten()[:, None]).to(F64)
    values = s[:, None] * mask
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened[:, 0].view(x.shape[:2])  # every row has >= 1 token: its first token's advantage


def nemo_gdpo(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """NeMo-RL gdpo with leave_one_out_baseline: per prompt and component, baseline = (1 - I) @ r / (n - 1),
    std = sqrt((1 - I) @ r^2 / (n - 1) - baseline^2).nan_to_num(0), A = r - baseline, divided by (std + 1e-6) where
    std > 0; weighted sum; batch (A - mean) / std, or only the mean subtracted where std = 0."""
    P, G, C = x.shape
    out = torch.zeros(P, G, dtype=x.dtype)
    for c in range(C):
        for p in range(P):
            r = x[p, :, c]
            m = 1 - torch.eye(G, dtype=x.dtype)
            base, square = m @ r / (G - 1), m @ (r**2) / (G - 1)
            std = (square - base.square()).sqrt().nan_to_num(0)
            a = r - base
            out[p] += w[c] * torch.where(std > 0, a / (std + 1e-6), a)
    std = out.std()
    return (out - out.mean()) / std if std > 0 else out - out.mean()


# ----------------------------------------------------------------------------------------------
# MaxRL


def test_maxrl_values_and_edge_cases():
    """Guards against the wrong scale or baseline: a success gets 1/p - 1 and a failure -1, each group's advantages
    sum to 0, and all-0 groups, all-1 groups and groups of one give exactly 0 (no 0/0 nan)."""
    r = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    adv = maxrl.maxrl_advantages(r)
    assert adv[0].tolist() == [3.0, -1.0, -1.0, -1.0]  # p = 1/4: 1/p - 1 = 3
    torch.testing.assert_close(adv[1], torch.tensor([1 / 3, 1 / 3, 1 / 3, -1.0]))  # p = 3/4
    assert adv[2:].eq(0).all() and not adv.isnan().any()
    assert maxrl.maxrl_advantages(torch.tensor([[1.0], [0.0]])).eq(0).all()
    x = binary(64, 8, seed=1)
    a = maxrl.maxrl_advantages(x)
    live = x.mean(-1) > 0
    torch.testing.assert_close(a[live].sum(-1), torch.zeros(int(live.sum()), dtype=F64), atol=1e-12, rtol=0)


def test_maxrl_equals_prime_rl_and_documents_skyrl():
    """Guards against drifting from prime-rl/rlhf-book's rule, and pins SkyRL's documented difference: equal to
    1e-6 relative on binary groups of 2 or more, the raw reward for a group of one."""
    x = binary(200, 8, seed=2)
    torch.testing.assert_close(maxrl.maxrl_advantages(x), prime_rl_maxrl(x), atol=0, rtol=0)
    torch.testing.assert_close(maxrl.maxrl_advantages(x), skyrl_maxrl(x), atol=0, rtol=1e-5)
    one = torch.tensor([[1.0], [0.0]])
    assert skyrl_maxrl(one).tolist() == [[1.0], [0.0]] and maxrl.maxrl_advantages(one).eq(0).all()


def test_maxrl_gradient_is_the_truncated_log_likelihood_gradient():
    """Guards against an estimator that does not follow log p: with a Bernoulli policy (success probability
    p = sigmoid(theta)) and groups of N, the expected MaxRL gradient, summed over all 2^N outcomes, equals the
    gradient of -sum_{k=1}^{N-1} (1 - p)^k / k, the maximum-likelihood objective log p truncated at order N - 1."""
    N, theta0 = 4, 0.3
    theta = torch.tensor(theta0, dtype=F64, requires_grad=True)
    p = torch.sigmoid(theta)
    expected = torch.zeros((), dtype=F64)
    for ys in itertools.product((0.0, 1.0), repeat=N):
        y = torch.tensor(ys, dtype=F64)
        prob = (p**y * (1 - p) ** (1 - y)).prod().detach()
        logpi = y * torch.log(p) + (1 - y) * torch.log(1 - p)
        expected = expected + prob * (maxrl.maxrl_advantages(y[None])[0] * logpi).sum() / N
    (grad,) = torch.autograd.grad(expected, theta)
    t = torch.tensor(theta0, dtype=F64, requires_grad=True)
    truncated = -sum((1 - torch.sigmoid(t)) ** k / k for k in range(1, N))
    (want,) = torch.autograd.grad(truncated, t)
    torch.testing.assert_close(grad, want, atol=1e-12, rtol=0)


def test_maxrl_tree_and_binary_refusal():
    """Guards against GRPO-MA's tree changing MaxRL at M = 1, thoughts not valued by their answers' mean, and a
    non-binary reward (a shaped one) being trained on silently."""
    r = binary(6, 4, 3, seed=3)
    thought, answer = maxrl.grpo_ma_maxrl_advantages(r)
    torch.testing.assert_close(thought, maxrl.maxrl_advantages(r.mean(-1)))
    torch.testing.assert_close(answer, maxrl.maxrl_advantages(r.view(6, 12)).view(6, 4, 3))
    t1, a1 = maxrl.grpo_ma_maxrl_advantages(r[..., :1])
    torch.testing.assert_close(t1, a1[..., 0])
    torch.testing.assert_close(t1, maxrl.maxrl_advantages(r[..., 0]))
    maxrl.check_binary(r, 1)
    with pytest.raises(ValueError, match=r"--advantage maxrl needs rewards in \{0, 1\}, and this step has 0.5"):
        maxrl.check_binary(torch.tensor([1.0, 0.5]), 1)


# ----------------------------------------------------------------------------------------------
# GDPO


@pytest.mark.parametrize("form", gdpo.FORMS)
def test_gdpo_equals_each_peer(form):
    """Guards against drifting from the peer each --gdpo-form names (eps, std, leave-one-out, token weighting):
    random components and weights, 8 prompts x 6 completions x 3 components."""
    x, w = rand(8, 6, 3, seed=4), torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    lengths = torch.randint(1, 12, (8, 6), generator=torch.Generator().manual_seed(5))
    want = {
        "trl": lambda: trl_normalize_then_sum(x, w),
        "swift": lambda: swift_gdpo(x, w),
        "verl": lambda: verl_gdpo(x, w, lengths, 12),
        "nemo": lambda: nemo_gdpo(x, w),
    }[form]()
    torch.testing.assert_close(gdpo.gdpo_advantages(x, w, form, lengths), want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("form", gdpo.FORMS)
def test_gdpo_constant_components_give_zero(form):
    """Guards against rounding or a leave-one-out std residue turning a constant component into a signal: all-equal
    rewards give exactly 0 everywhere, and a component constant within a group adds exactly 0 to that group's score
    (so the group's advantages are those of the other components alone)."""
    lengths = torch.full((4, 5), 3)
    same = torch.full((4, 5, 2), 0.1, dtype=F64)
    assert gdpo.gdpo_advantages(same, torch.ones(2, dtype=F64), form, lengths).eq(0).all()
    x = rand(4, 5, 2, seed=6)
    x[1, :, 0] = 0.7  # component 0 constant in group 1
    z = gdpo.group_scores(x, form)
    assert z[1, :, 0].eq(0).all()
    alone = x.clone()
    alone[..., 0] = x[..., 1]
    torch.testing.assert_close(gdpo.weighted(x, torch.tensor([1.0, 1.0]), form)[1], z[1, :, 1])
    x[2] = 0.3  # every component constant in group 2
    adv = gdpo.gdpo_advantages(x, torch.ones(2, dtype=F64), form, lengths)
    if form in ("trl", "swift"):
        assert adv[2].eq(0).all()


def test_gdpo_weights_scale_the_normalised_components():
    """Guards against weighting the raw rewards instead (a weight of 10 on a 0/1 component would then just scale it
    before its z-score and change nothing): the weights multiply the group z-scores, before the batch step."""
    x = rand(5, 4, 2, seed=7)
    z = gdpo.group_scores(x, "trl")
    s = gdpo.weighted(x, torch.tensor([10.0, 1.0]), "trl")
    torch.testing.assert_close(s, 10 * z[..., 0] + z[..., 1])
    raw = x.clone()
    raw[..., 0] *= 10
    torch.testing.assert_close(gdpo.weighted(raw, torch.ones(2), "trl"), z.sum(-1), atol=1e-3, rtol=0)  # eps 1e-4


def test_gdpo_singletons_and_tiny_batches():
    """Guards against nan from a group of one or a batch of one: trl, swift and nemo give 0 for a group of one,
    verl its raw reward (its GRPO's mean 0, std 1); a batch of one entry has std 0."""
    x = torch.tensor([[[0.2, 1.0]], [[0.6, 0.0]]], dtype=F64)
    assert gdpo.group_scores(x, "trl").eq(0).all() and gdpo.group_scores(x, "nemo").eq(0).all()
    assert torch.equal(gdpo.group_scores(x, "verl"), x)
    assert gdpo.batch_normalise(torch.tensor([0.5], dtype=F64), "trl").eq(0).all()


def test_gdpo_tree_reduces_to_plain_at_one_answer():
    """Guards against GRPO-MA's tree changing GDPO at M = 1 or valuing thoughts otherwise than by their answers'
    mean components: thought = GDPO over the thought values, answer = GDPO over the prompt's K*M answers."""
    x = rand(3, 4, 2, 2, seed=8)  # P, K, M, C
    groups = [
        Group(
            example={},
            prompt=[1],
            thoughts=[
                Thought([5] * (k + 1), [0.0] * (k + 1), False, [answer(x[p, k, j], 2 + j) for j in range(2)])
                for k in range(4)
            ],
        )
        for p in range(3)
    ]
    run = fake_run(("correct", "format"))
    thought, ans = gdpo.advantages(run, groups, None, 0.0)
    w = torch.ones(2, dtype=F64)
    torch.testing.assert_close(ans.double(), gdpo.gdpo_advantages(x.view(3, 8, 2), w).view(3, 4, 2), atol=1e-6, rtol=0)
    torch.testing.assert_close(thought.double(), gdpo.gdpo_advantages(x.mean(2), w), atol=1e-6, rtol=0)
    one = [
        Group(example={}, prompt=[1], thoughts=[Thought([], [], False, t.answers[:1]) for t in g.thoughts])
        for g in groups
    ]
    t1, a1 = gdpo.advantages(run, one, None, 0.0)
    torch.testing.assert_close(t1, a1[..., 0])
    torch.testing.assert_close(t1.double(), gdpo.gdpo_advantages(x[:, :, 0], w), atol=1e-6, rtol=0)


def answer(values: torch.Tensor, n_tokens: int) -> Answer:
    return Answer(
        [7] * n_tokens, [0.0] * n_tokens, "stop", components=dict(zip(("correct", "format"), values.tolist()))
    )


def fake_run(names: tuple[str, ...], **flags) -> SimpleNamespace:
    cfg = SimpleNamespace(advantage="gdpo", reward_weights="", gdpo_form="trl", **flags)
    task = SimpleNamespace(name="t", components={n: (None, 1.0) for n in names})
    return SimpleNamespace(cfg=cfg, task=task, rank=0, world=1)


def _ranks(rank: int, world: int, path: str, x: torch.Tensor, tokens: torch.Tensor, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    half = x.shape[0] // world
    rows = slice(rank * half, (rank + 1) * half)
    w = torch.tensor([1.0, 0.5], dtype=F64)
    for form in gdpo.FORMS:
        adv = gdpo.step_advantages(x[rows], w, form, tokens[rows], rank, world)
        torch.save(adv, f"{out}.{form}.{rank}")
    dist.destroy_process_group()


def test_gdpo_batch_step_is_the_same_on_two_ranks():
    """Guards against a batch statistic taken over one rank's rows: 2 gloo ranks, each with half the prompts, give
    every form's advantages of one process on the whole batch."""
    x, tokens = rand(6, 4, 2, seed=9), torch.randint(1, 9, (6, 4), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "adv")
        mp.spawn(_ranks, args=(2, os.path.join(d, "init"), x, tokens, out), nprocs=2, join=True)
        for form in gdpo.FORMS:
            two = torch.cat([torch.load(f"{out}.{form}.{r}") for r in range(2)])
            torch.testing.assert_close(two, gdpo.gdpo_advantages(x, torch.tensor([1.0, 0.5], dtype=F64), form, tokens))


# ----------------------------------------------------------------------------------------------
# Reward components


def test_builtin_components_sum_to_the_reward():
    """Guards against components that change the reward (every golden number rests on it): for each built-in task the
    weighted sum of the components equals the task's reward, on right, wrong and malformed completions."""
    completions = [
        "<think>1+1</think>2",
        "</think>3",
        "no thought",
        "<think>x</think><answer>(52 * 14) - 98</answer>",
        "<think>x</think>\\boxed{2}",
        "<think>x</think>```python\ndef f():\n    return 1\n```",
        "",
    ]
    for name in ("synthetic", "synthetic-vertical", "synthetic-mul", "countdown"):
        task = get_task(name)
        for ex in task.train(3, 0):
            for c in completions + [f"<think>x</think>{ex['answer']}", f"<answer>{ex['answer']}</answer>"]:
                total = sum(w * fn(c, ex) for fn, w in task.components.values())
                assert total == task.reward(c, ex), (name, c)
    assert set(get_task("countdown").components) == {"correct", "format", "each_number_once"}


def test_countdown_components():
    """Guards against components that do not say what their names say: format is a closed <answer> tag, right or
    wrong; each_number_once ignores the value; correct needs both and the target."""
    ex = {"nums": [52, 14, 98], "target": 630}
    right, wrong_value, reused = (
        "<answer>(52 * 14) - 98</answer>",
        "<answer>52 + 14 + 98</answer>",
        "<answer>52*14</answer>",
    )
    form = components(countdown_reward)["format"][0]
    assert [form(c, ex) for c in (right, wrong_value, reused, "(52*14)-98")] == [1, 1, 1, 0]
    assert [countdown_numbers_reward(c, ex) for c in (right, wrong_value, reused)] == [1, 1, 0]
    assert [countdown_reward(c, ex) for c in (right, wrong_value, reused)] == [1, 0, 0]


def test_math_and_code_format_components():
    """Guards against a format component that grades the answer, or misses the form the task asks for: math's is a
    final answer extract_answer reads (boxed, ####), right or wrong; code's a closed ```python block."""
    math_form, code_form = components(math_reward)["format"][0], components(code_reward)["format"][0]
    ex = {"answer": "2"}
    assert [math_form(c, ex) for c in ("<think>x</think>\\boxed{3}", "#### 2", "the answer is", "\\boxed{")] == [
        1,
        1,
        0,
        0,
    ]
    assert [code_form(c, ex) for c in ("```python\nx = 1\n```", "```python\nx = 1", "x = 1")] == [1, 0, 0]
    assert components(math_reward)["correct"] == (math_reward, 1.0) and components(math_reward)["format"][1] == 0.0


def test_component_means_are_logged():
    """Guards against the components' means missing from the metrics row (or mixing up components)."""
    x = torch.tensor([[[[1.0, 1.0]], [[0.0, 1.0]]], [[[0.0, 0.5]], [[0.0, 1.0]]]], dtype=F64)  # P=2, K=2, M=1
    groups = [Group({}, [1], [Thought([], [], False, [answer(x[p, k, 0], 2)]) for k in range(2)]) for p in range(2)]
    row = rollout_metrics(groups, 1, 1)
    assert row["reward/correct"] == 0.25 and row["reward/format"] == 0.875


# ----------------------------------------------------------------------------------------------
# Refusals


def errors(**flags) -> list[str]:
    try:
        TrainConfig(**flags)
    except ValueError as e:
        return [str(e)]
    return []


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(advantage="maxrl"), "--advantage maxrl scales by the group mean"),
        (dict(advantage="gdpo", std_normalize=False), "--advantage gdpo divides by its own stds"),
        (dict(advantage="gdpo", reward_noise="0.1,0.1"), "which --reward-noise does not change"),
        (dict(advantage="gdpo", overlong_buffer=4), "which --overlong-buffer does not change"),
        (dict(advantage="gdpo", anchors=True), "which --anchors does not change"),
        (dict(reward_weights="correct=2"), "--reward-weights needs --advantage gdpo"),
        (dict(gdpo_form="verl"), "--gdpo-form needs --advantage gdpo"),
        (dict(advantage="gdpo", reward_weights="correct"), "'correct' is not name=number"),
        (dict(advantage="gdpo", gdpo_form="other"), "--gdpo-form must be one of"),
    ],
)
def test_refusals_are_one_sentence_naming_the_flag(kw, message):
    """Guards against a combination GDPO or MaxRL cannot honour being accepted (a reward transform the components never
    see, a no-op weight) or refused without naming the flag."""
    found = errors(**kw)
    assert any(message in e for e in found), found
    assert all("\n" not in e for e in found)


def test_gdpo_refuses_a_task_without_components_and_unknown_weights():
    """Guards against GDPO running on a scalar reward (nothing to normalise one by one) or a weight whose name
    matches no component (a typo that would leave every weight at 1)."""
    run = fake_run(("correct", "format"))
    run.task.components = None
    with pytest.raises(ValueError, match="needs a reward with named components, and task 't' has none"):
        gdpo.start(run)
    run = fake_run(("correct", "format"))
    run.cfg.reward_weights = "corect=2"
    with pytest.raises(
        ValueError, match=r"--reward-weights names corect, not a component of task 't' \(correct, format\)"
    ):
        gdpo.start(run)


@pytest.mark.slow
def test_gdpo_and_maxrl_train_through_the_seam(tmp_path):
    """Guards against the wiring between the components and the loop: GDPO on GRPO-MA's tree (verl's token-weighted
    form) and MaxRL each train 2 steps of the bundled model with finite losses, GDPO logging each component's mean,
    and a reward shaped off {0, 1} (DAPO's overlong penalty) stops MaxRL with its one sentence."""
    import train
    from helpers import SMALL_RUN

    for name, kw in (("gdpo", dict(algo="gdpo", answers=2, gdpo_form="verl")), ("maxrl", dict(algo="maxrl"))):
        out = str(tmp_path / name)
        train.main(TrainConfig(**{**SMALL_RUN, **PRESETS[kw["algo"]], "out": out, "samples_every": 0, **kw}))
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
        assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
        if name == "gdpo":  # its components, scored and logged (a run that does not read them scores none)
            assert all(0 <= r["reward/format"] <= 1 and r["reward/correct"] == r["reward/mean"] for r in rows)
        else:
            assert not any("reward/format" in r for r in rows)
    shaped = dict(
        SMALL_RUN, **PRESETS["maxrl"], algo="maxrl", overlong_buffer=12, out=str(tmp_path / "x"), samples_every=0
    )
    with pytest.raises(Exception, match=r"--advantage maxrl needs rewards in \{0, 1\}"):
        train.main(TrainConfig(**shaped))
