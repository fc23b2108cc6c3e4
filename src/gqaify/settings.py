"""One way to configure every stage: a settings dataclass, read from a file and overridden on the command line.

    gqaify convert SRC OUT --kv-heads 2 --method lsq --calib-data calib.txt
    gqaify convert --config convert.yaml --kv-heads 1        the file's values; the command line wins
    gqaify convert --config OUT/gqaify.json --out OUT2       rerun a conversion from its own record

Each stage (`ConvertSettings`, `EvalSettings`, `UptrainSettings`, `GenerateSettings`) is one dataclass. Every field
is a key of a --config file (YAML, or a JSON record gqaify wrote: its "settings"), a `--field value` option
(`--field-name` and `--field_name` alike) and a keyword argument in Python. `build_parser` turns the fields into
options and --help, as transformers' HfArgumentParser would, in a few lines of our own (importing transformers for
it took most of --help's time); a positional argument (convert's SRC OUT, eval's MODEL...) is a second way to give
one field. Unknown keys and options are refused with the nearest name.

A field declares what its values may be beside it, in `setting(...)`: its type (a Literal gives the choices),
whether it is `required`, and the rules a value must meet (`Range`, `Limit`, `Finite`, `Needs`, `Excludes`, or a
function). Two checks, each reporting every problem at once:

    types       when a settings object is made (`Settings.__post_init__`): an object always holds values of its
                fields' types, whether the command line, a file or a Python caller gave them
    problems()  each stage's one list of what is wrong with the values: required fields unset, and every rule
                its fields declare (`Stage.declared_problems`), with the few that read better as code. Each stage
                asks it before any work, with what only the files can tell (is SRC there, can OUT be written,
                does G divide SRC's heads), so that every problem is one message; it keeps what those checks
                parse (a size in bytes, where SRC is) for the work that follows. `parse` checks only the types
                and the required fields, which the stage needs to read the files at all.

A --config file is read with care, as it may come from anyone: at most 1 MiB of YAML (a JSON record, 16 MiB),
no YAML aliases, no deep nesting, and no message shows more than the start of a value.

Only the standard library and PyYAML are imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import json
import math
import os
import reprlib
import shlex
import stat
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from gqaify.errors import UserError, raise_if_problems


def setting(default, help: str, *, required: bool = False, check=(), empty_list: bool = False):
    """A settings field: its default, the help line --help shows, and what its values may be.

    Args:
        required: the field must be given (by a file, an option or a positional): not None, empty text or an
            empty list.
        check: a rule, or a tuple of rules, that a value must meet (None, unset, is not checked): `Range`,
            `Limit`, `Finite`, `Needs`, `Excludes`, or a function `(value, name) -> problem | None`, `name` being
            how the stage names the field. The first rule a value breaks is reported.
        empty_list: a list option may be given with no values (`--generate` alone: an empty list, not None).
    """
    rules = check if isinstance(check, tuple) else (check,)
    metadata = {"help": help, _REQUIRED: required, _RULES: rules, _EMPTY_LIST: empty_list}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# a field's metadata keys, beside "help" (HfArgumentParser's name for it)
_REQUIRED = "gqaify_required"
_RULES = "gqaify_rules"
_EMPTY_LIST = "gqaify_empty_list"  # its list option may be given with no values


class Settings:
    """The base of every stage's settings dataclass.

    Its fields hold values of their types, or it is not made: `__post_init__` refuses every wrong type at once, as
    peft's configs check themselves in theirs (which raise at the first problem, and for value ranges too). Values
    are left to `problems()`: an object may be incomplete while it is built up (`EvalSettings(seq_len=1024)` is
    given its models later), and a range is reported with the problems found in the files, all in one message.
    """

    def __post_init__(self) -> None:
        for name, value in text_lists(type(self), dataclasses.asdict(self)).items():
            object.__setattr__(self, name, value)
        raise_if_problems(type_problems(self))

    def problems(self) -> list[str]:
        """Everything wrong with the values, at once; the stage's own (see `Stage.declared_problems`)."""
        raise NotImplementedError


# -- rules a field's values must meet ------------------------------------------------------------------------


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
class Range:
    """A number from `low` (above it, with `low_open`) to `high` (below it, with `high_open`); a bound may name
    another field, and is then that field's value. NaN and the infinities are in no range.

    Reported as "--seq-len 1 must be at least 2" (`says` words the range where the default would not say enough,
    `fix` adds what to do).
    """

    low: float | str | None = None
    high: float | str | None = None
    low_open: bool = False
    high_open: bool = False
    says: str | None = None
    fix: str | None = None

    def problem(self, field: str, value, ctx: Context) -> str | None:
        low, high = (ctx.value(b) if isinstance(b, str) else b for b in (self.low, self.high))
        if ctx.follow_bounds and any(isinstance(b, str) and ctx.breaks_a_rule(b) for b in (self.low, self.high)):
            return None  # the bound's own problem is reported
        above_low = low is None or (value > low if self.low_open else value >= low)
        below_high = high is None or (value < high if self.high_open else value <= high)
        if math.isfinite(value) and above_low and below_high:
            return None
        return ctx.requirement(field, value, f"must be {self.says or self.words(ctx)}", self.fix)

    def words(self, ctx: Context) -> str:
        """ "at least 2", "between 1 and --seq-len 2048", "in (0, 1]", "0 or more and below --length 256"."""
        low, high = (ctx.said(b) if isinstance(b, str) else _number(b) for b in (self.low, self.high))
        if self.low is not None and self.high is not None:
            if not (self.low_open or self.high_open):
                return f"between {low} and {high}"
            if not (isinstance(self.low, str) or isinstance(self.high, str)):
                return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        said = []
        if self.low is not None:
            zero = self.low == 0
            said.append(
                ("a positive number" if zero else f"above {low}")
                if self.low_open
                else ("0 or more" if zero else f"at least {low}")
            )
        if self.high is not None:
            said.append(f"below {high}" if self.high_open else f"at most {high}")
        return " and ".join(said)


@dataclass(frozen=True)
class Limit:
    """A cap on what a number costs (memory, time, disk) rather than a bound on what it means: "--refine-steps
    2000000 is more than the 1,000,000 allowed (why); lower it"."""

    most: int
    why: str

    def problem(self, field: str, value, ctx: Context) -> str | None:
        if value <= self.most:
            return None
        return f"{ctx.said(field, value)} is more than the {self.most:,} allowed ({self.why}); lower it"


@dataclass(frozen=True)
class Finite:
    """A finite number: "--refine-lr nan is not a finite number; give a positive one"."""

    fix: str

    def problem(self, field: str, value, ctx: Context) -> str | None:
        return None if math.isfinite(value) else f"{ctx.said(field, value)} is not a finite number; {self.fix}"


@dataclass(frozen=True)
class Needs:
    """When this field's value meets `when` (by default: it is true), another `field` must be set, or with
    `value`, set to it: "--chat wraps prompts in the chat template; pass --prompts"."""

    field: str
    why: str
    when: Callable[[object], bool] = bool
    value: object = None  # None: any value but None

    def problem(self, field: str, value, ctx: Context) -> str | None:
        other = ctx.value(self.field)
        if not self.when(value) or (other is not None if self.value is None else other == self.value):
            return None
        subject = ctx.name(field) if value is True else f"{ctx.name(field)} {value}"
        return f"{subject} {self.why}; {ctx.ask(self.field, self.value)}"


# what numpy's generator takes (accelerate's set_seed seeds it), well inside torch's with the seeds derived from it
# (seed x 1,000,003 + shard or epoch): a seed past it was a traceback, after OUT was claimed
SEED = Range(0, 2**32 - 1, says="a whole number from 0 to 2**32 - 1")


@dataclass(frozen=True)
class OnePerItem:
    """Weights: one positive number per item of the list `field` (the sources of a mixture)."""

    field: str

    def problem(self, field: str, weights: list[float], ctx: Context) -> str | None:
        items = ctx.value(self.field) or []
        if len(weights) != len(items):
            return (
                f"{ctx.name(field)} gives {len(weights)} weights for {len(items)} {self.field} sources; give one "
                "per source"
            )
        if not all(math.isfinite(w) and w > 0 for w in weights):
            return f"{ctx.name(field)} {shown(weights)} must be positive numbers; e.g. 2 1 1 gives the first half"
        return None


@dataclass(frozen=True)
class Excludes:
    """When this field's value meets `when` (by default: it is true), another `field` must be unset (None), the
    two being two ways to ask for one thing: "--start and --prompts both choose how a sample begins; keep one"."""

    field: str
    why: str
    when: Callable[[object], bool] = bool

    def problem(self, field: str, value, ctx: Context) -> str | None:
        if not self.when(value) or ctx.value(self.field) is None:
            return None
        return f"{ctx.name(field)} and {ctx.name(self.field)} {self.why}; keep one"


def _number(bound: float | None) -> str:
    if bound is None:  # no bound on that side: not worded
        return ""
    return f"{bound:,}" if isinstance(bound, int) else f"{bound:g}"


# -- stages --------------------------------------------------------------------------------------------------


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
class Stage:
    """How one command reads its settings, and names them in what it says about them."""

    command: str  # "convert"
    settings: type[Settings]  # the dataclass
    description: str
    positionals: tuple[Positional, ...] = ()
    switches: tuple[Switch, ...] = ()
    foreign_names: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # theirs: (ours, note)
    config_flags: tuple[str, ...] = ("--config",)
    record_kind: str = "a record"  # what its gqaify.json is called, e.g. "an eval report"
    # how messages name a field: its positional's metavar or its option ("--seq-len"), or, for a stage set up
    # by a recipe file, its key ("seq_len")
    named_by: Literal["options", "keys"] = "options"
    # a file named by a --config flag that is no path: the shipped file of that name, or None (`gqaify.packaged`)
    shipped: Callable[[str], Path | None] | None = None

    def field_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.settings)]

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
        for f in dataclasses.fields(settings):
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
        for f in dataclasses.fields(settings)
        if f.metadata.get(_REQUIRED) and _unset(getattr(settings, f.name))
    ]


# -- the command line ----------------------------------------------------------------------------------------


def parse(stage: Stage, argv: list[str] | None, prog: str | None = None, stages: tuple[Stage, ...] = ()):
    """The settings object of `stage` from `--config FILE`, `--field value` options and positionals in `argv`,
    with its types and required fields checked (a required field unset: with every problem `problems()` finds).
    Otherwise the values' rules are left to the stage, which reports them with what only the files can tell
    (SRC's config, the models' positions), all in one message. `stages`: the other commands', to name whose
    settings a --config file holds when they are not this one's.

    Raises:
        UserError: the file is missing, not a mapping, or has unknown keys; an option is unknown; a value has
            the wrong type (each of these, every problem at once); a positional and its option are both given;
            a required field is unset.
        SystemExit: --help (status 0), or a malformed option value (argparse's one-line error, status 2).
    """
    parser = build_parser(stage, prog)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument(*stage.config_flags, dest="config")
    try:
        config = pre.parse_known_args(argv)[0].config
    except argparse.ArgumentError:  # `--config` without a file: the full parser reports it below
        config = None
    if config:
        parser.set_defaults(**read_config(stage, config, stages))
    namespace, unused = parser.parse_known_args(argv)
    if unused:
        flags = [a for a in unused if a.startswith("-")] or unused[:1]
        raise_if_problems([f"unknown option {f}{nearest(stage, f.lstrip('-'), '--')}" for f in flags])
    values = vars(namespace)
    problems = []
    for p in stage.positionals:
        given = values.pop(f"positional {p.field}")
        if given in (None, []):
            continue
        if values[p.field] not in (None, "", []) and values[p.field] != parser.get_default(p.field):
            problems.append(f"{p.metavar} and --{p.field.replace('_', '-')} both given; give one")
        values[p.field] = given
    settings = stage.settings(**{name: values[name] for name in stage.field_names()})
    missing = required_problems(stage, settings)  # the stage cannot start: say now all the values' problems too
    raise_if_problems(problems + (settings.problems() if missing else []))
    return settings


def build_parser(stage: Stage, prog: str | None = None) -> argparse.ArgumentParser:
    """An option per field of the stage's dataclass (`add_field_option`), with --config, positionals and switches;
    the fields a base class declares (uptrain's and convert's `MethodSettings`) under its docstring's first line."""
    parser = OneLineParser(
        prog=prog or f"gqaify {stage.command}",
        description=stage.description,
        allow_abbrev=False,  # --max_token must not quietly mean --max_tokens
        formatter_class=_Formatter,
    )
    hints = _hints(stage.settings)
    for owner, fields in _by_declaring_class(stage.settings):
        group = parser if owner is stage.settings else parser.add_argument_group(owner.__doc__.splitlines()[0])
        for f in fields:
            add_field_option(group, f, hints[f.name])
    for p in stage.positionals:
        parser.add_argument(
            f"positional {p.field}",
            nargs=p.nargs,
            metavar=p.metavar,
            default=None,
            help=f"the same as --{p.field.replace('_', '-')}",
        )
    parser.add_argument(
        *stage.config_flags,
        metavar="FILE",
        help="YAML file of settings (its keys are the options below), or the gqaify.json or "
        "report.json gqaify wrote (its settings: a rerun); options given here win",
    )
    for s in stage.switches:
        parser.add_argument(*s.flags, dest=s.field, action="store_const", const=s.value, help=s.help)
    return parser


def _by_declaring_class(settings: type) -> list[tuple[type, list[dataclasses.Field]]]:
    """The fields of `settings` by the class that first declares each (one a subclass declares again, to change
    its default, stays with its base): the class's own first, then each base's."""
    declared_by = {}
    for cls in reversed(settings.__mro__):
        for name in inspect.get_annotations(cls):
            declared_by.setdefault(name, cls)
    groups: dict[type, list[dataclasses.Field]] = {settings: []}
    for f in dataclasses.fields(settings):
        groups.setdefault(declared_by[f.name], []).append(f)
    return list(groups.items())


def add_field_option(parser, f: dataclasses.Field, hint) -> None:
    """`--field-name` (and `--field_name`) for one settings field, as transformers' HfArgumentParser adds it.

    `X | None` is read as X; a Literal gives the choices; a list takes one value or more (`nargs="+"`; "*" for
    `setting(..., empty_list=True)`), each of its item type; a boolean is a plain flag (`--force`, not
    HfArgumentParser's optional value, which would take the next argument, `--force SRC`, for its value; files
    give true/false), and a boolean that defaults to true also gets `--no-field`.
    """
    flags = _flags(f.name)
    default = field_default(f)
    kwargs = {"dest": f.name, "default": default, "help": f.metadata["help"]}
    hint = _without_none(hint)
    if hint is bool:
        parser.add_argument(*flags, action="store_const", const=True, **kwargs)
        if default is True:
            parser.add_argument(
                *_flags(f"no_{f.name}"),
                action="store_false",
                dest=f.name,
                default=argparse.SUPPRESS,
                help=f"the opposite of {flags[0]}",
            )
    elif typing.get_origin(hint) is list:
        nargs = "*" if f.metadata.get(_EMPTY_LIST) else "+"
        parser.add_argument(*flags, nargs=nargs, **_typed(typing.get_args(hint)[0]), **kwargs)
    else:
        parser.add_argument(*flags, **_typed(hint), **kwargs)


def _typed(hint) -> dict:
    """argparse's `type` (and `choices`, for a Literal) of an option's values."""
    if typing.get_origin(hint) is not Literal:
        return {"type": hint}
    choices = typing.get_args(hint)
    by_text = {str(c): c for c in choices}  # a choice typed on the command line is text
    return {"choices": choices, "type": lambda text: by_text.get(text, text)}


def _flags(name: str) -> list[str]:
    """["--kv-heads", "--kv_heads"]: the dashed form first, as errors and --help show it."""
    return list(dict.fromkeys([f"--{name.replace('_', '-')}", f"--{name}"]))


def _without_none(hint):
    """X for `X | None` (the option takes an X; None is its default)."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 else hint


class OneLineParser(argparse.ArgumentParser):
    """Reports a usage error on one line, exit status 2 (the `gqaify` command's and every stage's parser)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (it holds example commands); each option's default after its help."""


# A settings file is a few hundred bytes; a record gqaify wrote, a few KB (tens for a large model's per-layer fits).
# Larger files are refused before they are parsed: PyYAML reads about 1 MB a second, so 50 MB took 51 s.
MAX_YAML_BYTES = 1 << 20
MAX_JSON_BYTES = 16 << 20  # json parses in C, 100 times faster: a record may be larger
MAX_DEPTH = 32  # of YAML (PyYAML composes nodes recursively); settings are values and lists of values


def read_config(stage: Stage, path: str | Path, stages: tuple[Stage, ...] = ()) -> dict:
    """The settings a --config file holds, as a dict of known keys.

    A YAML mapping of field: value; or a record gqaify wrote (a conversion's gqaify.json, an evaluation's
    report.json), whose "settings" are taken. `stages` are the other commands' (given by the caller, who knows
    them: this module is below them all): a file that holds one of theirs is named as such.

    Raises:
        UserError: no such file, or not a file; too large, not YAML, not a mapping; a YAML alias, deep nesting;
            an unknown key (named with the nearest valid one), or another command's settings (named).
    """
    path = Path(path).expanduser()
    if not path.exists() and stage.shipped is not None:
        if (local := path.with_name(f"{path.name}.yaml")).exists():
            path = local  # NAME for ./NAME.yaml (what `gqaify recipes cp NAME .` writes) before the shipped NAME
        elif (found := stage.shipped(str(path))) is not None:
            path = found  # a shipped recipe, by name
    where = f"{stage.config_flags[0]} {path}"
    values, record = _settings_in(_parse(_read_text(path, where), where), where)
    _check_keys(stage, values, record, where, path, stages)
    return _numbers_from_text(values, stage, where)


def read_data(path: Path, where: str):
    """The data of a YAML or JSON file read as settings files are (size, aliases, depth, repeated keys), e.g. an
    accelerate config; `where` names it in messages ("--plan FILE").

    Raises:
        UserError: not a readable file, too large, not UTF-8, not YAML, a YAML alias, deep nesting, a key twice.
    """
    return _parse(_read_text(Path(path), where), where)


def _read_text(path: Path, where: str) -> str:
    """The text of a settings file (a regular file, or a pipe such as `<(...)`), read only up to the cap."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(
            f"{where} does not exist; check the path (gqaify recipes lists the shipped recipes, which "
            "--recipe finds by name)"
        ) from None
    except OSError as exc:
        raise UserError(f"{where} cannot be read ({exc.strerror}); check the path") from None
    if stat.S_ISDIR(mode):
        inside = [path / n for n in ("gqaify.json", "report.json") if (path / n).is_file()]
        hint = f"did you mean {inside[0]}?" if inside else "name the YAML file, or the gqaify.json or report.json"
        raise UserError(f"{where} is a folder, not a settings file; {hint}")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise UserError(f"{where} is a device, not a settings file; name the YAML file")
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{where} cannot be read ({exc.strerror}); check the path") from None
    if len(data) > MAX_JSON_BYTES:
        raise UserError(
            f"{where} is larger than {MAX_JSON_BYTES >> 20} MiB; settings files are a few hundred "
            "bytes: name the settings file"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{where} is not UTF-8 text; name the YAML settings file") from None


def _parse(text: str, where: str):
    """The data in `text`: JSON (a record gqaify wrote), else YAML (at most MAX_YAML_BYTES, without aliases)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:  # json's own bound on nesting
        raise UserError(f"{where} nests values too deeply; write values and lists of values") from None
    except _RepeatedKey as exc:
        raise UserError(f"{where} gives the key {exc.key!r} twice; keep one") from None
    except ValueError:  # not JSON: YAML
        pass
    if len(text.encode("utf-8")) > MAX_YAML_BYTES:
        raise UserError(
            f"{where} is larger than {MAX_YAML_BYTES >> 20} MiB of YAML; settings files are a few "
            "hundred bytes: name the settings file"
        )
    try:
        return yaml.load(text, Loader=_SettingsLoader) or {}
    except _Refused as exc:
        line = f" (line {exc.problem_mark.line + 1})" if exc.problem_mark is not None else ""
        raise UserError(f"{where} {exc.problem}{line}; {exc.fix}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise UserError(f"{where} is not valid YAML{f' (line {mark.line + 1})' if mark else ''}; fix it") from None


class _RepeatedKey(Exception):  # not a ValueError, which `_parse` takes for "not JSON"
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are each given once (json keeps the last of a repeated key)."""
    values = {}
    for key, value in pairs:
        if key in values:
            raise _RepeatedKey(key)
        values[key] = value
    return values


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, fix: str, mark):
        super().__init__(problem)
        self.problem, self.fix, self.problem_mark = problem, fix, mark


class _SettingsLoader(yaml.SafeLoader):
    """PyYAML's safe loader, without aliases, at most MAX_DEPTH deep, and with each key of a mapping given once.

    An alias (`*name`) repeats a whole subtree by reference: nine levels of nine aliases are 81 aliases in a few
    hundred bytes, but 9**9 values to any code that walks them (a message's repr ran out of memory). Counting
    aliases would not catch that, and a settings file has no need for them, so every alias is refused.
    """

    _depth = 0

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            raise _Refused("uses a YAML alias (*name)", "write the value itself: settings files allow no aliases", mark)
        if self._depth >= MAX_DEPTH:
            raise _Refused(f"nests values more than {MAX_DEPTH} deep", "write values and lists of values", mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        """A mapping whose keys are each given once: PyYAML keeps the last of a repeated key, silently dropping
        the value the reader of the file may take for the one in force."""
        if isinstance(node, yaml.MappingNode):
            lines = {}  # key: the line it is first given on
            for key_node, _ in node.value:
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in lines:
                        where = f"line {line}" if lines[key] == line else f"lines {lines[key]} and {line}"
                        raise _Refused(f"gives the key {key!r} twice ({where})", "keep one", None)
                    lines[key] = line
                except TypeError:  # an unhashable key: PyYAML's own error names it
                    continue
        return super().construct_mapping(node, deep=deep)


def _settings_in(values, where: str) -> tuple[dict, bool]:
    """The settings mapping in a file's data (a record's "settings"), and whether it was a record gqaify wrote."""
    record = isinstance(values, dict) and values.get("tool") == "gqaify" and "settings" in values
    if record:
        values = values["settings"]
        if not isinstance(values, dict):
            raise UserError(f"{where} has no settings gqaify can read; check the file")
    if not isinstance(values, dict):
        raise UserError(f"{where} must be a mapping of setting: value; see --help for the settings")
    return values, record


def _check_keys(stage: Stage, values: dict, record: bool, where: str, path: Path, stages: tuple[Stage, ...]) -> None:
    """Refuse a key that names another settings file, another command's settings, or unknown keys (5 named)."""
    flags = {f.lstrip("-").replace("-", "_") for f in stage.config_flags}
    nested = [key for key in values if key in flags]
    if nested:
        raise UserError(
            f"{where}: a settings file cannot name another ({nested[0]}: ...); gqaify reads one, "
            "so copy that file's settings into this one"
        )
    known = set(stage.field_names())
    unknown = [key for key in values if key not in known]
    if not unknown:
        return
    owner = _owner(stage, list(values), stages)
    if owner is not None:
        what = f"is {owner.record_kind}" if record else f"holds gqaify {owner.command}'s settings"
        readable = set(values) <= set(owner.field_names())  # else only the other command's own run reads it
        fix = (
            f"use `gqaify {owner.command} {owner.config_flags[0]} {shlex.quote(str(path))}`"
            if readable
            else f"name {stage.command}'s settings file instead"
        )
        raise UserError(f"{where} {what}, not {stage.command}'s; {fix}")
    problems = [f"unknown key {shown(key)}{nearest(stage, str(key))}" for key in unknown[:5]]
    more = [f"and {len(unknown) - 5} more unknown keys"] if len(unknown) > 5 else []
    raise UserError(f"{where}: " + "; ".join(problems + more))


def _owner(stage: Stage, keys: list, stages: tuple[Stage, ...]) -> Stage | None:
    """The other command whose settings `keys` are: it knows 3/4 of them or more, and more than `stage` does."""

    def known(s: Stage) -> int:
        return len(set(keys) & set(s.field_names()))

    best = max((stage, *stages), key=known)
    if best.command != stage.command and known(best) > known(stage) and known(best) >= 0.75 * len(keys):
        return best
    return None


def _numbers_from_text(values: dict, stage: Stage, where: str) -> dict:
    """Numbers YAML read as text (`lr: 1e-4` lacks the dot YAML wants) as numbers, as argparse would convert them;
    text that is no number is refused here, naming the file, before argparse reports it as an option's."""
    hints = _hints(stage.settings)
    converted, problems = dict(values), []
    for key, value in values.items():
        number = next((t for t in (int, float) if t in (hints[key], *typing.get_args(hints[key]))), None)
        if number is None or not isinstance(value, str):
            continue
        try:
            converted[key] = number(value)
        except ValueError:
            problems.append(f"{where}: {key} {shown(value)} is not {_describe(hints[key])}; fix the file")
    raise_if_problems(problems)
    return converted


def type_problems(settings) -> list[str]:
    """Values of the wrong type or outside a field's choices (`Settings.__post_init__` refuses them)."""
    hints = _hints(type(settings))
    problems = []
    for f in dataclasses.fields(settings):
        value, hint = getattr(settings, f.name), hints[f.name]
        if not _is_a(value, hint):
            problems.append(f"{f.name} {shown(value)} is not {_describe(hint)}; fix the file, option or argument")
    return problems


@functools.cache
def _hints(settings: type) -> dict:
    """The field types of a settings class (its annotations are text until read: `from __future__ import
    annotations`), read once."""
    return typing.get_type_hints(settings)


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


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxdict = 6
_SHORT.maxlevel = 3


def shown(value) -> str:
    """`repr(value)`, cut short (a string's middle, a list's tail, deep levels): messages show what a value is,
    never all of it."""
    return _SHORT.repr(value)


def field_default(f: dataclasses.Field):
    """The value a settings field takes when it is not given (a list field: a new list)."""
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def defaults(settings: type) -> dict:
    """Every field's default, by name (what a record written before a field existed is read as)."""
    return {f.name: field_default(f) for f in dataclasses.fields(settings)}


def recorded(settings, leave_out: frozenset[str] = frozenset()) -> dict:
    """The settings as JSON-ready data, without the fields in `leave_out`."""
    return {k: v for k, v in dataclasses.asdict(settings).items() if k not in leave_out}


def text_lists(settings: type, values: dict) -> dict:
    """`values` with each list-of-text field's value as a list: one text is a list of one, an empty text (`--eval-data
    ''`) unset (None, or [] where the field takes no None). Settings objects and records written before a field
    became a list (a run.json's `data: x.txt`) are read through it."""
    hints, found = _hints(settings), dict(values)
    for name, value in values.items():
        if name not in hints or not _takes_text_list(hints[name]):
            continue
        if value in ("", [""]):
            found[name] = None if _without_none(hints[name]) != hints[name] else []
        elif isinstance(value, str):
            found[name] = [value]
    return found


def _takes_text_list(hint) -> bool:
    """Whether `hint` is `list[str]` or `list[str] | None` (and not also `str`)."""
    return _without_none(hint) == list[str]


def _is_a(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_is_a(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}"
    names = {int: "a whole number", float: "a number", str: "text", bool: "true or false", type(None): "empty"}
    return names.get(hint, str(hint))
