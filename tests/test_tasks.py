"""Built-in task generators, JSONL loaders and prompt rendering."""

import json
from pathlib import Path

import pytest

from rewards import code_reward, countdown_reward, exact_reward, math_reward
from tasks import SYNTHETIC_CHARS, SYSTEM_PROMPT, addition_examples, get_task, load_jsonl, render_prompt, sft_completion


def test_synthetic_deterministic_by_seed() -> None:
    """Guards against unseeded generation (irreproducible runs) or a seed that is ignored."""
    task = get_task("synthetic")
    assert task.train(200, 0) == task.train(200, 0)
    assert task.train(200, 0) != task.train(200, 1)
    assert task.test(200, 3) == task.test(200, 3)


@pytest.mark.parametrize("name", ["synthetic", "synthetic-hard"])
def test_synthetic_train_test_never_overlap(name: str) -> None:
    """Guards against held-out problems leaking into training (also as the swapped pair b+a)."""
    task = get_task(name)
    pairs = lambda examples: {tuple(sorted((e["a"], e["b"]))) for e in examples}
    train = pairs(task.train(3000, 0)) | pairs(task.train(3000, 1))
    test = pairs(task.test(3000, 0))
    assert len(test) > 500 and train.isdisjoint(test)


def test_synthetic_distribution() -> None:
    """Guards against the default task drifting from 1-3 digit operands (mixed) and the hard task
    from 4 digits; and against wrong reference answers."""
    lengths = {(len(str(e["a"])), len(str(e["b"]))) for e in get_task("synthetic").train(2000, 0)}
    assert lengths == {(i, j) for i in (1, 2, 3) for j in (1, 2, 3)}
    hard = get_task("synthetic-hard").test(200, 0)
    assert all(len(str(e["a"])) == len(str(e["b"])) == 4 for e in hard)
    for e in get_task("synthetic").train(500, 0) + hard:
        assert e["prompt"] == f"{e['a']}+{e['b']}" and e["answer"] == str(e["a"] + e["b"])


def test_sft_completion_format() -> None:
    """Guards against an ambiguous or long scratchpad: the exact documented format, least
    significant digit first, a 3-digit thought under 40 characters, final carry in the last sum."""
    assert sft_completion({"a": 357, "b": 68}) == "<think>7+8=15\n5+6+1=12\n3+0+1=4\n</think>425"
    assert sft_completion({"a": 95, "b": 7}) == "<think>5+7=12\n9+0+1=10\n</think>102"
    assert sft_completion({"a": 0, "b": 0}) == "<think>0+0=0\n</think>0"
    longest = max(
        len(sft_completion(e).split("</think>")[0]) - len("<think>") for e in addition_examples(2000, 0, digits=(3,))
    )
    assert longest < 40
    with pytest.raises(ValueError):
        sft_completion({"prompt": "x", "answer": "1"})


def test_sft_completion_scores_one_and_uses_only_synthetic_chars() -> None:
    """Guards against the warm-start data and the reward disagreeing (every reference must score
    1.0, a wrong answer 0.0), and against characters outside the tiny model's vocabulary."""
    for name in ("synthetic", "synthetic-hard"):
        task = get_task(name)
        assert task.system_prompt is None and task.reward is exact_reward
        for e in task.train(300, 0) + task.test(300, 0):
            completion = sft_completion(e)
            assert task.reward(completion, e) == task.correct(completion, e) == 1.0
            assert task.reward(completion + "<|im_end|>", e) == 1.0
            assert task.reward(completion[:-1] + str((int(completion[-1]) + 1) % 10), e) == 0.0
            text = e["prompt"] + completion.replace("<think>", "").replace("</think>", "")
            assert set(text) <= set(SYNTHETIC_CHARS)


def test_countdown_solvable_by_construction() -> None:
    """Guards against unsolvable puzzles (a zero reward no policy can escape) and against the
    generator and the reward disagreeing about the rules."""
    task = get_task("countdown")
    assert task.reward is countdown_reward and task.system_prompt == SYSTEM_PROMPT
    examples = task.train(300, 0) + task.test(100, 0)
    for e in examples:
        assert len(e["nums"]) in (3, 4) and 1 <= e["target"] <= 999
        assert countdown_reward(f"<think>t</think><answer>{e['answer']}</answer>", e) == 1.0
        assert str(e["target"]) in e["prompt"] and "<answer>" in e["prompt"]
    assert {len(e["nums"]) for e in examples} == {3, 4}
    key = lambda e: (tuple(sorted(e["nums"])), e["target"])
    assert {key(e) for e in task.train(2000, 0)}.isdisjoint({key(e) for e in task.test(500, 0)})
    assert task.train(20, 5) == task.train(20, 5)


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_load_formats(tmp_path: Path) -> None:
    """Guards against wrong reference answers from each file format, and unknown fields breaking loading."""
    gsm = load_jsonl(
        write_jsonl(tmp_path / "g.jsonl", [{"question": "How many?", "answer": "48/2 = 24\n#### 1,024", "extra": 1}]),
        "gsm8k",
    )
    assert gsm == [{"prompt": "How many?", "answer": "1,024", "solution": "48/2 = 24\n#### 1,024"}]
    math = load_jsonl(
        write_jsonl(
            tmp_path / "m.jsonl",
            [{"problem": "P", "solution": r"so \boxed{\frac{1}{2}} or \boxed{\dfrac{1}{\sqrt{4}}}"}],
        ),
        "math",
    )
    assert math[0]["answer"] == r"\dfrac{1}{\sqrt{4}}"
    code = load_jsonl(
        write_jsonl(tmp_path / "c.jsonl", [{"prompt": "Write f.", "tests": ["assert f() == 1"], "entry_point": "f"}]),
        "code",
    )
    assert code[0]["tests"] == ["assert f() == 1"] and code[0]["entry_point"] == "f"
    assert code[0]["prompt"].startswith("Write f.") and "```python" in code[0]["prompt"]
    generic = load_jsonl(
        write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "answer": 7}, "", {"prompt": "q", "answer": "8"}]), "jsonl"
    )
    assert [e["answer"] for e in generic] == ["7", "8"]
    assert load_jsonl(str(tmp_path / "g.jsonl"), "jsonl") == gsm  # detected from the fields


def test_load_errors_name_file_line_and_field(tmp_path: Path) -> None:
    """Guards against a 40-line traceback (or a silently skipped line) for a bad data file: the
    error names the file, the line number and the field."""
    good = {"question": "q", "answer": "#### 1"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, "{not json"])
    with pytest.raises(ValueError, match=r"bad\.jsonl line 3: not valid JSON"):
        load_jsonl(path, "gsm8k")
    path = write_jsonl(tmp_path / "missing.jsonl", [good, {"question": "q"}])
    with pytest.raises(ValueError, match=r"missing\.jsonl line 2: missing field 'answer'"):
        load_jsonl(path, "gsm8k")
    path = write_jsonl(tmp_path / "nohash.jsonl", [{"question": "q", "answer": "42"}])
    with pytest.raises(ValueError, match=r"nohash\.jsonl line 1: .*####"):
        load_jsonl(path, "gsm8k")
    path = write_jsonl(tmp_path / "nobox.jsonl", [{"problem": "p", "solution": "it is 4"}])
    with pytest.raises(ValueError, match=r"nobox\.jsonl line 1: .*boxed"):
        load_jsonl(path, "math")
    path = write_jsonl(tmp_path / "list.jsonl", [[1, 2]])
    with pytest.raises(ValueError, match=r"list\.jsonl line 1: expected a JSON object"):
        load_jsonl(path, "jsonl")
    path = write_jsonl(tmp_path / "type.jsonl", [{"prompt": "p", "tests": [1]}])
    with pytest.raises(ValueError, match=r"type\.jsonl line 1: field 'tests'"):
        load_jsonl(path, "code")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(str(tmp_path / "nope.jsonl"), "gsm8k")


def test_get_task_arguments(tmp_path: Path) -> None:
    """Guards against silently ignoring a wrong task name or a missing/unneeded --data."""
    with pytest.raises(ValueError, match="unknown task"):
        get_task("gsm9k")
    with pytest.raises(ValueError, match="--data"):
        get_task("gsm8k")
    with pytest.raises(ValueError, match="--data"):
        get_task("synthetic", data="x.jsonl")


def test_file_task_split_and_sampling(tmp_path: Path) -> None:
    """Guards against train/test overlap in file tasks, non-deterministic sampling, and sampling
    that repeats some rows before others were seen."""
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(30)]
    task = get_task("gsm8k", data=write_jsonl(tmp_path / "g.jsonl", rows))
    assert task.reward is math_reward and task.system_prompt == SYSTEM_PROMPT
    test = task.test(100, 0)
    assert [e["answer"] for e in test] == ["9", "19", "29"]  # every 10th example
    train = task.train(54, 0)
    assert sorted(int(e["answer"]) for e in train[:27]) == [i for i in range(30) if i % 10 != 9]
    assert train == task.train(54, 0) and train != task.train(54, 1)
    assert {e["prompt"] for e in train}.isdisjoint({e["prompt"] for e in test})
    separate = get_task("gsm8k", data=str(tmp_path / "g.jsonl"), test_data=write_jsonl(tmp_path / "t.jsonl", rows[:2]))
    assert len(separate.test(10, 0)) == 2 and len({e["prompt"] for e in separate.train(60, 0)}) == 30
    code = get_task("jsonl", data=write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "tests": "assert True"}] * 10))
    assert code.reward is code_reward


def test_render_prompt() -> None:
    """Guards against a dropped system prompt, an added one where none was asked for (the tiny
    model), or a template rendered without the generation prompt."""

    class FakeTokenizer:
        def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
            assert add_generation_prompt
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    tok = FakeTokenizer()
    decode = lambda ids: "".join(map(chr, ids))
    assert decode(render_prompt(tok, {"prompt": "1+2"}, None)) == "user:1+2|assistant:"
    assert decode(render_prompt(tok, {"prompt": "q"}, "S")) == "system:S|user:q|assistant:"
