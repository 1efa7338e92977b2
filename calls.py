"""Calls from the tests' interpreter to the solution's: the two programs the sandbox runs (sandbox.py
starts them, confine.py shuts each in), and the plain data that is all that crosses between them.

The SOLUTION's program (`serve`) runs `setup` (e.g. HumanEval's prompt: its imports and helpers), then the
code, then sends what the tests may bind (its functions' names, its plain-data globals, the standard modules
it imported), then answers calls: a function name and arguments in, a result or an exception out. The TESTS'
program (`run_tests`) runs `setup` itself, binds every function the solution defines to a proxy (never under
a builtin's name, a dunder name or a name `setup` defined, save the functions under test: the entry point,
MBPP's `sum`), runs the tests, calls `check(proxy of entry_point)` when given, and only then writes the run's
pass signal. So nothing the solution does reaches the tests but the values it returns.

Arguments, results and exceptions cross as PLAIN DATA only: None, bool, int, float (nan and inf included),
complex, str, bytes, list, tuple, set, frozenset, dict, nested (`to_plain`). The tests' side rebuilds them
from a tagged JSON form into exactly those types (`from_plain`), so no object of the solution's (an `__eq__`
that always answers True) ever reaches the tests. Subclasses (Counter, namedtuple) cross as their plain
base; an exception of a builtin type (or a subclass: its builtin base) is raised again in the tests'
interpreter with the same arguments, so tests that expect one still work. Anything else ends the run as a
failure at once, out of reach of the tests' own `try` (`fail`): a result that is not plain data (a
generator, an iterator, a class instance, a function), an argument that is not (a callback), SystemExit
or StopIteration inside a call (the latter, through `map` or `zip`, would end a loop of tests early), a
malformed or oversized reply, the solution's process ending. Arguments are copies: a
function that mutates its argument in place is not seen to (call by value). Not supported, by design:
objects that are not plain data (so the few MBPP rows whose test setup builds trees of the solution's own
class fail), in-place mutation of arguments, generator results.

File descriptors: the solution reads calls on 3 and replies on 4; the tests read replies on 3, call on 4
and write the pass signal on 5. Standard library only: the sandbox's harness imports this at its start.
"""

import _thread
import builtins
import importlib
import json
import os
import sys

MESSAGE_MB = 16  # largest message (the code, the tests, one call or one result) (MiB)
PLAIN_DEPTH = 100  # deepest nesting of containers that crosses between the interpreters
VALUE_MB = 1  # largest global of the solution's copied into the tests' namespace (MiB of JSON)
_ENDS_ITERATION = (StopIteration, StopAsyncIteration)


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


def frame(message: dict) -> bytes:
    """A message as 8 bytes of length, then JSON."""
    body = json.dumps(message).encode()
    return len(body).to_bytes(8, "big") + body


def send(fd: int, message: dict) -> None:
    data = frame(message)
    while data:
        data = data[os.write(fd, data) :]


def receive(fd: int) -> dict | None:
    """The next message on `fd`; None at end of file; ValueError if it is malformed or over MESSAGE_MB."""
    header = _read_exactly(fd, 8)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > MESSAGE_MB << 20:
        raise ValueError(f"a message of {size} bytes, over the {MESSAGE_MB} MiB limit")
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


# ---------------------------------------------------------------- the solution's interpreter: a server of calls


def serve(setup: str, code: str) -> None:
    """Run `setup`, then the code, then answer calls (fd 3) with results (fd 4) until end of file. First
    message: what the tests may bind (the code's functions and plain-data globals)."""
    scope = {"__name__": "solution"}  # not "__main__": a demo under `if __name__ == "__main__":` does not run
    try:
        exec(compile(setup, "setup.py", "exec"), scope)
        exec(compile(code, "solution.py", "exec"), scope)  # compiled apart: an open string cannot swallow setup
        reply = _exports(scope)
        while True:
            sys.stdout.flush()  # before every reply: the run may be killed as soon as the tests end
            send(4, reply)
            if (call := receive(3)) is None:
                break
            reply = _answer(scope, call)
    except BaseException:  # the code failed to load, or the tests' side is gone: it is printed, the tests fail
        try:
            sys.__excepthook__(*sys.exc_info())
            sys.stdout.flush()
        finally:
            os._exit(1)
    os._exit(0)


def _exports(scope: dict) -> dict:
    """What the tests may bind, for every global that is not a dunder name: {"functions": names of callables,
    "modules": [[name, module name], ...], "values": [[name, plain value], ...]}; a value that is not plain
    data, or takes over VALUE_MB (a precomputed table, which the tests do not read), is left out."""
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
                plain = to_plain(value)
            except (TypeError, ValueError, RecursionError):
                continue
            if len(json.dumps(plain)) <= VALUE_MB << 20:
                exports["values"].append([name, plain])
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


def run_tests(setup: str, tests_part: dict, nonce: str) -> None:
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
        exports = receive(3)
        if exports is None:
            fail("the solution's code did not load (its traceback is above)")
        taken = (set(scope) | set(dir(builtins))) - set(required)
        free = lambda name: type(name) is str and not name.startswith("__") and name not in taken
        lock = _thread.allocate_lock()
        proxies = {name: _proxy(name, lock) for name in list(exports["functions"]) if free(name)}
        values = {name: from_plain(value) for name, value in list(exports["values"]) if free(name)}
        modules = {name: module for name, module in list(exports["modules"]) if free(name) and type(module) is str}
    except Exception as e:
        fail(f"malformed exports from the solution ({type(e).__name__}: {e})")
    if missing := [name for name in required if name not in proxies]:
        fail(f"the solution defines no function {', '.join(missing)}")
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
    result (or a builtin exception) back. Anything else ends the run (`fail`): the tests cannot catch it."""

    def call(*args, **kwargs):
        value, error = _call_solution(name, args, kwargs, lock)
        if error is not None:
            raise error
        return value

    call.__name__ = call.__qualname__ = name
    return call


def _call_solution(name: str, args: tuple, kwargs: dict, lock: _thread.LockType) -> tuple[object, Exception | None]:
    """(result, None) or (None, the exception the solution raised, rebuilt); `fail` for anything else."""
    try:
        request = {"name": name, "args": to_plain(args), "kwargs": to_plain(kwargs)}
    except (TypeError, ValueError, RecursionError) as e:
        fail(f"a test passed {name} an argument that is not plain data ({e})")
    try:
        with lock:
            send(4, request)
            reply = receive(3)
        if reply is None:
            fail(f"the solution's process ended during a call of {name}")
        if "fatal" in reply:
            fail(str(reply["fatal"])[:1000])
        return (from_plain(reply["value"]), None) if "value" in reply else (None, _rebuild_exception(reply))
    except Exception as e:  # a broken pipe, a malformed reply: the protocol's failure, never the tests' to catch
        fail(f"a call of {name} failed ({type(e).__name__}: {str(e)[:200]})")


def _rebuild_exception(reply: dict) -> Exception:
    """The builtin exception a reply names, with its arguments; ValueError if it names anything else, or
    StopIteration (raised through `map` or `zip` it would end the tests' loop early, as if all had passed)."""
    kind = getattr(builtins, str(reply["raise"]), None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)) or issubclass(kind, _ENDS_ITERATION):
        raise ValueError(f"not an exception that may cross: {str(reply['raise'])[:80]}")
    return kind(*from_plain(reply["args"]))


def fail(reason: str) -> None:
    """End the tests' process as a failure, past any `try` in the tests."""
    try:
        sys.stdout.flush()
        os.write(2, f"sandbox: {reason}\n".encode(errors="replace"))
    finally:
        os._exit(1)
