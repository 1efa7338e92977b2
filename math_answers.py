"""Math answers: the final answer of a completion, the reference of an example, and whether they are equal,
by a built-in checker and by math-verify when it is installed. rewards.math_reward wires them together; this
file holds every rule, so that a reader checks them in one place. The rule: ONE final answer, stated once; a
qualifier, scale word, percent sign or unit the reference lacks, or a second candidate makes it wrong; when
unsure, 0.

- The text (`plain_text`): every dash and minus sign is a minus (`−5`, `–5` are -5, never 5), full-width forms
  are ASCII, markdown emphasis goes (`**Answer:** 12`).
- The final answer (`final_answer`), kept as written: the content of the `\\boxed{}`s and `<answer>` tags, where
  statements that differ are ONE answer, their list `a, b` (`\\boxed{18} or \\boxed{20}` and `<answer>41</answer>
  \\boxed{42}` are right only against that list); else the rest of the last `####` line; else the last math span
  or number outside spans, whichever ends last. A number counts only alone (`_stands_alone`): `x+5`, `2^4`, `6!`,
  `√5`, `5 ± 1`, `AZYUK2A`, `7万`, `18 or 20`, `(0,9)`, `1, 2`, `x + 1 = 7`, `8 = 7` give no answer; `[90]`, `+7`,
  `答案是7`, `1234 meters` do. A box counts only outside expressions (`x \\neq \\boxed{4}`, `-\\boxed{5}`,
  `\\boxed{2}^3` give none) and holding no other box. What qualifies it just after it is part of it (`7 thousand`,
  `\\boxed{0.25}\\%`, `20 or more`: `_with_tail`). No answer when its sentence hedges (`20 or maybe 21`, `about
  $7$`, `Is it 21?`, `\\boxed{7} (in thousands)`: `_hedged`), or when the text states another answer
  (`_contradicted`): a number or a span stating one after it (`guess \\boxed{7}, but ... the answer is 9`), an
  `Answer: N` or a line that is a bare number before it (three candidates on three lines).
- The reference (`reference_answer`): the answer field as the task loader left it (GSM8K's `#### N`),
  without `$..$` around it; given a whole solution, its last box and the boxes a short gap or a `,` `;`
  `and` `or` joins to it (as Math-Verify reads a reference; tasks.py's MATH loader stores that).
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
  units glued to the number `5cm`, `50%` for a reference of 50, an approximation `\\approx 11`, a number after the
  box such as `\\boxed{7} after 5 years`: 0); that math-verify has no false positives of its own on what it is
  handed; that every hedge in every language is seen (English, Chinese, Japanese and Korean ones are).

bench/bench_math_checker.py measures these rules against the verdicts of Math-Verify's own test suite.
"""

import ctypes
import itertools
import logging
import re
import threading
from collections.abc import Callable
from fractions import Fraction
from types import ModuleType

MAX_NUMBER_CHARS = 64  # longer numeric strings are compared as text, never parsed
MAX_VERIFY_CHARS = 1000  # longer final answers (or references) are not compared: 0
MATH_VERIFY_SECONDS = 5.0  # wall-clock bound of one math-verify comparison (both parses and the verify)
MAX_RIVALS = 200  # more restatements than this to check against the final answer: unsure, 0

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
_EMPHASIS = re.compile(r"(?<![A-Za-z0-9)\]}*])(\*\*|__|\*)(?=[^\s*])([^*\n]{1,200}?)(?<=[^\s*])\1(?![A-Za-z0-9(\[{*])")
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
_NUMBER_TOKEN = re.compile(  # a number or fraction as prose writes it: -1,234.5  +7  3/4  \frac{10}{9}  \dfrac34
    r"[-+]?(?:\\[dtc]?frac(?:\{\d+(?:\.\d+)?\}\{\d+(?:\.\d+)?\}|\d\d)"  # a LaTeX fraction of two numbers
    r"|(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"  # 1,234 or 1 234 or 1234, .5, /4
    r"|\.\d+)"
)
_CONNECTIVE = r"(?:[,;&]|\b(?:or|and|plus|minus|times|over|vs)\b)"  # `18 or 20`, `1, 2`: neither is the answer
_LISTED_BEFORE = re.compile(rf"\d[^\s\d]{{0,3}}\s*{_CONNECTIVE}\s*\$?$", re.IGNORECASE)
_LISTED_AFTER = re.compile(rf"[^\s\d]{{0,3}}\s*{_CONNECTIVE}\s*\$?[-+]?\.?\d", re.IGNORECASE)
_SPAN_LISTED_BEFORE = re.compile(rf"(?:\$|\\\)|\\\]|\d)\s*{_CONNECTIVE}\s*$", re.IGNORECASE)
_SPAN_LISTED_AFTER = re.compile(rf"\s*{_CONNECTIVE}\s*(?:\$|\\\(|\\\[|[-+]?\d)", re.IGNORECASE)
_JOINS_BEFORE = set("+-*/^_<>([{|$\\×÷·√∛∜±∓≈~∼≠≤≥⁺⁻₊₋")  # a number after one of these is in an expression: `x+5`
_JOINS_AFTER = set("^_!\\([{/'⁺⁻₊₋")  # ... and so is one glued to one of these (`2^4`, `6!`, `12\sqrt{2}`)
_OPERATORS = set("+-*/^=<>×÷·±∓≈≠≤≥")  # ... or followed by an operator (`5 + 3`)
# LaTeX commands that may stand next to an answer; any other (`\pm 1`, `x \neq`, `7 \cdot 2`) makes it a part.
_COMMANDS_BEFORE = {"quad", "qquad", "displaystyle", "textstyle", "Rightarrow", "Longrightarrow", "implies"}
_COMMANDS_BEFORE |= {"therefore", "hfill", "newline", "in", "equiv"}  # `x \in \boxed{..}`, `\equiv \boxed{9}`
_COMMANDS_AFTER = {"quad", "qquad", "text", "textrm", "mathrm", "mbox", "right", "end", "hfill", "newline", "pmod"}
_COMMAND_END = re.compile(r"\\([A-Za-z]+)\s*$")
_COMMAND_START = re.compile(r"\s*\\([A-Za-z]+)")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")
_CJK_NUMERALS = "〇一二三四五六七八九十百千万萬亿億兆两兩零廿卅십백천만억조"  # 7万 is 70000, 三分之7 is 7/3
_CJK_AFTER = re.compile(
    rf"[{_CJK_NUMERALS}倍成折点點多余餘来來几幾或超쯤]|分之|次方|左右|上下|以上|以下|以内|之多|弧度|くらい|ぐらい|程度|前後|未満"
    r"|정도|이상|이하|가량|미만"
)
_CJK_BEFORE = re.compile(
    rf"(?:[{_CJK_NUMERALS}约約近负負减減加乘除点點或的약]|分之|大概|可能|也许|也許|超过|超過|不到|至少|至多|最多|最少"
    r"|多于|少于|大于|小于|たぶん|多分|おそらく|대략|아마)$"
)
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?(?![A-Za-z0-9^_])")
_OPERAND_END = re.compile(r"(?:[\d)\]}!]|\b[A-Za-z])$")  # `5 +7`, `x -5`: a sign after an operand is an operator
_LEFT_SIDE = re.compile(r"((?:[^\s=<>$]+\s*[-+*/^×÷·]\s*)*[^\s=<>$]+)\s*=$")  # the `x + 1` of `x + 1 =`
_BOUNDARY = re.compile(r"[.!?](?=[\s$)\]]|$)|\n")  # the end of a sentence
_HEDGE = re.compile(  # anywhere in the final answer's sentence: the answer is one of several, or a guess
    r"(?<![\\A-Za-z])(?:or|maybe|perhaps|possibly|probably|likely|either|guess(?:ed|ing)?|approx(?:imately)?|roughly"
    r"|nearly|almost|circa|unsure|uncertain|alternatively|might|vs|versus)(?![A-Za-z])"
    r"|或|也许|也許|可能|大概|大约|大約|约|約|左右|差不多|还是|還是|たぶん|多分|おそらく|くらい|ぐらい|아마|또는|대략|정도",
    re.IGNORECASE,
)
_QUALIFIED_BEFORE = re.compile(  # the word just before the final answer qualifies it: `at least 7`, `about $7$`
    r"(?<![A-Za-z\\])(?:least|most|more|less|fewer|greater|smaller|larger|than|not|no|minus|negative|half|twice"
    r"|double|triple|about|around|over|under|above|below|up\s+to|exceeds?|except|from|between)[^A-Za-z0-9]{0,12}$",
    re.IGNORECASE,
)
_TAIL = re.compile(r"(?:[ \t$~]|\\[,;:! ])*((?:\\%|%|‰|\\(?:text|textrm|mathrm|mbox)\s*\{|\}|[A-Za-z]+|[ \t]+){1,12})")
_TAIL_TOKEN = re.compile(r"\\%|%|‰|\\(?:text|textrm|mathrm|mbox)\s*\{|\}|[A-Za-z]+")
_LABEL = re.compile(r"(?:\b(?:final\s+)?answer\b\s*(?:is\b|was\b|[:=])|答案\s*(?:是|为|為|:|=))\s*:?\s*", re.IGNORECASE)
_CANDIDATE_LINE = re.compile(  # a line that is one number: `20`, `- 20`, `3) 20`, `#### 20`, `Answer: $20$.`
    r"^[ \t]*(?:[>*#•+-]+[ \t]+)*(?:\(?[0-9A-Za-z]{1,2}[.)][ \t]+)?(?:(?:final\s+)?(?:answer|result|ans)[ \t]*:[ \t]*)?"
    r"(\$[^$\n]{1,200}\$|\\\([^\n]{1,200}?\\\)|[-+]?[0-9][0-9,. /]{0,40})[ \t]*[.,;!]?[ \t]*$",
    re.MULTILINE | re.IGNORECASE,
)


def plain_text(text: str) -> str:
    """`text` with one spelling per character (`_PLAIN`: `−5` and `–5` are `-5`) and without markdown emphasis
    around a phrase (`**Answer:** 12` is `Answer: 12`; `2**3` stays)."""
    return _EMPHASIS.sub(r"\2", text.translate(_PLAIN))


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
    """The one final answer in `text` (after `plain_text`) as written, or None when there is not exactly one: the
    statements (`_statements`: boxes and tags; that differ: their list `a, b`), else the rest of the last `####`
    line, else the last math span or stand-alone number (`_last_candidate`); with its tail (`_with_tail`); None
    when its sentence hedges (`_hedged`) or the text states another answer (`_contradicted`)."""
    text = plain_text(text)
    if (found := _statements(text)) is None:
        return None
    if found:
        distinct: list[str] = []
        for content, _, _ in found:  # `\boxed{7}` and `<answer>7.0</answer>` are one answer
            if not content:
                return None
            if not any(_restates(content, said, []) for said in distinct):
                distinct.append(content)
        answer, start, end = ", ".join(distinct), found[-1][1], found[-1][2]
    elif (i := text.rfind("####")) >= 0:
        end = text.find("\n", i) if "\n" in text[i:] else len(text)
        answer, start = text[i + 4 : end].strip(), i
        found = [(answer, start, end)]
    elif (candidate := _last_candidate(text)) is not None:
        (answer, start, end), found = candidate, [candidate]
    else:
        return None
    answer, end = _with_tail(text, answer, end)
    first = start  # the first statement of the final sentence: `\boxed{1} or \boxed{2}` is one list, not a hedge
    for _, s, e in reversed(found[:-1]):
        if first - e > 300 or _BOUNDARY.search(text, e, first):
            break
        first = s
    if not answer or _hedged(text, first, end) or _contradicted(text, [c for c, _, _ in found], answer, start, end):
        return None
    return answer


def _statements(text: str) -> list[tuple[str, int, int]] | None:
    """(content, start, end) of every box and `<answer>` tag (a tag holding a box is that box), in order; None when
    a box never closes, holds a box besides its content (a box only wrapping one is its content) or is an operand
    (`_part_of_expression`)."""
    if (boxes := boxed_answers(text)) is None:
        return None
    found = []
    for content, start, end in boxes:
        content = content.strip()
        for _ in range(3):  # \boxed{\boxed{3}} is 3
            if not (inner := boxed_answers(content)) or inner[0][1:] != (0, len(content)):
                break
            content = inner[0][0].strip()
        if inner != [] or _part_of_expression(text, start, end, box=True):
            return None
        found.append((content, start, end))
    pos = 0
    while (end := text.find("</answer>", pos)) >= 0:  # linear, however many tags are open
        if (start := text.rfind("<answer>", pos, end)) >= 0 and _BOX.search(text, start, end) is None:
            found.append((text[start + 8 : end].strip(), start, end + 9))
        pos = end + 9
    return sorted(found, key=lambda statement: statement[1])


def _last_candidate(text: str) -> tuple[str, int, int] | None:
    """The last math span's content or the last number outside spans, whichever ends last, with its place; None
    when it is not alone (`_stands_alone`; a span beside another: `$18$ or $20$`)."""
    spans = list(_MATH_SPAN.finditer(text))
    if numbers := list(_NUMBER_TOKEN.finditer(text, spans[-1].end() if spans else 0)):
        return (numbers[-1][0], *numbers[-1].span()) if _stands_alone(text, *numbers[-1].span()) else None
    if not spans:
        return None
    start, end = spans[-1].span()
    if _SPAN_LISTED_BEFORE.search(text, max(0, start - 40), start) or _SPAN_LISTED_AFTER.match(text, end):
        return None
    return (content, start, end) if (content := _span_content(spans[-1]).strip()) else None


def _stands_alone(text: str, start: int, end: int) -> bool:
    """Whether the number at text[start:end] is a whole answer (`x = 18`, `Answer: 18`, `[18]`, `$18`, `18 dollars`,
    `答案是7`), not part of a word (`AZYUK2A`, `2x`, `7万`, `约7`), an expression (`5 +7`, `x+5`, `2^4`, `√5`,
    `5 \\pm 1`: `_part_of_expression`), an equation with an expression on its left (`x + 1 = 7`) or a list
    (`1, 2`, `18 or 20`)."""
    for _ in range(2):  # [90], ((90))
        if (text[start - 1 : start], text[end : end + 1]) not in (("(", ")"), ("[", "]")):
            break
        start, end = start - 1, end + 1
    before, after = text[start - 1 : start], text[end : end + 1]
    if _letter(before) or before == "." or _letter(after) or (after == "." and _letter(text[end + 1 : end + 2])):
        return False
    if _CJK_BEFORE.search(text, max(0, start - 4), start) or _CJK_AFTER.match(text, end):
        return False
    window = text[max(0, start - 40) : start].rstrip()
    if text[start] in "+-" and _OPERAND_END.search(window):
        return False  # `5 +7`, `x -5`: an operator, not a sign
    if _part_of_expression(text, start, end, box=False) or _unnamed_left_side(window):
        return False
    return _LISTED_BEFORE.search(text, max(0, start - 40), start) is None and _LISTED_AFTER.match(text, end) is None


def _letter(ch: str) -> bool:
    return ch.isalnum() and _CJK.match(ch) is None


def _unnamed_left_side(window: str) -> bool:
    """Whether `window` ends with `LEFT =`, LEFT a lone number (`8 =`) or an expression with a letter that is not a
    name (`x + 1 =`, `2x =`); `x =` and `5 + 3 =` are fine."""
    if (m := _LEFT_SIDE.search(window)) is None:
        return False
    return _PLAIN_NUMBER.fullmatch(m[1]) is not None or (_WORD.search(m[1]) and not re.fullmatch(_NAME, m[1]))


def _part_of_expression(text: str, start: int, end: int, box: bool) -> bool:
    """Whether text[start:end] (a number, or a box when `box`) is an operand: after an operator, an opening bracket
    or a LaTeX command not in _COMMANDS_BEFORE (`x+5`, `\\pm 1`, `x \\neq \\boxed{4}`, `-\\boxed{5}`); glued to a
    power, subscript, factorial or command (`2^4`, `6!`, `\\boxed{12}_3`, not `90^\\circ`); before an operator
    (`5 + 3`, `5-year`; after a box, `- seven` is prose). Delimiters and tags around a box do not count."""
    before, after = text[max(0, start - 40) : start], text[end : end + 40]
    if box:
        before = re.sub(r"(?:\s|\$|\\[(\[]|\\|</?answer>)+$", "", before)  # `$`, `\(`, `\[`, a line break `\\`
        after = re.sub(r"^(?:\s|\$|\\[)\]]|</?answer>)+", "", after)
    elif text[start - 1 : start] == "$":
        before = ""  # `$18`: currency
    if ((m := _COMMAND_END.search(before)) and m[1] not in _COMMANDS_BEFORE) or before.rstrip()[-1:] in _JOINS_BEFORE:
        return True
    if after.startswith("\\%") or _DEGREES.match(after):  # `50\%`, `90^\circ`: units
        return False
    if (after[:1] in _JOINS_AFTER and not (box and after[:1] == "\\")) or (
        (m := _COMMAND_START.match(after)) and m[1] not in _COMMANDS_AFTER
    ):
        return True
    operator, rest = after.lstrip()[:1], after.lstrip()[1:].lstrip()
    return operator in _OPERATORS and not (box and re.match(r"[A-Za-z]{2}", rest))


def _with_tail(text: str, answer: str, end: int) -> tuple[str, int]:
    """The answer and its tail, when the (up to three) words or `%` just after it hold a mark (`_marks`) or `or`:
    `7 thousand`, `\\boxed{0.25}\\%`, `20 or more`; other words after it are prose (`18 dollars left`)."""
    if (m := _TAIL.match(text, end, end + 80)) is None:
        return answer, end
    words, cut = 0, None
    for token in _TAIL_TOKEN.finditer(m[1]):
        if (words := words + token[0][0].isalpha()) > 3:
            break
        if token[0] in ("%", "\\%", "‰") or token[0].lower() in (*_MARK_WORDS, "or", "nor", "cent"):
            cut = token.end()
    if cut is None:
        return answer, end
    tail = m[1][:cut] + "}" * (m[1][:cut].count("{") - m[1][:cut].count("}"))
    return f"{answer} {tail.strip()}", m.start(1) + cut


def _hedged(text: str, start: int, end: int) -> bool:
    """Whether the sentence around text[start:end] (300 characters each side at most) is a question, hedges
    outside the answer (`_HEDGE`), qualifies it by the word just before it (`_QUALIFIED_BEFORE`), or scales it
    after it (`\\boxed{7} (in thousands)`)."""
    head = max(0, start - 300)
    for boundary in _BOUNDARY.finditer(text, head, start):
        head = boundary.end()
    stop = _BOUNDARY.search(text, end, end + 300)
    before, after = text[head:start], text[end : stop.start() if stop else min(len(text), end + 300)]
    if (stop and stop[0] == "?") or _marks(after) & {"percent", "scale", "angle"} - _marks(text[start:end]):
        return True
    return bool(_HEDGE.search(before) or _HEDGE.search(after) or _QUALIFIED_BEFORE.search(before))


def _contradicted(text: str, statements: list[str], answer: str, start: int, end: int) -> bool:
    """Whether the text states another answer (not `_restates`): a stand-alone number or a math span that states a
    number after the final answer; `Answer: N`, `the answer is N` or a line that is a bare number before it. More
    than MAX_RIVALS to check: unsure, so True."""
    spans = list(_MATH_SPAN.finditer(text))
    outside, pos = [], end  # the stretches after the answer outside spans
    for m in spans:
        if m.end() > pos:
            outside.append((pos, max(pos, m.start())))
            pos = m.end()
    outside.append((pos, len(text)))
    starts = {m.start(): m for m in spans}
    rivals = itertools.chain(
        (content for m in spans if m.start() >= end and _is_number(content := _span_content(m))),
        (n[0] for lo, hi in outside for n in _NUMBER_TOKEN.finditer(text, lo, hi) if _stands_alone(text, *n.span())),
        (
            _span_content(starts[m.end()]) if m.end() in starts else n[0]
            for m in _LABEL.finditer(text, 0, start)
            if m.end() in starts or (n := _NUMBER_TOKEN.match(text, m.end()))
        ),
        (line[1] for line in _CANDIDATE_LINE.finditer(text, 0, start) if _is_number(line[1])),
    )
    checked = list(itertools.islice(rivals, MAX_RIVALS + 1))
    return len(checked) > MAX_RIVALS or not all(_restates(rival.strip(), answer, statements) for rival in checked)


def _span_content(span: re.Match) -> str:
    return next(group for group in span.groups() if group is not None)


def _is_number(s: str) -> bool:
    """Whether s states a number (`20`, `$\\frac{1}{2}$`, `x = 20`); other spans (`$13_5$`, `$B$`) are work."""
    s = normalize_answer(s.strip().removeprefix("\\(").removesuffix("\\)"))
    return parse_number(_right_side(s) if _is_relation(s) else s) is not None


def _restates(rival: str, answer: str, statements: list[str]) -> bool:
    """Whether `rival` says what the final answer or one of its statements says (the built-in check, sure)."""
    if not rival or _BOX.search(rival):
        return True  # a box is a statement, part of the answer already
    rival = rival.removeprefix("$").removesuffix("$").strip()
    return any(builtin_verdict(rival, said) is True for said in (answer, *statements))


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
_SEPARATOR = re.compile(r"\b(?:and|or)\b|[,;]")  # between a reference's boxes that form one answer
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
        answer_list = ", ".join(dict.fromkeys(content.strip() for content, _, _ in reversed(group)))
        return _with_tail(plain_text(answer), answer_list, boxes[-1][2])[0]  # `\boxed{20} percent`
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
