"""DaGRPO's anchors (a reconstruction): a group with no correct rollout trains on the example's reference
solution in place of its last rollout, off-policy. The references score full reward under their own task, the
splice puts the reference's tokens, reward and top credit in the right row (and only there), the update sees
the reference's log-probs exactly as a plain forward of prompt + reference gives them with the off-policy mask
on those tokens only, and every bad flag is one sentence."""

from __future__ import annotations

import json

import pytest

from helpers import BUNDLED
from model import load_tokenizer
from tasks import get_task, no_reference, solution_completion

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
