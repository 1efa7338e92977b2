"""What code run in the sandbox could leave on the host after its run, listed so that a test session can compare
before and after (tests/conftest.py): keys and keyrings of the sandbox's uids, System V objects, processes that
outlived their run, the runs' temp dirs, mounts."""

import os
import tempfile
import time
from pathlib import Path

SANDBOX_UIDS = 2_000_000_000  # sandbox.py gives each interpreter a uid from here up: 2e9 + 2 x harness pid (+1)


def residue() -> set[str]:
    """One line per thing on the host that belongs to a sandbox run: "key-user UID" (/proc/key-users: the
    uid holds keys, or keyrings, which the kernel keeps after its processes end), "sysv KIND ID" (a System V
    object a sandbox uid made), "process PID" (a process of a sandbox uid whose harness is gone, or a harness
    of this process's), "temp PATH", "mount PATH" (a mount point of this process's mount namespace)."""
    found = set()
    for line in Path("/proc/key-users").read_text().splitlines():
        if int(line.split(":")[0]) >= SANDBOX_UIDS:
            found.add(f"key-user {line.split(':')[0]}")
    for kind in ("sem", "shm", "msg"):
        header, *rows = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        names = header.split()
        for row in rows:
            fields = dict(zip(names, row.split()))
            if int(fields["cuid"]) >= SANDBOX_UIDS or int(fields["uid"]) >= SANDBOX_UIDS:
                found.add(f"sysv {kind} {fields['key']}")
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:  # gone meanwhile
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        uid, parent = int(fields["Uid"].split()[0]), int(fields["PPid"])
        harness = (uid - SANDBOX_UIDS) // 2
        if uid >= SANDBOX_UIDS and not Path(f"/proc/{harness}/environ").exists():
            found.add(f"process {entry} (uid {uid}, its harness {harness} is gone)")
        if b"NANORL_SANDBOX=" in environ and parent == os.getpid():
            found.add(f"process {entry} (a harness still running)")
    found |= {f"temp {path}" for path in Path(tempfile.gettempdir()).glob("nanorl-sandbox-*")}
    found |= {f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    return found


def new_residue(before: set[str], settle_s: float = 2.0) -> set[str]:
    """What `residue` finds that was not there `before`, given up to `settle_s` for runs still ending."""
    deadline = time.monotonic() + settle_s
    while (left := residue() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def key_users() -> set[int]:
    """The sandbox uids that hold keys or keyrings (/proc/key-users)."""
    uids = {int(line.split(":")[0]) for line in Path("/proc/key-users").read_text().splitlines()}
    return {uid for uid in uids if uid >= SANDBOX_UIDS}


def remove_keys(uid: int) -> None:
    """Invalidate every key and keyring of `uid` (as root: from a child that becomes `uid`), so that the kernel
    frees them: what a failed containment left. By serial number only: looking up the user keyring makes it anew."""
    import ctypes

    import pyseccomp

    keyctl = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "keyctl")
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            libc = ctypes.CDLL(None, use_errno=True)
            for line in Path("/proc/keys").read_text().splitlines():
                if line.split()[5] == str(uid):
                    libc.syscall(keyctl, 21, int(line.split()[0], 16))  # KEYCTL_INVALIDATE
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
