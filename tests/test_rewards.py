"""Answer extraction, equivalence, format, Countdown and batching; every reward against hostile text.
(The code sandbox has its own file, test_sandbox.py.)"""

import ast
import json
import sys
import threading
import time
import types
from pathlib import Path

import pytest

import math_answers
import math_equal
import rewards
from math_answers import answers_match, boxed_answers, parse_number, reference_answer
from rewards import (
    code_reward,
    combine_rewards,
    countdown_reward,
    exact_reward,
    extract_answer,
    extract_code,
    format_reward,
    math_reward,
    score_batch,
    strip_end_tokens,
)
from tasks import get_task

EXTRACTION = [  # (completion, extracted final answer)
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),  # nested braces
    (r"first \boxed{1} then \boxed{2}", "1, 2"),  # boxes that differ are one answer, their list
    (r"\boxed{2} ... so \boxed{ 2 }", "2"),  # the same box twice is one
    (r"\boxed{\boxed{3}}", "3"),  # a box that only wraps a box is its content
    (r"\fbox{7}", "7"),
    (r"\boxed 9", "9"),
    ("<answer> 12 </answer>", "12"),
    ("<answer>1</answer> and <answer>3</answer>", "1, 3"),  # tags that differ are one answer, like boxes
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "72"),
    ("#### 1,000\nextra words", "1,000"),
    ("It costs 3 dollars, then 5.5 dollars.", "5.5"),  # the last number
    ("the total is 1,234,567.", "1,234,567"),
    ("so 1 000 in all", "1 000"),
    (r"The answer is $\frac{1}{3}$.", r"\frac{1}{3}"),  # a math span, whole: never its denominator
    (r"The answer is \frac{10}{9}", r"\frac{10}{9}"),  # a LaTeX fraction in prose, whole
    (r"Therefore $x \geq 5$ is the solution.", r"x \geq 5"),
    ("The domain is $[0,9)$.", "[0,9)"),  # brackets untouched
    (r"Final Answer: The largest $n$ is 34.", "34"),  # a number after the last span wins
    ("She pays $5 and gets $3 back, so $18.", "18"),  # currency, not math delimiters
    ("<think>the answer is 5</think>It is 6", "6"),  # only after </think>
    ("<think>\\boxed{5}</think> no number here", None),  # box in the scratchpad
    (r"\boxed{unclosed", None),
    (r"\boxed{1} and then \boxed{2", None),  # the last box never closes: cut off
    ("no digits at all", None),
    ("AZYUK2A", None),  # glued to letters
    ("so it is x+5", None),  # part of an expression
    ("2^4", None),
    ("6!", None),
    ("It is 18 or 20.", None),  # one of several
    ("The roots are 1, 2, 5", None),
    ("$18$ or $20$", None),
    ("Answer $ \n 9 \n $", None),  # an inline span cannot cross lines: a stray delimiter
]


@pytest.mark.parametrize("completion,expected", EXTRACTION)
def test_extract_answer(completion: str, expected: str | None) -> None:
    """Guards against extracting the wrong span: the last of several boxes instead of all, broken nesting, the
    scratchpad's number, a number from inside an expression, a list or a fraction, brackets dropped."""
    assert extract_answer(completion) == expected


def test_boxed_answers_braces() -> None:
    """Guards against brace matching that stops at the first `}`, miscounts escaped braces, or takes a box
    that never closes."""
    assert boxed_answers(r"\boxed{a{b}c} tail \fbox{d}") == [("a{b}c", 0, 13), ("d", 19, 27)]
    assert boxed_answers(r"\boxed{\{1,2\}}")[0][0] == r"\{1,2\}"
    assert boxed_answers(r"\boxed{") is None and boxed_answers("\\boxed") is None and boxed_answers("none") == []


@pytest.mark.parametrize(
    "answer,reference",
    [
        ("$\\frac{1}{2}$", "\\frac{1}{2}"),
        ("\\(x \\in [0,1)\\)", "x \\in [0,1)"),
        ("1,234", "1,234"),
        ("so \\boxed{1} and \\boxed{-2}.", "1, -2"),  # joined by `and`
        ("\\boxed{5}" + " filler" * 12 + " \\boxed{7}", "7"),  # far apart: the last
        ("\\boxed{1} no no no no no \\boxed{2}", "2"),  # no separator in a gap of 10 or more
    ],
)
def test_reference_answer(answer: str, reference: str) -> None:
    """Guards against references read wrongly: delimiters kept, a whole solution's scratch boxes taken as part
    of the answer, or a list of roots cut to its last root."""
    assert reference_answer(answer) == reference


EQUIVALENT = [  # (prediction, reference)
    ("1,234", "1234"),
    ("1 000", "1000"),
    ("14{,}916", "14916"),
    ("32,\\! 349", "32349"),
    ("2.50", "2.5"),
    ("-3", "-3.0"),
    ("3/4", "0.75"),
    (r"\frac{3}{4}", "0.75"),
    (r"\dfrac{1}{2}", "1/2"),
    (r"\tfrac12", "0.5"),
    (r"\frac{10}{9}", "10/9"),
    (r"-\frac{1}{2}", "-0.5"),
    (r"\frac{-1}{2}", "-1/2"),
    ("0.333333", "1/3"),  # a decimal equal to 6 places (Math-Verify's rule)
    (r"50\%", "50%"),
    ("28 percent", r"28\%"),
    (r"\text{5}", "5"),
    ("$5$", "5"),
    (r"\$18", "18"),
    (r"1\,000", "1000"),
    ("1{,}000", "1000"),
    (r"18 \text{ dollars}", "18"),
    ("18 dollars", "18"),
    (r"\frac{1}{3} \text{meters}", "1/3"),
    ("x = 7", "7"),
    ("7", "k = 7"),
    (r"90^\circ", "90"),
    ("5.", "5"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    ("(1, 4.5)", r"(1,\frac{9}{2})"),  # tuples element by element
    ("(p,q) = (3,2)", "(3,2)"),
    ("-2, 1", "1,-2"),  # lists as sets
    (r"6 \text{ and } 8", "6,8"),
    (r"\{1,2,3\}", "3, 2, 1"),
    (r"x^2 + 1", "x^2+1"),
    (r"x \geq 5", "x >= 5"),
    (r"5 \geq x", r"x \le 5"),
    ("E", r"\text{E}"),
    (r"\sqrt3", r"\sqrt{3}"),
    (".5", "0.5"),
]
NOT_EQUIVALENT = [
    ("0.333", "1/3"),
    ("3", "-3"),
    ("1,5", "15"),
    ("12", "1.2"),
    ("1/0", "0"),
    (r"\frac{1}{0}", "1"),
    ("2", "22"),
    ("x+1", "x+2"),
    ("", "0"),
    ("", ""),
    ("9" * 100, "9" * 100 + "0"),
    ("0.5", "50%"),
    (r"50\%", "50"),  # a percent sign the reference lacks
    ("50%", "50"),
    ("32, 349", "32349"),  # a comma-space separates a list, not thousands
    ("1 000", "0"),
    (r"20 \text{ or more}", "20"),
    ("20 at most", "20"),
    (r"18 \text{ or } 20", "20"),
    ("18, 20", "20"),
    ("x+5", "5"),
    ("[0,9)", "(0,9)"),
    (r"\{1,3\}", "(3,1)"),  # a set is not a tuple
    ("5x", "5"),
    ("x = 6", "6x"),
]


@pytest.mark.parametrize("pred,ref", EQUIVALENT)
def test_answers_match(pred: str, ref: str) -> None:
    """Guards against marking right answers wrong over formatting: separators, trailing zeros, LaTeX fractions
    and wrappers, percent signs, units, flipped inequalities, the order of a list."""
    assert answers_match(pred, ref)
    assert math_reward(f"\\boxed{{{pred}}}", {"answer": ref}) == 1.0


@pytest.mark.parametrize("pred,ref", NOT_EQUIVALENT)
def test_answers_do_not_match(pred: str, ref: str) -> None:
    """Guards against lenient checks that reward wrong answers: float tolerance, dropped signs, lists read as
    thousands, division by zero, digit-prefix matches, hedges, a number inside an expression."""
    assert not answers_match(pred, ref)


def test_parse_number_values() -> None:
    """Guards against inexact parsing (floats) and parsing of huge digit strings."""
    assert parse_number("2.50") == parse_number("5/2") == parse_number(r"\frac{5}{2}")
    assert parse_number("1,234,567") == 1234567 and parse_number("1 234 567") == 1234567
    assert parse_number("9" * 65) is None and parse_number("1e5") is None and parse_number("--1") is None
    assert parse_number("32, 349") is None and parse_number("20 or more") is None


@pytest.fixture(scope="module")
def gsm8k_reference(tmp_path_factory: pytest.TempPathFactory):
    """gsm8k_reference(N) -> the reference the real GSM8K loader (tasks.get_task) makes of `#### N`."""

    def reference(final: str) -> str:
        path = Path(tmp_path_factory.mktemp("gsm8k")) / "data.jsonl"
        row = json.dumps({"question": "q", "answer": f"work\n#### {final}"})
        path.write_text((row + "\n") * 10)
        return get_task("gsm8k", str(path)).test(1, 0)[0]["answer"]

    return reference


WRONG = [  # (completion, reference): every one scores 0; a reference of digits goes through the GSM8K loader
    (r"\boxed{x+5}", "5"),
    (r"\boxed{2^4}", "4"),
    (r"\boxed{12\sqrt{2}}", "2"),
    (r"\boxed{\frac{1+\sqrt{5}}{2}}", "2"),
    (r"\boxed{6!}", "6"),
    (r"\boxed{18 \text{ or } 20}", "20"),
    ("The answer is $\\frac{1}{3}$.", "3"),
    ("AZYUK2A", "2"),
    (r"is $\boxed{32, 349}$", "32349"),
    ("$[0,9)$", "(0,9)"),
    (r"\boxed{18} or \boxed{20}", "20"),  # two boxes: a list, never one of them
    (r"\boxed{20 \text{ or more}}", "20"),
    (r"\boxed{1 000}", "0"),
    ("It is 18 or 20.", "20"),
]
RIGHT = [
    (r"\frac{10}{9}", "10/9"),
    (r"The answer is $\dfrac{1}{3}$.", "1/3"),
    (r"\boxed{14{,}916}", "14916"),
    ("so 1 000 in all", "1000"),
    (r"Therefore $x \geq 5$ is the solution.", "$x >= 5$"),
    ("$E$", r"$\text{E}$"),
    (r"\boxed{\$1,234}", "1234"),
    ("She pays $5 and gets $3 back, so $18.", "18"),
    (r"is $\boxed{32,\! 349}$", "32349"),
]


@pytest.mark.parametrize("completion,reference", WRONG)
def test_wrong_answers_score_zero(completion: str, reference: str, checker: str, gsm8k_reference) -> None:
    """Guards against credit for a number inside a larger expression, one of several alternatives, a fraction's
    denominator, a fragment of a word, a list read as thousands, or brackets dropped before comparing."""
    ref = gsm8k_reference(reference) if reference.isdigit() else reference
    assert math_reward(completion, {"answer": ref}) == 0.0


@pytest.mark.parametrize("completion,reference", RIGHT)
def test_right_answers_score_one(completion: str, reference: str, checker: str, gsm8k_reference) -> None:
    """Guards against refusing right answers over a LaTeX fraction, thousands separators, relation spellings,
    `\\text{}` or currency."""
    ref = gsm8k_reference(reference) if reference.isdigit() else reference
    assert math_reward(completion, {"answer": ref}) == 1.0


def fake_math_verify(parse) -> types.SimpleNamespace:
    """A stand-in for the math_verify module: `parse` as given, `verify` true when both parses agree."""
    return types.SimpleNamespace(
        parse=parse, verify=lambda gold, guess, **kw: gold == guess, LatexExtractionConfig=lambda **kw: kw
    )


def test_math_verify_gets_the_answer_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against the project's extraction editing the answer before math-verify reads it (brackets stripped,
    the last number of an interval taken, LaTeX normalized), and against a call that lets it read beyond it."""
    calls = []

    def parse(text: str, config, **kw) -> list:
        calls.append((text, config, kw))
        return [text.replace("[", "(")]

    monkeypatch.setitem(sys.modules, "math_verify", fake_math_verify(parse))
    assert math_reward(r"The domain is $[0,9)$.", {"answer": r"$(0,9)$"}) == 1.0  # what the fake says
    config = [{"boxed_match_priority": 0}]
    kw = {"extraction_mode": "first_match", "parsing_timeout": None}
    assert calls == [(r"\boxed{(0,9)}", config, kw), (r"\boxed{[0,9)}", config, kw)]
    calls.clear()
    assert math_reward(r"\boxed{\left[ \dfrac{1}{2}, 3 \right)}", {"answer": "(1/2, 3)"}) == 0.0
    assert calls[1][0] == r"\boxed{\left[ \dfrac{1}{2}, 3 \right)}"


def test_math_verify_never_sees_costly_powers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against handing sympy a power tower or a huge exponent: one C-level integer power can run for
    hours, and neither a signal nor a deadline can stop a C call."""
    calls = []
    monkeypatch.setitem(sys.modules, "math_verify", fake_math_verify(lambda text, config, **kw: calls.append(text)))
    for power in (r"9^{9^{9^{9}}}", "9^9^9", "9**9**9", r"10^{10000000}", r"(10^{100})^{100}"):
        assert math_reward(f"\\boxed{{{power}}}", {"answer": "x"}) == 0.0
    assert calls == []
    math_reward(r"\boxed{x^2 + 2^{2007}}", {"answer": "x"})
    assert calls == [r"\boxed{x}", r"\boxed{x^2 + 2^{2007}}"]


@pytest.mark.parametrize("in_thread", [False, True])
def test_math_verify_deadline_in_any_thread(in_thread: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against a math-verify call that never returns (sympy simplifying for minutes) stalling training,
    in the main thread and in a scoring pool's worker alike (its own SIGALRM timeout exists only in the main
    thread), and against the deadline firing after the call has returned."""

    def parse(text: str, config, **kw) -> list:
        start = time.perf_counter()
        while time.perf_counter() - start < 3:  # sympy at work, in Python bytecode, for longer than the deadline
            pass
        return [text]

    monkeypatch.setitem(sys.modules, "math_verify", fake_math_verify(parse))
    monkeypatch.setattr(math_equal, "MATH_VERIFY_SECONDS", 0.2)
    out = []
    start = time.perf_counter()
    if in_thread:
        thread = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{x}", {"answer": "y"})))
        thread.start()
        thread.join(5)
    else:
        out.append(math_reward(r"\boxed{x}", {"answer": "y"}))
    assert out == [0.0] and time.perf_counter() - start < 2
    monkeypatch.setitem(sys.modules, "math_verify", fake_math_verify(lambda text, config, **kw: [text[7:-1]]))
    assert math_reward(r"\boxed{x}", {"answer": "x"}) == 1.0  # fast calls are untouched ...
    time.sleep(0.3)  # ... and no deadline goes off after them


def test_math_fallback_without_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against the symbolic path crashing when the optional math-verify is absent."""
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    assert not answers_match("(x+1)^2", "x^2+2x+1")
    assert answers_match(r"\sqrt{2}", r"\sqrt{2}")


def test_math_verify_symbolic() -> None:
    """Guards against the math-verify path being wired wrongly when the extra is installed."""
    pytest.importorskip("math_verify")
    assert answers_match(r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt3}{2}")
    assert answers_match("(x+1)^2", "x^2+2x+1")
    assert answers_match(r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{bmatrix} 1 \\ 2 \end{bmatrix}")
    assert not answers_match("x+1", "x+2")
    assert not answers_match("[0,9)", "(0,9)")


def test_math_reward_answer_after_think() -> None:
    """Guards against crediting the scratchpad: with </think>, only the text after the last one counts."""
    ex = {"answer": "72"}
    assert math_reward("<think>maybe 72?</think>The answer is 71.", ex) == 0.0
    assert math_reward("<think>maybe 71?</think>The answer is 72.", ex) == 1.0
    assert math_reward("<think>a</think>b</think>#### 72", ex) == 1.0
    assert math_reward("no think block: 72", ex) == 1.0


@pytest.mark.parametrize(
    "completion,score",
    [
        ("<think>add them</think>42", 1.0),
        ("add them</think>42", 1.0),  # <think> was in the prompt
        ("<think>add them</think>42<|im_end|>", 1.0),
        ("<think></think>42", 0.5),  # empty thought
        ("<think>add them</think>  ", 0.5),  # empty answer
        ("<think>add them", 0.0),  # never closed
        ("42", 0.0),
        ("<think>a</think>b</think>c", 0.0),  # two closes
        ("<think>a<think>b</think>c", 0.0),  # two opens
        ("x<think>a</think>b", 0.0),  # open not at the start
    ],
)
def test_format_reward(completion: str, score: float) -> None:
    """Guards against rewarding broken structure (repeated/misplaced tags) and against the
    documented partial credit drifting."""
    assert format_reward(completion, {}) == score


def test_exact_reward_synthetic() -> None:
    """Guards against a lenient synthetic check (numeric equality would accept 0425) and against
    rejecting a correct answer followed by the end token."""
    ex = {"answer": "425"}
    assert exact_reward("<think>7+8=15\n</think>425", ex) == 1.0
    assert exact_reward("<think>x</think> 425\n<|im_end|>", ex) == 1.0
    assert exact_reward("<think>x</think>0425", ex) == 0.0
    assert exact_reward("425", ex) == 0.0  # no thought
    assert exact_reward("<think>425</think>4 25", ex) == 0.0
    assert strip_end_tokens(" 7 <|eot_id|></s> ") == "7"


COUNTDOWN = [  # (answer text, nums, target, reward); rule: every number exactly once
    ("(1 + 2) * 3", [1, 2, 3], 9, 1.0),
    ("3 * (1 + 2) = 9", [3, 1, 2], 9, 1.0),  # trailing "= target" ignored
    ("(6 / 4) * 2", [2, 4, 6], 3, 1.0),  # exact fractions
    ("7 / 2 * 2", [2, 2, 7], 7, 1.0),
    ("6 × 2 ÷ 3", [6, 2, 3], 4, 1.0),
    ("1 + 2", [1, 2, 3], 3, 0.0),  # 3 unused: exactly-once rule
    ("1 + 2 + 3 + 3", [1, 2, 3], 9, 0.0),  # 3 used twice
    ("(1 + 2) * 4", [1, 2, 3], 12, 0.0),  # 4 is not given
    ("1 + 2 + 3", [1, 2, 3], 7, 0.0),  # wrong value
    ("3 / (2 - 2) + 1", [3, 2, 2, 1], 1, 0.0),  # division by zero
    ("-1 + 2 + 3", [1, 2, 3], 4, 0.0),  # no unary minus
    ("2 ** 3 + 1", [2, 3, 1], 9, 0.0),  # no powers
    ("(1 + 2", [1, 2], 3, 0.0),
    ("1 2 + 3", [1, 2, 3], 6, 0.0),
    ("__import__('os')", [1], 1, 0.0),
]


@pytest.mark.parametrize("expr,nums,target,score", COUNTDOWN)
def test_countdown_reward(expr: str, nums: list[int], target: int, score: float) -> None:
    """Guards against eval-like parsing, float rounding, reused or missing numbers and crashes on
    division by zero."""
    ex = {"nums": nums, "target": target}
    assert countdown_reward(f"<think>try</think><answer>{expr}</answer>", ex) == score


def test_countdown_only_after_think() -> None:
    """Guards against grading an <answer> written inside the scratchpad."""
    ex = {"nums": [1, 2], "target": 3}
    assert countdown_reward("<think><answer>1+2</answer></think>nothing", ex) == 0.0


def test_extract_code() -> None:
    """Guards against running the wrong block: a non-Python block, one in the scratchpad, or an
    unclosed fence."""
    text = "```python\nA\n```\nthen\n```py\nB\n```\nand\n```text\nC\n```\n```python\nunclosed"
    assert extract_code(text) == "B\n"
    assert extract_code("<think>```python\nA\n```</think>none") is None
    assert extract_code("```\nbare\n```") == "bare\n"


def test_combine_rewards_weighted_sum() -> None:
    """Guards against weights applied to the wrong reward or per-reward metrics misaligned."""
    completions = ["<think>t</think>\\boxed{3}", "<think>t</think>\\boxed{4}", "no format 3"]
    examples = [{"answer": "3"}] * 3
    total, per = combine_rewards(
        completions, examples, {"correct": (math_reward, 1.0), "format": (format_reward, 0.25)}
    )
    assert per == {"correct": [1.0, 0.0, 1.0], "format": [1.0, 1.0, 0.0]}
    assert total == [1.25, 0.25, 1.0]
    with pytest.raises(ValueError):
        combine_rewards(completions, examples[:2], {"correct": (math_reward, 1.0)})


def test_score_batch_pool_keeps_order() -> None:
    """Guards against a thread pool returning results out of order."""
    completions = [f"\\boxed{{{i}}}" for i in range(20)]
    examples = [{"answer": str(i if i % 3 else -1)} for i in range(20)]
    assert score_batch(math_reward, completions, examples, max_workers=4) == [float(i % 3 != 0) for i in range(20)]


BIG = 10_000_000
HOSTILE = {
    "10 MB of digits": "9" * BIG,
    "10 MB of commas": "1," * (BIG // 2),
    "10 MB after think": "<think>x</think>" + "a" * BIG,
    "10k braces": "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    "10k unclosed braces": "\\boxed{" * 10_000,
    "10k parens": "<answer>" + "(" * 10_000 + "1" + ")" * 10_000 + "</answer>",
    "power tower": "\\boxed{9**9**9**9} <answer>9**9**9**9</answer> 9^{9^{9^{9}}}",
    "NUL bytes": "\x00" * 1000 + "<answer>\x001+2\x00</answer>\\boxed{\x00}",
    "import": "<answer>__import__('os').system('true')</answer>\\boxed{__import__('os')}",
    "unbalanced tags": "</think><think></answer><answer><answer>```python" * 1000,
    "many fences": "```\n" * 2_500_000,
    "many answers": "<answer>" * 1_000_000,
    "many boxes": "\\boxed{" * 1_000_000,
    "huge number in answer": "<answer>" + "9" * 100_000 + "</answer>",
    "10 MB thousands": "1" + ",000" * 2_500_000,
    "many think closes": "</think>" * 1_000_000,
}
EXAMPLE = {"answer": "3", "nums": [1, 2], "target": 3, "tests": "assert True"}


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("reward", [math_reward, format_reward, countdown_reward, exact_reward, code_reward])
def test_hostile_text_is_bounded(name: str, reward) -> None:
    """Guards against a model output that hangs or crashes training: catastrophic regex
    backtracking, quadratic scans, recursion on deep nesting, evaluating power towers, huge int
    parsing. (Only "many fences" reaches the sandbox, with an empty code block.)"""
    start = time.perf_counter()
    value = reward(HOSTILE[name], EXAMPLE)
    elapsed = time.perf_counter() - start
    assert isinstance(value, float) and 0.0 <= value <= 1.0
    assert elapsed < 1.0, f"{reward.__name__} took {elapsed:.2f}s on {name}"


def test_math_reward_same_in_a_thread_pool() -> None:
    """Guards against rewards that depend on the thread scoring them: math-verify used in the main thread only
    (its SIGALRM timeout raises elsewhere), so a --reward-workers run and its evaluation would disagree."""
    pytest.importorskip("math_verify")
    completions = [r"\boxed{(x+1)^2}", r"\boxed{x+1}", r"\boxed{\frac{\sqrt{3}}{2}}", r"\boxed{[0,9)}", r"\boxed{2}"]
    examples = [{"answer": a} for a in ("x^2+2x+1", "x+2", r"\dfrac{\sqrt3}{2}", "(0,9)", "2")]
    expected = [1.0, 0.0, 1.0, 0.0, 1.0]
    assert score_batch(math_reward, completions, examples, max_workers=1) == expected
    assert score_batch(math_reward, completions, examples, max_workers=4) == expected


def test_rewards_never_imports_tasks() -> None:
    """Guards against the rewards/tasks import cycle coming back (tasks.py imports rewards.py; a lazy import of
    tasks inside a reward was how the cycle used to be worked around), and against math_answers.py, which both
    use, importing either, or math_equal.py, which it imports, importing it back."""

    def imports(module) -> set[str]:
        tree = ast.parse(Path(module.__file__).read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}

    assert "tasks" not in imports(rewards) and "math_answers" in imports(rewards)  # (the walk does see imports)
    assert not imports(math_answers) & {"tasks", "rewards", "sandbox"} and "math_equal" in imports(math_answers)
    assert not imports(math_equal) & {"tasks", "rewards", "sandbox", "math_answers"}
