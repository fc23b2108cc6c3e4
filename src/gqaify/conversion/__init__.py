"""Streaming conversion of a checkpoint's K/V heads.

    gqaify.conversion.run(gqaify.ConvertSettings(src=..., out=..., kv_heads=1))   the entry (`core.convert_with`)
    gqaify.convert(src, out, kv_heads=1)                                         (the same, by keyword)

settings.py   what can be asked (methods, groupings, calibration settings), as data
source.py     SRC -> a folder of config and side files plus a tensor reader
checkpoint.py lazy tensor readers and the streaming shard writer
layout.py     one layer's head-indexed tensors <-> head-major tensors
methods.py    how a group of heads becomes one (pure functions of one layer)
fit.py        the linear algebra of the calibrated methods
grouping.py   which heads share a K/V head
calibrate.py  the statistics the calibrated methods fit on
sinks.py      where it goes: a folder, or one GGUF file
core.py       the steps: check, plan, fit, stream, commit
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["run"]

if TYPE_CHECKING:
    from gqaify.conversion.core import convert_with as run


def __getattr__(name: str):
    if name != "run":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from gqaify.conversion.core import convert_with

    globals()[name] = convert_with
    return convert_with
