"""Tests of tool-integrated reasoning's training side (methods/tools.py, pack.py's context mask): a tool's output
tokens are context, with no loss weight, ratio, KL or entropy term, not counted by the aggregation nor by the
sampler/trainer log-prob gap; the trainer's log-probs of a tool rollout, packed as training rows, equal the
sampler's; the flags that cannot compose are refused; the metrics count calls, errors and time."""

from types import SimpleNamespace

import pytest
import torch

import train
from cli import FlagError
from config import TrainConfig
from helpers import ScriptedEnv, make_char_tokenizer, make_hf_checkpoint
from hf import load_model
from losses import Tokens, policy_loss
from methods import tools
from methods.entropy_bonus import entropy_bonus
from metrics import SUMS, add_micro_batch
from pack import Answer, Group, Thought, pack, rollouts, token_stats
from tasks import Task
from tokenizer import load_tokenizer

# one completion, by hand: the policy wrote 0-1, a call's output filled 2-4, the policy wrote 5-6, output 7, then 8
# (5 tokens the policy's, 4 context)
CONTEXT = [False, False, True, True, True, False, False, True, False]


def hand_groups() -> list:
    """Two completions of one prompt: the hand-built row above and a plain one of 3 policy tokens."""
    a = Answer(list(range(10, 19)), [-0.5] * 9, "stop", reward=1.0, correct=1.0)
    a.context = list(CONTEXT)
    a.logprobs = [0.0 if c else -0.5 for c in CONTEXT]
    b = Answer([20, 21, 22], [-0.5] * 3, "stop")
    return [Group({"prompt": "p"}, [1, 2, 3], [Thought([], [], False, [a]), Thought([], [], False, [b])])]


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
def test_every_tool_output_token_is_masked_out_of_the_loss(aggregation):
    """Guards the loss against training what the tool wrote: on a row built by hand, every context position is in
    neither the thought nor an answer, out of the trained mask, has weight 0, and the aggregation counts only the
    policy's 5 tokens of that row (GRPO's per-sequence mean divides by 5, not 9; DAPO's token mean by 5 + 3). The
    loss, with a KL penalty and an entropy bonus, gives those positions exactly zero gradient, and the
    sampler/trainer log-prob gap never sees them."""
    groups = hand_groups()
    batch = pack(groups, 0, torch.device("cpu"), share_prompt=True)
    ctx = torch.tensor(CONTEXT)
    assert batch.context[0].tolist() == CONTEXT and not batch.context[1].any()
    assert not (batch.thought[0] & ctx).any() and (batch.answer_id[0][ctx] == -1).all()
    assert batch.ids[0].tolist() == list(range(10, 19))  # context tokens stay in the row: the policy attends to them
    cfg = TrainConfig(algo="grpo", thoughts=2, aggregation=aggregation, tools="python", beta=0.1)
    run = SimpleNamespace(cfg=cfg, world=1, device=torch.device("cpu"))
    adv, weight, mask, _ = train.advantages(run, groups, batch, 0.5)
    assert mask[0].tolist() == [not c for c in CONTEXT] and mask[1, :3].all()
    assert (weight[0][ctx] == 0).all() and (weight[0][~ctx] > 0).all()
    per_token = {"seq_mean_token_mean": 1 / (2 * 5), "token_mean": 1 / 8, "seq_mean_token_sum_norm": 1 / (2 * 80)}
    torch.testing.assert_close(weight[0][~ctx], torch.full((5,), per_token[aggregation]))

    logp = torch.full(weight.shape, -1.0, requires_grad=True)
    entropy = torch.full(weight.shape, 0.7, requires_grad=True)
    tok = Tokens(logp, logp.detach() - 0.3, adv, weight, ref_logp=torch.full(weight.shape, -2.0))
    loss, _ = policy_loss(tok, cfg)
    (loss - entropy_bonus(entropy, weight, 0.01)).backward()
    assert (logp.grad[0][ctx] == 0).all() and (logp.grad[0][~ctx] != 0).all()
    assert (entropy.grad[0][ctx] == 0).all()
    sums = dict.fromkeys(SUMS, 0.0)
    trainer = torch.where(batch.context if batch.context is not None else ctx, -9.0, batch.sampler_logp)  # far off
    add_micro_batch(sums, 8, loss, {}, trainer, batch.sampler_logp, mask, mask, entropy.detach(), None)
    assert sums["logp_gap"] == 0.0  # the context's gap of 9 per token is not in it


def test_refusals_in_one_sentence():
    """Guards the composition rules: GRPO-MA's answers with a tool are refused in one sentence naming both flags;
    plain GRPO and the estimators at M = 1 are accepted."""
    with pytest.raises(FlagError, match=r"--tools python .*--answers 1"):
        TrainConfig(algo="grpo_ma", answers=2, tools="python")
    for algo in ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"):
        TrainConfig(algo=algo, answers=1, tools="python")
    with pytest.raises(FlagError, match="--tools"):
        TrainConfig(tools="calculator")


@pytest.fixture(scope="module", params=["qwen2", "qwen3_5"])
def tiny(tmp_path_factory, request):
    """A tiny model and a character tokenizer: a transformer, and a Qwen3.5 hybrid (whose DeltaNet states must
    take each observation as the packed training row's forward does)."""
    d = tmp_path_factory.mktemp("tools")
    tok = load_tokenizer(make_char_tokenizer(d / "tok"))
    model = load_model(make_hf_checkpoint(d, request.param, vocab_size=tok.vocab_size))
    return model, tok


def test_trainer_logprobs_of_a_tool_rollout_equal_the_sampler_and_metrics_count_calls(tiny, monkeypatch):
    """Guards token in, token out through the trainer: tool rollouts (a user's Env) become the step's record, are
    packed (shared prompt) into rows whose ids are exactly those sampled and appended, and the trainer's log-probs
    of every policy token equal the sampler's (so the gap metric measures only precision), on a transformer and on
    a hybrid; the step's metrics count the calls, errors and time."""
    model, tok = tiny
    envs = []
    monkeypatch.setattr(tools, "make_env", lambda cfg, tokenizer: envs.append(ScriptedEnv()) or envs[-1])
    cfg = TrainConfig(algo="grpo", thoughts=4, tools="python", max_thought_tokens=40, max_answer_tokens=20)
    task = Task("t", None, None, None, None, None)
    examples = [{"prompt": "2+3=?"}, {"prompt": "what is ab"}]
    prompts, turns, stats = tools.tool_rollouts(
        model, tok, task, examples, cfg, n=4, max_new_tokens=60, temperature=1.0, seed=[3, 4]
    )
    assert stats["calls"] == sum(e.turns for e in envs) >= sum(turns.calls) > 0 and stats["completions"] == 8
    run = SimpleNamespace(cfg=cfg, sampler=model, tokenizer=tok, task=task, static_step=None, state={}, world=1)
    _, tree = tools.sample(run, examples, [3, 4])
    assert tree.answers == turns.tokens and tree.answer_context == turns.context
    groups = rollouts(examples, prompts, tree, 4, 1)
    batch = pack(groups, tok.pad_id, torch.device("cpu"), share_prompt=True)
    with torch.no_grad():
        logp, _ = token_stats(model, batch, 1.0)
    for b, (ids, ctx) in enumerate(zip(turns.tokens, turns.context)):
        assert batch.ids[b, : len(ids)].tolist() == ids
        own = torch.tensor([not c for c in ctx])
        torch.testing.assert_close(logp[b, : len(ids)][own], batch.sampler_logp[b, : len(ids)][own], atol=1e-5, rtol=0)
    row = tools.metrics(run, {}, {})
    assert row["tool/calls"] == stats["calls"] and row["tool/calls_per_completion"] == stats["calls"] / 8
    assert row["tool/errors"] == stats["errors"] and 0 < row["tool/error_rate"] <= 1 and "tool/time_s" in row
    assert "tool_step" not in run.state  # counted once: the next step starts from 0


def test_multiplication_demonstrations_mask_the_tool_output_as_rl_does(tmp_path):
    """Guards the tool model's warm start: synthetic-mul's reference completions (by hand and with the tool) earn
    the task's reward, and in a tool demonstration exactly the tool's output (what RL appends after ```output, the
    output and its closing fence) is out of the SFT loss, encoded alone as RL encodes an observation."""
    import sft
    from tasks import SYNTHETIC_CHARS, get_task, sft_completion

    task = get_task("synthetic-mul")
    ex = task.train(1, 0)[0]
    for tool in (False, True):
        assert task.reward(sft_completion({**ex, "tool": tool}), ex) == 1.0
    sft.write_tokenizer(sft.build_char_tokenizer(SYNTHETIC_CHARS + sft.TOOL_CHARS), str(tmp_path))
    tok = load_tokenizer(tmp_path)
    text = sft_completion({**ex, "tool": True})
    ids, trained = sft.completion_ids(tok, text)
    assert ids == tok.encode(text)
    masked = tok.decode([i for i, t in zip(ids, trained) if t == 0.0])
    assert masked == f"\n{ex['answer']}\n```\n" == tools.PythonTool().step(text[: text.index("```output") + 9])[0]


def test_held_out_evaluation_runs_with_the_tool():
    """Guards eval.py --tools: the held-out evaluation samples through the same multi-turn rollouts as training
    (the tool's output appended after each call), and --pass-rates, which samples without a tool, refuses it."""
    import os

    from eval import EvalConfig
    from heldout import evaluate
    from tasks import get_task

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny-tool-model")
    model, tok, task = load_model(path), load_tokenizer(path), get_task("synthetic-mul")
    examples = task.test(16, 0)
    rollout = tools.evaluator(EvalConfig(tools="python"), tok, task)
    out = rollout(model, examples, n=2, max_new_tokens=64, temperature=1.0, seed=list(range(16)))
    texts = [tok.decode(t) for t in out.tokens]
    called = [(t, ex) for t, ex in zip(texts, [ex for ex in examples for _ in range(2)]) if "```output" in t]
    assert called and all(f"```output\n{ex['answer']}\n```\n" in t for t, ex in called)  # the true product
    texts = [tok.decode(t) for t in rollout(model, examples, n=1, max_new_tokens=64, temperature=0.0).tokens]
    res = evaluate(model, tok, task, examples, n=0, max_new_tokens=64, rollout=rollout)
    assert res["greedy_accuracy"] == sum(task.correct(t, ex) for t, ex in zip(texts, examples)) / 16
    assert tools.evaluator(EvalConfig(), tok, task) is None
    with pytest.raises(ValueError, match="--pass-rates samples without a tool"):
        EvalConfig(tools="python", pass_rates=True, out="x.jsonl")


def test_a_machine_without_the_sandbox_is_one_sentence_at_the_start(monkeypatch, tmp_path):
    """Guards the start of a --tools python run where the sandbox cannot be built: one sentence before the first
    step (a UserError), not a traceback from a worker thread in the middle of sampling."""
    from cli import UserError

    def refuse(*args, **kw):
        raise RuntimeError("the code sandbox needs Linux namespaces that this machine refused (net_namespace)")

    from helpers import make_bpe_tokenizer

    tok = load_tokenizer(make_bpe_tokenizer(tmp_path / "bpe", "qwen2"))
    monkeypatch.setattr(tools, "run_code", refuse)
    run = SimpleNamespace(cfg=TrainConfig(algo="grpo", tools="python"), tokenizer=tok)
    with pytest.raises(UserError, match="--tools python runs code in the sandbox, which this machine refuses"):
        tools.start(run)
    tools.start(SimpleNamespace(cfg=TrainConfig(algo="grpo", tools="countdown", task="countdown"), tokenizer=tok))


def test_a_stop_token_inside_a_tool_output_ends_nothing(tiny):
    """Guards Qwen's tool form, whose <tool_response> turn holds an <|im_end|>: the reward's text (training and
    held-out evaluation alike) runs to the policy's own stop token, not to the first one in a tool's output."""
    from heldout import texts_of
    from tokenizer import decode_completion

    _, tok = tiny
    end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("12") + [end] + tok.encode("34") + [end, *tok.encode("junk")]
    context = [False, False, True, False, False, False]
    assert decode_completion(tok, ids) == "12"
    assert decode_completion(tok, ids, context) == "12\n34"  # the observation reads as one newline
    gen = tools.ToolGeneration([ids], [[0.0] * len(ids)], ["stop"], [context])
    assert texts_of(tok, gen) == ["12\n34"]


class Answer42:
    """An environment whose turn ends at "e" and whose observation is the ToRL output block "\\n42\\n```\\n"."""

    stop = "e"

    def __init__(self) -> None:
        self.errors, self.seconds, self.seen = 0, 0.0, []

    def reset(self, example: dict) -> str:
        return example["prompt"]

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.seen.append(text)
        return "\n42\n```\n", 0.0, False


def test_a_bpe_row_is_what_was_sampled_and_appended_never_re_encoded(tmp_path, monkeypatch):
    """Guards token in, token out where it matters, a byte-level BPE (verl issue 6719: re-encoding the conversation
    from text merged or dropped a token at every assistant/tool boundary). A multi-call row decodes to the policy's
    text and the observations in order, its ids are exactly the sampled ids and each observation encoded alone,
    and re-encoding its decoded text would have given other ids: the trainer never does."""
    from helpers import make_bpe_tokenizer

    tok = load_tokenizer(make_bpe_tokenizer(tmp_path / "bpe", "qwen2"))
    model = load_model(make_hf_checkpoint(tmp_path, "qwen2", vocab_size=tok.vocab_size))
    envs = []
    monkeypatch.setattr(tools, "make_env", lambda cfg, tokenizer: envs.append(Answer42()) or envs[-1])
    cfg = TrainConfig(algo="grpo", thoughts=4, tools="python", max_tool_calls=3)
    task = Task("t", None, None, None, None, None)
    examples = [{"prompt": "The quick brown fox"}, {"prompt": "def f(x):"}]
    _, turns, _ = tools.tool_rollouts(model, tok, task, examples, cfg, n=4, max_new_tokens=40, seed=[5, 6])
    obs = tok.encode("\n42\n```\n")
    multi = [r for r, c in enumerate(turns.calls) if c >= 2]
    assert multi, "the test needs a row with two calls"
    changed = 0
    for r in multi:
        ids, ctx = turns.tokens[r], turns.context[r]
        segments, start = [], 0
        for i in range(1, len(ids) + 1):  # the row's runs: policy, observation, policy, ...
            if i == len(ids) or ctx[i] != ctx[start]:
                segments.append((ctx[start], ids[start:i]))
                start = i
        assert [s for c, s in segments if c] == [obs] * turns.calls[r]  # each observation, encoded alone
        texts = [tok.decode(s) for _, s in segments]
        assert tok.decode(ids) == "".join(texts)
        assert envs[r].seen[: turns.calls[r]] == texts[0 : 2 * turns.calls[r] : 2]  # each: the policy's turn only
        changed += tok.encode(tok.decode(ids)) != ids
    assert changed, "re-encoding would have changed no row: the boundary hazard is not exercised"


def test_the_end_summary_evaluates_with_the_tool_the_run_trained_with():
    """Guards against a tool run's summary suggesting `eval.py` without --tools: a model trained with the tool still
    writes its calls there, gets no output and scores 0. The summary's flags carry every tool flag the run changed,
    and eval.py takes them; a run without tools adds none."""
    import methods
    from cli import parse_config
    from eval import EvalConfig

    cfg = TrainConfig(algo="grpo", answers=1, tools="python", max_tool_calls=2, tool_format="qwen")
    flags = methods.eval_flags(cfg)
    assert flags.split() == ["--tools", "python", "--tool-format", "qwen", "--max-tool-calls", "2"]
    evaluated, _ = parse_config(EvalConfig, ["--model", "m", *flags.split()])
    assert (evaluated.tools, evaluated.tool_format, evaluated.max_tool_calls) == ("python", "qwen", 2)
    assert methods.eval_flags(TrainConfig()) == ""
