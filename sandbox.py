"""The code sandbox: runs untrusted code (a model's ```python block) against tests, `run_sandboxed`.

Model code is hostile: fork bombs, infinite loops, memory bombs, `os.kill(os.getppid(), 9)`, writes into
the repository, reads of the trainer's API keys, and, since its reward is what a policy learns to raise,
attacks on the tests themselves (replace `exec`, swallow AssertionError, return an object equal to
everything, read the tests from the runner's frames, forge the pass signal). So the solution and the tests
never share an interpreter: the solution's serves calls, the tests' makes them through proxies, and only
plain data crosses (calls.py holds both programs and the protocol). This file starts and confines them.

Processes: the caller (the trainer); a disposable HARNESS (`python -I -c "import sandbox; ..."`, its own
session, an environment without the caller's variables; standard library only, so it starts fast), which
sets up isolation and watches; INIT, PID 1 of the run's PID namespace; the SOLUTION, forked by INIT into a
PID namespace nested in that one (it sees no process outside it) before the harness has even read the
tests, so no copy of them is in its memory; the TESTS, forked by the harness afterwards. The pass signal is
a random nonce that only the caller and the tests' process hold, written after the last test to a file
that only they hold. Each layer is applied where the OS allows (reported in "isolation"):
- PID namespaces (root, or a user namespace): killing INIT kills every process of the run, even ones
  that called setsid(); the solution can signal nothing outside its own namespace.
- network namespace: only a loopback device, which is down: no network at all.
- IPC namespace: System V objects and POSIX message queues exist only for the run.
- mount namespaces: every mount of the host read-only; each interpreter has a private tmpfs on /tmp
  (also bound on /dev/shm; CODE_TMPFS_MB in all) and, with a PID namespace, its own /proc.
- seccomp (x86-64, arm64; `_install_seccomp`): no AF_UNIX socket, so no path-named socket of the host
  (/run/...) can be reached; no memfd_create, System V shared memory or message queues (memory no
  address-space limit counts); no io_uring, no new user namespace, no other architecture's system calls.
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
Without a PID namespace the harness also kills every process still carrying this run's marker in
/proc/*/environ.

NOT contained (measured on Linux 6.18, as root): world-readable files can be read. Memory is bounded, not
counted (no cgroup): per interpreter nproc x memory_mb of address space, its CODE_TMPFS_MB tmpfs, and pipe
buffers (kernel memory: 28 MiB held by one process at 64 open files; the kernel caps a uid at 64 MiB).
CPU time is shared with the trainer, so a busy machine slows the runs (a slow run times out: 0).
Without seccomp (another architecture): memfd_create and System V memory are held outside the
address-space limit until the run ends, path-named sockets of the host can be connected to. Without a
mount namespace, world-writable dirs (/tmp, /dev/shm) are writable (and a privately installed Python
cannot import after the uid switch). Without a PID namespace, a process that calls setsid() and then
exec()s with a fresh environment escapes the cleanup and `kill(-1)` reaches every process of the user;
without the uid switch either (a plain user where user namespaces are off), the code runs as that user:
it can trace the trainer, which holds the tests and the nonce.
Linux only (namespaces, prctl, pidfd: kernel 5.3+).
"""

import ctypes
import errno
import fcntl
import json
import os
import re
import resource
import select
import signal
import sys

from calls import frame, receive, run_tests, serve

CODE_TIMEOUT_S = 10.0  # wall-clock limit of one run (s)
CODE_CPU_S = 5  # CPU-time limit of each process of the run (s)
CODE_MEMORY_MB = 512  # address-space limit of each process (MiB); worst case total = nproc x this, per interpreter
CODE_NPROC = 16  # processes (and threads) each interpreter may have at once
CODE_FILE_MB = 16  # largest file (and total output) the code may write (MiB)
CODE_TMPFS_MB = 64  # size of each interpreter's private tmpfs (/tmp, /dev/shm) (MiB)
CODE_OUTPUT_BYTES = 4000  # tail of stdout+stderr kept in the run's report (bytes)

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
        _feed_and_wait(proc, frame(solution_part) + frame(tests_part), timeout_s + 5)
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
    init = os.fork()
    if init == 0:
        _init_main(libc, request, isolation, uids[0], calls[0], replies[1])
    tests_part = receive(0)
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


# seccomp: the audit architecture and the system calls the filter looks at, by machine (numbers differ).
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYSCALLS = {  # name: (x86_64, aarch64)
    "socket": (41, 198),
    "socketpair": (53, 199),
    "unshare": (272, 97),
    "clone": (56, 220),
    "memfd_create": (319, 279),
    "shmget": (29, 194),
    "msgget": (68, 186),
}
_IO_URING_SETUP, _CLONE3, _X32_SYSCALL_BIT, _AF_UNIX, _SOCK_STREAM = 425, 435, 0x40000000, 1, 1
# ld [k], jeq #k, jge #k, jset #k (any bit of k set), and #k, ret #k
_BPF_LD, _BPF_JEQ, _BPF_JGE, _BPF_JSET, _BPF_AND, _BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
_SECCOMP_ALLOW, _SECCOMP_ERRNO = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ERRNO | errno


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _install_seccomp(libc: ctypes.CDLL) -> bool:
    """Refuse (EPERM) socket(AF_UNIX), AF_UNIX socket pairs other than stream ones (a datagram one can
    sendto() any path), memfd_create, shmget, msgget, io_uring_setup (io_uring opens sockets without a
    system call this filter sees), new user namespaces (unshare or clone with CLONE_NEWUSER: kernel surface
    a solution has no use for; clone3, whose flags a filter cannot read, gets ENOSYS, and C libraries fall
    back to clone) and every system call of another ABI. False on other machines."""
    machine = os.uname().machine
    if machine not in _AUDIT_ARCH:
        return False
    arch, column = _AUDIT_ARCH[machine], list(_AUDIT_ARCH).index(machine)
    nr = {name: numbers[column] for name, numbers in _SYSCALLS.items()}
    # (label, code, k, jump-if-true label, jump-if-false label); no label: the next one. Jumps go forward only.
    program = [
        ("", _BPF_LD, 4, "", ""),  # seccomp_data.arch
        ("", _BPF_JEQ, arch, "", "deny"),
        ("", _BPF_LD, 0, "", ""),  # seccomp_data.nr
        ("", _BPF_JGE, _X32_SYSCALL_BIT, "deny", ""),
        ("", _BPF_JEQ, nr["socket"], "socket", ""),
        ("", _BPF_JEQ, nr["socketpair"], "pair", ""),
        ("", _BPF_JEQ, nr["unshare"], "flags", ""),
        ("", _BPF_JEQ, nr["clone"], "flags", ""),
        ("", _BPF_JEQ, _CLONE3, "no such call", ""),
        *[("", _BPF_JEQ, n, "deny", "") for n in (nr["memfd_create"], nr["shmget"], nr["msgget"])],
        ("", _BPF_JEQ, _IO_URING_SETUP, "deny", "allow"),
        ("flags", _BPF_LD, 16, "", ""),  # args[0], the namespace flags of unshare and clone
        ("", _BPF_JSET, _CLONE_NEWUSER, "deny", "allow"),
        ("socket", _BPF_LD, 16, "", ""),  # args[0], the domain (low 32 bits, little-endian)
        ("", _BPF_JEQ, _AF_UNIX, "deny", "allow"),
        ("pair", _BPF_LD, 16, "", ""),
        ("", _BPF_JEQ, _AF_UNIX, "", "allow"),
        ("", _BPF_LD, 24, "", ""),  # args[1], the type, with SOCK_NONBLOCK/SOCK_CLOEXEC in its high bits
        ("", _BPF_AND, 0xF, "", ""),
        ("", _BPF_JEQ, _SOCK_STREAM, "allow", "deny"),
        ("no such call", _BPF_RET, _SECCOMP_ERRNO | errno.ENOSYS, "", ""),
        ("deny", _BPF_RET, _SECCOMP_ERRNO | errno.EPERM, "", ""),
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
            serve(request["setup"], request["code"])
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
        run_tests(request["setup"], tests_part, nonce)
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
                os.chmod(workdir, 0o711)  # which the uid may pass through
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
