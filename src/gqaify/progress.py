"""The progress bar every long step shows (`progress_bar`): tqdm's, drawn where standard error is a terminal, and
none where it is not (a log, a pipe) or the command was asked for none (`--no-progress`, `-q`).

A terminal that reports no size (a pseudo-terminal nobody sized: `script`, `ssh -T`, some IDEs and CI consoles)
made tqdm draw nothing at all for the minutes of a fit: it takes 0 rows as no room for a bar. Such a terminal is
given 80 columns and 24 rows.
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm

UNSIZED = (80, 24)  # the columns and rows of a terminal that reports no size


def progress_bar(iterable=None, *, shown: bool, **kwargs) -> tqdm:
    """A tqdm bar over `iterable` (or updated by hand, with total=), drawn where `shown` and standard error is a
    terminal; `kwargs` are tqdm's (desc, unit, total, initial...)."""
    columns, rows = _size()
    return tqdm(iterable, disable=not shown or None, ncols=columns, nrows=rows, **kwargs)


def _size() -> tuple[int | None, int | None]:
    """The bar's (columns, rows): None, None (tqdm's own, following the terminal) where standard error is a terminal
    that reports its size, or no terminal; `UNSIZED` where it is a terminal that reports none."""
    try:
        if not sys.stderr.isatty():
            return None, None
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture), or none at all
        return None, None
    return (None, None) if size.columns and size.lines else UNSIZED
