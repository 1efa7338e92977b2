"""The code sandbox: runs untrusted code (a model's ```python block) against tests, `run_sandboxed`.

Model code is hostile: fork bombs, infinite loops, memory bombs, `os.kill(os.getppid(), 9)`, writes into
the repository, reads of the trainer's API keys, and, since its reward is what a policy learns to raise,
attacks on the tests themselves (replace `exec`, swallow AssertionError, return an object equal to
everything, read the tests from the caller's frames, forge the pass signal). So the solution and the tests
never share an interpreter:
- the SOLUTION's interpreter runs `setup` (e.g. HumanEval's prompt: its imports and helpers), then the
  code, then serves calls: it reads a call (a function name and arguments), runs it, writes the result;
- the TESTS' interpreter, started apart and never reachable from the solution's, runs `setup` itself,
  binds every function the solution defines to a proxy (and copies its plain-data globals), runs the
  tests (then `check(proxy of entry_point)` when given), and only then writes the run's pass signal.
Arguments, results and exceptions cross between the two as PLAIN DATA only: None, bool, int, float (nan
and inf included), complex, str, bytes, list, tuple, set, frozenset, dict, nested. The tests' side rebuilds them
from a tagged JSON form into exactly those types, so no object of the solution's (an `__eq__` that always
answers True) ever reaches the tests. Subclasses (Counter, namedtuple) cross as their plain base; an
exception of a builtin type (or a subclass: its builtin base) is raised again in the tests' interpreter
with the same arguments, so tests that expect one still work. Anything else ends the run as a failure at
once, out of reach of the tests' own `try`: a result that is not plain data (a generator, an iterator,
a class instance, a function), an argument that is not (a callback), SystemExit inside a call, a
malformed or oversized reply, the solution's process ending. Arguments are copies: a function that
mutates its argument in place is not seen to (call by value). A name the solution defines never
replaces a builtin (`abs`, `len`, ...) or anything `setup` defines in the tests' namespace.

Processes: the caller (the trainer); a disposable HARNESS (`python -I -c 'import sandbox; sandbox._harness_main()'`,
its own session, an environment without the caller's variables; this file imports only the standard
library, so it starts fast), which sets up isolation and watches; an INIT process, PID 1 of the run's
PID namespace; the SOLUTION, forked by INIT into a PID namespace nested in that one (it sees no process
outside it) before the harness has even read the tests, so no copy of them is in its memory; the TESTS,
forked by the harness afterwards. Each layer is applied where the OS allows (reported in "isolation"):
- PID namespaces (root, or a user namespace): killing INIT kills every process of the run, even ones
  that called setsid(); the solution is PID 1 of its own namespace and can signal nothing outside it.
- network namespace: only a loopback device, which is down: no network at all.
- IPC namespace: System V objects and POSIX message queues exist only for the run.
- mount namespaces: every mount of the host read-only; each interpreter has a private tmpfs on /tmp
  (also bound on /dev/shm; CODE_TMPFS_MB) and, with a PID namespace, its own /proc.
- seccomp (x86-64, arm64): socket(AF_UNIX), so no path-named socket of the host (/run/...) can be reached,
  and AF_UNIX socket pairs other than stream ones; memfd_create, System V shared memory and message queues
  (memory that no address-space limit counts); io_uring; every other architecture's system-call ABI.
  Each refused call fails with EPERM.
- root: each interpreter switches to its own uid that no one else uses (2,000,000,000 + 2 x harness pid,
  +1 for the tests), no groups, so RLIMIT_NPROC (which root ignores) applies to it alone, files not
  world-readable are unreadable and root-owned files unwritable. Without root, a user namespace gives
  RLIMIT_NPROC its own count, but the code keeps the user's file permissions (read-only by the remount).
  A Python installed where other users cannot enter (pyenv under /root) stays importable: the private
  directory above it is covered by an empty read-only tmpfs, in which only the installation (read-only)
  reappears at its own path (`_expose_python`).
- always: its own session; rlimits CPU (cpu_s, then SIGKILL), address space (memory_mb), file size
  (CODE_FILE_MB, also caps the output), processes (nproc), open files, no core dumps; no_new_privs
  (setuid binaries do not elevate), no capabilities, parent-death SIGKILL; the tests' process and the
  harness are not dumpable (no process of the same uid may trace them or read their memory); environment
  = PATH, HOME and LANG only; stdin /dev/null; stdout+stderr of both interpreters to one unlinked file.
The pass signal is a random nonce that only the caller and the tests' process hold, written to a file
that only they hold, after the last test. Without a PID namespace the harness also kills every process
still carrying this run's marker in /proc/*/environ.

NOT contained (measured on Linux 6.18 as root): world-readable files can be read. Memory is bounded, not
counted (no cgroup): nproc x memory_mb of address space per interpreter, plus its CODE_TMPFS_MB tmpfs.
CPU time is shared with the trainer. Without seccomp (another architecture), memfd_create and System V
memory are held outside the address-space limit until the run ends, and path-named sockets of the host
can be connected to. Without a mount namespace, world-writable dirs (/tmp, /dev/shm) are writable (and a
privately installed Python cannot import after the uid switch). Without a PID namespace, a process that
calls setsid() and then exec()s with a fresh environment escapes the cleanup and `kill(-1)` reaches
every process of the user; without the uid switch either (a plain user where user namespaces are off),
the code runs as that user: it can trace the trainer, which holds the tests and the nonce.
Not supported, by design: objects that are not plain data (the few MBPP rows whose test setup builds
trees of the solution's own class), in-place mutation of arguments, generator results, module objects.
Linux only (namespaces, prctl, pidfd: kernel 5.3+).
"""

import _thread
import builtins
import ctypes
import errno
import fcntl
import importlib
import json
import os
import re
import resource
import select
import signal
import sys

CODE_TIMEOUT_S = 10.0  # wall-clock limit of one run (s)
CODE_CPU_S = 5  # CPU-time limit of each process of the run (s)
CODE_MEMORY_MB = 512  # address-space limit of each process (MiB); worst case total = nproc x this, per interpreter
CODE_NPROC = 16  # processes (and threads) each interpreter may have at once
CODE_FILE_MB = 16  # largest file (and total output) the code may write (MiB)
CODE_TMPFS_MB = 64  # size of each interpreter's private tmpfs (/tmp, /dev/shm) (MiB)
CODE_OUTPUT_BYTES = 4000  # tail of stdout+stderr kept in the run's report (bytes)
CODE_MESSAGE_MB = 16  # largest message (the code, the tests, one call or one result) (MiB)
PLAIN_DEPTH = 100  # deepest nesting of containers that crosses between the interpreters

_HERE = os.path.dirname(os.path.abspath(__file__))


def run_sandboxed(
    code: str,
    tests: str,
    *,
    setup: str = "",
    entry_point: str | None = None,
    functions: tuple[str, ...] = (),
    timeout_s: float = CODE_TIMEOUT_S,
    cpu_s: int = CODE_CPU_S,
    memory_mb: int = CODE_MEMORY_MB,
    nproc: int = CODE_NPROC,
) -> dict:
    """Run untrusted `code` (after `setup`) in one sandboxed interpreter and `tests` (after `setup`, then
    `check(entry_point)` when given) in another, calling the code's functions across (see the module docstring).
    `functions`, without an entry point: the functions under test, bound for the tests even where they shadow a
    builtin (MBPP's `sum`); the code must define them. Returns {"passed", "status", "output", "isolation",
    "run_id"}. "status" is the tests' process's end ("exit 0", "exit 1", "timeout", ...); "output" is the tail
    (CODE_OUTPUT_BYTES) of both interpreters' stdout+stderr; "isolation" says which layers were active. PASSING
    means the tests ran to the end: the tests' process writes the nonce drawn here after the last one, and exits 0."""
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
        solution_part = {**settings, "code": code, "setup": setup, "workdir": workdir, "result_fd": result.fileno()}
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
        _feed_and_wait(proc, _frame(solution_part) + _frame(tests_part), timeout_s + 5)
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


# ---------------------------------------------------------------- plain data and messages


def to_plain(value: object, depth: int = 0) -> object:
    """`value` as tagged JSON: lists stay lists; a tuple is {"t": [...]}, a set {"s": [...]}, a frozenset
    {"f": [...]}, a dict {"d": [[key, value], ...]}, bytes {"b": hex}, a complex {"c": [real, imag]}, an int
    of over 10,000 bits {"i": hex} (JSON's decimal digits are capped). Subclasses go as their plain base.
    TypeError for anything else."""
    if depth > PLAIN_DEPTH:
        raise ValueError(f"containers nested deeper than {PLAIN_DEPTH}")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        return int.__int__(value) if value.bit_length() <= 10_000 else {"i": format(value, "x")}
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, complex):
        return {"c": [value.real, value.imag]}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes):
        return {"b": bytes.hex(value)}
    if isinstance(value, list):
        return [to_plain(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {"d": [[to_plain(k, depth + 1), to_plain(v, depth + 1)] for k, v in value.items()]}
    for kind, tag in ((tuple, "t"), (set, "s"), (frozenset, "f")):
        if isinstance(value, kind):
            return {tag: [to_plain(item, depth + 1) for item in value]}
    raise TypeError(f"{type(value).__name__} is not plain data")


_CONTAINERS = {"t": tuple, "s": set, "f": frozenset}


def from_plain(data: object, depth: int = 0) -> object:
    """The value `to_plain` encoded, built of exactly None/bool/int/float/complex/str/bytes/list/tuple/set/
    frozenset/dict; ValueError (or TypeError: an unhashable set item or dict key) for anything else. This side is
    strict, since the other side may be hostile."""
    if depth > PLAIN_DEPTH:
        raise ValueError(f"containers nested deeper than {PLAIN_DEPTH}")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [from_plain(item, depth + 1) for item in data]
    if type(data) is dict and len(data) == 1:
        ((tag, inner),) = data.items()
        if tag in ("i", "b") and type(inner) is str:
            return int(inner, 16) if tag == "i" else bytes.fromhex(inner)
        if tag == "c" and type(inner) is list and len(inner) == 2 and all(type(x) is float for x in inner):
            return complex(*inner)
        if tag in _CONTAINERS and type(inner) is list:
            return _CONTAINERS[tag](from_plain(item, depth + 1) for item in inner)
        if tag == "d" and type(inner) is list and all(type(pair) is list and len(pair) == 2 for pair in inner):
            return {from_plain(k, depth + 1): from_plain(v, depth + 1) for k, v in inner}
    raise ValueError(f"not plain data: {str(data)[:80]}")


def _frame(message: dict) -> bytes:
    """A message as 8 bytes of length, then JSON."""
    body = json.dumps(message).encode()
    return len(body).to_bytes(8, "big") + body


def _send(fd: int, message: dict) -> None:
    data = _frame(message)
    while data:
        data = data[os.write(fd, data) :]


def _receive(fd: int) -> dict | None:
    """The next message on `fd`; None at end of file; ValueError if it is malformed or over CODE_MESSAGE_MB."""
    header = _read_exactly(fd, 8)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > CODE_MESSAGE_MB << 20:
        raise ValueError(f"a message of {size} bytes, over the {CODE_MESSAGE_MB} MiB limit")
    message = json.loads(_read_exactly(fd, size) or b"null")
    if type(message) is not dict:
        raise ValueError("a message that is not a JSON object")
    return message


def _read_exactly(fd: int, size: int) -> bytes | None:
    """`size` bytes from `fd`, or None at end of file before the first byte; ValueError at end of file
    after it. Unbuffered: the harness must not read past the first message before it forks."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            if left == size:
                return None
            raise ValueError("end of file inside a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------- the harness and the confinement

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_CLONE_NEWIPC = 0x08000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_MOVE, _MS_REC, _MS_PRIVATE = 8192, 16384, 1 << 18
_MOUNT_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
    "strictatime": 1 << 24,
}
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
_CAPABILITY_VERSION_3 = 0x20080522


def _harness_main() -> None:
    """The disposable harness: isolate, start the solution's process (through INIT), read the tests, start
    the tests' process, watch it, kill the run, report JSON on stdout."""
    request = _receive(0)  # the code and the settings only: the tests are still in the pipe
    if request is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # it will hold the tests: no process of the user may read them
    isolation = _isolate(libc)
    # Uids unique among running harnesses, above the ranges container hosts usually map.
    uids = (2_000_000_000 + 2 * os.getpid(), 2_000_000_001 + 2 * os.getpid()) if os.geteuid() == 0 else (None, None)
    calls, replies = os.pipe(), os.pipe()  # (read, write): the tests call, the solution replies
    isolation["pid_namespace"] = libc.unshare(_CLONE_NEWPID) == 0
    init = os.fork()
    if init == 0:
        _init_main(libc, request, isolation, uids[0], calls[0], replies[1])
    tests_part = _receive(0)
    tests = os.fork() if tests_part is not None else None
    if tests == 0:
        _tests_main(libc, request, tests_part, isolation, uids[1], (replies[0], calls[1], request["result_fd"]))
    for fd in (*calls, *replies):
        os.close(fd)  # so that either side sees end of file when the other's process ends
    status = _watch(tests, request["timeout_s"])
    # Kill before reaping: an unreaped child's pid cannot have been reused.
    for pid in (init, tests):
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    if not isolation["pid_namespace"]:  # with one, INIT's death killed every process of the run
        _kill_leftovers(os.environ["NANORL_SANDBOX"])
    _, wait_status = os.waitpid(tests, 0) if tests is not None else (0, 0)
    os.waitpid(init, 0)
    if status == "exited":
        code = os.waitstatus_to_exitcode(wait_status)
        status = f"exit {code}" if code >= 0 else f"killed by signal {-code}"
    json.dump({"status": status, "isolation": isolation}, sys.stdout)
    sys.stdout.flush()
    os._exit(0)  # nothing to tear down: a disposable process


def _watch(tests: int | None, timeout_s: float) -> str:
    """Wait for the tests' process to end, the deadline, or the caller closing our stdin (EOF: it is gone)."""
    if tests is None:
        return "trainer closed the harness"
    pidfd = os.pidfd_open(tests)
    ready, _, _ = select.select([pidfd, 0], [], [], timeout_s)
    return "exited" if pidfd in ready else "trainer closed the harness" if ready else "timeout"


def _isolate(libc: ctypes.CDLL) -> dict:
    """Enter new namespaces where the OS allows and install the seccomp filter; every process of the run
    inherits them. The PID namespace comes later (`_harness_main`): it applies to the processes forked next."""
    iso = {"user_namespace": False, "uid_switch": os.geteuid() == 0}
    uid, gid = os.getuid(), os.getgid()
    if uid != 0 and libc.unshare(_CLONE_NEWUSER) == 0:  # lets a plain user create the others
        # Map our ids to themselves (an unmapped owner cannot create files in the new tmpfs).
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        iso["user_namespace"] = True
    iso["net_namespace"] = libc.unshare(_CLONE_NEWNET) == 0
    iso["ipc_namespace"] = libc.unshare(_CLONE_NEWIPC) == 0
    iso["mount_namespace"] = False
    # Mounts must be private BEFORE anything is mounted, or the mounts would appear on the host too.
    if libc.unshare(_CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0:
        iso["mount_namespace"] = _read_only_mounts(libc)
    iso["seccomp"] = libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 and _install_seccomp(libc)
    return iso


def _read_only_mounts(libc: ctypes.CDLL) -> bool:
    """Remount every mount read-only; True if / was."""
    root_read_only = False
    for line in open("/proc/self/mountinfo"):  # id parent dev root MOUNT_POINT OPTIONS ...
        fields = line.split()
        point = re.sub(r"\\(\d{3})", lambda m: chr(int(m[1], 8)), fields[4])
        # A remount must repeat the mount's nosuid/nodev/... flags (in a user namespace they are locked).
        flags = sum(_MOUNT_FLAGS.get(o, 0) for o in fields[5].split(","))
        ok = libc.mount(None, point.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags, None) == 0
        root_read_only |= ok and point == "/"
    return root_read_only


# seccomp: (audit architecture, {system call: number}) by machine; the numbers differ between architectures.
_SECCOMP_ABI = {
    "x86_64": (0xC000003E, {"socket": 41, "socketpair": 53, "shmget": 29, "msgget": 68, "memfd_create": 319}),
    "aarch64": (0xC00000B7, {"socket": 198, "socketpair": 199, "shmget": 194, "msgget": 186, "memfd_create": 279}),
}
_IO_URING_SETUP, _X32_SYSCALL_BIT, _AF_UNIX, _SOCK_STREAM = 425, 0x40000000, 1, 1
_BPF_LD, _BPF_JEQ, _BPF_JGE, _BPF_AND, _BPF_RET = 0x20, 0x15, 0x35, 0x54, 0x06  # ld [k], jeq #k, jge #k, and #k, ret #k
_SECCOMP_ALLOW, _SECCOMP_DENY = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO | EPERM


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _install_seccomp(libc: ctypes.CDLL) -> bool:
    """Refuse (EPERM) socket(AF_UNIX), AF_UNIX socket pairs other than stream ones (a datagram one can
    sendto() any path), memfd_create, shmget, msgget, io_uring_setup (io_uring opens sockets without a
    system call this filter sees) and every system call of another ABI. False on other machines."""
    if os.uname().machine not in _SECCOMP_ABI:
        return False
    arch, nr = _SECCOMP_ABI[os.uname().machine]
    # (label, code, k, jump-if-true label, jump-if-false label); no label: the next one. Jumps go forward only.
    program = [
        ("", _BPF_LD, 4, "", ""),  # seccomp_data.arch
        ("", _BPF_JEQ, arch, "", "deny"),
        ("", _BPF_LD, 0, "", ""),  # seccomp_data.nr
        ("", _BPF_JGE, _X32_SYSCALL_BIT, "deny", ""),
        ("", _BPF_JEQ, nr["socket"], "socket", ""),
        ("", _BPF_JEQ, nr["socketpair"], "pair", ""),
        *[("", _BPF_JEQ, n, "deny", "") for n in (nr["memfd_create"], nr["shmget"], nr["msgget"])],
        ("", _BPF_JEQ, _IO_URING_SETUP, "deny", "allow"),
        ("socket", _BPF_LD, 16, "", ""),  # args[0], the domain (low 32 bits, little-endian)
        ("", _BPF_JEQ, _AF_UNIX, "deny", "allow"),
        ("pair", _BPF_LD, 16, "", ""),
        ("", _BPF_JEQ, _AF_UNIX, "", "allow"),
        ("", _BPF_LD, 24, "", ""),  # args[1], the type, with SOCK_NONBLOCK/SOCK_CLOEXEC in its high bits
        ("", _BPF_AND, 0xF, "", ""),
        ("", _BPF_JEQ, _SOCK_STREAM, "allow", "deny"),
        ("deny", _BPF_RET, _SECCOMP_DENY, "", ""),
        ("allow", _BPF_RET, _SECCOMP_ALLOW, "", ""),
    ]
    at = {label: i for i, (label, *_) in enumerate(program) if label}
    jump = lambda i, label: at[label] - i - 1 if label else 0  # BPF jumps are forward offsets
    code = [_SockFilter(c, jump(i, t), jump(i, f), k) for i, (_, c, k, t, f) in enumerate(program)]
    prog = _SockFprog(len(code), (_SockFilter * len(code))(*code))
    return libc.prctl(_PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0) == 0  # 2: SECCOMP_MODE_FILTER


def _init_main(libc: ctypes.CDLL, request: dict, isolation: dict, uid: int | None, calls: int, replies: int) -> None:
    """INIT: PID 1 of the run's namespace (its death kills the run). It forks the solution's process into a
    namespace of its own, nested, so that the solution sees neither INIT nor the tests, then waits."""
    try:
        harness = os.getppid()
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != harness:
            os._exit(3)
        if isolation["pid_namespace"] and libc.unshare(_CLONE_NEWPID) != 0:
            os._exit(3)  # never run the solution where it could see the tests' process
        if os.fork() == 0:
            _confine(libc, request, isolation, uid, (calls, replies))
            _serve(request["setup"], request["code"])
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps orphans
        os.closerange(3, 1 << 16)
        while True:
            signal.pause()
    finally:  # INIT must never fall back into the harness's code
        os._exit(3)


def _tests_main(libc: ctypes.CDLL, request: dict, tests_part: dict, isolation: dict, uid: int | None, fds) -> None:
    """The tests' process: confined like the solution's, and not dumpable, so that not even a process of its
    own uid can trace it."""
    try:
        nonce = tests_part.pop("nonce")
        _confine(libc, request, isolation, uid, fds)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        _run_tests(request["setup"], tests_part, nonce)
    finally:
        os._exit(3)


def _confine(libc: ctypes.CDLL, request: dict, isolation: dict, uid: int | None, fds: tuple[int, ...]) -> None:
    """Confine this process (the solution's or the tests'): private mounts, `fds` moved to 3, 4, ...,
    rlimits, its own uid, no capabilities. Exits (3) rather than run anything half-confined."""
    try:
        os.setsid()  # its own session: a kill(0, ...) cannot reach the harness
        workdir = _private_mounts(libc, isolation, uid) if isolation["mount_namespace"] else request["workdir"]
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in fds]  # out of the way of the targets
        for target, fd in enumerate(high, 3):
            os.dup2(fd, target)
        os.dup2(2, 1)  # stdout and stderr both go to the output file
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.closerange(3 + len(fds), 1 << 16)
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
            if not isolation["mount_namespace"]:  # a directory of its own in the shared work dir
                workdir = os.path.join(workdir, str(uid))
                os.mkdir(workdir, 0o700)
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
    except OSError as e:  # a confinement step failed: never run anything half-confined
        os.write(2, f"sandbox setup failed: {e}\n".encode())
        os._exit(3)


def _private_mounts(libc: ctypes.CDLL, isolation: dict, uid: int | None) -> str:
    """A mount namespace of this process's own: a fresh tmpfs on /tmp (its directory .shm bound on /dev/shm),
    /proc of its PID namespace, the Python installation exposed to the uid. Returns the work dir, /tmp/work."""
    tmpfs_options = f"size={CODE_TMPFS_MB}m,mode=1777".encode()
    if libc.unshare(_CLONE_NEWNS) or libc.mount(b"tmpfs", b"/tmp", b"tmpfs", _MS_NOSUID | _MS_NODEV, tmpfs_options):
        raise OSError(ctypes.get_errno(), "could not mount a private /tmp")
    for path in ("/tmp/.shm", "/tmp/work"):
        os.mkdir(path)
        os.chmod(path, 0o1777)
    if os.path.isdir("/dev/shm") and libc.mount(b"/tmp/.shm", b"/dev/shm", None, _MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), "could not bind /dev/shm")
    if isolation["pid_namespace"] and libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None):
        raise OSError(ctypes.get_errno(), "could not mount /proc")
    if uid is not None and (private := _private_ancestor(sys.base_prefix)):
        _expose_python(libc, private)
    return "/tmp/work"


def _private_ancestor(path: str) -> str | None:
    """The top-most directory on the way to `path` that other users cannot enter (pyenv under /root:
    /root), or None if they can reach `path`."""
    found = None
    while path != "/":
        if not os.stat(path).st_mode & 0o001:  # no search permission for others
            found = path
        path = os.path.dirname(path)
    return found


def _expose_python(libc: ctypes.CDLL, private: str) -> None:
    """Let the unprivileged uid import this Python's standard library AT ITS OWN PATH: move the
    installation aside (a read-only bind mount, like every mount here), cover `private` with an
    empty tmpfs anyone may enter, make the installation's path again in it, move the installation
    back, and make the tmpfs read-only. The rest of `private` stays out of sight.
    The path must not change: the packages imported at interpreter startup (encodings, importlib,
    collections, ...) import their submodules from their own `__path__`, not from sys.path, so a
    copy elsewhere with a rewritten sys.path broke `"x".encode("cp1252")` (LookupError)."""
    prefix, staged, read_only = sys.base_prefix.encode(), b"/tmp/.python", _MS_RDONLY | _MS_NOSUID | _MS_NODEV
    os.makedirs(staged)
    ok = libc.mount(prefix, staged, None, _MS_BIND | _MS_REC, None) == 0
    ok = ok and libc.mount(b"tmpfs", private.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,mode=0755") == 0
    if ok:
        umask = os.umask(0o022)  # every directory on the way must be enterable by the uid
        os.makedirs(prefix, exist_ok=True)
        os.umask(umask)
    ok = ok and libc.mount(staged, prefix, None, _MS_MOVE, None) == 0
    ok = ok and libc.mount(None, private.encode(), None, _MS_REMOUNT | _MS_BIND | read_only, None) == 0
    if not ok:
        raise OSError(ctypes.get_errno(), f"could not expose Python at {sys.base_prefix}")
    os.rmdir(staged)


# ---------------------------------------------------------------- the solution's interpreter: a server of calls


def _serve(setup: str, code: str) -> None:
    """Run `setup`, then the code, then answer calls (fd 3) with results (fd 4) until end of file. First
    message: what the tests may bind (the code's functions and plain-data globals)."""
    send, receive, exit_now, stdout = _send, _receive, os._exit, sys.stdout  # the code may patch this module's
    scope = {"__name__": "solution"}  # not "__main__": a demo under `if __name__ == "__main__":` does not run
    try:
        exec(compile(setup, "setup.py", "exec"), scope)
        exec(compile(code, "solution.py", "exec"), scope)  # compiled apart: an open string cannot swallow setup
        reply = _exports(scope)
        while True:
            stdout.flush()  # before every reply: the run may be killed as soon as the tests end
            send(4, reply)
            if (call := receive(3)) is None:
                break
            reply = _answer(scope, call)
    except BaseException:  # the code failed to load, or the tests' side is gone: it is printed, the tests fail
        try:
            sys.__excepthook__(*sys.exc_info())
            sys.stdout.flush()
        finally:
            exit_now(1)
    exit_now(0)


def _exports(scope: dict) -> dict:
    """What the tests may bind, for every global that is not a dunder name: {"functions": names of callables,
    "modules": [[name, module name], ...], "values": [[name, plain value], ...]}; any other value is left out."""
    exports = {"functions": [], "modules": [], "values": []}
    for name, value in list(scope.items()):
        if name.startswith("__"):
            continue
        if type(value) is type(sys):
            exports["modules"].append([name, value.__name__])
        elif callable(value):
            exports["functions"].append(name)
        else:
            try:
                exports["values"].append([name, to_plain(value)])
            except (TypeError, ValueError, RecursionError):
                pass
    return exports


def _answer(scope: dict, call: dict) -> dict:
    """Run one call: {"value": plain result}, {"raise": builtin exception type, "args": plain args}, or
    {"fatal": why} (a result that is not plain data, or SystemExit or another BaseException)."""
    try:
        result = scope[call["name"]](*from_plain(call["args"]), **from_plain(call["kwargs"]))
    except Exception as e:
        return _exception_reply(e)
    except BaseException as e:
        return {"fatal": f"{call['name']} raised {type(e).__name__}"}
    try:
        return {"value": to_plain(result)}
    except (TypeError, ValueError, RecursionError):
        return {"fatal": f"{call['name']} returned a {type(result).__name__}, which is not plain data"}


def _exception_reply(e: Exception) -> dict:
    """The exception as its nearest builtin type (json.JSONDecodeError -> ValueError) and its arguments
    (its message alone when they are not plain data)."""
    name = next(c.__name__ for c in type(e).__mro__ if getattr(builtins, c.__name__, None) is c)
    try:
        args = to_plain(e.args)
    except (TypeError, ValueError, RecursionError):
        try:
            args = to_plain((str(e),))
        except Exception:
            args = to_plain(())
    return {"raise": name, "args": args}


# ---------------------------------------------------------------- the tests' interpreter


def _run_tests(setup: str, tests_part: dict, nonce: str) -> None:
    """exec `setup`, bind the solution's exports, exec the tests, call `check(entry_point)`; the nonce goes
    to fd 5 only if all of that finished."""
    scope, entry_point = {"__name__": "__main__"}, tests_part["entry_point"]
    try:
        exec(compile(setup, "setup.py", "exec"), scope)
        proxies = _bind(scope, [entry_point] if entry_point else tests_part["functions"])
        exec(compile(tests_part["tests"], "tests.py", "exec"), scope)
        if entry_point:
            scope["check"](proxies[entry_point])
    except BaseException:  # anything, SystemExit included, means the tests did not finish; it is printed
        try:
            sys.__excepthook__(*sys.exc_info())
            sys.stdout.flush()
        finally:
            os._exit(1)
    os.write(5, nonce.encode())
    try:
        sys.stdout.flush()  # os._exit skips the flush of buffered prints
    finally:
        os._exit(0)


def _bind(scope: dict, required: list[str]) -> dict:
    """Put the solution's exports into `scope`: its functions as proxies, its plain-data globals as copies,
    the standard-library modules it imported imported again here (trusted code, like the tests). Never
    under dunder names, names of builtins or names `setup` already defined, except the `required` names
    (the entry point, whose stub `setup` defines; MBPP's function under test named like a builtin, `sum`),
    which must be functions of the solution's. Returns {name: proxy}."""
    try:
        exports = _receive(3)
        if exports is None:
            _fail("the solution's code did not load (its traceback is above)")
        taken = (set(scope) | set(dir(builtins))) - set(required)
        free = lambda name: type(name) is str and not name.startswith("__") and name not in taken
        lock = _thread.allocate_lock()
        proxies = {name: _proxy(name, lock) for name in list(exports["functions"]) if free(name)}
        values = {name: from_plain(value) for name, value in list(exports["values"]) if free(name)}
        modules = {name: module for name, module in list(exports["modules"]) if free(name) and type(module) is str}
    except Exception as e:
        _fail(f"malformed exports from the solution ({type(e).__name__}: {e})")
    if missing := [name for name in required if name not in proxies]:
        _fail(f"the solution defines no function {', '.join(missing)}")
    for name, module in modules.items():
        if module.partition(".")[0] in sys.stdlib_module_names:
            try:
                values[name] = importlib.import_module(module)
            except Exception:  # not importable here: the name stays unbound
                pass
    scope.update(values, **proxies)
    return proxies


def _proxy(name: str, lock: _thread.LockType):
    """A function of the tests' interpreter that calls the solution's `name`: plain arguments out, a plain
    result (or a builtin exception) back. Anything else ends the run (`_fail`): the tests cannot catch it."""

    def call(*args, **kwargs):
        value, error = _call_solution(name, args, kwargs, lock)
        if error is not None:
            raise error
        return value

    call.__name__ = call.__qualname__ = name
    return call


def _call_solution(name: str, args: tuple, kwargs: dict, lock: _thread.LockType) -> tuple[object, Exception | None]:
    """(result, None) or (None, the exception the solution raised, rebuilt); `_fail` for anything else."""
    try:
        request = {"name": name, "args": to_plain(args), "kwargs": to_plain(kwargs)}
    except (TypeError, ValueError, RecursionError) as e:
        _fail(f"a test passed {name} an argument that is not plain data ({e})")
    try:
        with lock:
            _send(4, request)
            reply = _receive(3)
        if reply is None:
            _fail(f"the solution's process ended during a call of {name}")
        if "fatal" in reply:
            _fail(str(reply["fatal"])[:1000])
        return (from_plain(reply["value"]), None) if "value" in reply else (None, _rebuild_exception(reply))
    except Exception as e:  # a broken pipe, a malformed reply: the protocol's failure, never the tests' to catch
        _fail(f"a call of {name} failed ({type(e).__name__}: {str(e)[:200]})")


def _rebuild_exception(reply: dict) -> Exception:
    """The builtin exception a reply names, with its arguments; ValueError if it names anything else."""
    kind = getattr(builtins, str(reply["raise"]), None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        raise ValueError(f"not a builtin exception: {str(reply['raise'])[:80]}")
    return kind(*from_plain(reply["args"]))


def _fail(reason: str) -> None:
    """End the tests' process as a failure, past any `try` in the tests."""
    try:
        sys.stdout.flush()
        os.write(2, f"sandbox: {reason}\n".encode(errors="replace"))
    finally:
        os._exit(1)


def _kill_leftovers(run_id: str) -> None:
    """Kill every process whose environment carries this run's marker (inherited by all forks; exec with a
    fresh environment drops it). Only without a PID namespace: with one, the processes of the run mounted
    their own /proc and these pids would mean other processes."""
    marker = f"NANORL_SANDBOX={run_id}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read():
                        os.kill(int(entry), signal.SIGKILL)
            except OSError:  # gone meanwhile, or not ours to read or kill
                pass
