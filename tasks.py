"""Tasks: built-in generated tasks, tasks over local JSONL files (read by data.py) and prompt rendering.

A `Task` is a plain record of functions: the training reward, the 0/1 correctness used for
accuracy and pass@k, and deterministic train/test example generators (and, where the task has one, a
fine-grained partial credit in [0, 1]: DaGRPO's score; and where an example has one, its reference solution
written as a completion: DaGRPO's anchor). Every example is a dict
with "prompt" (the user message) and "answer" (the reference) plus task fields.

Built in (no files): "synthetic" (the bundled default: addition with a carry scratchpad),
"synthetic-vertical" (the same sums written on two lines: the out-of-distribution split, see
SYNTHETIC_VARIANTS), "synthetic-hard" (4-digit operands: no model here solves any), "countdown".
From local JSONL (`data=`, `test_data=`, each read by data.load_jsonl): "gsm8k", "math", "code" and
"jsonl"; the held-out split is every 10th example of `data`, or all of `test_data` when given.
Rewards are correctness only (no format term); Task.components names their parts (`correct`, `format`, countdown's
`each_number_once`), weighted to sum to that reward (format weighs 0), for GDPO and the logs.

Callers check sizes before they start: `check_sizes` (enough distinct examples for one step and
for the evaluation asked for) and `check_prompt_lengths` (every prompt fits the context).
"""

import dataclasses
import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from data import CODE_INSTRUCTION, MAX_CHARS, load_jsonl  # noqa: F401  (CODE_INSTRUCTION stays importable from tasks)
from rewards import (
    MAX_ANSWER_CHARS,
    calculator_partial_credit,
    code_reward,
    components,
    countdown_reward,
    exact_reward,
    math_reward,
    strip_end_tokens,
)

SYSTEM_PROMPT = (
    "You are a helpful assistant. First think about the problem step by step inside "
    "<think> </think> tags, then give the final answer after </think>. "
    "Put a final mathematical answer in \\boxed{}."
)

# Every character of a synthetic prompt, thought or answer. `<think>`/`</think>` are not in it:
# the tiny tokenizer has them as single tokens (`</think>` is sample_tree's end-of-thought marker).
SYNTHETIC_CHARS = "\n+0123456789="

# The synthetic task and its out-of-distribution variants: name -> (operand digit counts, prompt layout).
# "synthetic-vertical" is the split for out-of-distribution claims (GTPO): the same skill and the same 1-3
# digit sums (for one seed, the very pairs of "synthetic"'s held-out split), in column layout, "357\n+68", a
# prompt format the bundled model never saw in its warm start or in RL. Longer operands cannot serve: the
# bundled model writes at most 3 scratchpad lines, so it scores 0% on every sum with a 4-digit operand (even
# 1234+5), before and after RL. In column layout it keeps part of its skill, so there is room to gain or
# lose: `eval.py --task synthetic-vertical --n 16` on the 200 held-out sums gives 13.5% greedy and 25.5%
# pass@16 for assets/tiny-model (42.5% and 67.5% inline), and 14.0% greedy, 18.0% pass@16 after 100 steps
# of GRPO on the inline format (72.5% and 85.5% inline). A trailing "=", "12+34=", was the other candidate
# format: 7.3% greedy on 1000 sums, too near the floor for 200 prompts.
SYNTHETIC_VARIANTS = {
    "synthetic": ((1, 2, 3), "inline"),
    "synthetic-vertical": ((1, 2, 3), "vertical"),
    "synthetic-hard": ((4,), "inline"),
}
PROMPT_LAYOUTS = {"inline": "{a}+{b}", "vertical": "{a}\n+{b}"}  # how a+b is written in the prompt

TASK_NAMES = (*SYNTHETIC_VARIANTS, "synthetic-mul", "countdown", "gsm8k", "math", "code", "jsonl")


def no_reference(example: dict) -> None:
    """Task.reference of a task whose examples carry no reference solution (countdown)."""
    return None


@dataclass(frozen=True)
class Task:
    """A plain record of functions, no behaviour of its own."""

    name: str
    reward: Callable[[str, dict], float]  # the training reward
    correct: Callable[[str, dict], float]  # 0/1 correctness, for accuracy and pass@k
    train: Callable[[int, int], list[dict]]  # (n, seed) -> n training examples, deterministic
    test: Callable[[int, int], list[dict]]  # (n, seed) -> n held-out examples, never in train
    system_prompt: str | None = None  # None: no system message (the tiny char-level model)
    n_train: int | None = None  # distinct training examples (None: generated, unbounded)
    n_test: int | None = None  # distinct held-out examples (None: generated, unbounded)
    train_source: str = ""  # where the training examples come from, for error messages
    test_source: str = ""  # where the held-out examples come from, for error messages
    partial_credit: Callable[[str, dict], float] | None = None  # fine-grained [0, 1] score (DaGRPO); None: reward
    reference: Callable[[dict], str | None] = no_reference  # example -> its reference completion (DaGRPO), or None
    components: dict | None = None  # name -> (fn, weight): the reward's parts, weighted to sum to it (GDPO); None: none


def get_task(name: str, data: str | None = None, test_data: str | None = None, max_chars: int = MAX_CHARS) -> Task:
    """The task called `name`. File tasks read `data` (JSONL); their test split is every 10th
    example of it, or all of `test_data` when given (then all of `data` is training, and `data`
    may be None for an evaluation). A field of a file example holds at most `max_chars` characters."""
    if name in SYNTHETIC_VARIANTS or name in ("countdown", "synthetic-mul"):
        for flag, value in (("--data", data), ("--test-data", test_data)):
            if value is not None:
                raise ValueError(f"task '{name}' is generated and takes no data file; drop {flag}.")
        if name == "countdown":
            train, test = (lambda n, seed, h=h: countdown_examples(n, seed, held_out=h) for h in (False, True))
            kw = dict(components=components(countdown_reward))
            return Task(name, countdown_reward, countdown_reward, train, test, SYSTEM_PROMPT, **kw)
        if name == "synthetic-mul":  # the Python tool's task (methods/tools.py): tiny models cannot multiply
            train, test = (lambda n, seed, h=h: multiplication_examples(n, seed, held_out=h) for h in (False, True))
            kw = dict(reference=sft_completion, components=components(exact_reward))
            return Task(name, exact_reward, exact_reward, train, test, None, **kw)
        digits, layout = SYNTHETIC_VARIANTS[name]
        train = lambda n, seed: addition_examples(n, seed, digits, layout=layout)
        test = lambda n, seed: addition_examples(n, seed, digits, held_out=True, layout=layout)
        kw = dict(partial_credit=synthetic_partial_credit, reference=sft_completion)
        return Task(name, exact_reward, exact_reward, train, test, None, components=components(exact_reward), **kw)
    if name not in TASK_NAMES:
        raise ValueError(f"unknown task '{name}'; choose one of {', '.join(TASK_NAMES)}.")
    if data is None and test_data is None:
        raise ValueError(f"task '{name}' reads local examples: pass --data FILE.jsonl (and optionally --test-data).")
    rows = load_jsonl(data, name, max_chars) if data is not None else []
    if test_data is not None:
        train_rows, test_rows = rows, load_jsonl(test_data, name, max_chars)
        train_source, test_source = data or "", test_data
    else:
        if len(rows) < 10:
            raise ValueError(
                f"{data}: {len(rows)} examples are too few to hold out every 10th one; "
                "add examples or pass --test-data FILE.jsonl."
            )
        train_rows = [row for i, row in enumerate(rows) if i % 10 != 9]
        test_rows = [row for i, row in enumerate(rows) if i % 10 == 9]
        train_source = f"the training split of {data} (9 of every 10 examples)"
        test_source = f"the held-out split of {data} (every 10th example)"
    reward = code_reward if "tests" in (rows or test_rows)[0] else math_reward
    return Task(
        name,
        reward,
        reward,
        _sampler(train_rows, name),
        _first(test_rows, test_source),
        SYSTEM_PROMPT,
        n_train=len(train_rows),
        n_test=len(test_rows),
        train_source=train_source,
        test_source=test_source,
        partial_credit=calculator_partial_credit if reward is math_reward else None,
        reference=solution_completion if reward is math_reward else code_completion,
        components=components(reward),
    )


def check_sizes(
    task: Task,
    train: int = 0,
    test: int = 0,
    *,
    train_flag: str = "--prompts-per-step",
    test_flag: str = "--eval-examples",
) -> None:
    """A one-sentence ValueError unless `task` has at least `train` distinct training examples
    (one step's prompts: none repeats within a step, except where a step straddles two passes
    over the data) and at least `test` held-out ones (an evaluation of `test` prompts uses that
    many). Generated tasks are unbounded. The flags name the caller's options in the message."""
    if train > 0 and task.n_train == 0:
        raise ValueError(f"task '{task.name}' has no training examples: pass --data FILE.jsonl.")
    if task.n_train is not None and train > task.n_train:
        raise ValueError(
            f"{train_flag} {train} needs {train} distinct training examples but {task.train_source} has "
            f"{task.n_train}; add examples or lower {train_flag}."
        )
    if task.n_test is not None and test > task.n_test:
        raise ValueError(
            f"{test_flag} {test} asks for {test} held-out examples but {task.test_source} has {task.n_test}; "
            f"lower {test_flag} or pass a larger --test-data FILE.jsonl."
        )


def restrict_train(task: Task, rows: list[dict], source: str) -> Task:
    """`task` with its training split replaced by `rows` (passes over them, each shuffled by the seed),
    e.g. train.py's --select subset; `source` names them in error messages (check_sizes)."""
    return dataclasses.replace(task, train=_sampler(rows, task.name), n_train=len(rows), train_source=source)


def render_prompt(tokenizer, example: dict, system_prompt: str | None) -> list[int]:
    """[system?] + user message -> chat template with the generation prompt -> token ids."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": example["prompt"]})
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def check_prompt_lengths(
    tokenizer, examples: list[dict], system_prompt: str | None, max_tokens: int, limit: str
) -> None:
    """A one-sentence ValueError naming the first example (by its "_where", file and line, when
    it came from a file) whose rendered prompt is longer than `max_tokens` tokens. `limit` says
    where the bound comes from, e.g. "the model's context of 4096 tokens minus --max-new-tokens
    512". A prompt that repeats (a training stream) is rendered once."""
    seen = set()
    for i, example in enumerate(examples):
        if example["prompt"] in seen:
            continue
        seen.add(example["prompt"])
        length = len(render_prompt(tokenizer, example, system_prompt))
        if length > max_tokens:
            raise ValueError(
                f"{example.get('_where', f'example {i}')}: the prompt is {length} tokens, more than the "
                f"{max_tokens} allowed by {limit}; shorten or drop that example."
            )


# ---------------------------------------------------------------- synthetic: addition


def _is_held_out(key: str) -> bool:
    """Held-out membership by a stable hash (crc32, not Python's salted hash) of the problem."""
    return zlib.crc32(key.encode()) % 10 == 0


def addition_examples(
    n: int, seed: int, digits: tuple[int, ...] = (1, 2, 3), held_out: bool = False, layout: str = "inline"
) -> list[dict]:
    """n addition problems a+b, each operand's digit count drawn from `digits`, the prompt written
    in `layout` (PROMPT_LAYOUTS: "357+68" or "357\n+68"; the layout does not change which pairs
    are drawn). A pair {a, b} (unordered, so 68+357 is held out with 357+68) is held out when its
    hash % 10 == 0; train and test draw from the same distribution and never share a pair."""
    rng = random.Random(f"addition:{held_out}:{seed}")
    examples = []
    while len(examples) < n:
        a, b = (rng.randrange(10 ** (d - 1) if d > 1 else 0, 10**d) for d in rng.choices(digits, k=2))
        if _is_held_out(f"{min(a, b)}+{max(a, b)}") == held_out:
            examples.append({"prompt": PROMPT_LAYOUTS[layout].format(a=a, b=b), "answer": str(a + b), "a": a, "b": b})
    return examples


def multiplication_examples(n: int, seed: int, held_out: bool = False) -> list[dict]:
    """n products a*b of two 2-digit numbers ("37*48", answer "1776"), split like the addition task: a pair {a, b}
    is held out when its hash % 10 == 0. The Python tool's task: the bundled-size model barely multiplies by hand."""
    rng = random.Random(f"multiplication:{held_out}:{seed}")
    examples = []
    while len(examples) < n:
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        if _is_held_out(f"{min(a, b)}*{max(a, b)}") == held_out:
            examples.append({"prompt": f"{a}*{b}", "answer": str(a * b), "a": a, "b": b, "op": "*"})
    return examples


def multiplication_completion(example: dict) -> str:
    """A worked product, by hand or with the Python tool (example["tool"], set by sft.py's demonstrations). 37*48 ->
    by hand "<think>37*8=296\\n37*40=1480\\n296+1480=1776\\n</think>1776"; with the tool (ToRL's form)
    "<think>```python\\nprint(37*48)\\n```\\n```output\\n1776\\n```\\n</think>1776"."""
    a, b = example["a"], example["b"]
    if example.get("tool"):
        return f"<think>```python\nprint({a}*{b})\n```\n```output\n{a * b}\n```\n</think>{a * b}"
    lo, hi = b % 10, b - b % 10
    return f"<think>{a}*{lo}={a * lo}\n{a}*{hi}={a * hi}\n{a * lo}+{a * hi}={a * b}\n</think>{a * b}"


def sft_completion(example: dict) -> str:
    """The reference completion of a synthetic example: one line per digit, least significant
    first, `x+y[+1]=s` (+1 = the carry in), then the sum. 357+68 ->
    "<think>7+8=15\\n5+6+1=12\\n3+0+1=4\\n</think>425". The answer is the last line's sum followed
    by the earlier lines' last digits in reverse; a final carry is the last sum's leading 1. A product
    (synthetic-mul): multiplication_completion."""
    if example.get("op") == "*":
        return multiplication_completion(example)
    if "a" not in example or "b" not in example:
        raise ValueError("sft_completion knows only the synthetic task (examples with 'a' and 'b').")
    a, b = str(example["a"]), str(example["b"])
    width = max(len(a), len(b))
    a, b = a.zfill(width), b.zfill(width)
    lines, carry = [], 0
    for x, y in zip(reversed(a), reversed(b)):
        total = int(x) + int(y) + carry
        lines.append(f"{x}+{y}{'+1' if carry else ''}={total}\n")
        carry = total // 10
    return "<think>" + "".join(lines) + "</think>" + str(int(a) + int(b))


def _lines_and_answer(text: str) -> tuple[list[str], str]:
    """The non-empty stripped lines of the thought (before the last `</think>`) and the answer after it."""
    i = text.rfind("</think>")
    thought, answer = (text[:i], strip_end_tokens(text[i + len("</think>") :])) if i >= 0 else (text, "")
    return [line.strip() for line in thought.strip().removeprefix("<think>").split("\n") if line.strip()], answer


def synthetic_partial_credit(completion: str, example: dict) -> float:
    """DaGRPO's fine-grained score (a RECONSTRUCTION: the paper scores with an LLM; this is a
    deterministic local stand-in) in [0, 1] of an addition completion against `sft_completion(example)`:
    (scratchpad lines equal to the reference's line at the same position + answer characters equal to
    the reference answer's, right-aligned) / (max(#lines) + max(#answer characters)) of the two, so
    missing and extra lines or digits both count against it. The reference itself scores 1; for 357+68
    (reference lines 7+8=15, 5+6+1=12, 3+0+1=4, answer 425), a thought with 5+6=11 and answer 415 scores
    (2 + 2) / (3 + 3)."""
    ref_lines, ref_answer = _lines_and_answer(sft_completion(example))
    lines, answer = _lines_and_answer(completion[:MAX_ANSWER_CHARS])
    same_lines = sum(a == b for a, b in zip(lines, ref_lines))
    same_chars = sum(a == b for a, b in zip(reversed(answer), reversed(ref_answer)))
    return (same_lines + same_chars) / (max(len(lines), len(ref_lines)) + max(len(answer), len(ref_answer)))


# ---------------------------------------------------------------- GSM8K / MATH / code reference completions

_CALC_ANNOTATION = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: 48/2 = <<48/2=24>>24


def solution_completion(example: dict) -> str | None:
    """The reference completion of a GSM8K or MATH example, as SYSTEM_PROMPT asks for it (and as model.py's
    chat template renders an assistant turn with a thought): `<think>`, newline, the worked solution, newline,
    `</think>`, a blank line, `\\boxed{answer}`. GSM8K's `#### N` line and its <<a=b>> calculator annotations are
    dropped from the thought (a MATH solution's own \\boxed{} stays there: only the text after </think> is graded).
    None for an example without a "solution" (generic prompt/answer files)."""
    solution = example.get("solution")
    if solution is None:
        return None
    work = _CALC_ANNOTATION.sub("", solution.rsplit("####", 1)[0]).strip()
    return f"<think>\n{work}\n</think>\n\n\\boxed{{{example['answer']}}}"


def code_completion(example: dict) -> str | None:
    """The reference completion of a code example: its "solution" (HumanEval's prompt and canonical solution,
    MBPP's code) as one ```python block; None for an example without one."""
    solution = example.get("solution")
    return None if solution is None else f"```python\n{solution.rstrip()}\n```"


# ---------------------------------------------------------------- Countdown


def countdown_examples(n: int, seed: int, counts: tuple[int, ...] = (3, 4), held_out: bool = False) -> list[dict]:
    """n Countdown puzzles: `counts` numbers in 1..99 and a target in 1..999 that a random
    expression using each number once reaches, so every puzzle is solvable ("answer" is that
    expression). Split by a hash of (sorted numbers, target), like the addition task."""
    rng = random.Random(f"countdown:{held_out}:{seed}")
    examples = []
    while len(examples) < n:
        nums = [rng.randint(1, 99) for _ in range(rng.choice(counts))]
        expr, value = _random_expression(rng, rng.sample(nums, len(nums)))
        if not 1 <= value <= 999:
            continue
        if _is_held_out(f"{sorted(nums)}={value}") == held_out:
            prompt = (
                f"Using the numbers {nums}, create an equation that equals {value}. You can use "
                "+, -, *, / and parentheses, and each number must be used exactly once. Show your "
                "work in <think> </think> tags, then give only the equation in <answer> </answer> "
                "tags, for example <answer>(1 + 2) / 3</answer>."
            )
            examples.append({"prompt": prompt, "answer": expr, "nums": nums, "target": value})
    return examples


def _random_expression(rng: random.Random, nums: list[int]) -> tuple[str, int]:
    """A random binary expression tree over `nums` in order -> (text, value). Every intermediate
    result is a positive integer (`-` only from a larger number, `/` only when exact)."""
    if len(nums) == 1:
        return str(nums[0]), nums[0]
    split = rng.randint(1, len(nums) - 1)
    (left, lv), (right, rv) = _random_expression(rng, nums[:split]), _random_expression(rng, nums[split:])
    op = rng.choice("+*" + "-" * (lv > rv) + "/" * (lv % rv == 0))
    value = lv + rv if op == "+" else lv - rv if op == "-" else lv * rv if op == "*" else lv // rv
    left = f"({left})" if split > 1 else left
    right = f"({right})" if len(nums) - split > 1 else right
    return f"{left} {op} {right}", value


# ---------------------------------------------------------------- samplers over a file task's rows


def _sampler(rows: list[dict], name: str) -> Callable[[int, int], list[dict]]:
    """(n, seed) -> n examples: passes over `rows`, each shuffled by the seed (copies, so callers
    may mutate). n above len(rows) repeats rows, pass by pass (epochs); see check_sizes."""

    def sample(n: int, seed: int) -> list[dict]:
        if not rows and n > 0:
            raise ValueError(f"task '{name}' has no training examples: pass --data FILE.jsonl.")
        rng, out = random.Random(seed), []
        while len(out) < n:
            out.extend(rng.sample(rows, len(rows)))
        return [dict(row) for row in out[:n]]

    return sample


def _first(rows: list[dict], source: str) -> Callable[[int, int], list[dict]]:
    """(n, seed) -> the first n held-out rows (copies; the seed is unused: a fixed test set), or
    an error when fewer exist, never a silently smaller evaluation."""

    def first(n: int, seed: int) -> list[dict]:
        if n > len(rows):
            raise ValueError(
                f"{n} held-out examples asked for but {source} has {len(rows)}; ask for fewer or pass a "
                "larger --test-data FILE.jsonl."
            )
        return [dict(row) for row in rows[:n]]

    return first
