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
  `MAX_NUMBER_CHARS` are not parsed (Python refuses or crawls on huge int strings); Countdown has no
  `**` and bounds expression length and parenthesis depth.
- Failures are caught by class, only where they can happen: ValueError (a malformed Countdown
  equation, or nesting past MAX_EXPR_DEPTH: that explicit counter is why RecursionError cannot
  occur), ZeroDivisionError (x/0 in Countdown); sandbox.py catches its own (a process that cannot start).
  Floats and powers are never evaluated, so OverflowError cannot occur; math-verify catches its
  own errors. A reward raises only for a malformed *example* (a missing "answer"), which is a bug
  in the task, not model output.
"""

import ctypes
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from types import ModuleType

from sandbox import run_sandboxed

MAX_ANSWER_CHARS = 20_000  # tail of the post-</think> text searched for an answer
MAX_NUMBER_CHARS = 64  # longer numeric strings are compared as text, never parsed
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


# ---------------------------------------------------------------- math answers: extraction

MAX_VERIFY_CHARS = 1000  # longer final answers (or references) are not compared: 0
MATH_VERIFY_SECONDS = 3.0  # wall-clock bound of one math-verify comparison (both parses and the verify)

_EXPONENT = re.compile(r"(?:\^|\*\*)\s*[{(]?\s*-?(\d+)")  # the integer an exponent starts with
_NESTED_POWER = re.compile(r"\^\s*\{[^{}]*\^|(?:\^|\*\*)\s*\w+\s*(?:\^|\*\*)")  # 9^{9^9}, 9^9^9, 9**9**9
_BOX = re.compile(r"(?:\\boxed|\\fbox)\s*")
_BRACE = re.compile(r"[{}]")
_TOKEN = re.compile(r"\S+")
# A math span: $$..$$ and \[..\] may cross lines, $..$ and \(..\) may not (as Math-Verify reads them). The
# bounded content keeps an opener that never closes from costing more than 500 characters of scanning.
_MATH_SPAN = re.compile(
    r"\$\$([^$]{1,500}?)\$\$|\\\[(.{1,500}?)\\\]|\\\(([^\n]{1,500}?)\\\)|(?<![\\$])\$([^$\n]{1,500}?)(?<!\\)\$",
    re.DOTALL,
)
_NUMBER_TOKEN = re.compile(  # a number or fraction as prose writes it: -1,234.5  3/4  \frac{10}{9}  \dfrac34
    r"-?(?:\\[dtc]?frac(?:\{\d+(?:\.\d+)?\}\{\d+(?:\.\d+)?\}|\d\d)"  # a LaTeX fraction of two numbers
    r"|(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"  # 1,234 or 1 234 or 1234, .5, /4
    r"|\.\d+)"
)
_CONNECTIVE = r"(?:,|\b(?:or|and|plus|minus|times|over)\b)"  # `18 or 20`, `1, 2`: neither number is the answer
_LISTED_BEFORE = re.compile(rf"\d[^\s\d]{{0,3}}\s*{_CONNECTIVE}\s*\$?$", re.IGNORECASE)
_LISTED_AFTER = re.compile(rf"[^\s\d]{{0,3}}\s*{_CONNECTIVE}\s*\$?-?\.?\d", re.IGNORECASE)
_SPAN_LISTED_BEFORE = re.compile(rf"(?:\$|\\\)|\\\]|\d)\s*{_CONNECTIVE}\s*$", re.IGNORECASE)
_SPAN_LISTED_AFTER = re.compile(rf"\s*{_CONNECTIVE}\s*(?:\$|\\\(|\\\[|-?\d)", re.IGNORECASE)
_JOINS_BEFORE = set("+-*/^_<>([{|$\\×÷·")  # a number after one of these belongs to an expression (`x+5`, `(0`)
_JOINS_AFTER = set("^_!\\([{/")  # ... and so does one glued to one of these (`2^4`, `6!`, `12\sqrt{2}`)
_OPERATORS = set("+-*/^=<>×÷·")  # ... or followed by an operator (`5 + 3`)


def boxed_answers(text: str) -> list[tuple[str, int, int]] | None:
    """(content, start, end) of every outermost `\\boxed{...}` / `\\fbox{...}` in `text` (a box inside a box is
    part of it), left to right; `\\boxed 5` boxes the next whitespace-delimited token. None when a box never
    closes (the text was cut off, its last answer is unknown). One left-to-right pass over the braces."""
    boxes, pos = [], 0
    while (m := _BOX.search(text, pos)) is not None:
        if not text.startswith("{", m.end()):  # `\boxed 5`
            if (token := _TOKEN.match(text, m.end())) is None:
                return None
            boxes.append((token[0].rstrip("$"), m.start(), token.end()))
            pos = token.end()
            continue
        depth = 0
        for brace in _BRACE.finditer(text, m.end()):  # depth is a counter, not recursion
            depth += 1 if brace[0] == "{" else -1
            if depth == 0:
                break
        if depth != 0:
            return None
        boxes.append((text[m.end() + 1 : brace.start()], m.start(), brace.end()))
        pos = brace.end()
    return boxes


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last `<tag>...</tag>`, or None."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, max(end, 0))
    return text[start + len(tag) + 2 : end] if 0 <= start < end else None


def extract_answer(completion: str) -> str | None:
    """The final answer of a math completion, from its text after the last `</think>` (see `final_answer`)."""
    return final_answer(answer_text(completion))


def final_answer(text: str) -> str | None:
    """The final answer in `text` as written (brackets, LaTeX, spacing untouched), or None when unsure:
    1. its `\\boxed{}`s: the content, when every box holds the same; boxes that differ are ONE answer, the list
       `a, b` of their contents (right only against a reference that is that list, never one of them alone);
    2. else the last `<answer>...</answer>`; 3. else the rest of the line after the last `####`;
    4. else the last candidate: a math span's content (`$..$`, `$$..$$`, `\\(..\\)`, `\\[..\\]`) or a number
       outside spans, whichever ends last; a number only if it stands alone (`_stands_alone`)."""
    boxes = boxed_answers(text)
    if boxes:
        distinct = list(dict.fromkeys(content.strip() for content, _, _ in boxes))
        return ", ".join(distinct) if all(distinct) else None
    if boxes is None:
        return None
    if (tagged := extract_tag(text, "answer")) is not None:
        return tagged.strip() or None
    if (i := text.rfind("####")) >= 0:
        return text[i + 4 :].split("\n", 1)[0].strip() or None
    return _last_candidate(text)


def _last_candidate(text: str) -> str | None:
    """Rule 4 of `final_answer`: the last math span or the last number outside spans, whichever ends last; None
    when that one is not alone (`_stands_alone`; a span next to another span or number: `$18$ or $20$`)."""
    spans = list(_MATH_SPAN.finditer(text))
    numbers = list(_NUMBER_TOKEN.finditer(text, spans[-1].end() if spans else 0))
    if numbers:
        return numbers[-1][0] if _stands_alone(text, numbers[-1].start(), numbers[-1].end()) else None
    if not spans:
        return None
    start, end = spans[-1].span()
    if _SPAN_LISTED_BEFORE.search(text, max(0, start - 40), start) or _SPAN_LISTED_AFTER.match(text, end):
        return None
    return next(group for group in spans[-1].groups() if group is not None).strip() or None


def _stands_alone(text: str, start: int, end: int) -> bool:
    """Whether the number at text[start:end] is a whole answer rather than part of an expression or a list: not
    glued to a letter, digit or dot (`AZYUK2A`, `2x`), not after an operator or opening bracket (`x+5`, `(0,9)`),
    not glued to a power, factorial or LaTeX command (`2^4`, `6!`, `12\\sqrt{2}`), not before an operator, not in
    a list or beside a connective (`1, 2`, `18 or 20`). Allowed: `x = 18`, `Answer: 18`, currency glued before
    it (`$18`), units, `%` or punctuation after it (`18 dollars.`)."""
    glued_before, glued_after = text[start - 1 : start], text[end : end + 1]
    if glued_before.isalnum() or glued_before == "." or glued_after.isalnum() or glued_after in _JOINS_AFTER:
        return False
    if glued_after == "." and text[end + 1 : end + 2].isalnum():
        return False
    before, after = text[:start].rstrip()[-1:], text[end:].lstrip()[:1]
    if (before in _JOINS_BEFORE and glued_before != "$") or after in _OPERATORS:
        return False
    return _LISTED_BEFORE.search(text, max(0, start - 40), start) is None and _LISTED_AFTER.match(text, end) is None


# ---------------------------------------------------------------- math answers: equivalence

_FRAC_COMMANDS = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_THOUSANDS_LATEX = re.compile(r"\{,\}|,\\!\s*")  # 14{,}916 and 10,\!000: LaTeX thousands separators
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|textnormal|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad(?![a-zA-Z])|~")
_DROPPED = re.compile(
    r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\displaystyle|\\\$|\$|\\[()\[\]]|\^\{?\\circ\}?|°|\\%|%"
)
_RELATIONS = (
    (re.compile(r"\\geq?(?![a-zA-Z])|≥"), ">="),
    (re.compile(r"\\leq?(?![a-zA-Z])|≤"), "<="),
    (re.compile(r"\\neq?(?![a-zA-Z])|≠"), "!="),
    (re.compile(r"\\gt(?![a-zA-Z])"), ">"),
    (re.compile(r"\\lt(?![a-zA-Z])"), "<"),
)
_BARE_ARGUMENTS = (  # one-character arguments without braces: \sqrt3, \frac34, \frac3{4}, \frac{3}4
    (re.compile(r"\\sqrt\s*([0-9a-zA-Z])"), r"\\sqrt{\1}"),
    (re.compile(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*([0-9a-zA-Z])\s*\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*([0-9a-zA-Z])"), r"\\frac\1{\2}"),
)
_TRAILING_WORDS = re.compile(r"(.*?[\d}])((?:\s+[A-Za-z]+)+)\s*(?:\^?\{?[23²³]\}?)?")  # 18 dollars, 5 cm^2
_QUALIFIERS = {  # words after a number that make it something else than that number: `20 or more`
    *("or", "and", "nor", "either", "not", "no", "to", "than", "at", "least", "most", "more", "less", "fewer"),
    *("greater", "smaller", "larger", "bigger", "higher", "lower", "above", "below", "over", "under", "maybe"),
    *("perhaps", "possibly", "plus", "minus", "times", "divided", "by", "approximately", "about", "roughly"),
}
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
_LATEX_FRAC = re.compile(r"(-?)\\frac\{([^{}]*)\}\{([^{}]*)\}")
_ASSIGNMENT = re.compile(r"([A-Za-z|(\\][^=<>!+\-*/]*?)\s*(?:=|\\approx|\\in(?![a-zA-Z]))\s*([^=<>]+)")  # x = 5
_FLIPPED = re.compile(r"([^<>=!]+)(>=|>)([^<>=!]+)")  # 5 >= x, read as x <= 5
_SEPARATOR = re.compile(r"\b(?:and|or)\b|[,;]")  # between a reference's boxes that form one answer
_LIST_WORDS = re.compile(r"\s+(?:and|or)\s+")  # 6 and 8: a list, like 6, 8
MAX_ELEMENTS = 16  # longer lists are not compared element by element
_GROUPS = (("\\{", "\\}", "set"), ("{", "}", "set"), *((o, c, o + c) for o in "([" for c in ")]"))  # (0,1] ...


def normalize_answer(s: str) -> str:
    """A final answer in one canonical spelling for comparison: `\\dfrac` -> `\\frac`, `\\frac34` -> `\\frac{3}{4}`,
    `\\sqrt3` -> `\\sqrt{3}`, `\\text{E}` -> `E`, `\\geq` -> `>=`, LaTeX thousands separators (`14{,}916`) -> `,`;
    dropped: `\\left`/`\\right`, math delimiters and `$`, degrees, `%`, LaTeX spacing, a trailing period; runs of
    whitespace become one space (a space can still separate thousands, `1 000`, and a comma-space a list)."""
    s = _FRAC_COMMANDS.sub(r"\\frac", s[:MAX_ANSWER_CHARS])
    s = _THOUSANDS_LATEX.sub(",", s)
    s = _TEXT_WRAPPER.sub(r" \1 ", s)
    s = _DROPPED.sub("", _SPACING.sub(" ", s))
    for pattern, replacement in _RELATIONS + _BARE_ARGUMENTS:
        s = pattern.sub(replacement, s)
    return " ".join(s.split()).rstrip(".").strip()


def parse_number(s: str) -> Fraction | None:
    """Exact value of a normalized answer that is one number: `1,234`, `1 000`, `2.50`, `-3`, `3/4`, `\\frac{3}{4}`,
    `-\\frac{1}{2}`, optionally followed by unit words of two letters or more (`18 dollars`, not `20 or more`);
    None for anything else, and for strings longer than MAX_NUMBER_CHARS. `32, 349` is a list, not a number."""
    if len(s) > 4 * MAX_NUMBER_CHARS:
        return None
    if (m := _TRAILING_WORDS.fullmatch(s)) is not None:
        if any(len(word) < 2 or word.lower() in _QUALIFIERS for word in m[2].split()):
            return None
        s = m[1]
    if len(s) > MAX_NUMBER_CHARS:
        return None
    if (m := _LATEX_FRAC.fullmatch(s)) is not None:
        (num, den), sign = (m[2].strip(), m[3].strip()), -1 if m[1] else 1
    elif s.count("/") == 1:
        (num, den), sign = (part.strip() for part in s.split("/")), 1
    else:
        return Fraction(s.replace(",", "").replace(" ", "")) if _PLAIN_NUMBER.fullmatch(s) else None
    if not (_PLAIN_NUMBER.fullmatch(num) and _PLAIN_NUMBER.fullmatch(den)):
        return None
    num_value, den_value = (Fraction(x.replace(",", "").replace(" ", "")) for x in (num, den))
    return None if den_value == 0 else sign * num_value / den_value


def _qualified(s: str) -> bool:
    """Whether s is a number followed by words with a qualifier in them (`20 or more`, `20 at most`)."""
    m = _TRAILING_WORDS.fullmatch(s) if len(s) <= 4 * MAX_NUMBER_CHARS else None
    return m is not None and parse_number(m[1]) is not None and any(w.lower() in _QUALIFIERS for w in m[2].split())


def numbers_equal(a: Fraction, b: Fraction, decimal: bool) -> bool:
    """Exact equality; when either side was written as a decimal, equality after rounding both to 6 places
    (Math-Verify's rule: 0.333333 is 1/3, 0.333 is not)."""
    return a == b or (decimal and round(a, 6) == round(b, 6))


def builtin_verdict(pred: str, ref: str) -> bool | None:
    """The built-in checker on a final answer and a reference: True when surely equal, False when surely not,
    None when it cannot tell. Both are normalized (`normalize_answer`); when only one is an equation whose left
    side is a name (`x = 5`, `(p,q) = (3,2)`, `x \\in [0,1]`), its right side stands for it. Two numbers compare
    by value (`numbers_equal`): the only False it gives. Anything else is equal when `_same` says so."""
    a, b = normalize_answer(pred), normalize_answer(ref)
    if not a or not b:
        return False
    if a == b:
        return True
    if _qualified(a) or _qualified(b):  # `20 or more` is not 20 (math-verify would read it as 20)
        return False
    if _is_relation(a) != _is_relation(b):
        a, b = _right_side(a), _right_side(b)
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return numbers_equal(x, y, "." in a or "." in b)
    return True if x is None and y is None and _same(a, b) else None


def _is_relation(s: str) -> bool:
    return any(sign in s for sign in ("=", "<", ">", "\\approx", "\\in"))


def _right_side(s: str) -> str:
    """`x = 5` -> `5` when the left side is a name (no operator in it: `x+1 = 5` stays), else s."""
    return m[2].strip() if (m := _ASSIGNMENT.fullmatch(s)) is not None else s


def _same(a: str, b: str, depth: int = 0) -> bool:
    """Equality of two normalized answers that are not both numbers: the same spelling without spaces (with
    `5 >= x` read as `x <= 5`), or the same collection: tuples and intervals element by element with the same
    brackets; sets (`\\{1,2\\}`) and bare lists (`1, 2`, `6 and 8`) as sets. Elements compare as numbers by value,
    else by this rule, two levels deep."""
    compact_a, compact_b = (_unflip(s.replace(" ", "")) for s in (a, b))
    if compact_a == compact_b:
        return True
    left, right = _collection(a), _collection(b)
    if depth >= 2 or left is None or right is None or left[0] != right[0]:
        return False

    def equal(p: str, q: str) -> bool:
        x, y = parse_number(p), parse_number(q)
        return numbers_equal(x, y, "." in p or "." in q) if x is not None and y is not None else _same(p, q, depth + 1)

    if left[0] == "set":
        return all(any(equal(p, q) for q in right[1]) for p in left[1]) and all(
            any(equal(p, q) for p in left[1]) for q in right[1]
        )
    return len(left[1]) == len(right[1]) and all(equal(p, q) for p, q in zip(left[1], right[1]))


def _unflip(compact: str) -> str:
    return f"{m[3]}{'<' if m[2] == '>' else '<='}{m[1]}" if (m := _FLIPPED.fullmatch(compact)) is not None else compact


def _collection(s: str) -> tuple[str, list[str]] | None:
    """("set", elements) for a bare list `a, b` (also `a; b`, `a and b`) or a set `\\{a, b\\}`; (its brackets,
    elements) for a tuple or interval `(a, b]`; None for anything else, or more than MAX_ELEMENTS elements."""
    parts = _split_top_level(_LIST_WORDS.sub(", ", s))
    if parts is not None and 1 < len(parts) <= MAX_ELEMENTS:
        return "set", parts
    for opening, closing, kind in _GROUPS:
        if s.startswith(opening) and s.endswith(closing) and len(s) >= len(opening) + len(closing):
            inner = _split_top_level(s[len(opening) : len(s) - len(closing)])
            if inner is not None and len(inner) <= MAX_ELEMENTS:
                return kind, inner
    return None


def _split_top_level(s: str) -> list[str] | None:
    """s split at the commas and semicolons outside brackets and braces (stripped); None when its brackets do not
    balance (`(0,1]` balances: any opener closes with any closer) or the part is empty."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if depth < 0:
            return None
        if depth == 0 and ch in ",;":
            parts.append(s[start:i].strip())
            start = i + 1
    parts.append(s[start:].strip())
    return parts if depth == 0 and all(parts) else None


def answers_match(pred: str, ref: str) -> bool:
    """Equivalence of a final answer and a reference answer: the built-in verdict when it has one, else
    math-verify's when it is installed, else False."""
    verdict = builtin_verdict(pred, ref)
    return verdict if verdict is not None else _math_verify_equal(pred, ref)


def reference_answer(answer: str) -> str:
    """The reference of a math example as a bare answer. A reference may be a whole solution: then its last box,
    joined (`a, b`) with the boxes just before it that a gap under 10 characters, or under 70 with a `,` `;`
    `and` `or` in it, separates from the next (as Math-Verify reads a reference; a PREDICTION's boxes all count,
    see `final_answer`). Else the answer without the math delimiters around it (`$\\frac{1}{2}$`), else as is."""
    answer = answer.strip()
    if boxes := boxed_answers(answer):
        group = [boxes[-1]]
        for box in reversed(boxes[:-1]):
            gap = answer[box[2] : group[-1][1]]
            if not (len(gap) < 10 or (len(gap) < 70 and box[0] != group[-1][0] and _SEPARATOR.search(gap))):
                break
            group.append(box)
        return ", ".join(dict.fromkeys(content.strip() for content, _, _ in reversed(group)))
    if (m := _MATH_SPAN.fullmatch(answer)) is not None:
        return next(group for group in m.groups() if group is not None).strip()
    return answer


def math_reward(completion: str, example: dict) -> float:
    """1.0 if the final answer (`extract_answer`) matches the reference (`reference_answer` of
    `example["answer"]`, compared by `answers_match`), else 0.0."""
    pred = extract_answer(completion)
    return float(pred is not None and answers_match(pred, reference_answer(str(example["answer"]))))


# ---------------------------------------------------------------- math answers: math-verify (optional)


class _Deadline(BaseException):
    """Raised inside a thread whose math-verify call ran past MATH_VERIFY_SECONDS. A BaseException, so that
    math-verify's and sympy's `except Exception` cannot swallow it and carry on computing."""


def _math_verify() -> ModuleType | None:
    """The math_verify module, or None when it is not installed. Its own timeouts are SIGALRM, which exists only
    in the main thread (rewards are scored in a thread pool too), so we call it with them off and bound it with
    `_within_deadline` instead; its warning that they are off is silenced."""
    try:
        import math_verify
    except ImportError:
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def _within_deadline(fn: Callable[[], bool], seconds: float) -> bool:
    """fn() in the calling thread, any thread, or False when it runs past `seconds`: a timer raises `_Deadline`
    in this thread (CPython's PyThreadState_SetAsyncExc, checked between bytecodes, as a signal handler is). The
    lock makes the timer raise only while fn runs; a raise that lands on the way out is caught here too."""
    thread, lock, running = threading.get_ident(), threading.Lock(), [True]

    def expire() -> None:
        with lock:
            if running[0]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(_Deadline))

    timer = threading.Timer(seconds, expire)
    try:
        timer.start()
        try:
            return fn()
        finally:
            with lock:
                running[0] = False
            timer.cancel()
    except _Deadline:
        return False


def _math_verify_equal(pred: str, ref: str) -> bool:
    """math-verify's verdict on a final answer and a reference, each handed over exactly as extracted, inside
    `\\boxed{}` (so it reads the whole answer and nothing else: first match, LaTeX only); False when it is not
    installed, when either is longer than MAX_VERIFY_CHARS or `_too_costly`, or when it runs past
    MATH_VERIFY_SECONDS."""
    mv = _math_verify()
    if mv is None or any(len(s) > MAX_VERIFY_CHARS or _too_costly(s) for s in (pred, ref)):
        return False
    config = [mv.LatexExtractionConfig(boxed_match_priority=0)]

    def compare() -> bool:
        gold = mv.parse(f"\\boxed{{{ref}}}", config, extraction_mode="first_match", parsing_timeout=None)
        guess = mv.parse(f"\\boxed{{{pred}}}", config, extraction_mode="first_match", parsing_timeout=None)
        return bool(gold and guess and mv.verify(gold, guess, timeout_seconds=None))

    return _within_deadline(compare, MATH_VERIFY_SECONDS)


def _too_costly(s: str) -> bool:
    """Whether sympy could spend minutes inside ONE C call on s (no deadline interrupts that: a signal handler and
    `_within_deadline` both wait for the interpreter loop): a power of a power (`9^{9^9}`, `(10^{100})^{100}`)
    or an exponent of 7 digits or more (`10^{10000000}`). Factorials and simplification stay in Python and
    are cut by the deadline."""
    digits = [len(m[1]) for m in _EXPONENT.finditer(s)]
    return _NESTED_POWER.search(s) is not None or any(n >= 7 for n in digits) or sum(n >= 3 for n in digits) >= 2


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
    expr = extract_tag(answer_text(completion), "answer")
    if expr is None:
        return 0.0
    expr = expr.split("=", 1)[0].replace("×", "*").replace("x", "*").replace("÷", "/")
    if len(expr) > MAX_EXPR_CHARS or not _EXPR_CHARS.fullmatch(expr):
        return 0.0
    tokens = _EXPR_TOKEN.findall(expr)
    numbers = sorted(int(t) for t in tokens if t.isdigit() and len(t) <= 9)
    if len(numbers) != sum(t.isdigit() for t in tokens) or numbers != sorted(example["nums"]):
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
    """1.0 if the last ```python block passes `example["tests"]` (asserts; a list is joined by lines;
    with `entry_point` the tests' `check(candidate)` is called on it) in the sandbox."""
    code = extract_code(completion)
    if code is None:
        return 0.0
    tests = example["tests"]
    tests = "\n".join(tests) if isinstance(tests, list) else tests
    return float(run_sandboxed(code, tests, entry_point=example.get("entry_point"))["passed"])


def code_rewards(completions: list[str], examples: list[dict], max_workers: int = 4) -> list[float]:
    """`code_reward` over a batch, `max_workers` sandboxes at a time."""
    return score_batch(code_reward, completions, examples, max_workers)


# ---------------------------------------------------------------- batches and weighted sums


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
# A RECONSTRUCTION (bibliography §1.7): the paper scores with an LLM; these are deterministic local stand-ins.


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


def noise_rates(text: str, flag: str, *, auto: bool = False) -> tuple[float, float] | None:
    """A `RHO_PLUS,RHO_MINUS` flag -> the two flip rates (each in [0, 1), their sum below 1), else a
    one-sentence ValueError naming `flag`; "" (off), and "auto" where `auto` allows it, give None."""
    if not text or (auto and text == "auto"):
        return None
    try:
        rho_plus, rho_minus = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be RHO_PLUS,RHO_MINUS, two numbers such as 0.2,0.1, got {text!r}") from None
    if not (0 <= rho_plus < 1 and 0 <= rho_minus < 1 and rho_plus + rho_minus < 1):
        raise ValueError(
            f"{flag} {text}: each flip rate must be in [0, 1) and RHO_PLUS + RHO_MINUS below 1 (at 1 or more the "
            "noisy reward carries no signal)"
        )
    return rho_plus, rho_minus
