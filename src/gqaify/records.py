"""Records: what an artifact says about itself (a conversion's gqaify.json, the record inside a GGUF), as frozen
dataclasses, written and read back in one place.

`as_json(record)` is a record's JSON value; `from_json(cls, value)` reads one back typed: nested records, lists of
them, optional ones. A field declared `optional()` is left out of the JSON where it says nothing: while it is None
(`optional()`), or while another field is None (`optional(unless_none="calibration")`: what calibration measured
is said only by a calibrated conversion, null or not). Read back, a field left out takes its default.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

_OMITTED_WITH = "gqaify_omitted_with"  # the field whose None leaves this one out of the JSON

R = TypeVar("R")


def optional(default: Any = None, unless_none: str | None = None) -> Any:
    """A field left out of the JSON while it is None, or, with `unless_none`, while that other field is None."""
    return dataclasses.field(default=default, metadata={_OMITTED_WITH: unless_none or ""})


def as_json(record) -> dict:
    """`record` as a JSON object: its fields in order (nested records as objects), the optional ones that say
    nothing left out."""
    value = {}
    for f in dataclasses.fields(record):
        if _OMITTED_WITH in f.metadata and getattr(record, f.metadata[_OMITTED_WITH] or f.name) is None:
            continue
        value[f.name] = _json(getattr(record, f.name))
    return value


def _json(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_json(value)
    if isinstance(value, (list, tuple)):
        return [_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _json(item) for key, item in value.items()}
    return value


def from_json(cls: type[R], value: dict) -> R:
    """The record of type `cls` that the JSON object `value` holds (`as_json` read back).

    Raises:
        ValueError: a key `cls` has no field for (a record of something else, or of a later gqaify), or a
            required field missing.
    """
    if not isinstance(value, dict):
        raise ValueError(f"{cls.__name__} is a JSON object, not {type(value).__name__}")
    hints, names = _hints(cls), {f.name for f in dataclasses.fields(cls)}
    unknown = [key for key in value if key not in names]
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {unknown[0]!r}")
    try:
        return cls(**{key: _read(hints[key], item) for key, item in value.items()})
    except TypeError as exc:  # a required field missing
        raise ValueError(f"{cls.__name__}: {exc}") from None


def _read(hint, value):
    if value is None:
        return None
    if dataclasses.is_dataclass(hint):
        return from_json(hint, value)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        records = [a for a in args if dataclasses.is_dataclass(a)]
        if records and isinstance(value, dict):
            return from_json(records[0], value)
        lists = [a for a in args if typing.get_origin(a) is list]
        return _read(lists[0], value) if lists and isinstance(value, list) else value
    if origin is list and args:
        return [_read(args[0], item) for item in value]
    return value


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)
