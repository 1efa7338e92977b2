"""Environments a completion talks to mid-way: the Env protocol and two of them, the Python tool and Countdown with
feedback. An Env is text in, text out (multiturn.py samples, methods/tools.py wires it into the trainer):

    env.reset(example) -> the user message;  env.step(the policy's current turn) -> (observation, reward, done)

`step` is called when the policy's text reaches `env.stop` (the call's end marker), with the text the policy wrote
since the last observation (its current turn: what an earlier observation printed is never the policy's); its
observation is appended to the completion as context (no loss), and `done` (or observation None) ends the
completion. An exception out of `step` becomes an error observation (methods/tools.py), never the end of the run.
The reward the trainer uses is the task's, on the policy's own text (rewards.py: one source of truth); an Env's own
reward is logged. A user writes a game or a checker with feedback as a class with these members.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Protocol

from rewards import _EXPR_TOKEN, MAX_EXPR_CHARS, _parse_sum, countdown_equation, countdown_reward
from sandbox import CODE_OUTPUT_CHARS, cut_output, run_sandboxed


class Env(Protocol):
    stop: str  # the text that ends a policy turn: the call's end marker
    tasks: tuple[str, ...] | None  # the tasks it serves (--task); None: any
    errors: int  # calls that failed (an error string was the observation)
    seconds: float  # time spent in calls

    def reset(self, example: dict) -> str: ...

    def step(self, text: str) -> tuple[str | None, float, bool]: ...


def wall_limit(cpu_s: float, workers: int = 1) -> float:
    """The wall-clock limit of a call whose CPU limit is cpu_s, when `workers` calls run at once: cpu_s x (1 +
    ceil(workers / cores)) + 1 s. A call's CPU time is what bounds it; the margin is for the share of a core it gets
    when the calls outnumber the cores (plus the trainer's own threads, and a second to start), so an honest call's
    observation does not depend on how busy the machine is. The wall clock still ends code that sleeps."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cpu_s * (1 + math.ceil(workers / cores)) + 1.0


def run_code(
    code: str, timeout_s: float, memory_mb: int, max_chars: int, wall_s: float | None = None
) -> tuple[str, bool]:
    """Run a snippet in the sandbox (sandbox.py's containment: its own namespaces, root, seccomp, limits) under
    timeout_s of CPU time (wall clock: wall_s, by default wall_limit(timeout_s)) and return (its output, or a
    one-line error: the exception, or the limit that stopped it; failed). Output past max_chars keeps its head and
    tail with sandbox.OUTPUT_CUT between (sandbox.cut_output). A hang, a memory bomb, 10 MB of print or a crash is
    an error string here, never an exception in the trainer."""
    wall_s = wall_limit(timeout_s) if wall_s is None else wall_s
    chars = max(max_chars, CODE_OUTPUT_CHARS)  # enough of the tail for a traceback's last line
    report = run_sandboxed(
        code, "", timeout_s=wall_s, cpu_s=timeout_s, memory_mb=memory_mb, nproc=4, output_chars=chars
    )
    out = report["output"]
    if report["passed"]:
        return cut_output(out.rstrip("\n"), max_chars), False
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("sandbox: ")]
    if lines and re.match(r"^\w*(Error|Exception|Interrupt|Exit)\b", lines[-1]):
        return cut_output(
            lines[-1], max_chars
        ), True  # the traceback's last line: "ZeroDivisionError: division by zero"
    if report["status"] == "cpu time limit":
        return f"Error: CPU time limit ({timeout_s:g} s)", True
    if report["status"] == "timeout":
        return f"Error: wall-clock limit ({wall_s:g} s)", True
    return "Error: the code was stopped (time or memory limit, or it exited)", True


NO_CALL = '<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>'
ENV_FAILED = "\nError: the environment failed on this call ({}).\n"  # the observation when an Env's `step` raises
NO_CALL_XML = "<tool_call>\n<function=python>\n<parameter=code>\n...\n</parameter>\n</function>\n</tool_call>"


class PythonTool:
    """The Python tool. form "torl" (ToRL, arXiv 2503.23383): the policy writes a ```python block, then the marker
    ```output; the observation is the output and a closing fence. form "qwen" (Qwen's chat templates): the policy
    writes a <tool_call> in either of Qwen's syntaxes, {"name": "python", "arguments": {"code": ...}} (Qwen2.5,
    Qwen3) or <function=python><parameter=code>...</parameter></function> (Qwen3.5/3.6, `xml`: the one its error
    message shows); the observation ends its turn, answers in a <tool_response> user turn and opens the next
    assistant turn as the chat template's generation prompt does (`reopen`: Qwen3.5's "<think>\n"). Every call
    runs in the sandbox with its time and memory limits; the wall clock gets wall_limit's margin for `workers`
    calls at once."""

    tasks = None  # any task

    def __init__(
        self,
        form: str = "torl",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_chars: int = 512,
        workers: int = 1,
        reopen: str = "",
        xml: bool = False,
    ):
        self.form, self.timeout_s, self.memory_mb, self.max_chars = form, timeout_s, memory_mb, max_chars
        self.wall_s = wall_limit(timeout_s, workers)
        self.stop = "```output" if form == "torl" else "</tool_call>"
        self.reopen, self.xml = reopen, xml
        self.errors, self.seconds = 0, 0.0

    def reset(self, example: dict) -> str:
        return example["prompt"]

    def code(self, turn: str) -> str | None:
        """The call's code in the policy's current turn (the text since the last observation), or None: torl, the
        ```python block that the marker closes, from the first ```python of the turn (code may hold the text
        ```python itself) to the fence before the marker; qwen, the code of the turn's first <tool_call>, whose
        body runs to the first </tool_call>: the "code" argument of its JSON, or its XML's one parameter "code".
        Malformed JSON (nested past Python's recursion limit, a number past its digit limit, not an object, no
        string code) or XML (another function, another or a second parameter, text around it) is no call."""
        body = turn[: turn.find(self.stop)] if self.stop in turn else turn
        if self.form == "torl":
            body, i = body.rstrip(), body.find("```python")
            if i < 0 or not body.endswith("```") or len(body) - 3 <= i + 9:
                return None
            return body[i + 9 : -3]
        i = body.find("<tool_call>")
        if i < 0:
            return None
        body = body[i + len("<tool_call>") :]
        if body.lstrip().startswith("<function="):
            return xml_code(body)
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            return None
        args = call.get("arguments") if isinstance(call, dict) and call.get("name") == "python" else None
        code = args.get("code") if isinstance(args, dict) else None
        return code if isinstance(code, str) else None

    def step(self, text: str) -> tuple[str | None, float, bool]:
        code, start = self.code(text), time.perf_counter()
        if code is None:
            how = "a ```python block, then ```output" if self.form == "torl" else NO_CALL_XML if self.xml else NO_CALL
            out, failed = f"Error: no code found (write {how})", True
        else:
            out, failed = run_code(code, self.timeout_s, self.memory_mb, self.max_chars, self.wall_s)
        self.errors += failed
        self.seconds += time.perf_counter() - start
        if self.form == "torl":
            return f"\n{out}\n```\n", 0.0, False
        turn = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        return f"{turn}{out}\n</tool_response><|im_end|>\n<|im_start|>assistant\n{self.reopen}", 0.0, False


def xml_code(body: str) -> str | None:
    """The code of a Qwen3.5/3.6 call's body (the text between <tool_call> and </tool_call>), as its chat template
    writes one: <function=python>, <parameter=code>, a newline, the code, a newline, </parameter>, </function>,
    whitespace between the tags. The code runs to the body's last </parameter>, so it may hold the tags' text."""
    body = body.strip()
    head, tail = "<function=python>", "</function>"
    if not (body.startswith(head) and body.endswith(tail)):
        return None
    inner = body[len(head) : -len(tail)].strip()
    head, tail = "<parameter=code>", "</parameter>"
    if not (inner.startswith(head) and inner.endswith(tail)) or len(inner) < len(head) + len(tail):
        return None
    code = inner[len(head) : -len(tail)]
    code = code[1:] if code.startswith("\n") else code
    code = code[:-1] if code.endswith("\n") else code
    return None if SECOND_PARAMETER.search(code) else code


SECOND_PARAMETER = re.compile(r"</parameter>\s*<parameter=")  # <parameter=code>a</parameter><parameter=x>b</parameter>


class CountdownFeedback:
    """Countdown with feedback: each <answer>...</answer> the policy proposes is checked, and the observation says
    which rule it broke (a malformed equation, a number used twice or left out, the wrong value); a right one ends
    the completion with reward 1. The trainer's reward is still countdown_reward of the final text."""

    stop = "</answer>"
    tasks = ("countdown",)  # it reads the example's nums and target

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
    """Which Countdown rule the last proposed equation breaks, in one sentence. It reads the equation as
    countdown_reward does (rewards.countdown_equation), within the same bounds: at most MAX_EXPR_CHARS characters,
    numbers of at most 9 digits, nesting at most MAX_EXPR_DEPTH deep."""
    expr = countdown_equation(text) or ""
    if len(expr) > MAX_EXPR_CHARS:
        return f"the equation is longer than {MAX_EXPR_CHARS} characters."
    tokens = _EXPR_TOKEN.findall(expr)
    if not tokens or "".join(tokens) != "".join(expr.split()):
        return "that is not an equation of the numbers, + - * / and parentheses."
    if any(t.isdigit() and len(t) > 9 for t in tokens):
        return f"it uses a number of more than 9 digits; use each of {sorted(example['nums'])} exactly once."
    used, nums = sorted(int(t) for t in tokens if t.isdigit()), sorted(example["nums"])
    if used != nums:
        return f"it uses {used}; use each of {nums} exactly once."
    try:
        value, end = _parse_sum(tokens, 0, 0)
    except (ValueError, ZeroDivisionError):
        return "the equation is malformed, nested too deep or divides by zero."
    if end != len(tokens):
        return "the equation is malformed."
    return f"it equals {float(value):g}, not {example['target']}."


ENVS = {"python": PythonTool, "countdown": CountdownFeedback}
