"""One way to configure every stage: a settings dataclass, read from a file and overridden on the command line.

    gqaify convert SRC OUT --kv-heads 2 --method lsq --calib-data calib.txt
    gqaify convert --config convert.yaml --kv-heads 1        the file's values; the command line wins
    gqaify convert --config OUT/gqaify.json --out OUT2       rerun a conversion from its own record

Each stage (`ConvertSettings`, `EvalSettings`, `UptrainSettings`) is one dataclass. Every field is a key of a
--config file (YAML, or a JSON record gqaify wrote: its "settings"), a `--field value` option (`--field-name`
and `--field_name` alike) and a keyword argument in Python. `build_parser` turns the fields into options and
--help, as transformers' HfArgumentParser would, in a few lines of our own (importing transformers for it took
most of --help's time); a positional argument (convert's SRC OUT, eval's MODEL...) is a second way to give one
field. argparse checks what is typed on the command line; a file's values are checked against their fields'
types here. Unknown keys and options are refused with the nearest name.

A --config file is read with care, as it may come from anyone: at most 1 MiB of YAML (a JSON record, 16 MiB),
no YAML aliases, no deep nesting, and no message shows more than the start of a value.

Only the standard library and PyYAML are imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import json
import os
import reprlib
import shlex
import stat
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


_EMPTY_LIST = "gqaify_empty_list"  # a field's metadata key: its list option may be given with no values


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
    record_kind: str = "a record"  # what its gqaify.json is called, e.g. "an eval report"

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
    """An option per field of the stage's dataclass (`add_field_option`), with --config, positionals and switches."""
    parser = OneLineParser(
        prog=prog or f"gqaify {stage.command}",
        description=stage.description,
        allow_abbrev=False,  # --max_token must not quietly mean --max_tokens
        formatter_class=_Formatter,
    )
    hints = typing.get_type_hints(stage.settings)
    for f in dataclasses.fields(stage.settings):
        add_field_option(parser, f, hints[f.name])
    for p in stage.positionals:
        parser.add_argument(f"positional {p.field}", nargs=p.nargs, metavar=p.metavar, default=None,
                            help=f"the same as --{p.field.replace('_', '-')}")  # fmt: skip
    parser.add_argument(*stage.config_flags, metavar="FILE",
                        help="YAML file of settings (its keys are the options below), or the gqaify.json or "
                             "report.json gqaify wrote (its settings: a rerun); options given here win")  # fmt: skip
    for s in stage.switches:
        parser.add_argument(*s.flags, dest=s.field, action="store_const", const=s.value, help=s.help)
    return parser


def add_field_option(parser: argparse.ArgumentParser, f: dataclasses.Field, hint) -> None:
    """`--field-name` (and `--field_name`) for one settings field, as transformers' HfArgumentParser adds it.

    `X | None` is read as X; a Literal gives the choices; a list takes one value or more (`nargs="+"`; "*" for
    `setting(..., empty_list=True)`); a boolean is a plain flag (`--force`, not HfArgumentParser's optional value,
    which would take the next argument, `--force SRC`, for its value; files give true/false), and a boolean
    that defaults to true also gets `--no-field`.
    """
    flags = _flags(f.name)
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    kwargs = {"dest": f.name, "default": default, "help": f.metadata["help"]}
    hint = _without_none(hint)
    if hint is bool:
        parser.add_argument(*flags, action="store_const", const=True, **kwargs)
        if default is True:
            parser.add_argument(*_flags(f"no_{f.name}"), action="store_false", dest=f.name,
                                default=argparse.SUPPRESS, help=f"the opposite of {flags[0]}")  # fmt: skip
    elif typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        by_text = {str(c): c for c in choices}  # a choice typed on the command line is text
        parser.add_argument(*flags, choices=choices, type=lambda text: by_text.get(text, text), **kwargs)
    elif typing.get_origin(hint) is list:
        nargs = "*" if f.metadata.get(_EMPTY_LIST) else "+"
        parser.add_argument(*flags, nargs=nargs, type=typing.get_args(hint)[0], **kwargs)
    else:
        parser.add_argument(*flags, type=hint, **kwargs)


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


def read_config(stage: Stage, path: str | Path) -> dict:
    """The settings a --config file holds, as a dict of known keys.

    A YAML mapping of field: value; or a record gqaify wrote (a conversion's gqaify.json, an evaluation's
    report.json), whose "settings" are taken.

    Raises:
        UserError: no such file, or not a file; too large, not YAML, not a mapping; a YAML alias, deep nesting;
            an unknown key (named with the nearest valid one), or another command's settings (named).
    """
    path = Path(path).expanduser()
    where = f"{stage.config_flags[0]} {path}"
    values, record = _settings_in(_parse(_read_text(path, where), where), where)
    _check_keys(stage, values, record, where, path)
    return _numbers_from_text(values, stage, where)


def _read_text(path: Path, where: str) -> str:
    """The text of a settings file (a regular file, or a pipe such as `<(...)`), read only up to the cap."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(f"{where} does not exist; check the path") from None
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
        raise UserError(f"{where} is larger than {MAX_JSON_BYTES >> 20} MiB; settings files are a few hundred "
                        "bytes: name the settings file")  # fmt: skip
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{where} is not UTF-8 text; name the YAML settings file") from None


def _parse(text: str, where: str):
    """The data in `text`: JSON (a record gqaify wrote), else YAML (at most MAX_YAML_BYTES, without aliases)."""
    try:
        return json.loads(text)
    except RecursionError:  # json's own bound on nesting
        raise UserError(f"{where} nests values too deeply; write values and lists of values") from None
    except ValueError:  # not JSON: YAML
        pass
    if len(text.encode("utf-8")) > MAX_YAML_BYTES:
        raise UserError(f"{where} is larger than {MAX_YAML_BYTES >> 20} MiB of YAML; settings files are a few "
                        "hundred bytes: name the settings file")  # fmt: skip
    try:
        return yaml.load(text, Loader=_SettingsLoader) or {}
    except _Refused as exc:
        raise UserError(f"{where} {exc.problem} (line {exc.problem_mark.line + 1}); {exc.fix}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise UserError(f"{where} is not valid YAML{f' (line {mark.line + 1})' if mark else ''}; fix it") from None


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, fix: str, mark):
        super().__init__(problem)
        self.problem, self.fix, self.problem_mark = problem, fix, mark


class _SettingsLoader(yaml.SafeLoader):
    """PyYAML's safe loader, without aliases and at most MAX_DEPTH deep.

    An alias (`*name`) repeats a whole subtree by reference: nine levels of nine aliases are 81 aliases in a few
    hundred bytes, but 9**9 values to any code that walks them (a message's repr ran out of memory). Counting
    aliases would not catch that, and a settings file has no need for them, so every alias is refused.
    """

    _depth = 0

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            raise _Refused("uses a YAML alias (*name)", "write the value itself: settings files allow no aliases",
                           mark)  # fmt: skip
        if self._depth >= MAX_DEPTH:
            raise _Refused(f"nests values more than {MAX_DEPTH} deep", "write values and lists of values", mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


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


def _check_keys(stage: Stage, values: dict, record: bool, where: str, path: Path) -> None:
    """Refuse a key that names another settings file, another command's settings, or unknown keys (5 named)."""
    flags = {f.lstrip("-").replace("-", "_") for f in stage.config_flags}
    nested = [key for key in values if key in flags]
    if nested:
        raise UserError(f"{where}: a settings file cannot name another ({nested[0]}: ...); gqaify reads one, "
                        "so copy that file's settings into this one")  # fmt: skip
    known = set(stage.field_names())
    unknown = [key for key in values if key not in known]
    if not unknown:
        return
    owner = _owner(stage, list(values))
    if owner is not None:
        what = f"is {owner.record_kind}" if record else f"holds gqaify {owner.command}'s settings"
        readable = set(values) <= set(owner.field_names())  # else only the other command's own run reads it
        fix = (f"use `gqaify {owner.command} {owner.config_flags[0]} {shlex.quote(str(path))}`" if readable
               else f"name {stage.command}'s settings file instead")  # fmt: skip
        raise UserError(f"{where} {what}, not {stage.command}'s; {fix}")
    problems = [f"unknown key {shown(key)}{nearest(stage, str(key))}" for key in unknown[:5]]
    more = [f"and {len(unknown) - 5} more unknown keys"] if len(unknown) > 5 else []
    raise UserError(f"{where}: " + "; ".join(problems + more))


# Where each command's `Stage` is defined, by name: this module is below them all, and reads them only to say
# whose settings a file holds (`_owner`).
STAGES = {
    "convert": "gqaify.conversion.options:CONVERT",
    "eval": "gqaify.eval.settings:EVAL",
    "uptrain": "gqaify.uptrain.settings:UPTRAIN",
    "generate": "gqaify.generation.settings:GENERATE",
}


def _owner(stage: Stage, keys: list) -> Stage | None:
    """The other command whose settings `keys` are: it knows 3/4 of them or more, and more than `stage` does."""
    stages = []
    for where in STAGES.values():
        module, name = where.split(":")
        stages.append(getattr(importlib.import_module(module), name))

    def known(s: Stage) -> int:
        return len(set(keys) & set(s.field_names()))

    best = max(stages, key=known)
    if best.command != stage.command and known(best) > known(stage) and known(best) >= 0.75 * len(keys):
        return best
    return None


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
            problems.append(f"{where}: {key} {shown(value)} is not {_describe(hints[key])}; fix the file")
    raise_if_problems(problems)
    return converted


def type_problems(settings) -> list[str]:
    """Values of the wrong type or outside a field's choices."""
    hints = typing.get_type_hints(type(settings))
    problems = []
    for f in dataclasses.fields(settings):
        value, hint = getattr(settings, f.name), hints[f.name]
        if not _is_a(value, hint):
            problems.append(f"{f.name} {shown(value)} is not {_describe(hint)}; fix the file, option or argument")
    return problems


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
