"""Answer extraction, equivalence, format, Countdown and batching; every reward against hostile text.
(The code sandbox has its own file, test_sandbox.py.)"""

import sys
import threading
import time

import pytest

from rewards import (
    answers_match,
    code_reward,
    combine_rewards,
    countdown_reward,
    exact_reward,
    extract_answer,
    extract_boxed,
    extract_code,
    format_reward,
    math_reward,
    parse_number,
    score_batch,
    strip_end_tokens,
)

EXTRACTION = [  # (completion, extracted answer)
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),  # nested braces
    (r"first \boxed{1} then \boxed{2}", "2"),  # the last box wins
    (r"\fbox{7}", "7"),
    (r"\boxed 9", "9"),
    ("<answer> 12 </answer>", " 12 "),
    ("<answer>1</answer> and <answer>3</answer>", "3"),
    ("Natalia sold 48+24 = 72 clips.\n#### 72", "72"),
    ("#### 1,000\nextra words", "1,000"),
    ("It costs 3 dollars, then 5.5 dollars.", "5.5"),  # last number
    ("the total is 1,234,567.", "1,234,567"),
    ("<think>the answer is 5</think>It is 6", "6"),  # only after </think>
    ("<think>\\boxed{5}</think> no number here", None),  # box in the scratchpad
    (r"\boxed{unclosed", None),
    ("no digits at all", None),
]


@pytest.mark.parametrize("completion,expected", EXTRACTION)
def test_extract_answer(completion: str, expected: str | None) -> None:
    """Guards against extracting the wrong span: first instead of last box, broken nesting, the
    scratchpad's number counted as the answer, a trailing sentence comma kept in the number."""
    assert extract_answer(completion) == expected


def test_extract_boxed_braces() -> None:
    """Guards against brace matching that stops at the first `}` or miscounts escaped braces."""
    assert extract_boxed(r"\boxed{a{b}c} tail") == "a{b}c"
    assert extract_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert extract_boxed(r"\boxed{") is None and extract_boxed(r"\boxed") is None


EQUIVALENT = [  # (prediction, reference)
    ("1,234", "1234"),
    ("2.50", "2.5"),
    ("-3", "-3.0"),
    ("3/4", "0.75"),
    (r"\frac{3}{4}", "0.75"),
    (r"\dfrac{1}{2}", "1/2"),
    (r"\tfrac12", "0.5"),
    (r"-\frac{1}{2}", "-0.5"),
    (r"\frac{-1}{2}", "-1/2"),
    (r"50\%", "50"),
    ("50%", "50"),
    (r"\text{5}", "5"),
    ("$5$", "5"),
    (r"1\,000", "1000"),
    ("1{,}000", "1000"),
    (r"18 \text{ dollars}", "18"),
    ("x = 7", "7"),
    (r"90^\circ", "90"),
    ("5.", "5"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"x^2 + 1", "x^2+1"),
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
    ("9" * 100, "9" * 100 + "0"),
    ("0.5", "50%"),
]


@pytest.mark.parametrize("pred,ref", EQUIVALENT)
def test_answers_match(pred: str, ref: str) -> None:
    """Guards against marking right answers wrong over formatting: separators, trailing zeros,
    LaTeX fractions and wrappers, percent signs, units."""
    assert answers_match(pred, ref)
    assert math_reward(f"\\boxed{{{pred}}}", {"answer": ref}) == 1.0


@pytest.mark.parametrize("pred,ref", NOT_EQUIVALENT)
def test_answers_do_not_match(pred: str, ref: str) -> None:
    """Guards against lenient checks that reward wrong answers: float tolerance, dropped signs,
    European decimal commas read as thousands, division by zero, digit-prefix matches."""
    assert not answers_match(pred, ref)


def test_parse_number_values() -> None:
    """Guards against inexact parsing (floats) and parsing of huge digit strings."""
    assert parse_number("2.50") == parse_number("5/2") == parse_number(r"\frac{5}{2}")
    assert parse_number("1,234,567") == 1234567
    assert parse_number("9" * 65) is None and parse_number("1e5") is None and parse_number("--1") is None


def test_math_fallback_without_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against the symbolic path crashing when the optional math-verify is absent."""
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    assert not answers_match("(x+1)^2", "x^2+2x+1")
    assert answers_match(r"\sqrt{2}", r"\sqrt{2}")


def test_math_verify_symbolic() -> None:
    """Guards against the math-verify path being wired wrongly when the extra is installed."""
    pytest.importorskip("math_verify")
    assert answers_match(r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt3}{2}")
    assert not answers_match("x+1", "x+2")


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


def test_rewards_thread_safe_and_math_verify_skipped_off_main_thread() -> None:
    """Guards against math-verify's SIGALRM timeout raising (or being unbounded) in a worker thread."""
    out = []
    thread = threading.Thread(target=lambda: out.append(math_reward("\\boxed{(x+1)^2}", {"answer": "(x+1)^2"})))
    thread.start()
    thread.join(5)
    assert out == [1.0]
