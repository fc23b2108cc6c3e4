"""One way to configure every stage: a settings dataclass, read from a file and overridden on the command line.

    gqaify convert SRC OUT --kv-heads 2 --method lsq --calib-data calib.txt
    gqaify convert --config convert.yaml --kv-heads 1        the file's values; the command line wins
    gqaify convert --config OUT/gqaify.json --out OUT2       rerun a conversion from its own record

Each stage (`ConvertSettings`, `EvalSettings`, `UptrainSettings`) is one dataclass. Every field is a key of a
--config file (YAML, or a JSON record gqaify wrote: its "settings"), a `--field value` option (`--field-name`
and `--field_name` alike) and a keyword argument in Python. transformers' HfArgumentParser builds the options
and --help from the fields; a positional argument (convert's SRC OUT, eval's MODEL...) is a second way to give
one field. argparse checks what is typed on the command line; a file's values are checked against their fields'
types here. Unknown keys and options are refused with the nearest name.

Only the standard library and PyYAML are imported at the top; transformers' parser when a command is parsed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from gqaify.errors import UserError, raise_if_problems


def setting(default, help: str, empty_list: bool = False):
    """A settings field: its default and the help line shown by --help (a list default is copied per object).

    Args:
        empty_list: a list option may be given with no values (`--generate` alone: an empty list, not None).
    """
    metadata = {"help": help, **({_EMPTY_LIST: True} if empty_list else {})}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


_EMPTY_LIST = "gqaify_empty_list"  # a field's metadata reach add_argument as keywords: this one is ours


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


@dataclass(frozen=True)
class Stage:
    """How one command reads its settings."""

    command: str  # "convert"
    settings: type  # the dataclass
    description: str
    required: tuple[str, ...] = ()  # fields that must be set, by a file, an option or a positional
    positionals: tuple[Positional, ...] = ()
    switches: tuple[Switch, ...] = ()
    foreign_names: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # theirs: (ours, note)
    config_flags: tuple[str, ...] = ("--config",)

    def field_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.settings)]

    def named(self, field: str) -> str:
        """How a user gives `field`: its positional's metavar or its option."""
        for p in self.positionals:
            if p.field == field:
                return p.metavar
        return f"--{field.replace('_', '-')}"


def parse(stage: Stage, argv: list[str] | None, prog: str | None = None):
    """The settings object of `stage` from `--config FILE`, `--field value` options and positionals in `argv`.

    Raises:
        UserError: the file is missing, not a mapping, or has unknown keys; an option is unknown; a value has
            the wrong type; a required field is unset. Every problem at once.
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
        parser.set_defaults(**read_config(stage, config))
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
    raise_if_problems(problems + type_problems(settings) + required_problems(stage, settings))
    return settings


def required_problems(stage: Stage, settings) -> list[str]:
    """The required fields that are not set (None, or an empty list)."""
    flag = stage.config_flags[0]
    return [f"{stage.named(name)} is required; give it on the command line or as {name}: in the {flag} file"
            for name in stage.required if getattr(settings, name) in (None, [])]  # fmt: skip


def build_parser(stage: Stage, prog: str | None = None) -> argparse.ArgumentParser:
    """transformers' HfArgumentParser over the stage's dataclass, with --config, positionals and switches."""
    from transformers.hf_argparser import HfArgumentParser, string_to_bool

    class Parser(HfArgumentParser):
        def error(self, message: str):  # one line, status 2
            self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

        def add_argument(self, *args, **kwargs):
            # --kv-heads before --kv_heads: the form errors and --help show first
            if len(args) > 1 and all(a.startswith("--") for a in args):
                args = sorted(args, key=lambda a: "_" in a)
            # A boolean field is a plain flag (`--force`), not HfArgumentParser's optional value, which would
            # take the next argument (`--force SRC`) for its value; files give true/false.
            if kwargs.get("type") is string_to_bool and kwargs.get("nargs") == "?":
                kwargs = {k: v for k, v in kwargs.items() if k not in ("type", "nargs")}
                kwargs["action"] = "store_const"
            if kwargs.pop(_EMPTY_LIST, False):
                kwargs["nargs"] = "*"
            return super().add_argument(*args, **kwargs)

    parser = Parser(
        stage.settings,
        prog=prog or f"gqaify {stage.command}",
        description=stage.description,
        allow_abbrev=False,  # --max_token must not quietly mean --max_tokens
        formatter_class=_Formatter,
    )
    for p in stage.positionals:
        parser.add_argument(f"positional {p.field}", nargs=p.nargs, metavar=p.metavar, default=None,
                            help=f"the same as --{p.field.replace('_', '-')}")  # fmt: skip
    parser.add_argument(*stage.config_flags, metavar="FILE",
                        help="YAML file of settings (its keys are the options below), or the gqaify.json or "
                             "report.json gqaify wrote (its settings: a rerun); options given here win")  # fmt: skip
    for s in stage.switches:
        parser.add_argument(*s.flags, dest=s.field, action="store_const", const=s.value, help=s.help)
    return parser


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (it holds example commands); each option's default after its help."""


def read_config(stage: Stage, path: str | Path) -> dict:
    """The settings a --config file holds, as a dict of known keys.

    A YAML mapping of field: value; or a record gqaify wrote (a conversion's gqaify.json, an evaluation's
    report.json), whose "settings" are taken.

    Raises:
        UserError: no such file, not YAML, not a mapping, or an unknown key (named with the nearest valid one).
    """
    path = Path(path).expanduser()
    flag = stage.config_flags[0]
    if not path.is_file():
        raise UserError(f"{flag} {path} does not exist; check the path")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}  # JSON is YAML too
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        raise UserError(
            f"{flag} {path} is not valid YAML{f' (line {where.line + 1})' if where else ''}; fix it"
        ) from exc
    if isinstance(values, dict) and values.get("tool") == "gqaify" and "settings" in values:
        values = values["settings"]  # a record gqaify wrote
        if not isinstance(values, dict):
            raise UserError(f"{flag} {path} has no settings gqaify can read; check the file")
    if not isinstance(values, dict):
        raise UserError(f"{flag} {path} must be a mapping of setting: value; see --help for the settings")
    known = set(stage.field_names())
    raise_if_problems([f"{flag} {path}: unknown key {key!r}{nearest(stage, str(key))}"
                       for key in values if key not in known])  # fmt: skip
    return _numbers_from_text(values, stage, f"{flag} {path}")


def _numbers_from_text(values: dict, stage: Stage, where: str) -> dict:
    """Numbers YAML read as text (`lr: 1e-4` lacks the dot YAML wants) as numbers, as argparse would convert them;
    text that is no number is refused here, naming the file, before argparse reports it as an option's."""
    hints = typing.get_type_hints(stage.settings)
    converted, problems = dict(values), []
    for key, value in values.items():
        number = next((t for t in (int, float) if t in (hints[key], *typing.get_args(hints[key]))), None)
        if number is None or not isinstance(value, str):
            continue
        try:
            converted[key] = number(value)
        except ValueError:
            problems.append(f"{where}: {key} {value!r} is not {_describe(hints[key])}; fix the file")
    raise_if_problems(problems)
    return converted


def type_problems(settings) -> list[str]:
    """Values of the wrong type or outside a field's choices."""
    hints = typing.get_type_hints(type(settings))
    problems = []
    for f in dataclasses.fields(settings):
        value, hint = getattr(settings, f.name), hints[f.name]
        if not _is_a(value, hint):
            problems.append(f"{f.name} {value!r} is not {_describe(hint)}; fix the file, option or argument")
    return problems


def nearest(stage: Stage, key: str, prefix: str = "") -> str:
    """ " (did you mean lr?)": ours for another tool's name, else the closest field name; "" when none is close.

    A key written with dashes (`kv-head`) is answered with dashes (`kv-heads`).
    """
    dashed = "-" in key
    key = key.replace("-", "_")
    if key in stage.foreign_names:
        name, note = stage.foreign_names[key]
    else:
        names = stage.field_names() + [f.lstrip("-") for f in stage.config_flags]
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
        if not close:
            return ""
        name, note = close[0], ""
    name = name.replace("_", "-") if dashed else name
    return f" (did you mean {prefix}{name}?{' ' + note if note else ''})"


def recorded(settings, leave_out: frozenset[str] = frozenset()) -> dict:
    """The settings as JSON-ready data, without the fields in `leave_out`."""
    return {k: v for k, v in dataclasses.asdict(settings).items() if k not in leave_out}


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
