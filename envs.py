"""Environments a completion talks to mid-way: the Env protocol and two of them, the Python tool and Countdown with
feedback. An Env is text in, text out (multiturn.py samples, methods/tools.py wires it into the trainer):

    env.reset(example) -> the user message;  env.step(completion so far) -> (observation, reward, done)

`step` is called when the policy's text reaches `env.stop` (the call's end marker); its observation is appended
to the completion as context (no loss), and `done` (or observation None) ends the completion. The reward the
trainer uses is the task's, on the final text (rewards.py: one source of truth); an Env's own reward is logged.
A user writes a game or a checker with feedback as a class with these three members.
"""

from __future__ import annotations

import json
import re
import time
from typing import Protocol

from rewards import _EXPR_TOKEN, _parse_sum, answer_text, countdown_reward
from sandbox import run_sandboxed

TRUNCATED = "\n[output truncated]"


class Env(Protocol):
    stop: str  # the text that ends a policy turn: the call's end marker
    errors: int  # calls that failed (an error string was the observation)
    seconds: float  # time spent in calls

    def reset(self, example: dict) -> str: ...

    def step(self, text: str) -> tuple[str | None, float, bool]: ...


def run_code(code: str, timeout_s: float, memory_mb: int, max_chars: int) -> tuple[str, bool]:
    """Run a snippet in the sandbox (sandbox.py's containment: its own namespaces, root, seccomp, limits) and
    return (its output, or a one-line error: the exception, or the limit that stopped it; failed). Output past
    max_chars is cut, with a marker. A hang, a memory bomb, 10 MB of print or a crash is an error string here,
    never an exception in the trainer."""
    start = time.perf_counter()
    report = run_sandboxed(code, "", timeout_s=timeout_s, cpu_s=timeout_s, memory_mb=memory_mb, nproc=4)
    out = report["output"]
    if report["passed"]:
        return (out[:max_chars] + TRUNCATED if len(out) > max_chars else out).rstrip("\n"), False
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("sandbox: ")]
    if lines and re.match(r"^\w*(Error|Exception|Interrupt|Exit)\b", lines[-1]):
        return lines[-1][:max_chars], True  # the traceback's last line: "ZeroDivisionError: division by zero"
    if time.perf_counter() - start >= timeout_s:
        return f"Error: time limit ({timeout_s:g} s)", True
    return "Error: the code was stopped (time or memory limit, or it exited)", True


class PythonTool:
    """The Python tool. form "torl" (ToRL, arXiv 2503.23383): the policy writes a ```python block, then the marker
    ```output; the observation is the output and a closing fence. form "qwen" (Qwen2.5's chat template): the policy
    writes <tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>; the observation ends its turn and
    answers in a <tool_response> user turn. Every call runs in the sandbox with its time and memory limits."""

    def __init__(self, form: str = "torl", timeout_s: float = 5.0, memory_mb: int = 512, max_chars: int = 512):
        self.form, self.timeout_s, self.memory_mb, self.max_chars = form, timeout_s, memory_mb, max_chars
        self.stop = "```output" if form == "torl" else "</tool_call>"
        self.errors, self.seconds = 0, 0.0

    def reset(self, example: dict) -> str:
        return example["prompt"]

    def code(self, text: str) -> str | None:
        """The call's code: the last ```python block before the marker, or the last <tool_call>'s "code"."""
        if self.form == "torl":
            body = text[: len(text) - len(self.stop)].rstrip()
            i = body.rfind("```python")
            if i < 0 or not body.endswith("```") or len(body) - 3 <= i + 9:
                return None
            return body[i + 9 : -3]
        i = text.rfind("<tool_call>")
        try:
            call = json.loads(text[i + len("<tool_call>") : len(text) - len(self.stop)]) if i >= 0 else None
            return call["arguments"]["code"] if call["name"] == "python" else None
        except (ValueError, TypeError, KeyError):
            return None

    def step(self, text: str) -> tuple[str | None, float, bool]:
        code, start = self.code(text), time.perf_counter()
        if code is None:
            out, failed = "Error: no code found (write a ```python block, then ```output)", True
        else:
            out, failed = run_code(code, self.timeout_s, self.memory_mb, self.max_chars)
        self.errors += failed
        self.seconds += time.perf_counter() - start
        if self.form == "torl":
            return f"\n{out}\n```\n", 0.0, False
        turn = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        return f"{turn}{out}\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0.0, False


class CountdownFeedback:
    """Countdown with feedback: each <answer>...</answer> the policy proposes is checked, and the observation says
    which rule it broke (a malformed equation, a number used twice or left out, the wrong value); a right one ends
    the completion with reward 1. The trainer's reward is still countdown_reward of the final text."""

    stop = "</answer>"

    def __init__(self) -> None:
        self.example: dict = {}
        self.errors, self.seconds = 0, 0.0

    def reset(self, example: dict) -> str:
        self.example = example
        return example["prompt"] + " After each <answer>, you are told which rule it broke; then try again."

    def step(self, text: str) -> tuple[str | None, float, bool]:
        if countdown_reward(text, self.example) == 1.0:
            return None, 1.0, True
        self.errors += 1
        return f"\nFeedback: {countdown_feedback(text, self.example)}\n", 0.0, False


def countdown_feedback(text: str, example: dict) -> str:
    """Which Countdown rule the last proposed equation breaks, in one sentence."""
    expr = answer_text(text).rpartition("<answer>")[2].removesuffix("</answer>").split("=", 1)[0]
    tokens = _EXPR_TOKEN.findall(expr)
    if not tokens or "".join(tokens) != "".join(expr.split()):
        return "that is not an equation of the numbers, + - * / and parentheses."
    used, nums = sorted(int(t) for t in tokens if t.isdigit()), sorted(example["nums"])
    if used != nums:
        return f"it uses {used}; use each of {nums} exactly once."
    try:
        value, end = _parse_sum(tokens, 0, 0)
    except (ValueError, ZeroDivisionError):
        return "the equation is malformed or divides by zero."
    if end != len(tokens):
        return "the equation is malformed."
    return f"it equals {float(value):g}, not {example['target']}."


ENVS = {"python": PythonTool, "countdown": CountdownFeedback}
