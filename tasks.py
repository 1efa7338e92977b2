"""Tasks: built-in generated tasks, local JSONL loaders and prompt rendering.

A `Task` is a plain record of functions: the training reward, the 0/1 correctness used for
accuracy and pass@k, and deterministic train/test example generators. Every example is a dict
with "prompt" (the user message) and "answer" (the reference) plus task fields.

Built in (no files): "synthetic" (the bundled default: addition with a carry scratchpad),
"synthetic-hard" (4-digit operands, out of distribution for a model trained on "synthetic"),
"countdown". From local JSONL (`data=`): "gsm8k", "math", "code", and "jsonl" (format detected
from the first line). Rewards are correctness only by default (no format term); combine with
rewards.format_reward in the trainer when wanted.
"""

import json
import os
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from rewards import code_reward, countdown_reward, exact_reward, extract_boxed, math_reward

SYSTEM_PROMPT = (
    "You are a helpful assistant. First think about the problem step by step inside "
    "<think> </think> tags, then give the final answer after </think>. "
    "Put a final mathematical answer in \\boxed{}."
)

# Every character of a synthetic prompt, thought or answer. `<think>`/`</think>` are not in it:
# the tiny tokenizer has them as single tokens (`</think>` is sample_tree's end-of-thought marker).
SYNTHETIC_CHARS = "\n+0123456789="

TASK_NAMES = ("synthetic", "synthetic-hard", "countdown", "gsm8k", "math", "code", "jsonl")


@dataclass(frozen=True)
class Task:
    """A plain record of functions, no behaviour of its own."""

    name: str
    reward: Callable[[str, dict], float]  # the training reward
    correct: Callable[[str, dict], float]  # 0/1 correctness, for accuracy and pass@k
    train: Callable[[int, int], list[dict]]  # (n, seed) -> n training examples, deterministic
    test: Callable[[int, int], list[dict]]  # (n, seed) -> held-out examples, never in train
    system_prompt: str | None = None  # None: no system message (the tiny char-level model)


def get_task(name: str, data: str | None = None, test_data: str | None = None) -> Task:
    """The task called `name`. File tasks read `data` (JSONL); their test split is every 10th
    example of it, or all of `test_data` when given (then `data` is all training)."""
    if name in ("synthetic", "synthetic-hard", "countdown"):
        if data is not None or test_data is not None:
            raise ValueError(f"task '{name}' is generated and takes no data file; drop --data.")
        if name == "countdown":
            return Task(
                name,
                countdown_reward,
                countdown_reward,
                lambda n, seed: countdown_examples(n, seed),
                lambda n, seed: countdown_examples(n, seed, held_out=True),
                SYSTEM_PROMPT,
            )
        digits = (1, 2, 3) if name == "synthetic" else (4,)
        return Task(
            name,
            exact_reward,
            exact_reward,
            lambda n, seed: addition_examples(n, seed, digits),
            lambda n, seed: addition_examples(n, seed, digits, held_out=True),
            None,
        )
    if name not in TASK_NAMES:
        raise ValueError(f"unknown task '{name}'; choose one of {', '.join(TASK_NAMES)}.")
    if data is None:
        raise ValueError(f"task '{name}' reads local examples: pass --data FILE.jsonl.")
    rows = load_jsonl(data, name)
    if test_data is not None:
        train_rows, test_rows = rows, load_jsonl(test_data, name)
    else:
        train_rows = [row for i, row in enumerate(rows) if i % 10 != 9]
        test_rows = [row for i, row in enumerate(rows) if i % 10 == 9]
    if not train_rows or not test_rows:
        raise ValueError(f"{data}: too few examples for a train/test split; add lines or pass a test file.")
    reward = code_reward if "tests" in rows[0] else math_reward
    return Task(
        name, reward, reward, _sampler(train_rows), lambda n, seed: [dict(r) for r in test_rows[:n]], SYSTEM_PROMPT
    )


def render_prompt(tokenizer, example: dict, system_prompt: str | None) -> list[int]:
    """[system?] + user message -> chat template with the generation prompt -> token ids."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": example["prompt"]})
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


# ---------------------------------------------------------------- synthetic: addition


def _is_held_out(key: str) -> bool:
    """Held-out membership by a stable hash (crc32, not Python's salted hash) of the problem."""
    return zlib.crc32(key.encode()) % 10 == 0


def addition_examples(n: int, seed: int, digits: tuple[int, ...] = (1, 2, 3), held_out: bool = False) -> list[dict]:
    """n addition problems a+b, each operand's digit count drawn from `digits`. A pair {a, b}
    (unordered, so 68+357 is held out with 357+68) is held out when its hash % 10 == 0; train
    and test draw from the same distribution and never share a pair."""
    rng = random.Random(f"addition:{held_out}:{seed}")
    examples = []
    while len(examples) < n:
        a, b = (rng.randrange(10 ** (d - 1) if d > 1 else 0, 10**d) for d in rng.choices(digits, k=2))
        if _is_held_out(f"{min(a, b)}+{max(a, b)}") == held_out:
            examples.append({"prompt": f"{a}+{b}", "answer": str(a + b), "a": a, "b": b})
    return examples


def sft_completion(example: dict) -> str:
    """The reference completion of a synthetic example: one line per digit, least significant
    first, `x+y[+1]=s` (+1 = the carry in), then the sum. 357+68 ->
    "<think>7+8=15\\n5+6+1=12\\n3+0+1=4\\n</think>425". The answer is the last line's sum followed
    by the earlier lines' last digits in reverse; a final carry is the last sum's leading 1."""
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


# ---------------------------------------------------------------- local JSONL files


def load_jsonl(path: str, kind: str) -> list[dict]:
    """Examples of a JSONL file. kind: "gsm8k" (question, answer with `#### N`), "math" (problem,
    solution with \\boxed{}), "code" (prompt, tests [, entry_point]), "jsonl" (detected from the
    first line: tests -> code, question -> gsm8k, problem -> math, else generic prompt, answer).
    Unknown fields are ignored; a bad line is a ValueError naming the file and line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such data file.")
    examples = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}).") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object.")
            if kind == "jsonl":
                kind = (
                    "code"
                    if "tests" in row
                    else "gsm8k"
                    if "question" in row
                    else "math"
                    if "problem" in row
                    else "generic"
                )
            examples.append(_CONVERTERS[kind](row, where))
    if not examples:
        raise ValueError(f"{path}: the file has no examples.")
    return examples


def _field(row: dict, name: str, where: str, types: tuple = (str,)) -> object:
    if name not in row:
        raise ValueError(f"{where}: missing field '{name}'.")
    if not isinstance(row[name], types) or isinstance(row[name], bool):
        raise ValueError(f"{where}: field '{name}' must be {' or '.join(t.__name__ for t in types)}.")
    return row[name]


def _gsm8k(row: dict, where: str) -> dict:
    solution = _field(row, "answer", where)
    if "####" not in solution:
        raise ValueError(f"{where}: field 'answer' has no '#### N' final answer.")
    return {
        "prompt": _field(row, "question", where),
        "answer": solution.rsplit("####", 1)[1].strip(),
        "solution": solution,
    }


def _math(row: dict, where: str) -> dict:
    solution = _field(row, "solution", where)
    answer = extract_boxed(solution)
    if answer is None:
        raise ValueError(f"{where}: field 'solution' has no \\boxed{{...}} final answer.")
    return {"prompt": _field(row, "problem", where), "answer": answer, "solution": solution}


def _code(row: dict, where: str) -> dict:
    tests = _field(row, "tests", where, (str, list))
    if isinstance(tests, list) and not all(isinstance(t, str) for t in tests):
        raise ValueError(f"{where}: field 'tests' must be a string or a list of strings.")
    example = {
        "prompt": _field(row, "prompt", where) + "\n\nGive your solution as one ```python code block.",
        "answer": "",
        "tests": tests,
    }  # the tests are the reference; there is no answer text
    if "entry_point" in row:
        example["entry_point"] = _field(row, "entry_point", where)
    return example


def _generic(row: dict, where: str) -> dict:
    return {"prompt": _field(row, "prompt", where), "answer": str(_field(row, "answer", where, (str, int, float)))}


_CONVERTERS = {"gsm8k": _gsm8k, "math": _math, "code": _code, "generic": _generic}


def _sampler(rows: list[dict]) -> Callable[[int, int], list[dict]]:
    """(n, seed) -> n examples: passes over `rows`, each shuffled by the seed (copies, so callers may mutate)."""

    def sample(n: int, seed: int) -> list[dict]:
        rng, out = random.Random(seed), []
        while len(out) < n:
            out.extend(rng.sample(rows, len(rows)))
        return [dict(row) for row in out[:n]]

    return sample
