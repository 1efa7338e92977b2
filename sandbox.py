"""The code sandbox: runs untrusted code (a model's ```python block) against tests, `run_sandboxed`.

Model code is hostile: fork bombs, infinite loops, memory bombs, `os.kill(os.getppid(), 9)`, writes into
the repository, reads of the trainer's API keys and of the task's own data files, and, since its reward is
what a policy learns to raise, attacks on the tests themselves (replace `exec`, swallow AssertionError, return
an object equal to everything, read the tests from the runner's frames, forge the pass signal) and channels
to other runs (a key, a lock, a System V object left for a later sample). So the solution and the tests never
share an interpreter: the solution's serves calls, the tests' makes them through proxies, and only plain data
crosses (calls.py holds both programs and the protocol). This file starts them and watches; confine.py shuts
each one in.

Processes: the caller (the trainer); a disposable HARNESS (`python -I -c "import sandbox; ..."`, its own
session, an environment without the caller's variables; standard library only, so it starts fast), which
sets up isolation and watches; INIT, PID 1 of the run's PID namespace; the SOLUTION, forked by INIT into a
PID namespace nested in that one (it sees no process outside it) before the harness has even read the
tests, so no copy of them is in its memory; the TESTS, forked by the harness afterwards. The pass signal is
a random nonce that only the caller and the tests' process hold, written after the last test to a file
that only they hold. The layers (docs/rewards.md has them as a table, each with its test):
- namespaces: user (without root), network (a loopback device that is down), IPC (System V objects and POSIX
  queues exist only for the run), PID (killing INIT kills every process of the run, even ones that called
  setsid(); the solution can signal nothing outside), and a mount namespace per interpreter. Where one of
  them cannot be made, the sandbox refuses to run code (RuntimeError, one sentence): the layers below assume them.
- a root filesystem of its own (confine.py, then pivot_root): the system's /usr, /bin, /lib* and the
  Python standard library read-only at their own paths, with every site-packages/dist-packages directory
  covered by an empty one; /etc/ld.so.cache and /etc/localtime; /dev with null, zero, full, random,
  urandom; a /proc of its PID namespace; a private tmpfs on /tmp (also /dev/shm), CODE_TMPFS_MB of data and
  CODE_TMPFS_INODES files. No project tree, no data files, no home, no host /tmp, no other process.
- seccomp (confine.py: a filter compiled by libseccomp in the caller, loaded by each interpreter
  last): no socket() of any family, only AF_UNIX stream socket pairs; no keyrings; no System V IPC or POSIX
  queues; no file locks or leases (they show in the host's /proc/locks, OFD ones in every run's); no setsid()
  (each session is a scheduler group of its own); no memfd, io_uring, inotify/fanotify, userfaultfd, bpf,
  perf_event_open, new user namespaces; no other architecture's system calls.
- root: each interpreter switches to its own uid that no one else uses (2,000,000,000 + 2 x harness pid,
  +1 for the tests), no groups, so RLIMIT_NPROC (which root ignores) applies to it alone. Without root the
  user namespace gives RLIMIT_NPROC its own count (the code keeps the user's uid, but sees none of its files).
- time: the run's CPU time, all its processes together, is read every _POLL_S (`_run_cpu_s`) and the run
  ends at cpu_s of it, however busy the machine; a wall-clock limit (timeout_s) ends code that sleeps.
- always: its own session; rlimits CPU (cpu_s, then SIGKILL), address space (memory_mb), file size
  (CODE_FILE_MB, also caps the output), processes (nproc), open files, no core dumps; no_new_privs
  (setuid binaries do not elevate), no capabilities, parent-death SIGKILL; the tests' process and the
  harness are not dumpable (no process of the same uid may trace them or read their memory); environment
  = PATH, HOME and LANG only; stdin /dev/null; stdout+stderr of both interpreters to one unlinked file.

NOT contained (measured on Linux 6.18, as root): memory is bounded, not counted (no cgroup): per interpreter
nproc x memory_mb of address space, its tmpfs (CODE_TMPFS_MB, and about 1 KiB of kernel memory per inode), and
pipe buffers (kernel memory: 28 MiB held by one process at 64 open files; the kernel caps a uid at 64 MiB).
CPU: a process that lives less than _POLL_S and is reaped at once escapes the count of the run's CPU (the
wall-clock limit still ends the run), and the run's processes share the machine with the trainer's.
Readable: what the system's /usr holds (binaries, libraries, documentation; not its Python packages).
Linux only (namespaces, prctl, pidfd: kernel 5.3+); the seccomp filter needs pyseccomp and libseccomp.
"""

import ctypes
import json
import os
import select
import signal
import sys
import time

from calls import frame, receive, run_tests, serve
from confine import CLONE_NEWUSER, PR_SET_PDEATHSIG, confine, root_plan, seccomp_program, syscall_numbers

CODE_TIMEOUT_S = 10.0  # wall-clock limit of one run: ends code that sleeps or waits (s)
CODE_CPU_S = 5  # CPU time of one run, all its processes together, and of each process (s)
CODE_MEMORY_MB = 512  # address-space limit of each process (MiB); worst case total = nproc x this, per interpreter
CODE_NPROC = 16  # processes (and threads) each interpreter may have at once
CODE_FILE_MB = 16  # largest file (and total output) the code may write (MiB)
CODE_TMPFS_MB = 64  # size of each interpreter's private tmpfs (/tmp, /dev/shm) (MiB)
CODE_TMPFS_INODES = 4096  # files and directories in that tmpfs (the kernel spends about 1 KiB on each)
CODE_OUTPUT_CHARS = 4000  # stdout+stderr kept in the run's report: its head and tail, cut between (characters)
OUTPUT_CUT = "\n[... output cut ...]\n"  # stands where the middle of a longer output was cut
_POLL_S = 0.05  # how often the harness reads the run's CPU time (s)

_HERE = os.path.dirname(os.path.abspath(__file__))


def run_sandboxed(
    code: str,
    tests: str,
    *,
    setup: str = "",
    entry_point: str | None = None,
    functions: tuple[str, ...] = (),
    timeout_s: float = CODE_TIMEOUT_S,
    cpu_s: float = CODE_CPU_S,
    memory_mb: int = CODE_MEMORY_MB,
    nproc: int = CODE_NPROC,
    output_chars: int = CODE_OUTPUT_CHARS,
) -> dict:
    """Run untrusted `code` (after `setup`) in one sandboxed interpreter and `tests` (after `setup`, then
    `check(entry_point)` when given) in another, calling the code's functions across (see the module docstring).
    `functions`, without an entry point: the functions under test, bound for the tests even where they shadow a
    builtin (MBPP's `sum`); the code must define them. Returns {"passed", "status", "output", "isolation",
    "run_id"}. "status" is the tests' process's end ("exit 0", "exit 1", "timeout", "cpu time limit", ...);
    "output" is both interpreters' stdout+stderr, cut to `output_chars` (`cut_output`: head and tail, a marker
    between); "isolation" says which layers were active. PASSING means the tests ran to the end: the tests'
    process writes the nonce drawn here after the last one, and exits 0. RuntimeError (one sentence) where the
    sandbox cannot be built: code is never run with less."""
    import subprocess  # here, not at the top: the harness runs this file, and starts faster without them
    import tempfile

    nonce, run_id = os.urandom(16).hex(), os.urandom(8).hex()
    settings = {"timeout_s": timeout_s, "cpu_s": cpu_s, "memory_mb": memory_mb, "nproc": nproc}
    with (
        tempfile.TemporaryDirectory(prefix="nanorl-sandbox-") as workdir,
        tempfile.TemporaryFile() as report,
        tempfile.TemporaryFile() as output,
        tempfile.TemporaryFile() as result,
    ):
        # Two messages: the harness starts the solution's process after the first, before it reads the second.
        solution_part = {**settings, "code": code, "setup": setup, "staging": workdir, "result_fd": result.fileno()}
        solution_part |= {"seccomp": seccomp_program().hex(), "root": root_plan(), "syscalls": syscall_numbers()}
        solution_part |= {"file_mb": CODE_FILE_MB, "tmpfs_mb": CODE_TMPFS_MB, "tmpfs_inodes": CODE_TMPFS_INODES}
        tests_part = {"tests": tests, "entry_point": entry_point, "functions": list(functions), "nonce": nonce}
        # This file imported as a module (not run as a script, which would be compiled anew each time).
        start = f"import sys; sys.path[:0] = [{_HERE!r}]; import sandbox; del sys.path[0]; sandbox._harness_main()"
        cmd = [sys.executable, "-I", "-c", start]
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
        _feed_and_wait(proc, frame(solution_part) + frame(tests_part), timeout_s + 5)
        report.seek(0)
        result.seek(0)
        try:
            info = json.loads(report.read() or b"{}")
        except ValueError:  # the harness was killed mid-report
            info = {}
        if "refused" in info:
            raise RuntimeError(info["refused"])
        return {
            "passed": result.read(len(nonce) + 1) == nonce.encode() and info.get("status") == "exit 0",
            "status": info.get("status", f"harness failed ({proc.returncode})"),
            "output": _read_output(output, output_chars),
            "isolation": info.get("isolation", {}),
            "run_id": run_id,
        }


def cut_output(text: str, chars: int) -> str:
    """`text` if it has at most `chars` characters, else its first chars // 2 and its last chars - chars // 2
    with OUTPUT_CUT between them: whatever was cut, the marker says so, and both the start and the end of the
    output (a traceback's last line, a loop's last values) are kept."""
    if len(text) <= chars:
        return text
    return text[: chars // 2] + OUTPUT_CUT + text[len(text) - (chars - chars // 2) :]


def _read_output(file, chars: int) -> str:
    """`cut_output` of the output file (at most CODE_FILE_MB): of a long one only its first and last 4 x chars
    bytes are read, which hold at least `chars` characters each (a character is at most 4 bytes)."""
    size, window = os.fstat(file.fileno()).st_size, 4 * chars
    file.seek(0)
    if size <= 2 * window:
        return cut_output(file.read().decode(errors="replace"), chars)
    head = file.read(window).decode(errors="replace")
    file.seek(size - window)
    tail = file.read().decode(errors="replace")
    return head[: chars // 2] + OUTPUT_CUT + tail[len(tail) - (chars - chars // 2) :]


def _feed_and_wait(proc, request: bytes, timeout_s: float) -> None:
    """Write the request to the harness, wait up to `timeout_s` for it to exit (it enforces the run's own
    limit; this is a backstop), close its stdin (EOF: a harness still running kills the run and exits), and
    reap it, killed if it hangs. A pidfd wakes us at its exit; Popen.wait(timeout) polls with sleeps of up
    to 50 ms."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        proc.stdin.write(request)
        proc.stdin.flush()
        select.select([pidfd], [], [], timeout_s)
    except BrokenPipeError:
        pass  # the harness died: reaped below
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
        if not select.select([pidfd], [], [], 2)[0]:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(pidfd)
        proc.wait()


# ---------------------------------------------------------------- the harness

_CLONE_NEWPID, _CLONE_NEWNET, _CLONE_NEWIPC = 0x20000000, 0x40000000, 0x08000000
_PR_SET_DUMPABLE = 4


def _harness_main() -> None:
    """The disposable harness: isolate, start the solution's process (through INIT), read the tests, start
    the tests' process, watch it, kill the run, report JSON on stdout."""
    request = receive(0)  # the code and the settings only: the tests are still in the pipe
    if request is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    isolation = _isolate(libc)  # before the next line: a process that is not dumpable cannot write its uid_map
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # it will hold the tests: no process of the user may read them
    # Uids unique among running harnesses, above the ranges container hosts usually map.
    uids = (2_000_000_000 + 2 * os.getpid(), 2_000_000_001 + 2 * os.getpid()) if os.geteuid() == 0 else (None, None)
    calls, replies = os.pipe(), os.pipe()  # (read, write): the tests call, the solution replies
    isolation["pid_namespace"] = libc.unshare(_CLONE_NEWPID) == 0
    needed = ["net_namespace", "ipc_namespace", "pid_namespace"] + ([] if uids[0] else ["user_namespace"])
    if missing := [name for name in needed if not isolation[name]]:
        why = f"the code sandbox needs Linux namespaces that this machine refused ({', '.join(missing)})"
        json.dump(
            {"refused": why + ": run as root, or allow unprivileged user namespaces, to use code tasks"}, sys.stdout
        )
        sys.stdout.flush()
        os._exit(0)
    init = os.fork()
    if init == 0:
        _init_main(libc, request, uids[0], calls[0], replies[1])
    tests_part = receive(0)
    tests = os.fork() if tests_part is not None else None
    if tests == 0:
        _tests_main(libc, request, tests_part, uids[1], (replies[0], calls[1], request["result_fd"]))
    for fd in (*calls, *replies):
        os.close(fd)  # so that either side sees end of file when the other's process ends
    status = _watch(tests, init, request["cpu_s"], request["timeout_s"])
    # Kill before reaping: an unreaped child's pid cannot have been reused. INIT's death kills the whole run.
    for pid in (init, tests):
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    _, wait_status = os.waitpid(tests, 0) if tests is not None else (0, 0)
    os.waitpid(init, 0)
    if status == "exited":
        code = os.waitstatus_to_exitcode(wait_status)
        status = f"exit {code}" if code >= 0 else f"killed by signal {-code}"
    isolation |= {"mount_namespace": True, "seccomp": True}  # each interpreter has them, or does not run
    json.dump({"status": status, "isolation": isolation}, sys.stdout)
    sys.stdout.flush()
    os._exit(0)  # nothing to tear down: a disposable process


def _watch(tests: int | None, init: int, cpu_s: float, timeout_s: float) -> str:
    """Wait for the tests' process to end ("exited"), the run's CPU time to reach `cpu_s` ("cpu time limit"),
    the wall-clock deadline ("timeout"), or the caller closing our stdin (EOF: it is gone)."""
    if tests is None:
        return "trainer closed the harness"
    pidfd, seen = os.pidfd_open(tests), {}
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([pidfd, 0], [], [], min(_POLL_S, left))
        if ready:
            return "exited" if pidfd in ready else "trainer closed the harness"
        if _run_cpu_s((init, tests), seen) >= cpu_s:
            return "cpu time limit"
    return "timeout"


def _run_cpu_s(roots: tuple[int, ...], seen: dict) -> float:
    """CPU seconds used so far by the processes under `roots` (INIT and the tests' process: every process of the
    run descends from one of them; orphans are adopted by a PID 1 among them). `seen` keeps each process's last
    reading, by pid and start time, so the CPU of one that has ended still counts."""
    stack = list(roots)
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()  # after the command name, which may hold spaces
            for thread in os.listdir(f"/proc/{pid}/task"):  # a child's parent is the thread that forked it
                with open(f"/proc/{pid}/task/{thread}/children", "rb") as f:
                    stack += map(int, f.read().split())
        except (OSError, ValueError):  # it ended meanwhile
            continue
        # fields[11], [12]: utime, stime of all its threads (clock ticks); fields[19]: its start time
        seen[pid, fields[19]] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return sum(seen.values())


def _isolate(libc: ctypes.CDLL) -> dict:
    """Enter new user (without root), network and IPC namespaces; every process of the run inherits them. The
    PID namespace comes later (`_harness_main`, for the processes forked next), the mount namespaces in each
    interpreter (`confine`). Reports which were made."""
    iso = {"user_namespace": False, "uid_switch": os.geteuid() == 0}
    uid, gid = os.getuid(), os.getgid()
    if uid != 0 and libc.unshare(CLONE_NEWUSER) == 0:  # lets a plain user create the others
        # Map our ids to themselves (an unmapped owner cannot create files in the new tmpfs).
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        iso["user_namespace"] = True
    iso["net_namespace"] = libc.unshare(_CLONE_NEWNET) == 0
    iso["ipc_namespace"] = libc.unshare(_CLONE_NEWIPC) == 0
    return iso


def _init_main(libc: ctypes.CDLL, request: dict, uid: int | None, calls: int, replies: int) -> None:
    """INIT: PID 1 of the run's namespace (its death kills the run). It forks the solution's process into a
    namespace of its own, nested, so that the solution sees neither INIT nor the tests, then waits."""
    try:
        harness = os.getppid()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != harness:
            os._exit(3)
        if libc.unshare(_CLONE_NEWPID) != 0:
            os._exit(3)  # never run the solution where it could see the tests' process
        if os.fork() == 0:
            confine(libc, request, uid, (calls, replies))
            serve(request["setup"], request["code"])
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps orphans
        os.closerange(3, 1 << 16)
        while True:
            signal.pause()
    finally:  # INIT must never fall back into the harness's code
        os._exit(3)


def _tests_main(libc: ctypes.CDLL, request: dict, tests_part: dict, uid: int | None, fds) -> None:
    """The tests' process: confined like the solution's, and not dumpable, so that not even a process of its
    own uid can trace it."""
    try:
        nonce = tests_part.pop("nonce")
        confine(libc, request, uid, fds)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        run_tests(request["setup"], tests_part, nonce)
    finally:
        os._exit(3)
