"""Tool rollouts that a policy cannot crash or steer: whatever a completion holds, a rollout returns with every row
complete and `0 <= tool/error_rate <= 1`; a call runs only the code of the policy's current turn; the reward reads
only the policy's own text; output is cut head and tail with a marker; and tool flags that would fail every call
are refused at the start, in train.py and eval.py alike."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from cli import UserError
from config import TrainConfig
from envs import PythonTool, countdown_feedback, run_code, wall_limit
from eval import EvalConfig
from methods import tools
from multiturn import Turns
from rewards import countdown_reward, math_reward
from sandbox import OUTPUT_CUT
from tasks import Task
from tokenizer import decode_completion, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NESTED = '<tool_call>{"name": "python", "arguments": {"code": ' + "[" * 1000 + "]" * 1000 + "}}</tool_call>"
DIGITS = '<tool_call>{"name": "python", "arguments": {"code": "print(1)", "n": ' + "9" * 5000 + "}}</tool_call>"


class Bytes:
    """A byte-level tokenizer (one id per UTF-8 byte, 256 = the stop id): any text, hostile bytes included."""

    stop_ids, vocab_size, pad_id, style = [256], 257, 256, None

    def turn_opening(self) -> str:
        return ""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return messages[-1]["content"]


def scripted(script: list[list[str]], tok):
    """multiturn.sample_turns with the policy's turns scripted: row r writes script[r % len(script)], turn by turn
    (each cut at the call's end marker, as the sampler stops there), with the same calls, budget and context mask."""

    def sample_turns(model, prompts, *, n, max_tokens, call_end, respond, max_calls, **_):
        B = len(prompts) * n
        tokens, context, finish, calls = [[] for _ in range(B)], [[] for _ in range(B)], ["length"] * B, [0] * B
        for r in range(B):
            for text in script[r % len(script)]:
                i = text.find(call_end.text)
                text = text if i < 0 else text[: i + len(call_end.text)]
                ids = tok.encode(text)[: max_tokens - len(tokens[r])]
                tokens[r] += ids
                context[r] += [False] * len(ids)
                if i < 0 or len(tokens[r]) >= max_tokens or calls[r] == max_calls:
                    finish[r] = "stop" if i < 0 and len(tokens[r]) < max_tokens else "length"
                    break
                obs = respond(r, list(tokens[r]))
                if obs is None or len(tokens[r]) + len(obs) >= max_tokens:
                    finish[r] = "stop" if obs is None else "length"
                    break
                tokens[r] += obs
                context[r] += [True] * len(obs)
                calls[r] += 1
        return Turns(tokens, [[0.0] * len(t) for t in tokens], context, finish, calls, [], [])

    return sample_turns


def rollouts(monkeypatch, script, examples, **flags):
    """tools.sample on scripted turns (one row per script entry): (the ToolTree, the step's tool/ metrics)."""
    tok = Bytes()
    monkeypatch.setattr(tools, "sample_turns", scripted(script, tok))
    cfg = TrainConfig(algo="grpo", thoughts=len(script), **flags)
    task = Task("t", None, None, None, None, None)
    run = SimpleNamespace(cfg=cfg, sampler=None, tokenizer=tok, task=task, static_step=None, state={}, world=1)
    _, tree = tools.sample(run, examples, list(range(len(examples))))
    return tree, tools.metrics(run, {}, {})


def soup(rng: random.Random, marker: str) -> str:
    """Random bytes and random marker soup: what a policy early in training writes around a tool."""
    if rng.random() < 0.5:
        return os.urandom(rng.randrange(1, 200)).decode(errors="replace") + marker
    parts = ["```python", "```output", "```", "\n", "<tool_call>", "</tool_call>", "{", "[", '"code": ', '"name": ']
    parts += ['"python"', "<answer>", "</answer>", "\\boxed{", "}", "(", ")", "9" * 40, "<|im_end|>", "print(", "'"]
    return "".join(rng.choice(parts) for _ in range(rng.randrange(1, 40))) + marker


HOSTILE = {
    "torl": [
        ["```python\nprint('```python\\nprint(6*7)\\n')\n```\n```output", "```output", "done"],
        ["```python\ns = '```python'\nprint(len(s))\n```\n```output", "done"],
        ["```python\n" + "(" * 1000 + ")" * 1000 + "\n```\n```output"],
        ["```python\nprint('x' * 100000)\n```\n```output", "```python\nimport os; os._exit(1)\n```\n```output"],
        ["```output", "```output", "```output", "```output", "```output", "```output"],
    ],
    "qwen": [[NESTED, "done"], [DIGITS], ['<tool_call>"s"</tool_call>', "<tool_call>[1]</tool_call>"]],
    "countdown": [
        ["<answer>" + "9" * 5000 + "</answer>", "<answer>" + "(" * 500 + "3" + ")" * 500 + "</answer>"],
        ["<answer>" + "+".join("1" * 4400 for _ in range(3)) + "</answer>", "<answer>3 + 5 + 7</answer>"],
        ["<answer>3 * 5 + 7</answer>"],
    ],
}


@pytest.mark.parametrize("form", ["torl", "qwen", "countdown"])
def test_no_completion_can_end_a_rollout(monkeypatch, form):
    """Guards the rule that nothing a completion holds raises out of a rollout: scripted turns holding each hostile
    form (JSON nested 1,000 deep, a 5,000-digit number, code an observation printed, a block holding the text
    ```python, 100,000 characters of output, a crash), random bytes and random marker soup. Rollouts return,
    every row is complete (its ids and context line up, it ended), calls count every call the environment got,
    and 0 <= tool/error_rate <= 1."""
    rng = random.Random(form)
    stop = {"torl": "```output", "qwen": "</tool_call>", "countdown": "</answer>"}[form]
    script = HOSTILE[form] + [[soup(rng, stop) for _ in range(5)] for _ in range(12)]
    flags = dict(tools="countdown", task="countdown") if form == "countdown" else dict(tools="python", tool_format=form)
    example = {"prompt": "Using the numbers [3, 5, 7], make 22.", "nums": [3, 5, 7], "target": 22, "answer": "22"}
    tree, row = rollouts(monkeypatch, script, [example], max_thought_tokens=20000, max_answer_tokens=20000, **flags)
    assert len(tree.answers) == len(script)
    assert all(len(ids) == len(ctx) > 0 for ids, ctx in zip(tree.answers, tree.answer_context))
    assert all(f in ("stop", "length") for f in tree.answer_finish)
    assert 0 <= row["tool/errors"] <= row["tool/calls"] and 0 <= row["tool/error_rate"] <= 1
    assert row["tool/calls"] >= len(script)


def test_a_raising_environment_is_an_error_observation_through_the_sampler(tmp_path, monkeypatch):
    """Guards the one place that holds the rule, through the real multi-turn sampler: an environment whose every
    call raises (a parser's RecursionError, a bug in a user's Env) gives error observations, counted in tool/errors,
    and every row still completes."""
    from helpers import make_char_tokenizer, make_hf_checkpoint
    from hf import load_model

    class Raises:
        stop, errors, seconds = "m", 0, 0.0

        def reset(self, example: dict) -> str:
            return example["prompt"]

        def step(self, text: str):
            raise RecursionError("maximum recursion depth exceeded")

    tok = load_tokenizer(make_char_tokenizer(tmp_path / "tok"))
    model = load_model(make_hf_checkpoint(tmp_path, "qwen2", vocab_size=tok.vocab_size))
    monkeypatch.setattr(tools, "make_env", lambda cfg, tokenizer: Raises())
    cfg = TrainConfig(algo="grpo", thoughts=4, tools="python")
    task = Task("t", None, None, None, None, None)
    examples = [{"prompt": "2+3=?"}, {"prompt": "what is ab"}]
    _, turns, stats = tools.tool_rollouts(model, tok, task, examples, cfg, n=4, max_new_tokens=200, seed=[3, 4])
    assert stats["calls"] > 0 and stats["errors"] == stats["calls"]
    assert all(len(t) == len(c) for t, c in zip(turns.tokens, turns.context)) and len(turns.tokens) == 8
    assert sum(turns.calls) > 0  # the error observations were appended, and the rows went on


def test_a_call_runs_only_the_code_of_the_policys_current_turn(monkeypatch):
    """Guards against running code that an observation printed: a call prints a ```python block, and the policy's
    next turn is a bare ```output. That turn holds no code of its own: its observation is the no-code error, not
    the 42 the printed block would give. The same in Qwen's form: a <tool_call> inside an observation is no call."""
    printed = ["```python\nprint('```python\\nprint(6*7)')\n```\n```output", "```output", "done"]
    flags = dict(tools="python", max_thought_tokens=200, max_answer_tokens=200)
    tree, row = rollouts(monkeypatch, [printed, printed], [{"prompt": "p"}], **flags)
    obs = Bytes().decode([t for t, c in zip(tree.answers[0], tree.answer_context[0]) if c])
    assert (
        obs == "\n```python\nprint(6*7)\n```\n\nError: no code found (write a ```python block, then ```output)\n```\n"
    )
    assert row["tool/calls"] == 4 and row["tool/errors"] == 2
    qwen = PythonTool("qwen")
    assert qwen.code("</tool_call>") is None  # the turn after an observation that printed a <tool_call>
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    assert qwen.code(call) == "print(6*7)" and qwen.code(call[:-12] + " x " + call) is None


def test_a_block_holding_the_text_of_its_own_marker_runs_whole():
    """Guards the block's start: the block the marker closes starts at the turn's first ```python, so code that
    holds the text ```python (in a string) runs whole, not as a SyntaxError of its tail."""
    env = PythonTool("torl")
    assert env.step("```python\ns = '```python'\nprint(len(s))\n```\n```output") == ("\n9\n```\n", 0.0, False)
    assert env.errors == 0


@pytest.mark.parametrize(
    "call",
    [
        NESTED,
        DIGITS,
        "<tool_call>" + "{" * 5000 + "</tool_call>",
        '<tool_call>"print(1)"</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"name": "python", "arguments": "print(1)"}</tool_call>',
        '<tool_call>{"name": "python", "arguments": {"code": 7}}</tool_call>',
        '<tool_call>{"name": ["python"], "arguments": {"code": "print(1)"}}</tool_call>',
        "<tool_call><function=python><parameter=code>1</parameter><parameter=x>2</parameter></function></tool_call>",
        "<tool_call>\n<function=sh>\n<parameter=code>\nls\n</parameter>\n</function>\n</tool_call>",
        "<tool_call><function=python><parameter=cmd>print(1)</parameter></function></tool_call>",
        "<tool_call><function=python><parameter=code>print(1)</function></tool_call>",
        "<tool_call><function=python><parameter=code>print(1)</parameter></function> and more</tool_call>",
        "<tool_call><function=python>" + "<parameter=code>" * 5000 + "</tool_call>",
    ],
)
def test_a_malformed_qwen_call_is_an_error_observation(call):
    """Guards PythonTool against the JSON a policy writes: nested past Python's recursion limit, a number past its
    digit limit, not an object, no string code; and the XML of Qwen3.5's syntax: a second parameter, another
    function or parameter, an unclosed parameter, text after the function, 5,000 open tags. Each is no call: an
    error observation, counted, never a raise."""
    env = PythonTool("qwen")
    assert env.code(call) is None
    obs, _, done = env.step(call)
    assert "Error: no code found" in obs and not done and env.errors == 1


def test_countdown_reads_numbers_within_bounds():
    """Guards Countdown's feedback and reward against numbers and equations past Python's limits (a 5,000-digit
    number raised ValueError out of the rollout): a sentence, and a reward of 0."""
    ex = {"nums": [3, 5, 7], "target": 22}
    for text in ("9" * 5000, "9" * 10, "(" * 2000 + "3" + ")" * 2000, "+".join(["1" * 4400] * 3)):
        feedback = countdown_feedback(f"<answer>{text}</answer>", ex)
        assert feedback.endswith(".") and "\n" not in feedback
        assert countdown_reward(f"<answer>{text}</answer>", ex) == 0.0
    assert "more than 9 digits" in countdown_feedback("<answer>3 + 5 + 7000000000</answer>", ex)
    assert "longer than 256" in countdown_feedback("<answer>" + "3+" * 200 + "5</answer>", ex)
    assert countdown_feedback("<answer>3 x 5 + 7 = 22</answer>", ex) == "it equals 22, not 22."  # as the reward reads


def test_output_keeps_its_head_and_tail_with_a_marker_whenever_cut():
    """Guards the rule for output: past --tool-output-chars, its first and last halves with OUTPUT_CUT between,
    whatever the flag's value (a 10,000-character output under 5,000 came back as 3,999 characters, no marker);
    an output that fits comes back whole, with no marker."""
    out, failed = run_code("for i in range(2000):\n    print(i)", 5.0, 256, 256)
    assert not failed and out.startswith("0\n1\n2\n") and out.endswith("1998\n1999") and OUTPUT_CUT in out
    assert len(out) == 256 + len(OUTPUT_CUT)
    out, _ = run_code("import sys; sys.stdout.write('a' * 5000 + 'b' * 5000)", 5.0, 256, 5000)
    assert out == "a" * 2500 + OUTPUT_CUT + "b" * 2500
    out, _ = run_code("import sys; sys.stdout.write('a' * 5000 + 'b' * 5000)", 5.0, 256, 20000)
    assert out == "a" * 5000 + "b" * 5000
    for chars in (16, 17, 999):
        out, _ = run_code(f"print('x' * {chars + 1})", 5.0, 256, chars)
        assert OUTPUT_CUT in out and len(out) == chars + len(OUTPUT_CUT)


def test_error_rate_counts_errors_over_the_same_calls(monkeypatch):
    """Guards tool/error_rate above 1 (8.0 when observations were dropped for the token budget): calls and errors
    are counted over the same calls, every call the environment got, its observation appended or not."""
    long_print = "```python\nprint('x' * 200)\n```\n```output"
    script = [[long_print], ["```output"], ["```python\n1/0\n```\n```output", "done"]]
    tree, row = rollouts(
        monkeypatch, script, [{"prompt": "p"}], tools="python", max_thought_tokens=30, max_answer_tokens=30
    )
    assert row["tool/calls"] == 3 and row["tool/errors"] == 2 and row["tool/error_rate"] == 2 / 3
    assert tree.answer_finish[0] == "length" and not any(tree.answer_context[0])  # its observation was dropped


def test_the_reward_reads_the_policys_answer_not_the_tools():
    """Guards against a reward for an answer only the tool printed (a \\boxed{} or an <answer> in an observation):
    the text handed to every reward is the policy's own tokens, each observation read as one newline."""
    tok = Bytes()
    call, obs = (
        tok.encode("```python\nprint(...)\n```\n```output"),
        tok.encode("\n\\boxed{42} <answer>3*5+7</answer>\n```\n"),
    )
    example = {"answer": "42", "nums": [3, 5, 7], "target": 22}
    for reward, tail, score in (
        (math_reward, "so the tool found it", 0.0),
        (countdown_reward, "so the tool found it", 0.0),
        (math_reward, "\\boxed{42}", 1.0),
        (countdown_reward, "<answer>3*5+7</answer>", 1.0),
    ):
        ids = call + obs + tok.encode(tail)
        text = decode_completion(tok, ids, [False] * len(call) + [True] * len(obs))
        assert text == "```python\nprint(...)\n```\n```output\n" + tail
        assert reward(text, example) == score


def test_samples_log_the_transcript_of_a_tool_rollout(tmp_path):
    """Guards what a user reads in samples.jsonl: the reward's text (the policy's own) and, with a tool, the whole
    transcript, observations included."""
    import json

    import train
    from pack import Answer, Group, Thought

    tok = Bytes()
    ids, context = tok.encode("abOBSc"), [False] * 2 + [True] * 3 + [False]
    a = Answer(ids, [0.0] * len(ids), "stop", decode_completion(tok, ids, context), 1.0, context=context)
    groups = [Group({"prompt": "p"}, [], [Thought([], [], False, [a])])]
    run = SimpleNamespace(cfg=SimpleNamespace(out=str(tmp_path)), tokenizer=tok, rank=0, wandb=None)
    train.log_samples(run, 1, groups)
    row = json.loads((tmp_path / "samples.jsonl").read_text())
    assert row["completion"] == "ab\nc" and row["transcript"] == "abOBSc"


def test_tool_flags_that_fail_every_call_are_refused_in_train_and_eval():
    """Guards flags accepted and then failing every call: an environment paired with a task it does not serve
    (--tools countdown --task synthetic-mul raised KeyError: 'nums'), limits no call runs under, an output the
    sandbox cannot deliver; and eval.py runs the same checks as train.py (it checked none)."""
    bad = [
        dict(tools="countdown", task="synthetic-mul"),
        dict(tools="python", tool_timeout_s=-1.0),
        dict(tools="python", tool_timeout_s=0.001),
        dict(tools="python", tool_memory_mb=8796093022208),
        dict(tools="python", tool_output_chars=1 << 30),
        dict(tools="python", tool_format="xml"),
        dict(tools="python", max_tool_calls=0),
    ]
    for flags in bad:
        for make in (lambda f: TrainConfig(algo="grpo", **f), lambda f: EvalConfig(**f)):
            with pytest.raises(ValueError, match="--t|--max-tool-calls") as e:
                make(flags)
            assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--tools countdown gives feedback on countdown only: it needs --task"):
        EvalConfig(tools="countdown", task="synthetic")
    EvalConfig(tools="countdown", task="countdown")
    TrainConfig(algo="grpo", tools="python", tool_timeout_s=0.25, tool_output_chars=16 << 20)


def test_a_marker_the_tokenizer_cannot_write_or_limits_that_fail_print_are_refused(monkeypatch):
    """Guards the live check before the first step (train.py) or call (eval.py): a tokenizer that cannot write the
    call's end marker (--tool-format qwen with the tiny tool model: </tool_call>) never calls the tool, and limits
    under which print(1) fails fail every call: each is one sentence at the start."""
    tok = load_tokenizer(os.path.join(ROOT, "assets", "tiny-tool-model"))
    with pytest.raises(UserError, match="ends a call at '</tool_call>', which this model's tokenizer cannot write"):
        tools.ready(EvalConfig(tools="python", tool_format="qwen"), tok)
    tools.ready(EvalConfig(tools="python"), tok)  # ```output it can write, and print(1) runs
    monkeypatch.setattr(tools, "run_code", lambda *a: ("Error: CPU time limit (0.25 s)", True))
    with pytest.raises(UserError, match=r"print\(1\) fails in the sandbox under --tool-timeout-s 0.25"):
        tools.ready(EvalConfig(tools="python", tool_timeout_s=0.25), tok)


def test_an_honest_call_passes_however_many_calls_share_the_cores():
    """Guards observations against the machine's load: CPU time is what a call is limited by; the wall clock gets
    wall_limit's margin for --tool-workers calls per core. On 2 cores, 4 parallel calls of 1 s of CPU under a
    2 s limit timed out 2 to 4 times in 4 when the wall clock equalled the CPU limit; here all 4 pass."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\nprint('ok')"
    env = PythonTool("torl", timeout_s=2.0, workers=4)
    assert env.wall_s == wall_limit(2.0, 4) >= 2.0 * (1 + 4 / len(os.sched_getaffinity(0))) + 1
    call = f"```python\n{busy}\n```\n```output"
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda _: PythonTool("torl", 2.0, 512, 64, workers=4).step(call)[0], range(4)))
    assert outputs == ["\nok\n```\n"] * 4
    assert run_code("import time; time.sleep(60)", 0.5, 256, 64) == ("Error: wall-clock limit (2 s)", True)
    assert run_code("while True: pass", 0.5, 256, 64) == ("Error: CPU time limit (0.5 s)", True)


def test_the_tour_says_its_figures_come_from_the_machine_named_at_its_end():
    """Guards a new user's surprise: docs/tour.md regenerated on another machine kind differs in the last digits;
    its header says so, and its end names the machine its figures come from."""
    tour = open(os.path.join(ROOT, "docs", "tour.md")).read()
    assert "Its figures come from the machine named at its end" in tour.split("## ")[0]
    assert tour.rstrip().splitlines()[-2].startswith("Figures from: torch ")
