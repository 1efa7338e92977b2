"""DaGRPO's anchors (a reconstruction): a group with no correct rollout trains on the example's reference
solution in place of its last rollout, off-policy. The references score full reward under their own task, the
splice puts the reference's tokens, reward and top credit in the right row (and only there), the update sees
the reference's log-probs exactly as a plain forward of prompt + reference gives them with the off-policy mask
on those tokens only, and every bad flag is one sentence."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import train
from helpers import BUNDLED, SMALL_RUN
from hf import load_model
from logprobs import token_logprobs
from methods import dagrpo
from pack import Answer, Group, completions, per_completion, rollouts
from sampler import Tree
from tasks import get_task, no_reference, render_prompt, sft_completion, solution_completion
from tokenizer import load_tokenizer
from train import PRESETS, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?",
    "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72 clips.\n#### 72",
}
MATH_ROW = {"problem": "What is 1/4 + 1/4?", "solution": "We add: $\\frac14+\\frac14=\\boxed{\\frac{1}{2}}$."}


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------- Task.reference


@pytest.mark.parametrize("name", ["synthetic", "synthetic-hard", "gsm8k", "math"])
def test_reference_completions_earn_full_reward(tmp_path, name):
    """Guards against an anchor the task's own reward would not accept (a reference written in another format
    than the one the reward parses, e.g. GSM8K's `#### N` or a box left inside the thought), which would train
    the policy towards a completion the verifier calls wrong."""
    rows = {"gsm8k": GSM8K_ROW, "math": MATH_ROW}
    data = write_jsonl(tmp_path / "d.jsonl", [rows[name]] * 10) if name in rows else None
    task = get_task(name, data)
    tokenizer = load_tokenizer(BUNDLED)
    for example in task.train(20, 0):
        text = task.reference(example)
        assert text is not None and text.startswith("<think>") and text.count("</think>") == 1
        assert task.reward(text, example) == 1.0 and task.correct(text, example) == 1.0
        if name.startswith("synthetic"):  # the bundled tokenizer writes it back exactly (the trainer encodes it)
            assert tokenizer.decode(tokenizer.encode(text)) == text


def test_reference_completion_formats_by_hand():
    """Guards against GSM8K's calculator annotations or `#### N` line leaking into the thought, and against the
    final answer not being the box after </think> that SYSTEM_PROMPT asks for."""
    gsm8k = {"prompt": "q", "answer": "72", "solution": GSM8K_ROW["answer"]}
    want = "<think>\nIn May she sold 48/2 = 24 clips.\nIn all 48+24 = 72 clips.\n</think>\n\n\\boxed{72}"
    assert solution_completion(gsm8k) == want
    math = {"prompt": "q", "answer": "\\frac{1}{2}", "solution": MATH_ROW["solution"]}
    assert solution_completion(math) == f"<think>\n{MATH_ROW['solution']}\n</think>\n\n\\boxed{{\\frac{{1}}{{2}}}}"
    addition = {"prompt": "357+68", "answer": "425", "a": 357, "b": 68}
    assert get_task("synthetic").reference(addition) == "<think>7+8=15\n5+6+1=12\n3+0+1=4\n</think>425"


def test_tasks_without_references_give_none(tmp_path):
    """Guards against an anchor made up for an example that has no reference solution (countdown puzzles,
    code tests, generic prompt/answer rows), instead of that group simply getting no anchor."""
    assert get_task("countdown").reference is no_reference
    generic = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "1+1?", "answer": "2"}] * 10)
    code = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "def f(): ...", "tests": "assert f() is None"}] * 10)
    for task in (get_task("countdown"), get_task("jsonl", generic), get_task("code", code)):
        assert all(task.reference(e) is None for e in task.train(5, 0))
    assert solution_completion({"prompt": "1+1?", "answer": "2"}) is None  # a generic row in a math file


# ---------------------------------------------------------------- the splice (step 2c)


def anchor_run(tmp_path, **kw) -> train.Run:
    """A run on synthetic-hard (4-digit sums, out of distribution for the bundled model: most groups fail) with
    room for a reference completion (at most 4 lines of 8 characters, the answer and the think tokens)."""
    cfg = dict(SMALL_RUN, task="synthetic-hard", max_thought_tokens=40, max_answer_tokens=8, anchors=True,
               samples_every=0, out=str(tmp_path / "run"), overwrite=True)  # fmt: skip
    return train.setup(TrainConfig(**{**cfg, **kw}))


def hand_rollouts(run: train.Run, correct: list[list[float]], credit: list[list[float]]) -> list[Group]:
    """P groups of K wrong-format rollouts for run.pool's first P examples, with the given 0/1 correctness
    (reward = correctness) and partial credit, each [P][K]."""
    tok, P, K = run.tokenizer, len(correct), len(correct[0])
    examples = run.pool[:P]
    prompts = [render_prompt(tok, ex, run.task.system_prompt) for ex in examples]
    answers = [tok.encode(f"<think>{k}+{k}={2 * k}\n</think>{p}{k}") + [tok.end_id] for p in range(P) for k in range(K)]
    logprobs = [[-0.5] * len(a) for a in answers]
    tree = Tree([[] for _ in range(P * K)], [[] for _ in range(P * K)], [False] * (P * K), answers, logprobs,
                ["stop"] * (P * K))  # fmt: skip
    groups = rollouts(examples, prompts, tree, K, 1)
    for (_, _, a), c, s in zip(completions(groups), sum(correct, []), sum(credit, [])):
        a.reward, a.correct, a.credit = float(c), float(c), float(s)
    return groups


def flat(groups: list[Group]) -> list[Answer]:
    """The step's completions, prompt-major (row b = p * K + k with M = 1)."""
    return [a for _, _, a in completions(groups)]


def table(groups: list[Group], field: str) -> list[list]:
    """A field of every completion, [P][K] (M = 1)."""
    return [[getattr(t.answers[0], field) for t in g.thoughts] for g in groups]


def test_splice_anchors_puts_the_reference_in_the_last_rollout_of_failing_groups(tmp_path):
    """Guards against anchoring a group that has a correct rollout, replacing the wrong row, splicing the
    reward without the reference's tokens (or tokens without the end-of-turn token), changing the policy's own
    rollouts (they are what the metrics report), and the anchor not taking the top credit: under the pair mask
    a wrong rollout whose credit is within delta of the reference's 1.0 must not be pushed down."""
    run = anchor_run(tmp_path, std_normalize=False, aggregation="seq_mean_token_sum_norm", pair_delta=0.1)
    correct = [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    credit = [[0.2, 0.95, 0.3, 0.0], [1.0, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    ro = hand_rollouts(run, correct, credit)
    sampled = [list(a.tokens) for a in flat(ro)]
    trained, counts = dagrpo.splice_anchors(ro, run.task, run.tokenizer, run.cfg.completion_limit)
    assert counts == {"anchors": 2, "anchors/too_long": 0, "anchors/no_reference": 0}
    assert [[not s for s in row] for row in table(trained, "sampled")] == [
        [False] * 3 + [True], [False] * 4, [False] * 3 + [True]
    ]  # fmt: skip
    tok = run.tokenizer
    for p, b in ((0, 3), (2, 11)):
        ref = tok.encode(sft_completion(run.pool[p])) + [tok.end_id]
        a = flat(trained)[b]
        assert a.tokens == ref and len(trained[p].thoughts[-1].tokens) + len(a.tokens) == len(ref)
        assert a.finish == "stop" and len(a.logprobs) == len(ref)
    assert [flat(trained)[b].tokens for b in range(12) if b not in (3, 11)] == [
        sampled[b] for b in range(12) if b not in (3, 11)
    ]
    # the policy's rollouts
    assert [a.tokens for a in flat(ro)] == sampled and sum(sum(table(ro, "reward"), [])) == 1
    assert all(a.sampled for a in flat(ro))
    assert table(trained, "reward") == [[0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 1]]
    assert table(trained, "correct") == table(trained, "reward")
    assert [row[-1] for row in table(trained, "credit")] == [1.0, 0.5, 1.0]
    _, adv = train.sequence_advantages(run, trained, per_completion(trained, "reward"), batch_accuracy=0.0)
    # Dr. GRPO's pairwise form: (1/G) sum_j m_ij (r_i - r_j). Group 0: the rollout credited .95 is within .1 of
    # the anchor's 1.0, so that pair cancels; group 2: plain (G-1)/G and -1/G; group 1 is untouched.
    want = [[-0.25, 0.0, -0.25, 0.5], [0.75, -0.25, -0.25, -0.25], [-0.25, -0.25, -0.25, 0.75]]
    torch.testing.assert_close(adv.view(3, 4), torch.tensor(want), atol=1e-7, rtol=0)


def test_groups_whose_reference_is_too_long_or_rejected_get_no_anchor(tmp_path):
    """Guards against a reference truncated to the completion limit (a cut-off "expert solution" with a reward
    of 1), and against training on a reference the task's own check rejects; both are counted, not hidden."""
    run = anchor_run(tmp_path)
    ro = hand_rollouts(run, [[0] * 4, [0] * 4], [[0] * 4, [0] * 4])
    longest = max(len(run.tokenizer.encode(sft_completion(ex))) + 1 for ex in run.pool[:2])
    trained, counts = dagrpo.splice_anchors(ro, run.task, run.tokenizer, longest - 1)  # a limit one token short
    assert counts["anchors/too_long"] >= 1 and counts["anchors"] + counts["anchors/too_long"] == 2
    assert sum(not a.sampled for a in flat(trained)) == counts["anchors"]
    assert sum(a.reward for a in flat(trained)) == counts["anchors"]
    assert all(len(a.tokens) <= longest - 1 for a in flat(trained))
    wrong = replace(run.task, reference=lambda ex: "<think>\n</think>0")
    trained, counts = dagrpo.splice_anchors(ro, wrong, run.tokenizer, run.cfg.completion_limit)
    assert counts == {"anchors": 0, "anchors/too_long": 0, "anchors/no_reference": 2}
    assert all(a.sampled for a in flat(trained)) and sum(a.reward for a in flat(trained)) == 0
    assert [a.tokens for a in flat(trained)] == [a.tokens for a in flat(ro)]


# ---------------------------------------------------------------- the update sees the reference


@pytest.mark.slow
@pytest.mark.parametrize("share_prompt", [True, False])
def test_anchor_logprobs_in_the_update_equal_a_plain_forward(tmp_path, monkeypatch, share_prompt):
    """Guards against anchor tokens that the update scores at the wrong positions or rows, against the wrong
    tokens (a reference without its end-of-turn token, or the sampled rollout still in place), against the
    off-policy mask missing policy_loss or covering other tokens, and against the anchor's advantage: in a
    failing group of 4 under Dr. GRPO centring it is 3/4, the other rollouts -1/4. The log-probs policy_loss gets
    on the anchor row must equal log_softmax(logits / T) of a plain forward of prompt + reference (float32)."""
    calls, wiring = [], []
    real_loss, real_update = train.policy_loss, train.update

    def spy_loss(tok, hp, objective):
        gamma = objective.fn.keywords["gamma"]  # the LUFFY-shaped objective of --loss (methods/dagrpo.py)
        calls.append(dict(logp=tok.logp.detach().clone(), adv=tok.adv, off=tok.off_policy, gamma=gamma))
        return real_loss(tok, hp, objective)

    def spy_update(run, step, batch, micro):
        wiring.append((micro, batch.off_policy & batch.mask))  # the anchors' tokens the update trains
        return real_update(run, step, batch, micro)

    monkeypatch.setattr(train, "policy_loss", spy_loss)
    monkeypatch.setattr(train, "update", spy_update)
    cfg = dict(SMALL_RUN, task="synthetic-hard", max_thought_tokens=40, max_answer_tokens=8, anchors=True,
               anchor_gamma=0.25, std_normalize=False, max_steps=1, eval_samples=0, eval_examples=1,
               samples_every=0, micro_batch_rows=5, share_prompt=share_prompt, out=str(tmp_path / "run"))  # fmt: skip
    train.main(TrainConfig(**cfg))
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"loss"' in line][0]
    assert metrics["anchors"] >= 2, metrics  # the bundled model fails most 4-digit sums

    (micro, off_policy), P, K = wiring[0], cfg["prompts_per_step"], cfg["thoughts"]
    assert len(calls) == len(micro) > 1 and all(c["gamma"] == 0.25 for c in calls)
    B, T = off_policy.shape
    logp, adv, off = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
    for (rows, _), c in zip(micro, calls):  # back from micro-batch rows to the step's rows
        logp[rows], adv[rows], off[rows] = c["logp"], c["adv"], c["off"]
    assert torch.equal(off, off_policy)
    anchored = [p for p in range(P) if off[p * K + K - 1].any()]
    assert len(anchored) == metrics["anchors"] and off.sum() == off[[p * K + K - 1 for p in anchored]].sum()

    model, tok = load_model(BUNDLED), load_tokenizer(BUNDLED)  # the weights of step 1's forward
    examples = get_task("synthetic-hard").train(P, TrainConfig.seed)  # step 0's prompts (the stream is prefix-stable)
    for p in anchored:
        b = p * K + K - 1
        prompt = render_prompt(tok, examples[p], None)
        ref = tok.encode(sft_completion(examples[p])) + [tok.end_id]
        assert off[b].tolist() == [True] * len(ref) + [False] * (T - len(ref))
        seq = torch.tensor([prompt + ref])
        with torch.no_grad():
            plain = token_logprobs(model(seq)[0, :-1], seq[0, 1:], TrainConfig.temperature)[len(prompt) - 1 :]
        torch.testing.assert_close(logp[b, : len(ref)], plain, atol=1e-5, rtol=0)
        assert (adv[b, : len(ref)] == 0.75).all()
        assert all((adv[p * K + k][logp[p * K + k] != 0] == -0.25).all() for k in range(K - 1))
    assert 0 < metrics["anchors/p_mean"] < 1 and abs(metrics["logp_gap"]) < 1e-4  # anchors are not in the gap


@pytest.mark.slow
def test_metrics_describe_the_policys_own_rollouts(tmp_path):
    """Guards against anchors leaking into the policy's reward and accuracy curves (an anchored run would look
    better than it samples), and against --anchors changing the sampling: step 1's rollouts are the same."""
    base = dict(SMALL_RUN, task="synthetic-hard", max_thought_tokens=40, max_answer_tokens=8, max_steps=1,
                eval_samples=0, eval_examples=1, samples_every=0)  # fmt: skip
    rows = {}
    for name, anchors in (("off", False), ("on", True)):
        train.main(TrainConfig(**base, anchors=anchors, out=str(tmp_path / name)))
        rows[name] = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl") if '"loss"' in line][0]
    same = ("reward/mean", "reward/std", "accuracy", "frac_zero_std_groups", "len/completion_mean", "tokens/generated")
    assert {k: rows["on"][k] for k in same} == {k: rows["off"][k] for k in same}
    assert rows["on"]["anchors"] > 0 and "anchors" not in rows["off"] and rows["on"]["loss"] != rows["off"]["loss"]


# ---------------------------------------------------------------- flags


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--anchors", "--answers", "2"], "--anchors (an anchor is a whole reference completion"),
        (["--anchor-gamma", "0"], "--anchor-gamma must be > 0 and finite"),
        (["--anchor-gamma", "-0.1"], "--anchor-gamma must be > 0 and finite"),
        (["--anchor-gamma", "nan"], "--anchor-gamma must be > 0 and finite"),
        (["--anchor-gamma", "inf"], "--anchor-gamma must be > 0 and finite"),
        (["--anchors", "--task", "countdown"], "--anchors needs reference solutions"),
        (["--algo", "dagrpo", "--task", "countdown"], "--anchors needs reference solutions"),
        (["--anchors", "--task", "jsonl", "--data", "generic.jsonl"], "--anchors needs reference solutions"),
    ],
)
def test_bad_anchor_flags_are_one_sentence(tmp_path, argv, message):
    """Guards against a bad --anchors / --anchor-gamma value or combination ending in a traceback, being
    accepted, or being found only after the model has loaded (nothing may be written to --out)."""
    write_jsonl(tmp_path / "generic.jsonl", [{"prompt": f"{i}+1?", "answer": str(i + 1)} for i in range(100)])
    argv = [str(tmp_path / a) if a.endswith(".jsonl") else a for a in argv]
    small = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_RUN.items()]
    cmd = [sys.executable, "train.py", *small, "--out", str(tmp_path / "run"), *argv]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: ") and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "run")


def test_anchors_are_off_by_default_and_on_in_the_dagrpo_preset():
    """Guards against anchors switching on in a default run (every golden number would move) or being left
    out of the dagrpo preset."""
    assert TrainConfig().anchors is False and TrainConfig().anchor_gamma == 0.1
    assert PRESETS["dagrpo"]["anchors"] is True
    assert not any(preset.get("anchors") for name, preset in PRESETS.items() if name != "dagrpo")


def test_the_anchors_shaping_wraps_whichever_objective_the_loss_chose():
    """Guards against the order of the objective hooks: LUFFY's shaping of the anchors must wrap the objective the
    other methods chose (the dual clip replaces the clipped surrogate outright), or an anchor run with --dual-clip
    would lose its shaping. Without --anchors the entry is untouched; the shaped tokens are never clipped."""
    import methods
    from losses import Tokens, policy_loss
    from methods.dual_clip import dual_clip_objective

    plain = TrainConfig(algo="grpo", dual_clip=3.0)
    assert methods.objective(plain).fn is dual_clip_objective
    entry = methods.objective(replace(plain, anchors=True, anchor_gamma=0.5))
    assert "off_policy" in entry.takes and entry.fn.args == (dual_clip_objective,) and entry.fn.keywords["gamma"] == 0.5
    # token 0 an anchor at p = .5 with A = -1 (f = .5: obj -.5, where the dual clip's floor 3A = -3 cannot bind);
    # token 1 sampled with ratio e^2 and A = -1: the dual clip binds, obj = -3
    logp = torch.tensor([[math.log(0.5), 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[float("nan"), -2.0]], dtype=torch.float64)
    adv, w = torch.full((1, 2), -1.0, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    tok = Tokens(logp, old, adv, w, off_policy=torch.tensor([[True, False]]))
    loss, m = policy_loss(tok, replace(plain, anchors=True, anchor_gamma=0.5), entry)
    assert abs(loss.item() - (0.5 + 3.0)) < 1e-12 and m["clip_frac"] == 0.5  # only the sampled token is cut
