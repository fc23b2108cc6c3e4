"""The command line of a stage: an option per settings field (`build_parser`), with --config, positionals and
switches, and `parse`, which reads a --config file under the options and makes the settings object.

Only the standard library is imported (transformers' HfArgumentParser took most of --help's time).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Literal

from gqaify.errors import UserError, raise_if_problems
from gqaify.settings.fields import (
    _EMPTY_LIST,
    _RULES,
    Settings,
    _hints,
    _without_none,
    declared_by,
    field_default,
    is_group,
    ordered_fields,
)
from gqaify.settings.files import read_settings_file
from gqaify.settings.stage import Stage, nearest, required_problems


def parse(stage: Stage, argv: list[str] | None, prog: str | None = None, stages: tuple[Stage, ...] | None = None):
    """The settings object of `stage` from `argv` (`parse_command`, without the command's other options)."""
    return parse_command(stage, argv, prog, stages)[0]


def parse_command(
    stage: Stage, argv: list[str] | None, prog: str | None = None, stages: tuple[Stage, ...] | None = None
) -> tuple[Settings, dict[str, str | None]]:
    """The settings object of `stage` from `--config FILE`, `--field value` options and positionals in `argv`,
    with its types and required fields checked (a required field unset: with every problem `problems()` finds).
    Otherwise the values' rules are left to the stage, which reports them with what only the files can tell
    (SRC's config, the models' positions), all in one message. `stages`: the commands' whose settings a --config
    file is named as holding when they are not this one's (default: every declared one, `registry.every_stage`).
    Beside it, the value of each of the stage's `options` (by flag; None when not given).

    Raises:
        UserError: the file is missing, not a mapping, or has unknown keys; an option is unknown; a value has
            the wrong type (each of these, every problem at once); a positional and its option are both given;
            a required field is unset; an option given without its value; a rerun from a record that changes
            what the record pins (`Stage.rerun_problems`).
        SystemExit: --help (status 0), or a malformed option value (argparse's one-line error, status 2).
    """
    parser = build_parser(stage, prog)
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    raise_if_problems([f"--{old.replace('_', '-')} and --{new.replace('_', '-')} both given; --{old.replace('_', '-')} "
                       f"is --{new.replace('_', '-')}'s former name, give one"
                       for old, new in stage.settings.renamed.items()
                       if given & set(_flags(old)) and given & set(_flags(new))])  # fmt: skip
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument(*stage.config_flags, dest="config")
    try:
        config = pre.parse_known_args(argv)[0].config
    except argparse.ArgumentError:  # `--config` without a file: the full parser reports it below
        config = None
    record = None
    if config:
        values, is_record = read_settings_file(stage, config, stages)
        parser.set_defaults(**values)
        record = values if is_record else None
    # intermixed: a positional after the options is one too (`convert SRC --kv-heads 2 OUT`, as every CLI takes it)
    namespace, unused = parser.parse_known_intermixed_args(argv)
    if unused:
        after_dashes = argv[argv.index("--") + 1 :] if "--" in argv else []
        if surplus := [a for a in unused if a in after_dashes]:  # `convert SRC -- --out --kv-heads 1`: no option
            raise UserError(
                f"unexpected argument {surplus[0]} after '--': every word after '--' is a positional argument; give "
                "the options first, then '--' and all the positionals (or write a folder named like an option as "
                "./NAME)"
            )
        flags = [a for a in unused if a.startswith("-")] or unused[:1]
        raise_if_problems([f"unknown option {f}{nearest(stage, f.lstrip('-'), '--')}" for f in flags])
    values = vars(namespace)
    options = {o.flag: values.pop(f"option {o.flag}", None) for o in stage.options}
    problems = [o.missing for o in stage.options if options[o.flag] == ""]
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
    if record is not None and stage.rerun_problems is not None:
        raise_if_problems(stage.rerun_problems(record, settings))
    return settings, options


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
        group = parser if owner is stage.settings else parser.add_argument_group(_group_title(owner.__doc__))
        for f in fields:
            add_field_option(group, f, hints[f.name])
    for old, name in stage.settings.renamed.items():  # an earlier gqaify's option: taken, not shown in --help
        f = next(f for f in ordered_fields(stage.settings) if f.name == name)
        add_field_option(parser, f, hints[name], flags=_flags(old), shown=False)
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
        help=f"YAML file of settings (its keys are the options below), or the {' or '.join(stage.record_files)} "
        f"gqaify {stage.command} wrote (its settings: a rerun); options given here win",
    )
    for s in stage.switches:
        parser.add_argument(*s.flags, dest=s.field, action="store_const", const=s.value, help=s.help)
    for o in stage.options:  # given without a value: "" (`Option.missing` says what to give)
        parser.add_argument(
            o.flag,
            dest=f"option {o.flag}",
            nargs="?",
            const="",
            default=argparse.SUPPRESS,
            metavar=o.metavar,
            help=o.help,
        )
    return parser


def _by_declaring_class(settings: type) -> list[tuple[type, list[dataclasses.Field]]]:
    """The fields of `settings` by the class that first declares each (an override stays with its base): the
    class's own, with those of the shared groups it inherits after them (`ordered_fields`), then each other base's
    (the conversion's `MethodSettings`) under its docstring's first line."""
    owners = declared_by(settings)
    groups: dict[type, list[dataclasses.Field]] = {settings: []}
    for f in ordered_fields(settings):
        owner = owners[f.name]
        groups.setdefault(settings if is_group(owner) else owner, []).append(f)
    return list(groups.items())


def add_field_option(parser, f: dataclasses.Field, hint, flags: list[str] | None = None, shown: bool = True) -> None:
    """`--field-name` (and `--field_name`) for one settings field, as transformers' HfArgumentParser adds it.

    `X | None` is read as X; a Literal gives the choices; a list takes one value or more (`nargs="+"`; "*" for
    `setting(..., empty_list=True)`), each of its item type; a boolean is a plain flag (`--force`, not
    HfArgumentParser's optional value, which would take the next argument, `--force SRC`, for its value; files
    give true/false), and a boolean that defaults to true also gets `--no-field`.
    """
    flags = flags or _flags(f.name)
    default = field_default(f)
    kwargs = {"dest": f.name, "default": default, "help": f.metadata["help"] if shown else argparse.SUPPRESS}
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
    elif choices := next((rule.choices for rule in f.metadata[_RULES] if hasattr(rule, "choices")), None):
        parser.add_argument(*flags, choices=choices, **kwargs)  # a registry's names, read now (`rules.OneOf`)
    else:
        parser.add_argument(*flags, **_typed(hint), **kwargs)


def _typed(hint) -> dict:
    """argparse's `type` (and `choices`, for a Literal) of an option's values; for a number or a word (`int |
    Literal["auto"]`), the word as itself and anything else as the number."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        words = [a for a in typing.get_args(hint) if typing.get_origin(a) is Literal]
        kinds = [a for a in typing.get_args(hint) if typing.get_origin(a) is not Literal]
        if len(words) == 1 and len(kinds) == 1:
            choices, kind = {str(c): c for c in typing.get_args(words[0])}, kinds[0]

            def word_or_number(text: str):
                return choices[text] if text in choices else kind(text)

            word_or_number.__name__ = f"{kind.__name__} or {' or '.join(choices)}"  # argparse's "invalid X value"
            return {"type": word_or_number}
    if typing.get_origin(hint) is not Literal:
        return {"type": hint}
    choices = typing.get_args(hint)
    by_text = {str(c): c for c in choices}  # a choice typed on the command line is text
    return {"choices": choices, "type": lambda text: by_text.get(text, text)}


def _flags(name: str) -> list[str]:
    """["--kv-heads", "--kv_heads"]: the dashed form first, as errors and --help show it."""
    return list(dict.fromkeys([f"--{name.replace('_', '-')}", f"--{name}"]))


class OneLineParser(argparse.ArgumentParser):
    """Reports a usage error on one line, exit status 2 (the `gqaify` command's and every stage's parser)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _group_title(doc: str) -> str:
    """A group of options' title: its class docstring's opening clause (up to the first colon or full stop), its
    `code` references left out: "The group of options (`code`) a class declares"."""
    words = " ".join(doc.split())
    clause = re.split(r"[:.](?:\s|$)", words, maxsplit=1)[0]
    return re.sub(r"\s*\(`[^)]*`\)", "", clause)


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (it holds example commands); each option's default after its help, where it has
    one its help does not already give."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.default is None or "(default" in text:  # "(default: None)" says nothing; twice says it twice
            return text
        return super()._get_help_string(action)
