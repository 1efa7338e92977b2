"""The code sandbox: runs untrusted code (a model's ```python block) against tests, `run_sandboxed`.

Model code is hostile: fork bombs, infinite loops, memory bombs, `os.kill(os.getppid(), 9)`,
writes into the repository, reads of the trainer's API keys. Three processes: the caller (the
trainer), a disposable HARNESS (`python -I sandbox.py --sandbox-harness RUN_ID`, its own session,
an environment without the caller's variables; this file imports only the standard library, so the
harness starts fast) and the CHILD the harness forks to run the code. The harness sets up
isolation, then watches the child: a wall-clock deadline and the caller closing the harness's stdin
(or dying) both kill it. The child is confined as follows, each layer applied only where the OS
allows (reported in "isolation"):
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
  A Python installed where other users cannot enter (pyenv under /root) stays importable: the
  private directory above it is covered by an empty read-only tmpfs, in which only the
  installation (read-only) reappears at its own path (`_expose_python`).
- always: its own session; rlimits CPU (cpu_s, then SIGKILL), address space (memory_mb), file
  size (CODE_FILE_MB, also caps the output), processes (nproc), open files, no core dumps;
  no_new_privs (setuid binaries do not elevate), parent-death SIGKILL; cwd = a fresh temp dir;
  environment = PATH, HOME and LANG only; stdin /dev/null; stdout+stderr to an unlinked file.
Afterwards the harness kills the child, and with it the namespace. Without a PID namespace it
also kills the child's process group and every process still carrying this run's marker in
/proc/*/environ.

NOT contained: world-readable files can be read; without a mount namespace, world-writable dirs
(/tmp, /dev/shm) are writable (and a privately installed Python cannot import after the uid
switch); without a PID namespace a process that calls setsid() and then exec()s with a fresh
environment escapes the cleanup, `kill(-1)` reaches every process of the user, and without a uid
switch either, /proc/<pid>/environ of the user's processes is readable; total memory is bounded
only by nproc x memory_mb (no cgroup); CPU time is shared with the trainer.
Linux only (namespaces, prctl, pidfd: kernel 5.3+).
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
import traceback

CODE_TIMEOUT_S = 10.0  # wall-clock limit of one run (s)
CODE_CPU_S = 5  # CPU-time limit of each process of the run (s)
CODE_MEMORY_MB = 512  # address-space limit of each process (MiB); worst case total = nproc x this
CODE_NPROC = 16  # processes (and threads) the code may have at once
CODE_FILE_MB = 16  # largest file (and total output) the code may write (MiB)
CODE_TMPFS_MB = 64  # size of each private tmpfs (/tmp, /dev/shm, the work dir) (MiB)
CODE_OUTPUT_BYTES = 4000  # tail of stdout+stderr kept in the run's report (bytes)

_HARNESS_FLAG = "--sandbox-harness"


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
    """Run untrusted `code`, then `tests`, in a sandbox (see the module docstring for what it isolates
    and how); returns {"passed", "status", "output", "isolation", "run_id"}. "output" is the tail
    (CODE_OUTPUT_BYTES) of the code's stdout+stderr; "isolation" says which layers were active.

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


# The harness and the child (run in `python -I sandbox.py --sandbox-harness RUN_ID`).

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
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
        if uid is not None and isolation["mount_namespace"] and (private := _private_ancestor(sys.base_prefix)):
            _expose_python(libc, private)
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
        os.umask(0o022)  # every directory on the way must be enterable by the uid
        os.makedirs(prefix, exist_ok=True)
    ok = ok and libc.mount(staged, prefix, None, _MS_MOVE, None) == 0
    ok = ok and libc.mount(None, private.encode(), None, _MS_REMOUNT | _MS_BIND | read_only, None) == 0
    if not ok:
        raise OSError(ctypes.get_errno(), f"could not expose Python at {sys.base_prefix}")
    os.rmdir(staged)


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


if __name__ == "__main__":
    if sys.argv[1:2] != [_HARNESS_FLAG] or len(sys.argv) != 3:
        sys.exit("sandbox.py is a library; `--sandbox-harness RUN_ID` is how run_sandboxed starts its harness.")
    _harness_main(sys.argv[2])
