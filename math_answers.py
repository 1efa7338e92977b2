"""Math answers: the final answer of a completion, the reference of an example, and whether they are equal,
by a built-in checker and by math-verify when it is installed. rewards.math_reward wires them together; this
file holds every rule, so that a reader checks them in one place. The first rule: when unsure, 0.

- The final answer (`final_answer`), kept as written: the content of the `\\boxed{}`s, where boxes that
  differ are ONE answer, their list `a, b` (`\\boxed{18} or \\boxed{20}` is right only against the
  reference 18, 20); else the last `<answer>`; else the rest of the last `####` line; else the last math
  span (`$..$`, `$$..$$`, `\\(..\\)`, `\\[..\\]`) or number outside spans, whichever ends last. A number counts
  only alone (`_stands_alone`): `x+5`, `2^4`, `6!`, `AZYUK2A`, `18 or 20`, `(0,9)`, `1, 2` give no answer.
- The reference (`reference_answer`): the answer field as the task loader left it (GSM8K's `#### N`),
  without `$..$` around it; given a whole solution, its last box and the boxes a short gap or a `,` `;`
  `and` `or` joins to it (as Math-Verify reads a reference; tasks.py's MATH loader stores that).
- The built-in check (`builtin_verdict`) is sure of: two numbers, equal by exact value (a decimal: to 6
  places) after units (`18 dollars`), currency, `%`, degrees, `\\text{}`, thousands separators (`1,234`,
  `1 000`, `14{,}916`, `10,\\!000`) and fraction spellings (`\\dfrac13`, `3/4`); `32, 349` is a list and
  `20 or more` is not 20 (both surely wrong); `x = 5` against 5 is 5; otherwise the same spelling after
  normalizing (`\\geq` is `>=`, `5 \\geq x` is `x \\leq 5`, `\\left(` is `(`), or tuples and intervals equal
  element by element with the same brackets, or lists and sets equal as sets. It is unsure of the rest.
- math-verify (the field's checker, used by TRL and open-r1; requirements-dev.txt installs it) decides
  what the built-in check is unsure of: symbolic equality, matrices, equations. It gets both answers exactly
  as extracted, inside `\\boxed{}` (LaTeX only, first match, so it reads nothing else), never longer than
  MAX_VERIFY_CHARS nor a power that one C call could spend hours on (`_too_costly`), and runs under a
  deadline of MATH_VERIFY_SECONDS in any thread (its own SIGALRM timeout works only in the main thread,
  and rewards are scored in a thread pool too). Without it, unsure is 0.
- Not promised: that a right answer in an unusual form scores 1 (an expression against a number, `1,5`
  for 1.5, units glued to the number `5cm`, intermediate boxes before the final one: 0); that math-verify
  has no false positives of its own on what it is handed; a prose hedge ("maybe 18, maybe 20") is read by
  its last number, as GSM8K's convention does, which gives no edge over answering 20.

bench/bench_math_checker.py measures these rules against the verdicts of Math-Verify's own test suite.
"""

import ctypes
import logging
import re
import threading
from collections.abc import Callable
from fractions import Fraction
from types import ModuleType

MAX_NUMBER_CHARS = 64  # longer numeric strings are compared as text, never parsed
MAX_VERIFY_CHARS = 1000  # longer final answers (or references) are not compared: 0
MATH_VERIFY_SECONDS = 5.0  # wall-clock bound of one math-verify comparison (both parses and the verify)

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
    s = _FRAC_COMMANDS.sub(r"\\frac", s)
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
