"""Rewards: every training signal and eval metric is a pure `(completion: str, example: dict) -> float`.

Owns answer extraction and checking (`math_reward`), the think/answer structure (`format_reward`),
Countdown equations (`countdown_reward`, a small exact-arithmetic parser, never `eval`), the exact
answer of the synthetic task (`exact_reward`), the code block of a completion run against tests
(`extract_code`, `code_reward`; running untrusted code is sandbox.py's job), and weighted sums for
logging (`combine_rewards`). DAPO's overlong penalty works on token lengths and lives in advantage.py.

Model outputs are hostile input: megabytes long, braces ten thousand deep, `9**9**9**9`, NUL bytes,
fork bombs. Every reward returns in bounded time and never raises on any completion. Bounds:
- Only the text after the LAST `</think>` is graded when the completion has one: a number, box or
  code block in the scratchpad earns nothing. Of that text only the last `MAX_ANSWER_CHARS` (code:
  `MAX_CODE_CHARS`) are searched, so a 10 MB completion costs one `rfind`.
- Regexes have no nested quantifiers (no catastrophic backtracking); numbers longer than
  `math_equal.MAX_NUMBER_CHARS` are not parsed (Python refuses or crawls on huge int strings); Countdown has no
  `**` and bounds expression length and parenthesis depth.
- Failures are caught by class, only where they can happen: ValueError (a malformed Countdown
  equation, or nesting past MAX_EXPR_DEPTH: that explicit counter is why RecursionError cannot
  occur), ZeroDivisionError (x/0 in Countdown); sandbox.py catches its own (a process that cannot start).
  Floats and powers are never evaluated, so OverflowError cannot occur; math-verify catches its
  own errors and runs under a deadline (math_equal.py). A reward raises only for a malformed *example* (a
  missing "answer"), which is a bug in the task, not model output.

Math answers: `math_reward` is `final_answer` of the graded text against `reference_answer`, compared by
`answers_match`; math_answers.py and math_equal.py hold those rules, with math-verify behind them when it is installed.
"""

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

from math_answers import answers_match, extract_tag, final_answer, parse_number, reference_answer
from sandbox import run_sandboxed

MAX_ANSWER_CHARS = 20_000  # tail of the post-</think> text searched for an answer
MAX_EXPR_CHARS = 256  # Countdown: longer equations score 0
MAX_EXPR_DEPTH = 32  # Countdown: deeper parenthesis nesting scores 0
MAX_CODE_CHARS = 100_000  # tail of the post-</think> text searched for a ```python block


def answer_text(completion: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """The gradable part of a completion: after the last `</think>` if any, its last `limit` chars."""
    i = completion.rfind("</think>")
    text = completion[i + len("</think>") :] if i >= 0 else completion
    return text[-limit:]


def strip_end_tokens(text: str) -> str:
    """Strip whitespace and trailing special-token text (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...),
    which a decode with skip_special_tokens=False leaves at the end of a completion."""
    text = text.strip()
    while True:
        if text.endswith("</s>"):
            text = text[:-4].rstrip()
        elif text.endswith("|>") and (j := text.rfind("<|", max(0, len(text) - 40))) >= 0:
            text = text[:j].rstrip()
        else:
            return text


# ---------------------------------------------------------------- math answers (rules: math_answers.py, math_equal.py)


def extract_answer(completion: str) -> str | None:
    """The final answer of a math completion, from its text after the last `</think>` (see `final_answer`)."""
    return final_answer(answer_text(completion))


def math_reward(completion: str, example: dict) -> float:
    """1.0 if the final answer (`extract_answer`) matches the reference (`reference_answer` of
    `example["answer"]`, compared by `answers_match`), else 0.0."""
    pred = extract_answer(completion)
    return float(pred is not None and answers_match(pred, reference_answer(str(example["answer"]))))


def exact_reward(completion: str, example: dict) -> float:
    """1.0 if the text after the last `</think>`, stripped of whitespace and trailing end-token text,
    is exactly `example["answer"]` (the synthetic task: no normalization, `0425` is wrong)."""
    i = completion.rfind("</think>")
    if i < 0 or len(completion) - i > 1000:  # no thought, or far too long to be an answer
        return 0.0
    return float(strip_end_tokens(completion[i + len("</think>") :]) == str(example["answer"]))


def format_reward(completion: str, example: dict) -> float:
    """The `<think>thought</think>answer` structure. The opening `<think>` is optional (chat templates
    often put it in the prompt) but if present it must open the completion.
    1.0: one closed thought and a non-empty answer after it; 0.5: one closed thought but the
    thought or the answer is empty; 0.0: no `</think>`, repeated or misplaced tags."""
    text = strip_end_tokens(completion)
    if text.count("</think>") != 1 or text.count("<think>") > 1:
        return 0.0
    if "<think>" in text and not text.startswith("<think>"):
        return 0.0
    thought, answer = text.removeprefix("<think>").split("</think>")
    return 1.0 if thought.strip() and answer.strip() else 0.5


# ---------------------------------------------------------------- Countdown

_EXPR_CHARS = re.compile(r"[\d+\-*/() ]*")
_EXPR_TOKEN = re.compile(r"\d+|[-+*/()]")


def countdown_reward(completion: str, example: dict) -> float:
    """1.0 if the equation in the last `<answer>...</answer>` uses every number of `example["nums"]`
    EXACTLY ONCE (the TinyZero rule; a subset scores 0) and equals `example["target"]`.
    Allowed: integers, + - * /, parentheses, spaces; `x`/`×`/`÷` are read as * and /; a trailing
    `= N` is ignored. No unary minus, no `**`. Exact arithmetic with Fraction: 7/2*2 == 7."""
    tokens = countdown_tokens(completion, example["nums"])
    if tokens is None:
        return 0.0
    try:
        value, end = _parse_sum(tokens, 0, 0)
        if end != len(tokens):
            raise ValueError("trailing tokens")
    except ValueError:  # malformed equation (syntax, nesting deeper than MAX_EXPR_DEPTH)
        return 0.0
    except ZeroDivisionError:  # a division by zero anywhere makes the equation invalid
        return 0.0
    return float(value == example["target"])


def countdown_tokens(completion: str, nums: list[int]) -> list[str] | None:
    """The tokens of the last `<answer>` equation if it is well formed (allowed characters, bounded length) and uses
    every number of `nums` exactly once (a number of more than 9 digits never matches), else None."""
    expr = countdown_equation(completion)
    if expr is None or len(expr) > MAX_EXPR_CHARS or not _EXPR_CHARS.fullmatch(expr):
        return None
    tokens = _EXPR_TOKEN.findall(expr)
    numbers = sorted(int(t) for t in tokens if t.isdigit() and len(t) <= 9)
    return tokens if len(numbers) == sum(t.isdigit() for t in tokens) and numbers == sorted(nums) else None


def countdown_numbers_reward(completion: str, example: dict) -> float:
    """Countdown's "uses each number once" component: 1.0 if `countdown_tokens` accepts the equation, any value."""
    return float(countdown_tokens(completion, example["nums"]) is not None)


def countdown_equation(completion: str) -> str | None:
    """The equation of the last `<answer>...</answer>`, before any `=`, with x, × and ÷ read as * and /."""
    expr = extract_tag(answer_text(completion), "answer")
    return None if expr is None else expr.split("=", 1)[0].replace("×", "*").replace("x", "*").replace("÷", "/")


def _parse_sum(tokens: list[str], i: int, depth: int) -> tuple[Fraction, int]:
    """sum := product (('+' | '-') product)*  ->  (value, index after it)."""
    value, i = _parse_product(tokens, i, depth)
    while i < len(tokens) and tokens[i] in "+-":
        rhs, j = _parse_product(tokens, i + 1, depth)
        value, i = (value + rhs if tokens[i] == "+" else value - rhs), j
    return value, i


def _parse_product(tokens: list[str], i: int, depth: int) -> tuple[Fraction, int]:
    """product := atom (('*' | '/') atom)*"""
    value, i = _parse_atom(tokens, i, depth)
    while i < len(tokens) and tokens[i] in "*/":
        rhs, j = _parse_atom(tokens, i + 1, depth)
        value, i = (value * rhs if tokens[i] == "*" else value / rhs), j
    return value, i


def _parse_atom(tokens: list[str], i: int, depth: int) -> tuple[Fraction, int]:
    """atom := integer | '(' sum ')'"""
    if i >= len(tokens):
        raise ValueError("unexpected end")
    if tokens[i].isdigit():
        return Fraction(int(tokens[i])), i + 1
    if tokens[i] != "(" or depth >= MAX_EXPR_DEPTH:
        raise ValueError("expected a number or '(' (or nesting too deep)")
    value, i = _parse_sum(tokens, i + 1, depth + 1)
    if i >= len(tokens) or tokens[i] != ")":
        raise ValueError("missing ')'")
    return value, i + 1


# ---------------------------------------------------------------- code, run against tests (in sandbox.py)


def extract_code(completion: str) -> str | None:
    """The last ```python (or ```py, or bare ```) block after the last `</think>`, or None. Fences are
    paired left to right by plain string search (a lazy regex would be quadratic on many fences)."""
    text = answer_text(completion, MAX_CODE_CHARS)
    fences, i = [], text.find("```")
    while i >= 0:
        fences.append(i)
        i = text.find("```", i + 3)
    for start, end in reversed(list(zip(fences[::2], fences[1::2]))):
        info, _, body = text[start + 3 : end].partition("\n")
        if info.strip().lower() in ("", "python", "python3", "py"):
            return body
    return None


def code_reward(completion: str, example: dict) -> float:
    """1.0 if the last ```python block passes `example["tests"]` (asserts; a list is joined by lines; with `entry_point`
    the tests' `check(candidate)` is called on it) in the sandbox, `example["setup"]` (HumanEval's prompt: its
    imports and helpers) run ahead of both the code and the tests; `example["functions"]` names the functions under
    test that the tests may take from the code even where they shadow a builtin. The tests run in an interpreter of
    their own and reach the code's functions only through plain-data calls (sandbox.py), so code that attacks the
    tests instead of passing them scores 0."""
    code = extract_code(completion)
    if code is None:
        return 0.0
    tests = example["tests"]
    tests = "\n".join(tests) if isinstance(tests, list) else tests
    setup, functions = example.get("setup", ""), tuple(example.get("functions", ()))
    report = run_sandboxed(code, tests, setup=setup, entry_point=example.get("entry_point"), functions=functions)
    return float(report["passed"])


def code_rewards(completions: list[str], examples: list[dict], max_workers: int = 4) -> list[float]:
    """`code_reward` over a batch, `max_workers` sandboxes at a time."""
    return score_batch(code_reward, completions, examples, max_workers)


# ---------------------------------------------------------------- batches, weighted sums, reward components


def components(correct: Callable[[str, dict], float]) -> dict[str, tuple[Callable[[str, dict], float], float]]:
    """A built-in task's reward components, name -> (fn, weight), summing to its reward `correct`: correct (weight 1),
    format (0: the answer in the form the task asks for, right or wrong) and countdown's each_number_once (0)."""
    find = {countdown_reward: countdown_equation, math_reward: extract_answer, code_reward: extract_code}.get(correct)
    form = format_reward if find is None else lambda completion, example: float(find(completion) is not None)
    more = {"each_number_once": (countdown_numbers_reward, 0.0)} if correct is countdown_reward else {}
    return {"correct": (correct, 1.0), "format": (form, 0.0), **more}


def score_batch(
    fn: Callable[[str, dict], float], completions: list[str], examples: list[dict], max_workers: int = 1
) -> list[float]:
    """`fn` over (completion, example) pairs; a thread pool when max_workers > 1 (worth it for
    code_reward, whose work happens in subprocesses)."""
    if len(completions) != len(examples):
        raise ValueError(f"score_batch got {len(completions)} completions but {len(examples)} examples.")
    if max_workers <= 1:
        return [float(fn(c, e)) for c, e in zip(completions, examples)]
    with ThreadPoolExecutor(max_workers) as pool:
        return [float(r) for r in pool.map(fn, completions, examples)]


def combine_rewards(
    completions: list[str],
    examples: list[dict],
    fns: dict[str, tuple[Callable[[str, dict], float], float]],
    max_workers: int = 1,
) -> tuple[list[float], dict[str, list[float]]]:
    """Weighted sum of rewards: fns = {name: (fn, weight)} -> (total per completion, {name: values})."""
    if not fns:
        raise ValueError("combine_rewards needs at least one reward function.")
    per_reward = {name: score_batch(fn, completions, examples, max_workers) for name, (fn, _) in fns.items()}
    total = [sum(weight * per_reward[name][i] for name, (_, weight) in fns.items()) for i in range(len(completions))]
    return total, per_reward


# ---------------------------------------------------------------- partial credit (DaGRPO's fine-grained score)
# A RECONSTRUCTION: the paper scores with an LLM; these are deterministic local stand-ins.


_CALC_RESULT = re.compile(r"<<[^<>]*=([^<>=]*)>>")  # GSM8K calculator annotation <<48/2=24>>: its result
_UNSIGNED_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def calculator_partial_credit(completion: str, example: dict) -> float:
    """Fine-grained score in [0, 1] of a math completion: 1 when `math_reward` says it is correct, else the
    fraction of the distinct results of the reference solution's calculator annotations (GSM8K's
    `<<48/2=24>>` gives 24) that appear as numbers (compared by value, sign ignored) anywhere in the
    completion. A reference without annotations (MATH, generic answers) gives the plain reward."""
    if math_reward(completion, example) == 1.0:
        return 1.0
    values = (parse_number(r.strip()) for r in _CALC_RESULT.findall(str(example.get("solution", ""))))
    results = {abs(v) for v in values if v is not None}
    if not results:
        return 0.0
    seen = {parse_number(n.rstrip(",")) for n in _UNSIGNED_NUMBER.findall(completion[-MAX_ANSWER_CHARS:])}
    return len(results & seen) / len(results)
