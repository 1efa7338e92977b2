"""One final answer, stated once: each family of answers that qualify, scale, hedge or offer a second candidate
scores 0, and the plain right answers around them score 1, with the built-in checker alone and with math-verify.
(Extraction and equivalence one case at a time: test_rewards.py.)"""

import pytest

import math_equal
from math_answers import builtin_verdict, final_answer
from rewards import math_reward

DASHES = "\u2212\u2013\u2014\u2012\u2010\u2011\ufe63\uff0d"  # minus sign, en/em/figure dash, hyphens, small/full-width


def scores(cases: list[tuple[str, str]]) -> list[tuple[str, str, float]]:
    return [(gold, pred, math_reward(pred, {"answer": gold})) for gold, pred in cases]


def paid(cases: list[tuple[str, str]]) -> list[tuple[str, str, float]]:
    """The (gold, completion, reward) of every case that scores anything."""
    return [case for case in scores(cases) if case[2] != 0.0]


def refused(cases: list[tuple[str, str]]) -> list[tuple[str, str, float]]:
    """The (gold, completion, reward) of every case that does not score 1."""
    return [case for case in scores(cases) if case[2] != 1.0]


SCALE_WORDS = ["thousand", "million", "billion", "trillion", "hundred", "dozen", "lakh", "crore", "grand", "score"]
SCALED = [  # (gold, completion): the number times a scale, never the number
    *(("7", f"\\boxed{{7 \\text{{ {word}}}}}") for word in SCALE_WORDS),
    *(("7", f"The answer is 7 {word}.") for word in ("thousand", "million", "billion", "dozen", "hundred")),
    *(("7", f"\\boxed{{7}} {word}") for word in ("thousand", "million", "dozen")),
    ("7", r"\boxed{7}\text{ thousand}"),
    ("7", r"$\boxed{7}$ million dollars"),
    ("7", r"\boxed{7\,\text{k}}"),
    ("7", r"\boxed{7 \mathrm{M}}"),
    ("7", r"\boxed{7 \text{ gazillion}}"),
    ("7", r"\boxed{7 \text{ tenths}}"),
    ("7", r"\boxed{7 \text{ halves}}"),
    ("7", r"\boxed{7 \text{ squared}}"),
    ("7", "7k"),
    ("7", r"\boxed{7} (in thousands)."),
    ("7", r"The answer is $\boxed{7}$, in millions of dollars."),
    ("7", "答案是7万"),
    ("7", "答案是7千个"),
    ("7", "七百7"),
    ("7", "정답은 7만"),
]


def test_scale_words_are_not_the_number(checker: str) -> None:
    """Guards against `7 thousand` (million, dozen, hundred, billion, a CJK 万, `k`, ...) paying for 7: the unit
    words after a number were dropped as if they were `dollars`, and math-verify drops `\\text{}` altogether."""
    assert paid(SCALED) == []


UNITS = [  # (gold, completion): a unit or sign that changes the number's meaning, which the gold does not have
    ("90", r"\boxed{90 \text{ radians}}"),
    ("90", r"\boxed{90 \text{ rad}}"),
    ("90", "The angle is 90 radians."),
    ("90", r"\boxed{90} radians"),
    ("90", r"$\boxed{90}$ \text{rad}"),
    ("90", "90弧度"),
    ("0.25", r"\boxed{0.25\%}"),
    ("0.25", r"\boxed{0.25 \text{ percent}}"),
    ("0.25", "It is 0.25%."),
    ("0.25", "It is 0.25 percent."),
    ("0.25", "It is 0.25 pct"),
    ("0.25", "It is 0.25\uff05"),  # full-width percent sign
    ("0.25", r"\boxed{0.25}\%"),
    ("0.25", r"$\boxed{0.25}$ %"),
    ("0.25", r"\boxed{0.25‰}"),
    ("0.25", r"\boxed{0.25}\,\%"),
    ("0.25", "It is 0.25 per cent."),
    ("7", r"\boxed{7\ldots}"),
    ("7", r"\boxed{7'}"),
    ("50", r"\boxed{50\%}"),
    ("12", r"\boxed{12_{3}}"),
    ("12", r"\boxed{12_3}"),
    ("12", r"\boxed{(12)_3}"),
    ("12", r"\boxed{12_{\text{three}}}"),
    ("12", r"\boxed{12₃}"),
    ("12", r"\boxed{12}_3"),
    ("12", r"\boxed{12 \text{ in base } 3}"),
    ("12", "12_3"),
    ("12", "It is (12)_3."),
    ("12", "It is 12 in base 3."),
    ("5", "√5"),
    ("5", r"\boxed{√5}"),
    ("5", "The answer is ∛5."),
    ("5", r"The answer is \sqrt 5."),
    ("4", "4²"),
    ("4", r"\boxed{4²}"),
]


def test_units_the_gold_lacks_are_wrong(checker: str) -> None:
    """Guards against dropping what changes a number before comparing: radians against a unitless gold, `%`
    against a fraction, a base subscript (math-verify reads `12_{3}` as 12), a root or a power sign."""
    assert paid(UNITS) == []


HEDGED = [  # (gold, completion): the gold is one of the candidates, or the answer is a guess
    ("7", "x = -7 or x = 7"),
    ("7", "x = 7 or x = -7"),
    ("7", "$x = -7$ or $x = 7$"),
    ("7", r"\boxed{x = -7 \text{ or } x = 7}"),
    ("7", r"\boxed{x = \pm 7}"),
    ("7", r"\boxed{-7, 7}"),
    ("7", r"\boxed{\{-7, 7\}}"),
    ("7", r"\boxed{7 \text{ and } -7}"),
    ("7", r"\boxed{-7} or \boxed{7}"),
    ("21", "It is 20 or maybe 21."),
    ("21", "It is 20. Or maybe 21."),
    ("21", "Either 20 or 21"),
    ("21", "20, possibly 21"),
    ("21", "I guess 21."),
    ("21", "It is probably 21."),
    ("21", "Perhaps the answer is 21."),
    ("21", "20 vs 21"),
    ("21", "It is 21 (or 20)."),
    ("21", "It is 21, maybe 20."),
    ("21", "Is it 21?"),
    ("21", "roughly 21"),
    ("21", "approximately $21$"),
    ("21", "about 21"),
    ("21", "around \\boxed{21}"),
    ("21", "~21"),
    ("21", "≈ 21"),
    ("21", r"\approx \boxed{21}"),
    ("21", "at least 21"),
    ("21", r"at least \boxed{21}"),
    ("21", "more than 21"),
    ("21", "not 21"),
    ("21", r"\boxed{21} or more"),
    ("21", r"\boxed{21 \text{ or more}}"),
    ("21", r"\boxed{\text{at least } 21}"),
    ("21", r"\boxed{\text{about } 21}"),
    ("21", r"\boxed{\approx 21}"),
    ("21", r"\boxed{x \approx 21}"),
    ("21", r"\boxed{\sim 21}"),
    ("21", "21 or so"),
    ("21", "20 & 21"),
    ("21", "20; 21"),
    ("21", "たぶん21"),
    ("21", "21くらい"),
    ("21", "대략 21"),
    ("21", "答案是20或21"),
    ("21", "大约21"),
    ("21", "21左右"),
    ("21", "可能是21"),
    ("1", "5 ± 1"),
    ("1", r"5 \pm 1"),
    ("1", r"$5 \pm 1$"),
    ("1", r"\boxed{5 \pm 1}"),
    ("1", "5 ∓ 1"),
    ("1", "5 +/- 1"),
    ("1", "±1"),
    ("1", r"\pm 1"),
    ("1", r"5 \pm \boxed{1}"),
]


def test_hedges_and_alternatives_are_wrong(checker: str) -> None:
    """Guards against paying the last number of a hedge (`20 or maybe 21`, `x = -7 or x = 7`), a qualified answer
    (`at least`, `about`, `\\approx`, `or more`), a question, or a `±` whose second term is the gold."""
    assert paid(HEDGED) == []


CANDIDATE_LINES = [  # (gold, completion): several candidates, one a line
    ("20", "18\n19\n20"),
    ("20", "$18$\n$19$\n$20$"),
    ("20", "- 18\n- 19\n- 20"),
    ("20", "1. 18\n2. 19\n3. 20"),
    ("20", "Answer: 18\nAnswer: 19\nAnswer: 20"),
    ("20", "18\n19\nSo the answer is 20."),
    ("20", "18\n\\boxed{20}"),
    ("20", "#### 18\n#### 20"),
    ("20", "The answer is 18.\nThe answer is 20."),
    ("20", "\\boxed{20}\n21"),
    ("20", "答案：18\n答案：20"),
]


def test_candidate_lines_are_several_answers(checker: str) -> None:
    """Guards against paying one of several candidates listed on lines of their own: the last number was taken
    and the others ignored."""
    assert paid(CANDIDATE_LINES) == []


TWO_FINALS = [  # (gold, completion): two statements of a final answer that differ
    ("42", r"<answer>41</answer> \boxed{42}"),
    ("42", r"\boxed{41} <answer>42</answer>"),
    ("42", r"<answer>41</answer><answer>42</answer>"),
    ("42", "#### 41\n\\boxed{42}"),
    ("42", "\\boxed{42}\n#### 41"),
    ("42", r"\boxed{41} \fbox{42}"),
    ("42", "The answer is 41. \\boxed{42}"),
    ("42", r"\boxed{41}\boxed{42}"),
]


def test_two_final_answers_are_wrong(checker: str) -> None:
    """Guards against one statement of the final answer winning over another (the box over the tag, the last
    tag over the first): two different final answers are no answer."""
    assert paid(TWO_FINALS) == []


RESTATED = [  # (gold, completion): the answer is restated later as something else
    ("7", r"guess \boxed{7}, but ... the answer is 9"),
    ("7", r"\boxed{7}. Actually, 9."),
    ("7", "\\boxed{7}\n\nFinal answer: 9"),
    ("7", r"\boxed{7} (9 if we count zero)"),
    ("7", r"$\boxed{7}$, so $9$ in all."),
    ("7", r"\boxed{7}, not 9"),
    ("7", "<answer>7</answer> or 9"),
    ("7", "#### 7\nno, 9"),
    ("7", r"The answer is \boxed{7}. The answer is $x = 9$."),
]


def test_answers_restated_differently_are_wrong(checker: str) -> None:
    """Guards against reading only the first statement of an answer that the text then restates as another:
    `guess \\boxed{7}, but ... the answer is 9` paid for 7."""
    assert paid(RESTATED) == []


def test_unicode_minus_is_a_minus(checker: str) -> None:
    """Guards against dropping a minus written with another code point (U+2212 minus sign, en and em dash,
    hyphens, full-width): `−5` scored as 5; and against refusing it as the negative number it is."""
    for dash in DASHES:
        for completion in (f"{dash}5", f"\\boxed{{{dash}5}}", f"The answer is {dash}5.", f"x = {dash}5"):
            assert math_reward(completion, {"answer": "5"}) == 0.0, completion
            assert math_reward(completion, {"answer": "-5"}) == 1.0, completion
        assert math_reward("5", {"answer": f"{dash}5"}) == 0.0
    assert math_reward("⁻5", {"answer": "5"}) == 0.0  # a superscript minus makes it an exponent, not 5


NESTED = [  # (gold, completion): the box is part of an expression, or holds another box
    ("4", r"\boxed{x \neq \boxed{4}}"),
    ("4", r"\boxed{\boxed{4} + 1}"),
    ("4", r"$x \neq \boxed{4}$"),
    ("4", r"$x < \boxed{4}$"),
    ("4", r"$x \le \boxed{4}$"),
    ("4", r"$x \geq \boxed{4}$"),
    ("4", r"$x ≠ \boxed{4}$"),
    ("4", r"$-\boxed{4}$"),
    ("4", r"$\sqrt{\boxed{4}}$"),
    ("4", r"$\boxed{4}^2$"),
    ("4", r"$\frac{1}{\boxed{4}}$"),
    ("4", r"$3 \times \boxed{4}$"),
    ("4", r"$\boxed{4}!$"),
    ("4", r"$\boxed{4} + 1$"),
    ("4", r"$\sim \boxed{4}$"),
    ("4", r"$\boxed{4} \cdot 2$"),
]


def test_boxes_inside_expressions_are_wrong(checker: str) -> None:
    """Guards against paying a box that is one term of an expression or relation (`x \\neq \\boxed{4}`,
    `-\\boxed{5}`, `\\boxed{4}^2`): math-verify, given the whole box, reads the inner box's 4."""
    assert paid(NESTED) == []


RELATIONS = [  # (gold, completion): a relation whose right side is the gold but whose left side is not a name
    ("7", r"\boxed{x + 1 = 7}"),
    ("7", r"\boxed{8 = 7}"),
    ("7", r"\boxed{2x = 7}"),
    ("49", r"\boxed{x^2 = 49}"),
    ("7", r"\boxed{7 = 7}"),
    ("7", r"\boxed{x = 7 = 8}"),
    ("7", r"\boxed{x \neq 7}"),
    ("7", r"\boxed{x > 7}"),
    ("7", r"\boxed{x \geq 7}"),
    ("7", r"\boxed{x \equiv 7}"),
    ("7", r"\boxed{x ≡ 7}"),
    ("7", r"\boxed{x - 7 = 0}"),
    ("7", "So x + 1 = 7."),
    ("14", "So 2x = 14."),
    ("7", "8 = 7"),
    ("7", r"$x + 1 = 7$"),
    ("7", "<answer>x + 1 = 7</answer>"),
]


def test_relations_with_an_expression_on_the_left_are_wrong(checker: str) -> None:
    """Guards against paying the right side of any equation (`x + 1 = 7`, `8 = 7` for 7): math-verify takes the
    right side of whatever relation it is handed, so the project hands it only `name = value`."""
    assert paid(RELATIONS) == []


RIGHT = [  # (gold, completion): one final answer, stated once, in a plain form
    ("1234", "**Answer:** 1234 meters"),
    ("1234", "**Answer**: 1234"),
    ("1234", "The answer is **1234**."),
    ("1234", "__1234__"),
    ("1234", "*Answer:* 1234"),
    ("1234", "It is 1234 meters long."),
    ("90", "[90]"),
    ("90", "(90)"),
    ("90", "The answer is [90]."),
    ("90", r"\boxed{[90]}"),
    ("90", r"$[90]$"),
    ("7", "+7"),
    ("7", r"\boxed{+7}"),
    ("7", "The answer is +7."),
    ("7", "x = +7"),
    ("7", "答案是7"),
    ("7", "7个"),
    ("7", "答案是 7。"),
    ("7", "答案：7"),
    ("7", "共有7个苹果。"),
    ("7", "所以答案为7"),
    ("7", "答案是\uff17。"),  # a full-width digit
    ("7", "答え：7"),
    ("7", "정답은 7입니다"),
    ("7", "x = 7"),
    ("7", r"\boxed{x = 7}"),
    ("7", r"\boxed{f(3) = 7}"),
    ("7", r"$\boxed{7}$."),
    ("7", r"\[\boxed{7}\]"),
    ("7", r"Therefore, $3 + 4 = \boxed{7}$."),
    ("7", r"\boxed{7} \text{ apples}"),
    ("7", r"\boxed{7} apples"),
    ("7", "\\boxed{7}\n\nI hope it is correct."),
    ("7", r"\boxed{7} - seven apples in all."),
    ("7", "She has 3 + 4 = 7 apples."),
    ("7", "The answer is 7. That is, 7 apples."),
    ("7", r"\boxed{7} The answer is \boxed{7}."),
    ("7", r"<answer>\boxed{7}</answer>"),
    ("7", "<answer>7</answer> \\boxed{7}"),
    ("7", "<answer>7.0</answer> \\boxed{7}"),
    ("90", r"\boxed{90}^\circ"),
    ("90", r"The angle is 90^{\circ}."),
    ("18", r"\boxed{18 \text{ dollars}}"),
    ("18", "She pays $18."),
    ("25\\%", "25%"),
    ("25\\%", "25 percent"),
    ("25\\%", r"\boxed{25}\%"),
    ("25\\%", "25"),
    ("-5", "−5"),
    ("-7, 7", r"\boxed{x = -7 \text{ or } x = 7}"),
    ("9", r"$\equiv \boxed{9} \pmod{11}$"),
]


def test_right_answers_score_one(checker: str) -> None:
    """Guards against refusing a plain right answer while refusing the hostile ones around it: a markdown-bold
    label (`**Answer:** 1234 meters`), a number in brackets, a `+` sign, CJK text glued to the number, units."""
    assert refused(RIGHT) == []


def test_math_verify_is_handed_only_vetted_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against math-verify turning an answer the built-in rules refuse into credit: a fake that says yes
    to everything must not move one of them, because the built-in check is sure of each."""
    pytest.importorskip("math_verify")
    monkeypatch.setattr(math_equal, "_math_verify_equal", lambda pred, ref: True)
    hostile = SCALED + UNITS + HEDGED + CANDIDATE_LINES + TWO_FINALS + RESTATED + NESTED + RELATIONS
    assert paid(hostile) == []


def test_builtin_is_sure_of_what_math_verify_misreads() -> None:
    """Guards against a None (unsure) verdict on answers math-verify is known to misread as the gold (it drops
    `\\text{}`, single letters and subscripts, takes the right side of any relation, reads `\\{7\\}` as 7)."""
    for pred in (r"7 \text{ thousand}", "7 m", r"7 \text{ K}", "12_3", "x + 1 = 7", "8 = 7", r"\{7\}", r"x \approx 7"):
        assert builtin_verdict(pred, "12" if "12" in pred else "7") is False, pred
    assert final_answer(r"\boxed{x \neq \boxed{4}}") is None
