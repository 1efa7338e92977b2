"""cli.py: turn a config dataclass into a command line, so every default lives in one place.

Each dataclass field becomes `--kebab-case` with its type taken from the default (None: text, unset
unless typed), booleans get `--flag/--no-flag`, and the help text is the field's trailing comment in
the source; `# -- family` comments group the flags in --help, and a `CHOICES` class attribute lists
the values of choice flags. Unknown flags are an error. `parse_config` also reports which flags the
user typed, so presets can fill only the rest (style: "presets fill defaults the user did not set").

A config's `__post_init__` reports a bad value or combination as a `FlagError`: `out_of_range` checks
numeric flags against ranges written as text ('>= 1', '> 0', '[0, 1)'), and `first_error` joins the checks
that failed the same way into one sentence, which `parse_config` rewrites when a preset set the values.

Errors a user can cause end as one line, `error: <sentence>`, exit status 2, no traceback: flags
through the parser, everything else (files, data, checkpoints) through `user_errors`. Ctrl-C ends
as one line too (exit status 130). A training loop runs inside `stop_signals`: the first SIGINT or
SIGTERM asks it to stop at the next step boundary, a second one stops it at once. What a run prints
before its first step and after its last (`start_line`, `end_summary`) is formatted here.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import dataclasses
import difflib
import inspect
import math
import os
import re
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def _field_docs(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """From the source of the class and of each dataclass it inherits fields from (train.py's config gathers each
    method's): each field's trailing `# comment` (its help) and the `# -- family` header above it in its class (its
    group in --help; fields before the first header go under "options")."""
    helps, groups = {}, {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        group, names = "options", {f.name for f in dataclasses.fields(klass)}  # not a ClassVar with a comment
        for line in inspect.getsource(klass).splitlines():
            header = re.match(r"\s+# -- (.*)$", line)
            if header:
                group = header.group(1).strip()
            m = re.match(r"\s+(\w+)\s*:[^=]*=.*?#\s*(.*)$", line)
            if m and m.group(1) in names:
                helps[m.group(1)], groups[m.group(1)] = m.group(2).strip(), group
    return helps, groups


def build_parser(
    cls: type, description: str = "", presets: dict[str, dict[str, Any]] | None = None, preset_field: str = ""
) -> argparse.ArgumentParser:
    """One flag per field, grouped by family; a choice field (in `cls.CHOICES`) lists its values. With presets, a
    field the default preset sets shows that value as its default, and the plain one it replaces."""
    parser = Parser(description=description, allow_abbrev=False)
    helps, groups = _field_docs(cls)
    choices = getattr(cls, "CHOICES", {})
    sections: dict[str, argparse._ArgumentGroup] = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    by = f"{flag(preset_field)} {fields[preset_field].default}" if presets else ""
    preset = presets[fields[preset_field].default] if presets else {}
    for f in fields.values():
        kind = str if f.default is None else type(f.default)  # None: an optional text flag, unset by default
        kind = getattr(cls, "TYPES", {}).get(f.name, kind)  # a field parsed by a function of its own (int_or_auto)
        title = groups.get(f.name, "options")
        section = sections.get(title) or sections.setdefault(title, parser.add_argument_group(title))
        default = f"{f.default!r}"
        if f.name in preset:  # what a run without flags uses: the default preset's value
            default = f"{preset[f.name]!r}, from the default {by}; {f.default!r} without that preset"
        # SUPPRESS: a flag the user did not type is absent from the namespace (see parse_config).
        text = (helps.get(f.name, "") + f" (default: {default})").replace("%", "%%")  # argparse formats help with %
        kw: dict[str, Any] = dict(default=argparse.SUPPRESS, help=text)
        if kind is bool:
            section.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **kw)
        else:
            metavar = "{" + ",".join(choices[f.name]) + "}" if f.name in choices else kind.__name__.upper()
            section.add_argument(flag(f.name), type=kind, metavar=metavar, **kw)
    return parser


def parse_config(
    cls: type,
    argv: Sequence[str] | None = None,
    description: str = "",
    presets: dict[str, dict[str, Any]] | None = None,
    preset_field: str = "",
) -> tuple[Any, set[str]]:
    """Parse argv into `cls`. Returns (config, names the user set explicitly). With `presets`, the value of
    `preset_field` picks a dict of overrides that applies to every field the user did not set on the command line."""
    parser = build_parser(cls, description, presets, preset_field)
    ns = vars(parser.parse_args(sys.argv[1:] if argv is None else list(argv)))
    explicit = set(ns)
    values: dict[str, Any] = {}
    preset: dict[str, Any] = {}
    name = None
    if presets is not None:
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        name = ns.get(preset_field, defaults[preset_field])  # typed, or the default preset
        if name not in presets:
            parser.error(f"{flag(preset_field)} must be one of {', '.join(presets)}, got {name!r}")
        preset = {k: v for k, v in presets[name].items() if k not in explicit}
        values.update(preset)
    values.update(ns)
    try:
        return cls(**values), explicit
    except FlagError as e:  # __post_init__ validation: one sentence, no traceback
        parser.error(blame(e, preset, f"{flag(preset_field)} {name}"))
    except ValueError as e:
        parser.error(str(e))


def int_or_auto(text: str) -> int | str:
    """A count flag's value that may also be the word auto (--micro-batch-rows auto)."""
    if text == "auto" or text.lstrip("-").isdigit():
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"must be a whole number or auto, got {text!r}")


def flag(name: str) -> str:
    """A field's command-line spelling: max_steps -> --max-steps."""
    return "--" + name.replace("_", "-")


class FlagError(ValueError):
    """A flag value or combination a config refuses, said as `{subject} {predicate}`: `fields` are the flags
    the subject names (by default the subject is their spellings), `others` the flags the predicate names."""

    def __init__(self, fields: tuple[str, ...], predicate: str, others: tuple[str, ...] = (), subject: str = ""):
        self.fields, self.predicate, self.others = fields, predicate, others
        self.subject = subject or "/".join(map(flag, fields))
        self.verb = re.sub(r"^needs ", "need ", predicate) if len(fields) > 1 else predicate  # agrees with the subject
        super().__init__(f"{self.subject} {self.verb}")


def in_range(value: float, spec: str) -> bool:
    """value in `spec`: '>= 1', '> 0' or an interval such as '[0, 1)'; a float must also be finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if spec[0] in "[(":
        low, high = (float(x) for x in spec[1:-1].split(","))
        above = low <= value if spec[0] == "[" else low < value
        return above and (value <= high if spec[-1] == "]" else value < high)
    op, bound = spec.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


def out_of_range(config: Any, ranges: dict[str, str]) -> Iterator[FlagError]:
    """A FlagError for each field of `config` outside its range (see in_range)."""
    for name, spec in ranges.items():
        value = getattr(config, name)
        if not in_range(value, spec):
            interval = spec[0] in "[("
            finite = " and finite" * (isinstance(value, float) and not interval)  # an interval says it already
            yield FlagError((name,), f"must be {'in ' * interval}{spec}{finite}, got {value}")


def first_error(errors: list[FlagError]) -> FlagError:
    """The first failed check, joined by the later ones that failed the same way (same predicate and flags),
    so that one sentence names them all: `--pair-delta/--anchors need --answers 1`."""
    same = [e for e in errors if (e.predicate, e.others) == (errors[0].predicate, errors[0].others)]
    if len(same) == 1:
        return errors[0]
    fields, subject = sum((e.fields for e in same), ()), "/".join(e.subject for e in same)
    return FlagError(fields, same[0].predicate, same[0].others, subject)


def blame(e: FlagError, preset: dict[str, Any], by: str) -> str:
    """e's sentence, where the preset `by` (e.g. `--algo dagrpo`) set some of its flags to the values in `preset`
    (the ones the user did not type): a preset's value is never blamed as if the user had typed it."""
    set_here = [f for f in (*e.fields, *e.others) if f in preset]
    if not set_here:
        return str(e)
    if e.fields and all(f in preset for f in e.fields):
        shown = [f for f in e.others if f in preset]
        text = f"{by} sets {e.subject}, which {e.verb}"
    else:
        shown, text = set_here, str(e)
    values = [flag(f) if preset[f] is True else f"{flag(f)} {preset[f]}" for f in shown]
    return text + (f" ({by} sets {', '.join(values)})" if values else "")


class UserError(Exception):
    """A mistake the user can fix (a flag, a file, a data line): reported as one line, no traceback."""


class UserExit(SystemExit):
    """Exit status 2 after a one-line `error: ...` on stderr; str() is the sentence (for tests)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def fail(message: str) -> UserExit:
    """Print `error: message` to stderr and return the exception that exits with status 2."""
    print(f"error: {message}", file=sys.stderr)
    return UserExit(message)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, where argparse prints its usage block first
        if message.startswith("unrecognized arguments: "):
            message += did_you_mean(message.split()[2:], [o for a in self._actions for o in a.option_strings])
        raise fail(f"{message} (see --help)")


def did_you_mean(args: Sequence[str], known: Sequence[str]) -> str:
    """'; did you mean --model?': the known flags closest to the first unknown --flag in `args` (difflib), or ''."""
    typed = next((a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in known), "")
    known = [k for k in known if k.startswith("--no-") == typed.startswith("--no-")]  # --seeed: --seed, not --no-seed
    close = difflib.get_close_matches(typed, known, n=2, cutoff=0.7) if typed else []
    return f"; did you mean {' or '.join(close)}?" if close else ""


def check_flag_names(*sources: str) -> None:
    """Refuse an unknown --flag before the entry script imports torch, as the parser would: the fields of the classes
    `sources` names ('file.py:Class', globs allowed), read with ast, each also as --no-flag (the full parse checks)."""
    known = {"-h", "--help"}
    for pattern, name in (source.split(":") for source in sources):
        for path in sorted(Path(__file__).resolve().parent.glob(pattern)):
            tree = ast.walk(ast.parse(path.read_text()))
            body = [n for c in tree if isinstance(c, ast.ClassDef) and c.name == name for n in c.body]
            fields = [n.target.id for n in body if isinstance(n, ast.AnnAssign) and "ClassVar" not in ast.unparse(n)]
            known |= {flag(prefix + field) for field in fields for prefix in ("", "no_")}
    if unknown := [arg for arg in sys.argv[1:] if arg.startswith("--") and arg.split("=")[0] not in known]:
        raise fail(f"unrecognized arguments: {' '.join(unknown)}{did_you_mean(unknown, sorted(known))} (see --help)")


@contextlib.contextmanager
def user_errors():
    """Around an entry script's main: a user error ends as `error: <sentence>`, exit status 2, no
    traceback (NANORL_TRACEBACK=1 shows it). User errors are UserError, ValueError (the project's
    convention for bad configs, checkpoints and data) and OSError (paths, permissions, full disks)."""
    try:
        yield
    except (UserError, ValueError, OSError) as e:
        if os.environ.get("NANORL_TRACEBACK"):
            raise
        raise fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
    except KeyboardInterrupt as e:
        if os.environ.get("NANORL_TRACEBACK"):
            raise
        print(f"\n{e or 'interrupted: files already written are intact'}", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None


# -----------------------------------------------------------------------------
# Signals: stop a run at a step boundary


@dataclasses.dataclass
class StopRequest:
    """Set by stop_signals' handler: the signal that asked the run to stop (0 = none yet)."""

    signum: int = 0
    resume: str = ""  # the command that continues the run, for the messages


@contextlib.contextmanager
def stop_signals(resume: str) -> Iterator[StopRequest]:
    """While the block runs, the first SIGINT (Ctrl-C) or SIGTERM (a cluster's preemption) only sets
    the returned request's signum: the loop checks it at each step boundary, writes a checkpoint and
    leaves through Stopped. A second one, in the block or after a stop left it (the run winding down), ends the
    process at once: one line, exit status 128 + the signal's number (130 for Ctrl-C), no traceback, whatever
    Python was running (an exception raised there could land in a generator's close, where Python prints it and
    goes on). The last complete checkpoint stays: every save is atomic, and a partial one's temporary directory is
    removed at the next start. `resume`: the command that continues the run. Outside the main thread (no signal
    handlers there) it does nothing."""
    stop = StopRequest(resume=resume)

    def stop_now(signum: int, frame) -> None:  # the second signal
        message = f"stopped at once by a second signal; the last complete checkpoint is intact: {resume}"
        print(f"\n{message}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def handle(signum: int, frame) -> None:
        if stop.signum:
            stop_now(signum, frame)
        stop.signum = signum
        name = signal.Signals(signum).name
        print(f"\n{name}: stopping after this step, with a checkpoint (Ctrl-C again to stop at once)", file=sys.stderr)

    try:
        old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        old = {}

    def ignore_at_exit() -> None:  # interpreter shutdown resets Python handlers to the default (death by SIGINT,
        for s in old:  # status -2), but leaves an ignored signal ignored: the stopped run exits with its own status
            signal.signal(s, signal.SIG_IGN)

    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, stop_now if stop.signum else h)
        if stop.signum and old:
            atexit.register(ignore_at_exit)


class Stopped(SystemExit):
    """A run stopped at a step boundary by a signal: exit status 128 + the signal number; str() is the message."""

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.message = message

    def __str__(self) -> str:
        return self.message


# -----------------------------------------------------------------------------
# What a run prints before its first step and after its last


def start_line(
    *,
    algo: str,
    flags: str,
    model: str,
    task: str,
    out: str,
    step: int,
    max_steps: int,
    resumed_from: str,
    device: str,
    memory: str,
) -> str:
    """What will run, on a line or two: the algorithm, model, task, device, the steps to run (from where a resumed run
    continues), the output directory and the memory estimate; then `flags` (changed_flags: every other flag that
    differs from its default, the preset's included, grouped as --help groups them)."""
    since = f"resuming {resumed_from} at step {step}" if resumed_from else "from the start"
    line = f"train: --algo {algo}, model {model}, task {task}, on {device}; steps {step + 1}-{max_steps}, {since}"
    return line + f", into {out}" + (f"; {memory}" if memory else "") + (f"\n       {flags}" if flags else "")


def changed_flags(config: Any, skip: Sequence[str] = ()) -> str:
    """Every field of `config` (but `skip`) whose value differs from its default, spelt as its flag and grouped by its
    --help family: 'rollouts: --thoughts 4 --answers 4; optimisation: --lora-rank 4'. Empty when none differs."""
    _, groups = _field_docs(type(config))
    changed: dict[str, list[str]] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in skip or value == f.default:
            continue
        text = str(value) if re.fullmatch(r"[\w.,:/+=-]+", str(value)) else repr(value)  # quote text with spaces
        spelt = flag("no_" * (not value) + f.name) if isinstance(value, bool) else f"{flag(f.name)} {text}"
        changed.setdefault(groups.get(f.name, "options"), []).append(spelt)
    return "; ".join(f"{group}: {' '.join(spelt)}" for group, spelt in changed.items())


def eval_size(params: int, device: str) -> str:
    """The end summary's eval.py flags: parameters x completions within what eval.py's defaults (200 prompts, greedy
    and --n 16: 3,400) cost the bundled model on a CPU (1000x on CUDA); else --n 4, --n 0, then fewer prompts (20+)."""
    completions = 743_040 * 3_400 * (1000 if device == "cuda" else 1) // params
    n = 16 if completions >= 200 * 17 else 4 if completions >= 200 * 5 else 0
    examples = min(200, max(20, completions // (n + 1)))
    return f"--examples {examples} " * (examples < 200) + f"--n {n} " + "--device cuda " * (device == "cuda")


def end_summary(
    evals: list, seconds: float, out: str, files: list, flags: str, steps: int, saved: str, merged: bool = False
) -> str:
    """Held-out accuracy at the run's first and last evaluation (eval rows of metrics.jsonl), this
    process's wall time, the output files in `out` (with --merge: the merged weights; `saved`: final/'s size and
    what takes it), and the commands that evaluate (with `flags`, eval_size's included) and plot them."""
    lines = [f"done: step {steps} in {seconds // 60:.0f} min {seconds % 60:.0f} s (this process)"]
    if evals:
        first, last = evals[0], evals[-1]
        for key, name in (("eval/greedy_accuracy", "greedy accuracy"), *[(k, k[5:]) for k in last if "mean@" in k]):
            if key in first and key in last:
                change = f"{first[key]:.1%} at step {first['step']} -> {last[key]:.1%} at step {last['step']}"
                lines.append(f"held-out {name}: {change}")
    final, merged_dir = os.path.join(out, "final"), os.path.join(out, "merged")
    weights = f"weights in {final} ({saved})" + (f", merged (a full HF checkpoint) in {merged_dir}" if merged else "")
    lines += [
        f"outputs: {out} ({', '.join(files)}), {weights}",
        f"next: python eval.py --model {merged_dir if merged else final} {flags.rstrip()}  # pass@k of the "
        "trained model",
        f"      python eval.py --plot {out} --out {os.path.join(out, 'plot.png')}  # its curves",
    ]
    return "\n".join(lines)
