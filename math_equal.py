"""Math equal: whether a final answer and a reference are the same answer, by a built-in checker and by
math-verify when it is installed. Finding the ONE final answer of a completion and the reference of an example
is math_answers.py's (which re-exports the public names here); rewards.math_reward wires them together. When
unsure, 0.

- The built-in check (`builtin_verdict`) is sure of: a mark in the answer that the reference lacks is wrong
  (`_marks`: a percent sign, scale word, angle unit, qualifier, base subscript, `\\pm`, `\\approx`, `\\ldots`);
  so is a qualified number (`20 or more`), a relation whose left side is not a name (`x + 1 = 7`, `8 = 7`), and,
  against one number, a list, a set or a number followed by more than unit words (`-7, 7`, `\\{7\\}`, `7 m`).
  Two numbers are equal by exact value (a decimal: to 6 places) after units (`18 dollars`), currency, degrees,
  `\\text{}`, brackets around one number, thousands separators (`1,234`, `1 000`, `14{,}916`, `10,\\!000`) and
  fraction spellings (`\\dfrac13`, `3/4`); `32, 349` is a list; `x = 5` against 5 is 5; otherwise the same
  spelling after normalizing (`\\geq` is `>=`, `5 \\geq x` is `x \\leq 5`, `\\left(` is `(`), or tuples and
  intervals equal element by element with the same brackets, or lists and sets equal as sets. It is unsure of
  the rest.
- math-verify (the field's checker, used by TRL and open-r1; requirements-dev.txt installs it) decides only
  what the built-in check is unsure of: symbolic equality, matrices, equations. It never sees an answer the rules
  above refuse. It gets both answers as extracted, inside `\\boxed{}` (LaTeX only, first match, so it reads
  nothing else), never longer than MAX_VERIFY_CHARS nor a power that one C call could spend hours on
  (`_too_costly`), and runs under a deadline of MATH_VERIFY_SECONDS in any thread (its own SIGALRM timeout works
  only in the main thread, and rewards are scored in a thread pool too). Without it, unsure is 0.
- Not promised: that a right answer in an unusual form scores 1 (an expression against a number, `1,5` for 1.5,
  units glued to the number `5cm`, `50%` for a reference of 50, an approximation `\\approx 11`: 0); that
  math-verify has no false positives of its own on what it is handed.
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

# One spelling per character: every dash and minus sign is `-` (never dropped), full-width forms are ASCII, odd
# spaces are spaces, invisible characters go. Superscripts stay: `5²` is not 52.
_PLAIN = str.maketrans(
    {
        **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212\u2796\u02d7\ufe58\ufe63\uff0d", "-"),
        **dict.fromkeys("\uff0b\ufe62\u2795", "+"),
        **dict.fromkeys("\uff05\ufe6a\u066a", "%"),
        **dict.fromkeys("\u2044\u2215", "/"),
        **dict.fromkeys("\u00a0\u2007\u2008\u2009\u200a\u202f\u205f\u3000", " "),
        **dict.fromkeys("\u200b\u200c\u200d\u2060\ufeff\u00ad", None),
        **{chr(0xFF10 + d): str(d) for d in range(10)},
        **{"，": ", ", "、": ", ", "；": "; ", "：": ": ", "。": ". ", "！": "! ", "？": "? ", "（": "(", "）": ")"},
    }
)
_EXPONENT = re.compile(r"(?:\^|\*\*)\s*[{(]?\s*-?(\d+)")  # the integer an exponent starts with
_NESTED_POWER = re.compile(r"\^\s*\{[^{}]*\^|(?:\^|\*\*)\s*\w+\s*(?:\^|\*\*)")  # 9^{9^9}, 9^9^9, 9**9**9
_CJK_NUMERALS = "〇一二三四五六七八九十百千万萬亿億兆两兩零廿卅십백천만억조"  # 7万 is 70000, 三分之7 is 7/3

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
_WORDS = {  # words that change what a number means, by kind (`_marks`)
    "percent": "percent percents percentage pct percentile",
    "angle": "radian radians rad rads gradian gradians grad grads",
    "base": "base",
    "scale": "thousand thousands hundred hundreds dozen dozens million millions billion billions trillion trillions "
    "lakh lakhs crore crores grand score gross thousandth thousandths hundredth hundredths tenth tenths millionth "
    "millionths half halves third thirds quarter quarters twice double triple squared cubed factorial fold",
    "qualifier": "not nor either least most more less fewer greater smaller larger bigger higher lower above below "
    "over under than maybe perhaps possibly probably likely approximately approx about around roughly nearly almost "
    "circa exceeds exceed exceeding except unless guess",
}
_MARK_WORDS = {word: kind for kind, words in _WORDS.items() for word in words.split()}
_QUALIFIERS = {*_WORDS["qualifier"].split(), *"or and no to at plus minus times divided by".split()}  # `20 or more`
_MARK_SIGNS = (  # ... and signs that do
    ("percent", re.compile(r"%|‰|‱")),
    ("pm", re.compile(r"[±∓]|\\(?:pm|mp)(?![A-Za-z])")),
    ("approx", re.compile(r"[≈∼≃≅]|\\(?:approx|sim|simeq|thicksim|thickapprox|cong)(?![A-Za-z])")),
    ("base", re.compile(r"[\d)}]\s*_|[₀-₉]")),  # 12_3, 12_{3}, 12₃
    ("power", re.compile(r"[⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻]")),
    ("root", re.compile(r"[√∛∜]")),
    ("etc", re.compile(r"\\[lc]?dots(?![A-Za-z])|\.\.\.|…")),  # math-verify reads `7\ldots` as 7
    ("prime", re.compile(r"'|′|″|\\prime(?![A-Za-z])")),  # ... and `7'` as 7
    ("percent", re.compile(r"per\s*cent(?![A-Za-z])", re.IGNORECASE)),
    ("scale", re.compile(rf"[{_CJK_NUMERALS}]|illions?(?![A-Za-z])")),
)
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]+(?![A-Za-z])")  # a word, not a LaTeX command's name
_NAME = r"(?:[A-Za-z]+(?: [A-Za-z]+)*|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?'*(?:\([A-Za-z0-9, ]*\))?"  # x, x_1, f(x)
_NAMED = re.compile(rf"(?:{_NAME}|\(\s*{_NAME}(?:\s*,\s*{_NAME})*\s*\))\s*(?:=|\\in(?![a-zA-Z]))\s*[^=<>]+")
_RELATION = re.compile(r"[=<>≡≔∈≝]|\\(?:approx|in|equiv|cong|sim|simeq|propto|coloneqq|triangleq|doteq)(?![a-zA-Z])")
_SEVERAL = re.compile(r",|;|or|and|\\pm|±")  # a reference with one of these may hold several answers
_BRACKETED = re.compile(r"\((.*)\)|\[(.*)\]")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
_LATEX_FRAC = re.compile(r"(-?)\\frac\{([^{}]*)\}\{([^{}]*)\}")
_ASSIGNMENT = re.compile(r"([A-Za-z|(\\][^=<>!+\-*/]*?)\s*(?:=|\\approx|\\in(?![a-zA-Z]))\s*([^=<>]+)")  # x = 5
_FLIPPED = re.compile(r"([^<>=!]+)(>=|>)([^<>=!]+)")  # 5 >= x, read as x <= 5
_LIST_WORDS = re.compile(r"\s+(?:and|or)\s+")  # 6 and 8: a list, like 6, 8
MAX_ELEMENTS = 16  # longer lists are not compared element by element
_GROUPS = (("\\{", "\\}", "set"), ("{", "}", "set"), *((o, c, o + c) for o in "([" for c in ")]"))  # (0,1] ...


def normalize_answer(s: str) -> str:
    """A final answer in one canonical spelling for comparison: `\\dfrac` -> `\\frac`, `\\frac34` -> `\\frac{3}{4}`,
    `\\sqrt3` -> `\\sqrt{3}`, `\\text{E}` -> `E`, `\\geq` -> `>=`, LaTeX thousands separators (`14{,}916`) -> `,`;
    dropped: `\\left`/`\\right`, math delimiters and `$`, degrees, `%`, LaTeX spacing, a trailing period; runs of
    whitespace become one space (a space can still separate thousands, `1 000`, and a comma-space a list). Every
    dash and minus sign is `-` (`_PLAIN`)."""
    s = _FRAC_COMMANDS.sub(r"\\frac", s.translate(_PLAIN))
    s = _THOUSANDS_LATEX.sub(",", s)
    s = _TEXT_WRAPPER.sub(r" \1 ", s)
    s = _DROPPED.sub("", _SPACING.sub(" ", s))
    for pattern, replacement in _RELATIONS + _BARE_ARGUMENTS:
        s = pattern.sub(replacement, s)
    return " ".join(s.split()).rstrip(".").strip()


def parse_number(s: str) -> Fraction | None:
    """Exact value of a normalized answer that is one number: `1,234`, `1 000`, `2.50`, `-3`, `3/4`, `\\frac{3}{4}`,
    `-\\frac{1}{2}`, optionally followed by unit words of two letters or more (`18 dollars`, `28 percent`; not
    `20 or more`, `7 thousand`, `90 radians`, `7 m`); None for anything else, and for strings longer than
    MAX_NUMBER_CHARS. `32, 349` is a list, not a number."""
    if len(s) > 4 * MAX_NUMBER_CHARS:
        return None
    if (m := _TRAILING_WORDS.fullmatch(s)) is not None:
        words = [word.lower() for word in m[2].split()]
        if any(len(w) < 2 or w in _QUALIFIERS or _MARK_WORDS.get(w, "percent") != "percent" for w in words):
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
    None when it cannot tell. Surely not: the answer carries a mark the reference lacks (`_marks`: `%`, a scale
    word, an angle unit, `\\pm`, `\\approx`, a qualifier, a base subscript), is a qualified number (`20 or more`),
    a relation whose left side is not a name (`x + 1 = 7`, `8 = 7`), or a number with more than units after it, a
    list or a set where the reference is a number. Both are normalized (`normalize_answer`); a number alone in
    brackets is that number (`[90]`); when only one is an equation whose left side is a name (`x = 5`,
    `(p,q) = (3,2)`, `x \\in [0,1]`), its right side stands for it. Two numbers compare by value
    (`numbers_equal`). Anything else is equal when `_same` says so."""
    if _marks(pred) - _marks(ref):
        return False
    a, b = normalize_answer(pred), normalize_answer(ref)
    if not a or not b:
        return False
    if a == b:
        return True
    if _qualified(a) or _qualified(b):  # `20 or more` is not 20 (math-verify would read it as 20)
        return False
    a, b = _unwrap(a), _unwrap(b)
    listed = parse_number(a) is None and (_collection(a) or ("",))[0] == "set"  # its elements compare in `_same`
    if not listed and _is_relation(a) != _is_relation(b):
        if _is_relation(a) and _NAMED.fullmatch(a) is None:  # math-verify would take the right side of any relation
            return False
        a, b = _right_side(a), _right_side(b)
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return numbers_equal(x, y, "." in a or "." in b)
    if x is None and y is None and _same(a, b):
        return True
    if _collection(b) is None and (_collection(a) or ("",))[0] == "set" and not _SEVERAL.search(b):
        return False  # `-7, 7`, `\\{7\\}` against one answer (math-verify reads `\\{7\\}` as 7)
    if y is not None and (m := _TRAILING_WORDS.fullmatch(a)) is not None and parse_number(m[1]) is not None:
        return False  # `7 m`, `7 \\text{ thousand}` against a number (math-verify drops the words)
    return None


def _marks(s: str) -> set[str]:
    """The marks in s that change what a number means (`_MARK_WORDS`, `_MARK_SIGNS`): percent, scale, angle,
    base, qualifier, pm, approx, power, root."""
    s = s.translate(_PLAIN)
    found = {_MARK_WORDS[word] for word in map(str.lower, _WORD.findall(s)) if word in _MARK_WORDS}
    return found | {name for name, pattern in _MARK_SIGNS if pattern.search(s)}


def _unwrap(s: str) -> str:
    """`(90)` and `[90]` -> `90`: a number alone in brackets; anything else unchanged."""
    m = _BRACKETED.fullmatch(s)
    inner = (m[1] if m[1] is not None else m[2]).strip() if m is not None else ""
    return inner if inner and parse_number(inner) is not None else s


def _is_relation(s: str) -> bool:
    return _RELATION.search(s) is not None


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
        if _is_relation(p) != _is_relation(q):  # `x = -7, x = 7` against `-7, 7`: only `name = value`
            if _NAMED.fullmatch(p if _is_relation(p) else q) is None:
                return False
            p, q = _right_side(p), _right_side(q)
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
