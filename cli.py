"""cli.py: turn a config dataclass into a command line, so every default lives in one place.

Each dataclass field becomes `--kebab-case` with its type taken from the default, booleans get
`--flag/--no-flag`, and the help text is the field's trailing comment in the source; `# -- family`
comments group the flags in --help, and a `CHOICES` class attribute lists the values of choice
flags. Unknown flags are an error. `parse_config` also reports which flags the user typed, so
presets can fill only the rest (style: "presets fill defaults the user did not set").

A config's `__post_init__` reports a bad value or combination as a `FlagError`: `out_of_range` checks
numeric flags against ranges written as text ('>= 1', '> 0', '[0, 1)'), and `first_error` joins the checks
that failed the same way into one sentence, which `parse_config` rewrites when a preset set the values.

Errors a user can cause end as one line, `error: <sentence>`, exit status 2, no traceback: flags
through the parser, everything else (files, data, checkpoints) through `user_errors`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import math
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any


def _field_docs(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """From the class source: each field's trailing `# comment` (its help) and the `# -- family`
    header above it (its group in --help; fields before the first header go under "options")."""
    helps, groups, group = {}, {}, "options"
    for line in inspect.getsource(cls).splitlines():
        header = re.match(r"\s+# -- (.*)$", line)
        if header:
            group = header.group(1).strip()
        m = re.match(r"\s+(\w+)\s*:[^=]*=.*?#\s*(.*)$", line)
        if m:
            helps[m.group(1)], groups[m.group(1)] = m.group(2).strip(), group
    return helps, groups


def build_parser(cls: type, description: str = "") -> argparse.ArgumentParser:
    """One flag per field, grouped by family; a choice field (in `cls.CHOICES`) lists its values."""
    parser = _Parser(description=description, allow_abbrev=False)
    helps, groups = _field_docs(cls)
    choices = getattr(cls, "CHOICES", {})
    sections: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default)
        title = groups.get(f.name, "options")
        section = sections.get(title) or sections.setdefault(title, parser.add_argument_group(title))
        # SUPPRESS: a flag the user did not type is absent from the namespace (see parse_config).
        text = (helps.get(f.name, "") + f" (default: {f.default!r})").replace("%", "%%")  # argparse formats help with %
        kw: dict[str, Any] = dict(default=argparse.SUPPRESS, help=text)
        if kind is bool:
            section.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            metavar = "{" + ",".join(choices[f.name]) + "}" if f.name in choices else kind.__name__.upper()
            section.add_argument(flag, type=kind, metavar=metavar, **kw)
    return parser


def parse_config(
    cls: type,
    argv: Sequence[str] | None = None,
    description: str = "",
    presets: dict[str, dict[str, Any]] | None = None,
    preset_field: str = "",
) -> tuple[Any, set[str]]:
    """Parse argv into `cls`. Returns (config, names the user set explicitly).

    With `presets`, the value of `preset_field` picks a dict of overrides that applies to every
    field the user did not set on the command line.
    """
    parser = build_parser(cls, description)
    ns = vars(parser.parse_args(sys.argv[1:] if argv is None else list(argv)))
    explicit = set(ns)
    values: dict[str, Any] = {}
    preset: dict[str, Any] = {}
    if presets is not None:
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        name = ns.get(preset_field, defaults[preset_field])
        if name not in presets:
            parser.error(f"{flag(preset_field)} must be one of {', '.join(presets)}, got {name!r}")
        preset = {k: v for k, v in presets[name].items() if k not in explicit}
        values.update(preset)
    values.update(ns)
    try:
        return cls(**values), explicit
    except FlagError as e:  # __post_init__ validation: one sentence, no traceback
        parser.error(blame(e, preset, f"{flag(preset_field)} {values.get(preset_field)}"))
    except ValueError as e:
        parser.error(str(e))


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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, where argparse prints its usage block first
        raise fail(f"{message} (see --help)")


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
