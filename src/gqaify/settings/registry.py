"""Every command that runs a stage, listed once (`StageEntry`, in `gqaify/entry/stages.py`): its name, its help
line, and where its settings (`Stage`) and its entry (`command_line(argv, prog)`) live, each by "module:name".

The list is declared by the package's front door (gqaify/__init__.py), which Python runs before any gqaify module
is imported: this module sits below every stage and imports none of them by statement, yet `every_stage()` gives
them all (each imported on first use), so that a settings file of another command is named as such wherever it is
read (`gqaify eval --config OUT/gqaify.json`: "is a conversion record, not eval's; use `gqaify convert ...`").
A new stage is one entry in that list; `gqaify` builds its command from it.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class StageEntry:
    """One command that runs a stage."""

    name: str  # the command: `gqaify NAME`
    help: str  # its line in `gqaify --help`
    settings: str  # "module:NAME" of its `Stage`
    command_line: str  # "module:function": parses argv (--help answers before torch), runs, prints its summary


def resolve(where: str):
    """The object "module:name" names, its module imported."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)


_DECLARED: list[StageEntry] = []


def declare(entries: tuple[StageEntry, ...]) -> None:
    """The stages, as gqaify/__init__.py declares them from `gqaify.entry.stages.STAGES` (once, before any stage
    runs)."""
    _DECLARED[:] = entries
    every_stage.cache_clear()


def declared() -> tuple[StageEntry, ...]:
    return tuple(_DECLARED)


@functools.cache
def every_stage() -> tuple:
    """Every declared command's `Stage`, in the order declared."""
    return tuple(resolve(entry.settings) for entry in _DECLARED)
