"""Tests of envs.py: the Python tool finds the call in both forms (Qwen's in its JSON and XML syntaxes) and answers in
the matching form, every fault of the called code (a hang, a memory bomb, 10 MB of print, a crash, an exit) is a
short error string and a counted error, never an exception, and Countdown's feedback names the rule a proposal
broke."""

import pytest

from envs import ENVS, CountdownFeedback, PythonTool, countdown_feedback, run_code
from sandbox import OUTPUT_CUT

TORL = "<think>```python\nprint(37*8)\n```\n```output"
QWEN = '<tool_call>\n{"name": "python", "arguments": {"code": "print(37*8)"}}\n</tool_call>'


def test_python_tool_reads_and_answers_both_call_forms():
    """Guards the two call forms: ToRL's fenced block answered after the ```output marker it stopped on (the
    output, then the closing fence), and Qwen's <tool_call> JSON answered with a <tool_response> user turn; a
    call with no code is an error observation, not a crash."""
    torl = PythonTool("torl")
    assert torl.stop == "```output" and torl.step(TORL) == ("\n296\n```\n", 0.0, False)
    qwen = PythonTool("qwen")
    obs, reward, done = qwen.step(QWEN)
    assert qwen.stop == "</tool_call>" and not done
    assert (
        obs == "<|im_end|>\n<|im_start|>user\n<tool_response>\n296\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert torl.errors == qwen.errors == 0
    obs, _, done = torl.step("no code here```output")
    assert obs.startswith("\nError: no code found") and not done and torl.errors == 1
    assert qwen.code('<tool_call>{"name": "python"}</tool_call>') is None


def test_python_tool_reads_qwen35s_xml_call_and_opens_the_next_turn():
    """Guards Qwen3.5/3.6's call syntax under --tool-format qwen: the code of <function=python><parameter=code>,
    newlines and whitespace around the tags as the template writes them, code that holds the tags' own text, text
    before the call; and the observation opens the next assistant turn with `reopen` (Qwen3.5's "<think>\\n")."""
    qwen = PythonTool("qwen", reopen="<think>\n", xml=True)
    call = "<tool_call>\n<function=python>\n<parameter=code>\n{}\n</parameter>\n</function>\n</tool_call>"
    assert qwen.code("I will multiply.\n\n" + call.format("print(37*8)")) == "print(37*8)"
    assert qwen.code(call.format("s = '</parameter>'\nprint(s)")) == "s = '</parameter>'\nprint(s)"
    assert qwen.code("<tool_call><function=python><parameter=code>print(2)</parameter></function></tool_call>") == (
        "print(2)"
    )
    obs, _, done = qwen.step(call.format("print(37*8)"))
    response = "<|im_end|>\n<|im_start|>user\n<tool_response>\n296\n</tool_response><|im_end|>\n"
    assert obs == response + "<|im_start|>assistant\n<think>\n" and not done and qwen.errors == 0
    assert PythonTool("qwen").code(call.format("print(1)")) == "print(1)"  # either syntax, whatever the template


@pytest.mark.parametrize(
    "code, error",
    [
        ("while True: pass", "Error: "),
        ("x = bytearray(10**10)", "MemoryError"),
        ("1/0", "ZeroDivisionError: division by zero"),
        ("import os; os._exit(3)", "Error: "),
        ("raise SystemExit(2)", "SystemExit: 2"),
    ],
)
def test_a_faulty_call_is_a_short_error_string(code, error):
    """Guards the trainer against the tool's code: a call that hangs, runs out of memory, crashes or exits
    becomes a one-line error observation (and a failed flag for tool/errors), never an exception or a hang."""
    out, failed = run_code(code, timeout_s=1.0, memory_mb=256, max_chars=200)
    assert failed and out.startswith(error) and "\n" not in out and len(out) <= 200


def test_ten_megabytes_of_print_are_cut_with_a_marker():
    """Guards the output cap: 10 MB of output becomes max_chars of it, its head and tail, the cut marker between."""
    out, failed = run_code("print('a' * 5_000_000 + 'b' * 5_000_000)", timeout_s=5.0, memory_mb=256, max_chars=100)
    assert not failed and out == "a" * 50 + OUTPUT_CUT + "b" * 50


def test_countdown_feedback_names_the_broken_rule():
    """Guards the interactive task's feedback: which rule a proposal broke (numbers, value, syntax), and a right
    one ends the completion with reward 1."""
    ex = {"prompt": "Using the numbers [3, 5, 7] ...", "nums": [3, 5, 7], "target": 22}
    env = ENVS["countdown"]()
    assert "told which rule" in env.reset(ex)
    assert (
        countdown_feedback("<answer>3 * 5 + 5</answer>", ex) == "it uses [3, 5, 5]; use each of [3, 5, 7] exactly once."
    )
    assert countdown_feedback("<answer>3 + 5 + 7</answer>", ex) == "it equals 15, not 22."
    assert countdown_feedback("<answer>3 + y</answer>", ex).startswith("that is not an equation")
    obs, reward, done = env.step("<answer>3 + 5 + 7</answer>")
    assert obs == "\nFeedback: it equals 15, not 22.\n" and reward == 0.0 and not done and env.errors == 1
    assert env.step("<answer>3 * 5 + 7</answer>") == (None, 1.0, True)
    assert isinstance(env, CountdownFeedback)
