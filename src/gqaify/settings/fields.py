"""A settings field and what its values may be: `setting(...)`, the `Settings` base whose objects always hold
values of their fields' types, and the field helpers every part of the package reads (defaults, records,
values cut short for messages).

Only the standard library is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import reprlib
import types
import typing
from typing import Literal

from gqaify.errors import raise_if_problems


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


class FieldTemplate:
    """Several fields declared once, which any settings class places in its body under a name of its choosing, the
    fields' names made from it: `calib_data = Texts(...)` (`gqaify.text.settings`) places calib_data, calib_weights,
    calib_split and calib_text_column. `Settings` puts the fields where the template stands, before `dataclass`
    reads the class: the class declares them, in that place among its own."""

    def fields(self, name: str) -> dict[str, tuple[object, dataclasses.Field]]:
        """The fields placed under `name`, in order: each one's name -> (its type, its `setting(...)`)."""
        raise NotImplementedError


def _place_templates(cls: type) -> None:
    """Each `FieldTemplate` of the class body replaced by its fields, in its place among the class's annotations."""
    body = vars(cls)
    if not any(isinstance(value, FieldTemplate) for value in body.values()):
        return
    annotations = body.get("__annotations__", {})
    placed = {name: hint for name, hint in annotations.items() if name not in body}  # no value: dataclass's first
    for name, value in list(body.items()):  # the body's order
        if isinstance(value, FieldTemplate):
            for field_name, (hint, f) in value.fields(name).items():
                if field_name in annotations or field_name in placed:
                    raise TypeError(
                        f"{cls.__name__} declares {field_name} twice, once as {name} = {type(value).__name__}(...)"
                    )
                placed[field_name] = hint
                setattr(cls, field_name, f)
        elif name in annotations:
            placed[name] = annotations[name]
    cls.__annotations__ = placed


@dataclasses.dataclass(frozen=True)
class Override:
    """A stage's own default, or help line, for a field a base declares (`override`)."""

    default: object = dataclasses.MISSING  # MISSING: the base's
    help: str | None = None  # None: the base's


def override(default=dataclasses.MISSING, help: str | None = None) -> Override:
    """A stage's own default (or help line) for a field that a base of its settings declares, e.g. uptrain's

        calib_split = override(None, "split of calib_data (default: split)")

    The field's type and rules stay the base's (a default of None makes the type optional): it is declared once,
    with the base, and its other stages keep the base's default.
    """
    return Override(default, help)


class Settings:
    """The base of every stage's settings dataclass, and of the groups of fields several stages share.

    Its fields hold values of their types, or it is not made: `__post_init__` refuses every wrong type at once, as
    peft's configs check themselves in theirs (which raise at the first problem, and for value ranges too). Values
    are left to `problems()`: an object may be incomplete while it is built up (`EvalSettings(seq_len=1024)` is
    given its models later), and a range is reported with the problems found in the files, all in one message.

    A field is declared once, in one class; a subclass changes an inherited field's default or help with
    `override` (listed in its `overrides`), never by declaring the field again. Fields several stages declare alike
    under their own names are one `FieldTemplate`, which each places.
    """

    overrides = frozenset()  # the inherited fields whose default or help this class overrides (no field)
    # the names an earlier gqaify gave some of its fields, each by its field's name now: what files and records it
    # wrote say under them is read as the field (`current_names`), and their options are taken too
    renamed: typing.ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        """Put the fields of each `FieldTemplate` of the class body in its place, and turn each `override(...)` into
        the field it overrides, with the new default or help (before `dataclass` reads the class: the field keeps its
        place among the fields)."""
        super().__init_subclass__(**kwargs)
        _place_templates(cls)
        overridden = {name: value for name, value in vars(cls).items() if isinstance(value, Override)}
        cls.overrides = frozenset(overridden)
        if not overridden:
            return
        annotations = cls.__dict__.get("__annotations__", {})
        for name, change in overridden.items():
            base = next((b for b in cls.__mro__[1:] if name in getattr(b, "__dataclass_fields__", {})), None)
            if base is None:
                raise TypeError(f"{cls.__name__}.{name} overrides no field of its bases; declare it")
            f, hint = base.__dataclass_fields__[name], _hints(base)[name]
            default = field_default(f) if change.default is dataclasses.MISSING else change.default
            if default is None and not _is_a(None, hint):
                hint = hint | None
            annotations[name] = hint
            metadata = f.metadata
            setattr(
                cls,
                name,
                setting(
                    default,
                    change.help or metadata["help"],
                    required=metadata[_REQUIRED],
                    check=metadata[_RULES],
                    empty_list=metadata[_EMPTY_LIST],
                ),
            )
        cls.__annotations__ = annotations

    def __post_init__(self) -> None:
        for name, value in text_lists(type(self), dataclasses.asdict(self)).items():
            object.__setattr__(self, name, value)
        raise_if_problems(type_problems(self))

    def problems(self) -> list[str]:
        """Everything wrong with the values, at once; the stage's own (see `Stage.declared_problems`)."""
        raise NotImplementedError


class FieldGroup(Settings):
    """A group of fields several stages share (`gqaify.settings.groups`): a stage's settings inherit it, and list its
    fields after their own (in --help, problems and records). Each group says so in its body (`shared = True`),
    which the settings that inherit it do not: they are groups' heirs, not groups."""

    shared = False  # True in a group's own body


def is_group(cls: type) -> bool:
    """Whether `cls` is a group of shared fields itself (not settings that inherit one)."""
    return bool(vars(cls).get("shared"))


def declared_by(settings: type) -> dict[str, type]:
    """The class that declares each field of `settings` (an override stays its base's: `override`)."""
    found = {}
    for cls in reversed(settings.__mro__):
        for name in inspect.get_annotations(cls):
            found.setdefault(name, cls)
    return found


def ordered_fields(settings) -> list[dataclasses.Field]:
    """The fields of a settings class (or object) in the order its stage lists them: its own and its other bases'
    (the conversion's `MethodSettings`) in their order, then those of the shared groups it inherits."""
    cls = settings if isinstance(settings, type) else type(settings)
    owners, fields = declared_by(cls), {f.name: f for f in dataclasses.fields(cls)}
    shared = {}  # name: field, the groups in the order the class lists them, each group's fields in their order
    for group in cls.__mro__:
        if is_group(group):
            shared.update((f.name, fields[f.name]) for f in dataclasses.fields(group) if f.name not in shared)
    return [f for name, f in fields.items() if not is_group(owners[name])] + list(shared.values())


def type_problems(settings) -> list[str]:
    """Values of the wrong type or outside a field's choices (`Settings.__post_init__` refuses them)."""
    hints = _hints(type(settings))
    problems = []
    for f in ordered_fields(settings):
        value, hint = getattr(settings, f.name), hints[f.name]
        if not _is_a(value, hint):
            problems.append(f"{f.name} {shown(value)} is not {_describe(hint)}; fix the file, option or argument")
    return problems


@functools.cache
def _hints(settings: type) -> dict:
    """The field types of a settings class (its annotations are text until read: `from __future__ import
    annotations`), read once."""
    return typing.get_type_hints(settings)


def _without_none(hint):
    """X for `X | None` (the option takes an X; None is its default)."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 else hint


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
    return {f.name: field_default(f) for f in ordered_fields(settings)}


def recorded(settings, leave_out: frozenset[str] = frozenset()) -> dict:
    """The settings as JSON-ready data, without the fields in `leave_out`."""
    values = dataclasses.asdict(settings)
    return {f.name: values[f.name] for f in ordered_fields(settings) if f.name not in leave_out}


def current_names(settings: type, values: dict, where: str) -> dict:
    """`values` (a settings file's, a record's) with each key an earlier gqaify named otherwise (`Settings.renamed`)
    under the field's name now, in its place.

    Raises:
        UserError: a field given under both of its names.
    """
    renamed = getattr(settings, "renamed", {})
    both = [old for old in values if old in renamed and renamed[old] in values]
    raise_if_problems([f"{where}: {old} and {renamed[old]} both given; {old} is {renamed[old]}'s former name, give one"
                       for old in both])  # fmt: skip
    return {renamed.get(key, key): value for key, value in values.items()}


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
