"""The code sandbox against hostile programs: each must score 0 (or be harmless), the test process
must survive, and no process may be left behind. Dangerous cases first check that the layer that
contains them is active on this machine, and skip otherwise."""

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rewards import code_reward, code_rewards
from sandbox import CODE_OUTPUT_BYTES, _private_ancestor, run_sandboxed

FAST = {"timeout_s": 2.0, "cpu_s": 2}


def run(code: str, tests: str = "pass", **kwargs) -> dict:
    return run_sandboxed(code, tests, **{**FAST, **kwargs})


def processes_with(text: str) -> list[int]:
    """Pids (other than ours) whose command line or environment contains `text`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            for name in ("cmdline", "environ"):
                try:
                    data = Path(f"/proc/{entry}/{name}").read_bytes()
                except OSError:
                    continue
                if text.encode() in data:
                    found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def isolation() -> dict:
    report = run("pass")
    assert report["passed"], report
    return report["isolation"]


def test_correct_code_passes_and_wrong_fails() -> None:
    """Guards against a sandbox that fails everything (or passes everything)."""
    good = run("def add(a, b):\n    return a + b", "assert add(2, 3) == 5\nassert add(-1, 1) == 0")
    assert good["passed"] and good["status"] == "exit 0"
    bad = run("def add(a, b):\n    return a - b", "assert add(2, 3) == 5")
    assert not bad["passed"] and "AssertionError" in bad["output"]


def test_code_reward_entry_point_and_list_tests() -> None:
    """Guards against HumanEval-style `check(candidate)` tests never being called, and MBPP-style
    test lists not being joined."""
    completion = "<think>easy</think>```python\ndef inc(x):\n    return x + 1\n```"
    check = "def check(candidate):\n    assert candidate(1) == 2"
    assert code_reward(completion, {"tests": check, "entry_point": "inc"}) == 1.0
    assert code_reward(completion, {"tests": "def check(c):\n    assert c(1) == 3", "entry_point": "inc"}) == 0.0
    assert code_reward(completion, {"tests": ["assert inc(1) == 2", "assert inc(2) == 3"]}) == 1.0
    assert code_reward(completion, {"tests": ["assert inc(1) == 2", "assert inc(2) == 4"]}) == 0.0


def test_sandbox_codecs_importable() -> None:
    """Guards against the issue where `"x".encode("cp1252")` / `"idna"` raised LookupError in the
    sandbox (the uid switch left a pyenv Python reachable only by a rewritten sys.path, while the
    `encodings` package, imported at startup, looks for its codec modules under its own old path),
    so a correct solution scored 0; and against other standard-library modules (submodules of
    packages loaded at startup included) failing to import."""
    completion = (
        "<think>codecs</think>```python\n"
        "import json, decimal, fractions, unicodedata, importlib.metadata, collections.abc, ctypes.util\n"
        "def encode(s, codec):\n    return s.encode(codec)\n"
        "def describe(c):\n    return json.dumps([unicodedata.name(c), str(decimal.Decimal('1.10') + 1), "
        "str(fractions.Fraction(1, 3))])\n```"
    )
    tests = [
        "assert encode('caf\u00e9', 'cp1252') == b'caf\\xe9'",
        "assert encode('b\u00fccher.de', 'idna') == b'xn--bcher-kva.de'",
        "assert encode('\u00e9', 'latin-1') == b'\\xe9' and encode('\u00e9', 'utf-16-le') == b'\\xe9\\x00'",
        "assert json.loads(describe('\u00e9')) == ['LATIN SMALL LETTER E WITH ACUTE', '2.10', '1/3']",
    ]
    assert code_reward(completion, {"tests": tests}) == 1.0


def test_exposed_python_shows_nothing_else(isolation: dict) -> None:
    """Guards against the way a privately installed Python (pyenv under /root) is made importable
    opening what hides it: in the private directory only the path to the installation may be
    visible, and the installation must stay read-only."""
    private = _private_ancestor(sys.base_prefix)
    if not (private and isolation.get("uid_switch") and isolation.get("mount_namespace")):
        pytest.skip("the Python installation is not exposed on this machine")
    first = os.path.relpath(sys.base_prefix, private).split(os.sep)[0]
    code = (
        f"import os\nassert os.listdir({private!r}) == [{first!r}], os.listdir({private!r})\n"
        f"for d in [{private!r}, {sys.base_prefix!r}, os.path.dirname(os.__file__)]:\n"
        "    try:\n        open(os.path.join(d, 'pwned'), 'w')\n        print('WROTE', d)\n"
        "    except OSError:\n        pass\n"
    )
    report = run(code)
    assert report["passed"] and "WROTE" not in report["output"], report


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos._exit(0)",  # exit 0 before the tests
        "import sys\nsys.exit(0)",
        "raise SystemExit(0)",
        'x = """',  # try to swallow the tests into a string
        "import os\nos.write(3, b'0' * 32)\nos._exit(0)",  # forge the nonce channel without the nonce
        "def f(): return 1\n\x00",  # NUL byte in the source
    ],
)
def test_not_finishing_the_tests_fails(code: str) -> None:
    """Guards against rewarding a zero exit instead of tests that ran to the end."""
    report = run(code, "assert False, 'the tests ran'")
    assert not report["passed"]
    assert not run(code, "pass")["passed"]


def test_infinite_loop_times_out() -> None:
    """Guards against a hung program stalling training past the wall-clock limit."""
    start = time.perf_counter()
    report = run("while True:\n    pass", timeout_s=1.0, cpu_s=10)
    assert not report["passed"] and report["status"] == "timeout"
    assert time.perf_counter() - start < 3.0


def test_cpu_limit_kills() -> None:
    """Guards against RLIMIT_CPU not applying (e.g. ignored by a PID-1 child), in either interpreter: the
    tests' process is killed by it, and a solution spinning at load ends the run long before the deadline."""
    start = time.perf_counter()
    report = run("def f():\n    return 1", "while True:\n    pass", timeout_s=8.0, cpu_s=1)
    assert report["status"] == "killed by signal 9"
    spinning = run("while True:\n    pass", "pass", timeout_s=8.0, cpu_s=1)
    assert spinning["status"] == "exit 1" and "did not load" in spinning["output"]
    assert time.perf_counter() - start < 8.0


def test_memory_bomb_is_contained() -> None:
    """Guards against a missing address-space limit (a 4 GiB allocation must fail at once), and a
    limit too tight for ordinary programs (50 MB must work)."""
    start = time.perf_counter()
    assert not run("b = bytearray(4 << 30)")["passed"]
    assert not run("xs = []\nwhile True:\n    xs.append(bytearray(1 << 24))", memory_mb=128)["passed"]
    assert run("b = bytearray(50 << 20)")["passed"]
    assert time.perf_counter() - start < 4.0


def test_process_limit_bounded_fork() -> None:
    """Guards against RLIMIT_NPROC not applying (root ignores it, hence the uid switch or user
    namespace): a BOUNDED loop of 40 forks must be stopped at the limit of 16 processes."""
    code = (
        "import os, time\nn = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
        "    n += 1\nprint('forked', n)"
    )
    report = run(code, nproc=16)
    assert report["passed"], report
    forked = int(report["output"].split("forked")[1])
    assert 10 <= forked < 16


def test_fork_bomb_is_contained() -> None:
    """Guards against a fork bomb taking the machine down or surviving the run. Runs only after a
    bounded probe shows the process limit holds here."""
    probe = run(
        "import os\nn = 0\nfor _ in range(30):\n    try:\n        if os.fork() == 0:\n"
        "            import time; time.sleep(3); os._exit(0)\n        n += 1\n    except OSError:\n"
        "        break\nprint('forked', n)",
        nproc=8,
    )
    if not (probe["passed"] and int(probe["output"].split("forked")[1]) < 8):
        pytest.skip(f"the process limit does not hold here: {probe}")
    start = time.perf_counter()
    report = run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", nproc=8, timeout_s=1.5
    )
    assert not report["passed"]
    assert time.perf_counter() - start < 4.0
    assert processes_with(f"NANORL_SANDBOX={report['run_id']}") == []


def test_no_process_left_behind(isolation: dict) -> None:
    """Guards against leaked processes: a forked Python child and (with a PID namespace; without
    one it escapes, as documented) a detached `sleep` with a fresh environment must be dead when
    run_sandboxed returns."""
    token = "nanorl-leftover-" + secrets.token_hex(6)
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\n"
    if isolation.get("pid_namespace"):
        code += f"if os.fork() == 0:\n    os.setsid()\n    os.execve('/bin/sleep', ['{token}', '60'], {{}})\n"
    report = run(code + "time.sleep(0.3)\n")
    assert report["passed"], report
    assert processes_with(f"NANORL_SANDBOX={report['run_id']}") == []
    assert processes_with(token) == []


def test_filesystem_outside_workdir_is_protected(tmp_path: Path, isolation: dict) -> None:
    """Guards against code writing outside its temp dir: into the repository, into a directory of
    the test's own, or (with a mount namespace) into the host's /tmp. Without a mount namespace or
    the uid switch the code has the user's own permissions (documented), so there is nothing to test."""
    if not (isolation.get("mount_namespace") or isolation.get("uid_switch")):
        pytest.skip("no layer protects the filesystem here")
    targets = [Path(__file__).parent / f"pwned-{secrets.token_hex(4)}", tmp_path / "pwned"]
    if isolation.get("mount_namespace"):  # without it world-writable dirs stay writable (documented)
        targets.append(Path("/tmp") / f"nanorl-pwned-{secrets.token_hex(4)}")
    code = "import os\n" + "".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n    print(e)\n" for t in targets
    )
    code += "open('inside.txt', 'w').write('ok')\nassert open('inside.txt').read() == 'ok'\n"
    try:
        report = run(code)
        assert report["passed"], report  # the work dir itself is writable
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


def test_parent_environment_is_not_visible(monkeypatch: pytest.MonkeyPatch, isolation: dict) -> None:
    """Guards against leaking the trainer's secrets (API keys in the environment) to the code:
    through an inherited os.environ, or (where a PID namespace or the uid switch hides other
    processes) through /proc/<pid>/environ of a process started with the secret."""
    secret = "nanorl-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("NANORL_TEST_SECRET", secret)
    bystander = subprocess.Popen(["sleep", "30"])  # inherits the secret at exec time, so /proc shows it
    try:
        others = "[p for p in os.listdir('/proc') if p.isdigit()] + " + str([bystander.pid, os.getpid()])
        if not (isolation.get("pid_namespace") or isolation.get("uid_switch")):
            others = "[]"  # same uid, same PID namespace: other processes' environ is readable (documented)
        code = (
            f"import os\nseen = str(dict(os.environ))\n"
            f"for pid in {others} + ['self']:\n"
            "    try:\n        seen += open(f'/proc/{pid}/environ', 'rb').read().decode('latin-1')\n"
            "    except OSError:\n        pass\n"
            f"print('FOUND' if {secret!r} in seen else 'CLEAN')\n"
        )
        report = run(code)
        assert report["passed"], report
        assert "CLEAN" in report["output"]
        assert secret.encode() in Path(f"/proc/{bystander.pid}/environ").read_bytes()  # the probe could find it
    finally:
        bystander.kill()
        bystander.wait()


def test_killing_the_parent_does_not_reach_the_trainer(isolation: dict) -> None:
    """Guards against code killing the process that runs it: the trainer must survive
    `os.kill(os.getppid(), 9)` and `os.killpg(0, 9)`, and so must a bystander process of ours;
    with a PID namespace also `kill(-1, 9)` (everything the code may signal)."""
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        for code in ["import os\nos.kill(os.getppid(), 9)", "import os\nos.killpg(0, 9)"]:
            assert isinstance(run(code, "pass"), dict)
        if isolation.get("pid_namespace"):  # the code checks too: it is PID 1 of its own namespace
            assert isinstance(run("import os\nif os.getpid() == 1:\n    os.kill(-1, 9)"), dict)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_huge_output_is_capped() -> None:
    """Guards against 100 MB of output filling memory or disk: the file-size limit stops it and
    only a tail comes back."""
    start = time.perf_counter()
    report = run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))")
    assert not report["passed"]
    assert len(report["output"]) <= CODE_OUTPUT_BYTES
    assert time.perf_counter() - start < 3.0


def test_no_network(isolation: dict) -> None:
    """Guards against code reaching the network (loopback included) where a network namespace exists."""
    if not isolation.get("net_namespace"):
        pytest.skip("no network namespace on this machine")
    code = (
        "import socket\nfor addr in [('127.0.0.1', 22), ('1.1.1.1', 53)]:\n    s = socket.socket()\n"
        "    s.settimeout(0.5)\n    try:\n        s.connect(addr)\n        print('CONNECTED')\n"
        "    except OSError:\n        pass\n"
    )
    report = run(code)
    assert report["passed"] and "CONNECTED" not in report["output"], report


def test_code_rewards_parallel_in_order() -> None:
    """Guards against the pool mixing up which completion got which result."""
    completions = [f"```python\nx = {i}\n```" for i in range(6)]
    examples = [{"tests": f"assert x == {i if i % 2 else -1}"} for i in range(6)]
    assert code_rewards(completions, examples, max_workers=3) == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
