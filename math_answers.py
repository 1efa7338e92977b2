"""Math answers: the ONE final answer of a completion, and the reference of an example, each as written.
Whether the two are equal (a built-in checker, then math-verify when it is installed) is math_equal.py's;
rewards.math_reward wires them together. The two files hold every rule, so that a reader checks them in two
places and nowhere else. The rule: ONE final answer, stated once; a qualifier, scale word, percent sign or unit
the reference lacks, or a second candidate makes it wrong; when unsure, 0.

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
  `and` `or` joins to it (as Math-Verify reads a reference; data.py's MATH loader stores that).
- Not promised: that a right answer followed by a number scores 1 (`\\boxed{7} after 5 years`: 0); that every
  hedge in every language is seen (English, Chinese, Japanese and Korean ones are).

The public names of math_equal.py are importable from here too. bench/bench_math_checker.py measures the rules
of both files against the verdicts of Math-Verify's own test suite.
"""

import itertools
import re

# What finding an answer uses of math_equal.py; the names marked noqa are re-exported only: callers import them here.
from math_equal import (
    _CJK_NUMERALS,
    _MARK_WORDS,
    _NAME,
    _PLAIN,
    _PLAIN_NUMBER,
    _WORD,
    MATH_VERIFY_SECONDS,  # noqa: F401
    MAX_ELEMENTS,  # noqa: F401
    MAX_NUMBER_CHARS,  # noqa: F401
    MAX_VERIFY_CHARS,  # noqa: F401
    _is_relation,
    _marks,
    _right_side,
    answers_match,  # noqa: F401
    builtin_verdict,
    normalize_answer,
    numbers_equal,  # noqa: F401
    parse_number,
)

MAX_RIVALS = 200  # more restatements than this to check against the final answer: unsure, 0

_EMPHASIS = re.compile(r"(?<![A-Za-z0-9)\]}*])(\*\*|__|\*)(?=[^\s*])([^*\n]{1,200}?)(?<=[^\s*])\1(?![A-Za-z0-9(\[{*])")
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
_SEPARATOR = re.compile(r"\b(?:and|or)\b|[,;]")  # between a reference's boxes that form one answer


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
