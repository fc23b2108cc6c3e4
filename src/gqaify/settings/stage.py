"""How one command reads its settings (`Stage`), and names them in what it says about them: its positionals and
switches, how a rule words a field (`Context`), and the problems its fields' declarations find.

Only the standard library is imported.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gqaify.records import KINDS
from gqaify.settings.fields import _REQUIRED, _RULES, Settings, ordered_fields, shown
from gqaify.settings.registry import entry_of


@dataclass(frozen=True)
class Context:
    """What a rule reads beside the value it checks: the other fields, and how the stage names them."""

    stage: Stage
    settings: Settings
    follow_bounds: bool = True  # False while a bound's own rules are checked: followed one level, never in a loop

    def name(self, field: str) -> str:
        return self.stage.named(field)

    def value(self, field: str):
        return getattr(self.settings, field)

    def breaks_a_rule(self, field: str) -> bool:
        """Whether `field`'s value breaks one of its own rules (a bound of another field's range that is itself
        wrong is no bound: its own problem is reported, not one for every field it bounds)."""
        f = next(f for f in dataclasses.fields(self.settings) if f.name == field)
        value = self.value(field)
        return (
            value is not None and _first_problem(f, value, dataclasses.replace(self, follow_bounds=False)) is not None
        )

    def said(self, field: str, value=dataclasses.MISSING) -> str:
        """A field with its value, as a command line gives it: "--seq-len 32"."""
        return f"{self.name(field)} {shown(self.value(field) if value is dataclasses.MISSING else value)}"

    def ask(self, field: str, value=None) -> str:
        """How to set `field` (to `value`): "pass --calib-data", "use --calib-mode sequential"; by keys, "set ..."."""
        if self.stage.named_by == "keys":
            return f"set {field}" if value is None else f"set {field}: {value}"
        return f"pass {self.name(field)}" if value is None else f"use {self.name(field)} {value}"

    def requirement(self, field: str, value, requirement: str, fix: str | None) -> str:
        """ "--seq-len 1 must be at least 2"; by keys, the key first and what it holds after: "seq_len must be at
        least 2, got 1" (a recipe is read key by key)."""
        if self.stage.named_by == "keys":
            said = f"{self.name(field)} {requirement}, got {shown(value)}"
        else:
            said = f"{self.said(field, value)} {requirement}"
        return f"{said}; {fix}" if fix else said


@dataclass(frozen=True)
class Positional:
    """A positional argument that gives one field: `SRC` for `src`; nargs "?" (one value) or "*" (a list)."""

    field: str
    metavar: str
    nargs: str = "?"


@dataclass(frozen=True)
class Switch:
    """A short flag that sets a field to a value, e.g. `-q/--quiet` sets progress to False."""

    flags: tuple[str, ...]
    field: str
    value: object
    help: str


QUIET = Switch(("-q", "--quiet"), "progress", False, "no progress bars (the same as --no-progress)")


@dataclass(frozen=True)
class Option:
    """An option of the command that is no setting (no key of a --config file, not recorded), e.g. uptrain's
    `--plan CONFIG`: `parse_command` hands its value (None when not given) to the command beside the settings."""

    flag: str  # "--plan"
    metavar: str
    help: str
    missing: str  # the problem when the flag is given without a value


@dataclass(frozen=True)
class Stage:
    """How one command reads its settings, and names them in what it says about them. Its command's name, and the
    records that rerun it, are its entry's in `gqaify.entry.stages.STAGES` (`command`, `record_kind`)."""

    settings: type[Settings]  # the dataclass
    description: str
    positionals: tuple[Positional, ...] = ()
    switches: tuple[Switch, ...] = ()
    options: tuple[Option, ...] = ()  # the command's options that are no settings
    foreign_names: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # theirs: (ours, note)
    config_flags: tuple[str, ...] = ("--config",)
    # how messages name a field: its positional's metavar or its option ("--seq-len"), or, for a stage set up
    # by a recipe file, its key ("seq_len")
    named_by: Literal["options", "keys"] = "options"
    # a file named by a --config flag that is no path: the packaged file of that name, or None (`gqaify.packaged`)
    packaged: Callable[[str], Path | None] | None = None
    # what a file of these keys is, where it is no command's settings but a file users confuse with them (an
    # accelerate config for uptrain's recipe): (its keys, how messages name it) -> the one-line refusal, or None
    foreign_file: Callable[[dict, str], str | None] | None = None
    # what a rerun from a record (a gqaify.json this stage wrote) changed that the record pins, said before any work:
    # (the record's settings, the settings made) -> problems
    rerun_problems: Callable[[dict, Settings], list[str]] | None = None

    @property
    def command(self) -> str:
        """The command that reads these settings ("convert"): the name of the entry that declares this stage."""
        return entry_of(self).name

    @property
    def record_kind(self) -> str:
        """What its own record is called ("an eval report"): the first kind of record its entry reruns from."""
        return KINDS[entry_of(self).records[0]].said

    @property
    def record_files(self) -> list[str]:
        """Where the records it reruns from are written ("run.json", "final/gqaify.json"), each once, its own first."""
        return list(dict.fromkeys(KINDS[kind].file for kind in entry_of(self).records))

    def field_names(self) -> list[str]:
        return [f.name for f in ordered_fields(self.settings)]

    def named(self, field: str) -> str:
        """How a user gives `field`: its positional's metavar, its option, or (named by keys) its key."""
        for p in self.positionals:
            if p.field == field:
                return p.metavar
        return field if self.named_by == "keys" else f"--{field.replace('_', '-')}"

    def declared_problems(self, settings: Settings, leave_out: frozenset[str] = frozenset()) -> list[str]:
        """What the fields' declarations say is wrong with `settings` (but the fields in `leave_out`): each
        required field that is unset, and the first rule each set value breaks, in the order of the fields."""
        ctx, problems = Context(self, settings), []
        for f in ordered_fields(settings):
            if f.name in leave_out:
                continue
            value = getattr(settings, f.name)
            if f.metadata.get(_REQUIRED) and _unset(value):
                problems.append(self._required_problem(f.name, value))
            elif value is not None and (problem := _first_problem(f, value, ctx)):
                problems.append(problem)
        return problems

    def _required_problem(self, field: str, value) -> str:
        missing = "is empty" if isinstance(value, str) else "is required"
        return (
            f"{self.named(field)} {missing}; give it on the command line or as {field}: in the "
            f"{self.config_flags[0]} file"
        )


def _unset(value) -> bool:
    return value is None or value == [] or (isinstance(value, str) and not value.strip())


def _first_problem(f: dataclasses.Field, value, ctx: Context) -> str | None:
    """The problem with `value` that the first rule of `f` it breaks reports: a rule object's, or a function's
    `(value, name)`."""
    for rule in f.metadata.get(_RULES, ()):
        problem = rule.problem(f.name, value, ctx) if hasattr(rule, "problem") else rule(value, ctx.name(f.name))
        if problem:
            return problem
    return None


def required_problems(stage: Stage, settings: Settings) -> list[str]:
    """The required fields of `settings` that are not given (the first of `Stage.declared_problems`, alone: for
    a caller that needs them set before it checks anything else)."""
    return [
        stage._required_problem(f.name, getattr(settings, f.name))
        for f in ordered_fields(settings)
        if f.metadata.get(_REQUIRED) and _unset(getattr(settings, f.name))
    ]


def nearest(stage: Stage, key: str, prefix: str = "") -> str:
    """ " (did you mean lr?)": ours for another tool's name, else the closest field name; "" when none is close.

    A key written with dashes (`kv-head`) is answered with dashes (`kv-heads`); an option (prefix "--") may also
    be the stage's --config flag, a file's key may not.
    """
    dashed = "-" in key
    key = key.replace("-", "_")
    if key in stage.foreign_names:
        name, note = stage.foreign_names[key]
    else:
        names = stage.field_names() + ([f.lstrip("-") for f in stage.config_flags] if prefix else [])
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.5) if len(key) <= 100 else []
        if not close:
            return ""
        name, note = close[0], ""
    name = name.replace("_", "-") if dashed else name
    return f" (did you mean {prefix}{name}?{' ' + note if note else ''})"
