"""Every command that runs a stage, listed once (`StageEntry`, in `gqaify/entry/stages.py`): its name, its help
line, where its settings (`Stage`) and its entry (`command_line(argv, prog)`) live, each by "module:name", and the
kinds of record that rerun it (`--config RECORD`).

The list is declared by the package's front door (gqaify/__init__.py), which Python runs before any gqaify module
is imported: this module sits below every stage and imports none of them by statement, yet `every_stage()` gives
them all (each imported on first use), so that a settings file of another command is named as such wherever it is
read (`gqaify eval --config OUT/gqaify.json`: "is a conversion record, not eval's; use `gqaify convert ...`").
A new stage is one entry in that list; `gqaify` builds its command from it.

A command's name is written there alone: its `Stage` reads it from its entry (`Stage.command`, `entry_of`), and a
record gives the command it reruns by its kind, which the entry lists (`rerun_by`).
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class StageEntry:
    """One command that runs a stage."""

    name: str  # the command: `gqaify NAME`
    help: str  # its line in `gqaify --help`
    settings: str  # "module:NAME" of its `Stage`
    command_line: str  # "module:function": parses argv (--help answers before torch), runs, prints its summary
    records: tuple[str, ...]  # the kinds of record (`records.KINDS`) `--config RECORD` reruns it from, its own first


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


def entry_of(stage) -> StageEntry:
    """The declared entry that names the `Stage` `stage` (compared by identity in its module, which is imported:
    `stage` was made there; no other stage is imported).

    Raises:
        LookupError: no declared entry names `stage`.
    """
    for entry in _DECLARED:
        module, _, name = entry.settings.partition(":")
        if getattr(sys.modules.get(module), name, None) is stage:
            return entry
    raise LookupError(f"no entry of the declared stages names the Stage of {stage.settings.__name__}; add one")


def rerun_by(kind: str) -> str:
    """The command a record of `kind` reruns (`--config RECORD`): the declared entry's that lists the kind.

    Raises:
        LookupError: no declared entry lists `kind`.
    """
    for entry in _DECLARED:
        if kind in entry.records:
            return entry.name
    raise LookupError(f"no declared stage reruns a {kind!r} record; list it in its entry's records")
