"""Rewards: every training signal and eval metric is a pure `(completion: str, example: dict) -> float`.

Owns answer extraction and checking (`math_reward`), the think/answer structure (`format_reward`),
Countdown equations (`countdown_reward`, a small exact-arithmetic parser, never `eval`), the exact
answer of the synthetic task (`exact_reward`), code run against tests in a sandboxed subprocess
(`code_reward`, `run_sandboxed`), and weighted sums for logging (`combine_rewards`). DAPO's overlong
penalty works on token lengths and lives in advantage.py.

Model outputs are hostile input: megabytes long, braces ten thousand deep, `9**9**9**9`, NUL bytes,
fork bombs. Every reward returns in bounded time and never raises on any completion. Bounds:
- Only the text after the LAST `</think>` is graded when the completion has one: a number, box or
  code block in the scratchpad earns nothing. Of that text only the last `MAX_ANSWER_CHARS` (code:
  `MAX_CODE_CHARS`) are searched, so a 10 MB completion costs one `rfind`.
- Regexes have no nested quantifiers (no catastrophic backtracking); numbers longer than
  `MAX_NUMBER_CHARS` are not parsed (Python refuses or crawls on huge int strings); Countdown has no
  `**` and bounds expression length and parenthesis depth.
- Failures are caught by class, only where they can happen: ValueError (a malformed Countdown
  equation, or nesting past MAX_EXPR_DEPTH: that explicit counter is why RecursionError cannot
  occur), ZeroDivisionError (x/0 in Countdown), OSError (a sandbox process that cannot start).
  Floats and powers are never evaluated, so OverflowError cannot occur; math-verify catches its
  own errors. A reward raises only for a malformed *example* (a missing "answer"), which is a bug
  in the task, not model output.

The code sandbox is described at `run_sandboxed`.
"""

import ctypes
import json
import os
import re
import resource
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

MAX_ANSWER_CHARS = 20_000  # tail of the post-</think> text searched for an answer
MAX_NUMBER_CHARS = 64  # longer numeric strings are compared as text, never parsed
MAX_EXPR_CHARS = 256  # Countdown: longer equations score 0
MAX_EXPR_DEPTH = 32  # Countdown: deeper parenthesis nesting scores 0
MAX_CODE_CHARS = 100_000  # tail of the post-</think> text searched for a ```python block


def answer_text(completion: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """The gradable part of a completion: after the last `</think>` if any, its last `limit` chars."""
    i = completion.rfind("</think>")
    text = completion[i + len("</think>") :] if i >= 0 else completion
    return text[-limit:]


def strip_end_tokens(text: str) -> str:
    """Strip whitespace and trailing special-token text (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...),
    which a decode with skip_special_tokens=False leaves at the end of a completion."""
    text = text.strip()
    while True:
        if text.endswith("</s>"):
            text = text[:-4].rstrip()
        elif text.endswith("|>") and (j := text.rfind("<|", max(0, len(text) - 40))) >= 0:
            text = text[:j].rstrip()
        else:
            return text


# ---------------------------------------------------------------- answer extraction and equivalence

_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
_LATEX_FRAC = re.compile(r"(-?)\\frac(?:\{([^{}]*)\}\{([^{}]*)\}|(\d)(\d))")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\{([^{}]*)\}")
_LATEX_NOISE = (
    "\\left",
    "\\right",
    "\\displaystyle",
    "\\,",
    "\\!",
    "\\;",
    "\\:",
    "\\ ",
    "~",
    "$",
    "\\(",
    "\\)",
    "\\[",
    "\\]",
    "^\\circ",
    "^{\\circ}",
    "\\%",
    "%",
)


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces), or of `\\boxed 5`; None if
    absent or its braces never close."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    keyword = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
    rest = text[start + len(keyword) :].lstrip()
    if not rest.startswith("{"):  # `\boxed 5`: the next whitespace-delimited token
        return rest.split(maxsplit=1)[0].rstrip("$") if rest.strip() else None
    depth = 0
    for j, ch in enumerate(rest):  # linear scan; depth is a counter, not recursion
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:j]
    return None


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last `<tag>...</tag>`, or None."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, max(end, 0))
    return text[start + len(tag) + 2 : end] if 0 <= start < end else None


def extract_answer(completion: str) -> str | None:
    """The final answer of a math completion, first found of: last `\\boxed{}`, last
    `<answer>...</answer>`, last `#### N` line, last number. Only text after the last `</think>`."""
    text = answer_text(completion)
    for found in (extract_boxed(text), extract_tag(text, "answer")):
        if found is not None:
            return found
    i = text.rfind("####")
    if i >= 0:
        return text[i + 4 :].strip().split("\n", 1)[0]
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def normalize_answer(s: str) -> str:
    """Drop LaTeX wrappers and spacing so `$\\text{5}$`, `5\\%` and `\\dfrac{1}{2}` read as 5, 5, \\frac{1}{2}."""
    s = s[:MAX_ANSWER_CHARS].replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = _TEXT_WRAPPER.sub(r"\1", s)
    for noise in _LATEX_NOISE:
        s = s.replace(noise, "")
    return "".join(s.split()).rstrip(".")


def parse_number(s: str) -> Fraction | None:
    """Exact value of a normalized answer: `1,234`, `2.50`, `-3`, `3/4`, `\\frac{3}{4}`, `\\frac34`;
    None if it is anything else (or longer than MAX_NUMBER_CHARS)."""
    if len(s) > MAX_NUMBER_CHARS:
        return None
    if (m := _LATEX_FRAC.fullmatch(s)) is not None:
        num, den = (m[2], m[3]) if m[2] is not None else (m[4], m[5])
        sign = -1 if m[1] else 1
    elif s.count("/") == 1:
        (num, den), sign = s.split("/"), 1
    else:
        return Fraction(s.replace(",", "")) if _PLAIN_NUMBER.fullmatch(s) else None
    if not (_PLAIN_NUMBER.fullmatch(num) and _PLAIN_NUMBER.fullmatch(den)):
        return None
    num_value, den_value = Fraction(num.replace(",", "")), Fraction(den.replace(",", ""))
    return None if den_value == 0 else sign * num_value / den_value


def answers_match(pred: str, ref: str) -> bool:
    """Equivalence of a predicted and a reference answer. Numbers compare exactly as fractions
    (`2.50 == 5/2`, `1,000 == 1000`, `50\\% == 50`, but `0.333 != 1/3`); a numeric reference
    matched by a non-numeric prediction uses the prediction's last number (`18 dollars`).
    Otherwise the normalized strings must be equal, or math-verify must say they are equal."""
    a, b = normalize_answer(pred), normalize_answer(ref)
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if y is not None and x is None and (numbers := _LAST_NUMBER.findall(a)):
        x = parse_number(numbers[-1].rstrip(","))
    if x is not None and y is not None:
        return x == y
    return _math_verify_equal(pred, ref)


def _math_verify_equal(pred: str, ref: str) -> bool:
    """Symbolic equivalence by math-verify (optional extra; False when not installed). Its timeout is
    SIGALRM, which works only in the main thread, so elsewhere (a scoring pool) and for inputs that
    could make sympy compute for minutes (long, stacked powers, factorials) we do not call it."""
    if threading.current_thread() is not threading.main_thread() or len(pred) > 200 or len(ref) > 200:
        return False
    if pred.count("^") + pred.count("**") > 1 or "!" in pred:
        return False
    try:
        import math_verify
    except ImportError:
        return False
    # math-verify catches its own parsing and timeout errors and answers []/False.
    gold = math_verify.parse(f"${ref}$", parsing_timeout=2)
    guess = math_verify.parse(f"${pred}$", parsing_timeout=2)
    return bool(math_verify.verify(gold, guess, timeout_seconds=2))


def math_reward(completion: str, example: dict) -> float:
    """1.0 if the final answer (see `extract_answer`) equals `example["answer"]` (see `answers_match`)."""
    pred = extract_answer(completion)
    return float(pred is not None and answers_match(pred, str(example["answer"])))


def exact_reward(completion: str, example: dict) -> float:
    """1.0 if the text after the last `</think>`, stripped of whitespace and trailing end-token text,
    is exactly `example["answer"]` (the synthetic task: no normalization, `0425` is wrong)."""
    i = completion.rfind("</think>")
    if i < 0 or len(completion) - i > 1000:  # no thought, or far too long to be an answer
        return 0.0
    return float(strip_end_tokens(completion[i + len("</think>") :]) == str(example["answer"]))


def format_reward(completion: str, example: dict) -> float:
    """The `<think>thought</think>answer` structure. The opening `<think>` is optional (chat templates
    often put it in the prompt) but if present it must open the completion.
    1.0: one closed thought and a non-empty answer after it; 0.5: one closed thought but the
    thought or the answer is empty; 0.0: no `</think>`, repeated or misplaced tags."""
    text = strip_end_tokens(completion)
    if text.count("</think>") != 1 or text.count("<think>") > 1:
        return 0.0
    if "<think>" in text and not text.startswith("<think>"):
        return 0.0
    thought, answer = text.removeprefix("<think>").split("</think>")
    return 1.0 if thought.strip() and answer.strip() else 0.5


# ---------------------------------------------------------------- Countdown

_EXPR_CHARS = re.compile(r"[\d+\-*/() ]*")
_EXPR_TOKEN = re.compile(r"\d+|[-+*/()]")


def countdown_reward(completion: str, example: dict) -> float:
    """1.0 if the equation in the last `<answer>...</answer>` uses every number of `example["nums"]`
    EXACTLY ONCE (the TinyZero rule; a subset scores 0) and equals `example["target"]`.
    Allowed: integers, + - * /, parentheses, spaces; `x`/`×`/`÷` are read as * and /; a trailing
    `= N` is ignored. No unary minus, no `**`. Exact arithmetic with Fraction: 7/2*2 == 7."""
    expr = extract_tag(answer_text(completion), "answer")
    if expr is None:
        return 0.0
    expr = expr.split("=", 1)[0].replace("×", "*").replace("x", "*").replace("÷", "/")
    if len(expr) > MAX_EXPR_CHARS or not _EXPR_CHARS.fullmatch(expr):
        return 0.0
    tokens = _EXPR_TOKEN.findall(expr)
    numbers = sorted(int(t) for t in tokens if t.isdigit() and len(t) <= 9)
    if len(numbers) != sum(t.isdigit() for t in tokens) or numbers != sorted(example["nums"]):
        return 0.0
    try:
        value, end = _parse_sum(tokens, 0, 0)
        if end != len(tokens):
            raise ValueError("trailing tokens")
    except ValueError:  # malformed equation (syntax, nesting deeper than MAX_EXPR_DEPTH)
        return 0.0
    except ZeroDivisionError:  # a division by zero anywhere makes the equation invalid
        return 0.0
    return float(value == example["target"])


def _parse_sum(tokens: list[str], i: int, depth: int) -> tuple[Fraction, int]:
    """sum := product (('+' | '-') product)*  ->  (value, index after it)."""
    value, i = _parse_product(tokens, i, depth)
    while i < len(tokens) and tokens[i] in "+-":
        rhs, j = _parse_product(tokens, i + 1, depth)
        value, i = (value + rhs if tokens[i] == "+" else value - rhs), j
    return value, i


def _parse_product(tokens: list[str], i: int, depth: int) -> tuple[Fraction, int]:
    """product := atom (('*' | '/') atom)*"""
    value, i = _parse_atom(tokens, i, depth)
    while i < len(tokens) and tokens[i] in "*/":
        rhs, j = _parse_atom(tokens, i + 1, depth)
        value, i = (value * rhs if tokens[i] == "*" else value / rhs), j
    return value, i


def _parse_atom(tokens: list[str], i: int, depth: int) -> tuple[Fraction, int]:
    """atom := integer | '(' sum ')'"""
    if i >= len(tokens):
        raise ValueError("unexpected end")
    if tokens[i].isdigit():
        return Fraction(int(tokens[i])), i + 1
    if tokens[i] != "(" or depth >= MAX_EXPR_DEPTH:
        raise ValueError("expected a number or '(' (or nesting too deep)")
    value, i = _parse_sum(tokens, i + 1, depth + 1)
    if i >= len(tokens) or tokens[i] != ")":
        raise ValueError("missing ')'")
    return value, i + 1


# ---------------------------------------------------------------- code, run against tests

CODE_TIMEOUT_S = 10.0  # wall-clock limit of one run (s)
CODE_CPU_S = 5  # CPU-time limit of each process of the run (s)
CODE_MEMORY_MB = 512  # address-space limit of each process (MiB); worst case total = nproc x this
CODE_NPROC = 16  # processes (and threads) the code may have at once
CODE_FILE_MB = 16  # largest file (and total output) the code may write (MiB)
CODE_TMPFS_MB = 64  # size of each private tmpfs (/tmp, /dev/shm, the work dir) (MiB)
CODE_OUTPUT_BYTES = 4000  # tail of stdout+stderr kept in the run's report (bytes)

_HARNESS_FLAG = "--sandbox-harness"


def extract_code(completion: str) -> str | None:
    """The last ```python (or ```py, or bare ```) block after the last `</think>`, or None. Fences are
    paired left to right by plain string search (a lazy regex would be quadratic on many fences)."""
    text = answer_text(completion, MAX_CODE_CHARS)
    fences, i = [], text.find("```")
    while i >= 0:
        fences.append(i)
        i = text.find("```", i + 3)
    for start, end in reversed(list(zip(fences[::2], fences[1::2]))):
        info, _, body = text[start + 3 : end].partition("\n")
        if info.strip().lower() in ("", "python", "python3", "py"):
            return body
    return None


def code_reward(completion: str, example: dict) -> float:
    """1.0 if the last ```python block passes `example["tests"]` (asserts; a list is joined by lines;
    with `entry_point` the tests' `check(candidate)` is called on it) in the sandbox."""
    code = extract_code(completion)
    if code is None:
        return 0.0
    tests = example["tests"]
    tests = "\n".join(tests) if isinstance(tests, list) else tests
    return float(run_sandboxed(code, tests, entry_point=example.get("entry_point"))["passed"])


def code_rewards(completions: list[str], examples: list[dict], max_workers: int = 4) -> list[float]:
    """`code_reward` over a batch, `max_workers` sandboxes at a time."""
    return score_batch(code_reward, completions, examples, max_workers)


def run_sandboxed(
    code: str,
    tests: str,
    *,
    entry_point: str | None = None,
    timeout_s: float = CODE_TIMEOUT_S,
    cpu_s: int = CODE_CPU_S,
    memory_mb: int = CODE_MEMORY_MB,
    nproc: int = CODE_NPROC,
) -> dict:
    """Run untrusted `code`, then `tests`, in a sandbox; returns {"passed", "status", "output",
    "isolation", "run_id"}.

    Three processes: this one (the trainer), a disposable HARNESS (`python -I rewards.py
    --sandbox-harness`, its own session, an environment without this process's variables) and the
    CHILD the harness forks to run the code. The harness sets up isolation, then watches the child:
    wall-clock deadline, and this process closing the harness's stdin (or dying), both kill it.
    The child runs as follows, each layer applied only where the OS allows (reported in
    "isolation"):
    - PID namespace (root, or a user namespace): the child is PID 1 of a new namespace, so it cannot
      see or signal any process outside (`os.kill(os.getppid(), 9)` and `kill(-1, 9)` reach nothing
      outside) and killing it kills every process it started, even ones that called setsid().
    - network namespace: only a loopback device, which is down: no network at all.
    - mount namespace: mounts made private, fresh tmpfs on /tmp, /dev/shm and the work dir
      (CODE_TMPFS_MB each), fresh /proc, EVERY other mount remounted read-only.
    - root: the child switches to a uid no one else uses (2,000,000,000 + harness pid), no groups,
      so RLIMIT_NPROC (which root ignores) applies to it alone, files not world-readable are
      unreadable and root-owned files unwritable. Without root, a user namespace gives RLIMIT_NPROC
      its own count, but the code keeps the user's file permissions (read-only by the remount).
      A Python installed where other users cannot read it (pyenv under /root) is bind-mounted
      into the private /tmp for imports; its executable still cannot be run by the code.
    - always: its own session; rlimits CPU (cpu_s, then SIGKILL), address space (memory_mb), file
      size (CODE_FILE_MB, also caps the output), processes (nproc), open files, no core dumps;
      no_new_privs (setuid binaries do not elevate), parent-death SIGKILL; cwd = a fresh temp dir;
      environment = PATH, HOME and LANG only; stdin /dev/null; stdout+stderr to an unlinked file.
    Afterwards the harness kills the child, and with it the namespace. Without a PID namespace it
    also kills the child's process group and every process still carrying this run's marker in
    /proc/*/environ.
    NOT contained: world-readable files can be read; without a mount namespace, world-writable
    dirs (/tmp, /dev/shm) are writable (and a privately installed Python cannot import after the
    uid switch); without a PID namespace a process that calls setsid() and then exec()s with a
    fresh environment escapes the cleanup, `kill(-1)` reaches every process of the user, and
    without a uid switch either, /proc/<pid>/environ of the user's processes is readable; total
    memory is bounded only by nproc x memory_mb (no cgroup); CPU time is shared with the trainer.
    Linux only (namespaces, prctl, pidfd: kernel 5.3+).

    PASSING means the tests ran to the end, not merely exit code 0: this process draws a random
    nonce per run; the child writes it to a file descriptor only after the last assert (and after
    `check(entry_point)`), and we compare. `os._exit(0)`, `sys.exit(0)` or a crash before the end
    fail. The nonce exists only as a local variable of the child's runner, which code could still
    dig out by frame introspection: it stops accidental or lazy exploits, not a targeted attack.
    """
    nonce, run_id = secrets.token_hex(16), secrets.token_hex(8)
    request = {
        "code": code,
        "tests": tests,
        "entry_point": entry_point,
        "nonce": nonce,
        "timeout_s": timeout_s,
        "cpu_s": cpu_s,
        "memory_mb": memory_mb,
        "nproc": nproc,
    }
    with (
        tempfile.TemporaryDirectory(prefix="nanorl-sandbox-") as workdir,
        tempfile.TemporaryFile() as report,
        tempfile.TemporaryFile() as output,
        tempfile.TemporaryFile() as result,
    ):
        request.update(workdir=workdir, result_fd=result.fileno())
        cmd = [sys.executable, "-I", os.path.abspath(__file__), _HARNESS_FLAG, run_id]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "NANORL_SANDBOX": run_id}
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=report,
                stderr=output,
                env=env,
                pass_fds=(result.fileno(),),
                start_new_session=True,
            )
        except OSError as e:  # fork/exec failed (out of processes or fds): not the model's fault
            return {
                "passed": False,
                "status": f"sandbox did not start: {e}",
                "output": "",
                "isolation": {},
                "run_id": run_id,
            }
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            proc.wait(timeout_s + 5)  # the harness enforces timeout_s itself; this is a backstop
        except (BrokenPipeError, subprocess.TimeoutExpired):
            pass  # the harness died or hung; the cleanup below handles both
        finally:
            try:
                proc.stdin.close()  # EOF tells a still-running harness to kill the child and exit
            except BrokenPipeError:
                pass
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        report.seek(0)
        output.seek(max(0, os.fstat(output.fileno()).st_size - CODE_OUTPUT_BYTES))
        result.seek(0)
        try:
            info = json.loads(report.read() or b"{}")
        except ValueError:  # the harness was killed mid-report
            info = {}
        return {
            "passed": result.read(len(nonce) + 1) == nonce.encode() and info.get("status") == "exit 0",
            "status": info.get("status", f"harness failed ({proc.returncode})"),
            "output": output.read().decode(errors="replace"),
            "isolation": info.get("isolation", {}),
            "run_id": run_id,
        }


# The harness and the child (run in `python -I rewards.py --sandbox-harness RUN_ID`).

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_REC, _MS_PRIVATE = 16384, 1 << 18
_MOUNT_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
    "strictatime": 1 << 24,
}
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _CAPABILITY_VERSION_3 = 1, 38, 0x20080522


def _harness_main(run_id: str) -> None:
    """The disposable harness: isolate, fork the child, watch it, clean up, report JSON on stdout."""
    request = json.loads(sys.stdin.buffer.readline())
    libc = ctypes.CDLL(None, use_errno=True)
    isolation = _isolate(libc, request["workdir"])
    # A uid unique among running harnesses, above the ranges container hosts usually map.
    uid = 2_000_000_000 + os.getpid() if os.geteuid() == 0 else None
    pid = os.fork()
    if pid == 0:
        try:
            _child_main(libc, request, isolation, uid)
        finally:  # the child must never fall back into the harness's code
            os._exit(3)
    del request["nonce"]
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd, 0], [], [], request["timeout_s"])  # 0: stdin, EOF = trainer gone
    status = "exited" if pidfd in ready else "trainer closed the harness" if ready else "timeout"
    # Kill before reaping: an unreaped child's pid (and process group id) cannot have been reused.
    os.kill(pid, signal.SIGKILL)
    if not isolation["pid_namespace"]:  # with one, the child's death killed all it started
        _kill_leftovers(pid, run_id)
    _, wait_status = os.waitpid(pid, 0)
    if status == "exited":
        code = os.waitstatus_to_exitcode(wait_status)
        status = f"exit {code}" if code >= 0 else f"killed by signal {-code}"
    json.dump({"status": status, "isolation": isolation}, sys.stdout)


def _isolate(libc: ctypes.CDLL, workdir: str) -> dict:
    """Enter new namespaces where the OS allows; the child forked next is PID 1 of the new one."""
    iso = {"user_namespace": False, "uid_switch": os.geteuid() == 0}
    uid, gid = os.getuid(), os.getgid()
    if uid != 0 and libc.unshare(_CLONE_NEWUSER) == 0:  # lets a plain user create the others
        # Map our ids to themselves (an unmapped owner cannot create files in the new tmpfs).
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        iso["user_namespace"] = True
    iso["pid_namespace"] = libc.unshare(_CLONE_NEWPID) == 0
    iso["net_namespace"] = libc.unshare(_CLONE_NEWNET) == 0
    iso["mount_namespace"] = False
    # Mounts must be private BEFORE anything is mounted, or the tmpfs would appear on the host too.
    if libc.unshare(_CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0:
        iso["mount_namespace"] = _private_filesystem(libc, workdir)
    return iso


def _private_filesystem(libc: ctypes.CDLL, workdir: str) -> bool:
    """tmpfs on /tmp, /dev/shm and the work dir; every other mount read-only. True if all that worked."""
    mounts = [line.split() for line in open("/proc/self/mountinfo")]
    tmpfs_options = f"size={CODE_TMPFS_MB}m,mode=1777".encode()
    private = [path for path in ("/tmp", "/dev/shm") if os.path.isdir(path)] + [workdir]
    tmpfs_ok = True
    for path in private:
        os.makedirs(path, exist_ok=True)  # a work dir under /tmp must be made again in the new /tmp
        tmpfs_ok &= libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, tmpfs_options) == 0
    root_read_only = False
    for fields in mounts:  # mountinfo: id parent dev root MOUNT_POINT OPTIONS ...
        point = re.sub(r"\\(\d{3})", lambda m: chr(int(m[1], 8)), fields[4])
        if point in private:
            continue
        # A remount must repeat the mount's nosuid/nodev/... flags (in a user namespace they are locked).
        flags = sum(_MOUNT_FLAGS.get(o, 0) for o in fields[5].split(","))
        ok = libc.mount(None, point.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags, None) == 0
        root_read_only |= ok and point == "/"
    return tmpfs_ok and root_read_only


def _child_main(libc: ctypes.CDLL, request: dict, isolation: dict, uid: int | None) -> None:
    """The child: confine itself, run the code and the tests, write the nonce only if they finish."""
    nonce = request.pop("nonce")  # kept in this frame's locals only
    try:
        os.setsid()  # its own session: a kill(0, ...) from the code cannot reach the harness
        if isolation["pid_namespace"] and isolation["mount_namespace"]:
            libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
        os.dup2(request["result_fd"], 3)
        os.dup2(2, 1)  # stdout and stderr both go to the output file
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.closerange(4, 1 << 16)
        if uid is not None and isolation["mount_namespace"] and _python_is_private():
            _expose_python(libc)
        workdir = request["workdir"]
        limits = {
            resource.RLIMIT_CPU: request["cpu_s"],
            resource.RLIMIT_NPROC: request["nproc"],
            resource.RLIMIT_AS: request["memory_mb"] << 20,
            resource.RLIMIT_FSIZE: CODE_FILE_MB << 20,
            resource.RLIMIT_NOFILE: 64,
            resource.RLIMIT_CORE: 0,
        }
        for kind, value in limits.items():
            hard = resource.getrlimit(kind)[1]  # without root a hard limit can only be lowered
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(kind, (value, value))
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        # Drop every capability (in a user namespace we hold all of them there, enough to undo the
        # read-only remounts), and make sure no setuid binary can give any back.
        if (
            libc.capset((ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0), (ctypes.c_uint32 * 6)()) != 0
            or libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        ):
            raise OSError(ctypes.get_errno(), "could not drop capabilities")
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
        os.chdir(workdir)
        os.umask(0o077)
        os.environ.clear()
        os.environ.update(PATH="/usr/bin:/bin", HOME=workdir, LANG="C.UTF-8")
    except OSError as e:  # a confinement step failed: never run the code half-confined
        os.write(2, f"sandbox setup failed: {e}\n".encode())
        os._exit(3)
    _run_tests(request["code"], request["tests"], request["entry_point"], nonce)


def _python_is_private() -> bool:
    """True if other users cannot reach this Python's standard library (e.g. pyenv under /root)."""
    path = sys.base_prefix
    while path != "/":
        if not os.stat(path).st_mode & 0o001:  # no search permission for others
            return True
        path = os.path.dirname(path)
    return False


def _expose_python(libc: ctypes.CDLL) -> None:
    """Bind the Python installation (read-only, like every mount here) into the private /tmp and point
    sys.path there, so the unprivileged uid can still import the standard library."""
    staged = "/tmp/.python"
    os.makedirs(staged)
    if libc.mount(sys.base_prefix.encode(), staged.encode(), None, _MS_BIND | _MS_REC, None) == 0:
        sys.path[:] = [p.replace(sys.base_prefix, staged, 1) if p.startswith(sys.base_prefix) else p for p in sys.path]


def _run_tests(code: str, tests: str, entry_point: str | None, nonce: str) -> None:
    """exec the code, then the tests, in one namespace; nonce to fd 3 only if all of it finished."""
    write, exit_now = os.write, os._exit  # local references: the code may monkeypatch the os module
    scope = {"__name__": "__main__"}
    try:
        exec(compile(code, "solution.py", "exec"), scope)  # compiled apart: code cannot swallow tests
        exec(compile(tests, "tests.py", "exec"), scope)
        if entry_point:
            scope["check"](scope[entry_point])
    except BaseException:  # anything, SystemExit included, means the tests did not finish; it is printed
        try:
            traceback.print_exc()
            sys.stdout.flush()
        finally:
            exit_now(1)
    write(3, nonce.encode())
    try:
        sys.stdout.flush()  # os._exit skips the flush of buffered prints
    finally:
        exit_now(0)


def _kill_leftovers(pid: int, run_id: str) -> None:
    """Kill the child's process group and every process whose environment carries this run's marker
    (inherited by all its forks; exec with a fresh environment drops it). Only without a PID
    namespace: with one, the child mounted its own /proc and these pids would mean other processes."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    marker = f"NANORL_SANDBOX={run_id}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read():
                        os.kill(int(entry), signal.SIGKILL)
            except OSError:  # gone meanwhile, or not ours to read or kill
                pass


# ---------------------------------------------------------------- batches and weighted sums


def score_batch(
    fn: Callable[[str, dict], float], completions: list[str], examples: list[dict], max_workers: int = 1
) -> list[float]:
    """`fn` over (completion, example) pairs; a thread pool when max_workers > 1 (worth it for
    code_reward, whose work happens in subprocesses)."""
    if len(completions) != len(examples):
        raise ValueError(f"score_batch got {len(completions)} completions but {len(examples)} examples.")
    if max_workers <= 1:
        return [float(fn(c, e)) for c, e in zip(completions, examples)]
    with ThreadPoolExecutor(max_workers) as pool:
        return [float(r) for r in pool.map(fn, completions, examples)]


def combine_rewards(
    completions: list[str],
    examples: list[dict],
    fns: dict[str, tuple[Callable[[str, dict], float], float]],
    max_workers: int = 1,
) -> tuple[list[float], dict[str, list[float]]]:
    """Weighted sum of rewards: fns = {name: (fn, weight)} -> (total per completion, {name: values})."""
    if not fns:
        raise ValueError("combine_rewards needs at least one reward function.")
    per_reward = {name: score_batch(fn, completions, examples, max_workers) for name, (fn, _) in fns.items()}
    total = [sum(weight * per_reward[name][i] for name, (_, weight) in fns.items()) for i in range(len(completions))]
    return total, per_reward


if __name__ == "__main__":
    if sys.argv[1:2] != [_HARNESS_FLAG] or len(sys.argv) != 3:
        sys.exit("rewards.py is a library; `--sandbox-harness RUN_ID` is how run_sandboxed starts its harness.")
    _harness_main(sys.argv[2])
