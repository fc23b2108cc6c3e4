"""The progress bar every long step shows (`progress_bar`): tqdm's, drawn where standard error is a terminal; where
it is not (a log, a pipe), a line of the bar's figures at most once a `LOG_EVERY`, and none for work done sooner;
nothing where the command was asked for none (`--no-progress`, `-q`).

A terminal that reports no size (a pseudo-terminal nobody sized: `script`, `ssh -T`, some IDEs and CI consoles)
made tqdm draw nothing at all for the minutes of a fit: it takes 0 rows as no room for a bar. Such a terminal is
given 80 columns and 24 rows.

A description is given whole (a model's name, its path): a log writes it whole, and a terminal that it leaves too
little room cuts it in its middle, its start and its end kept, so that the figures after it still show (tqdm cuts a
line too long for the terminal at its right end, figures first).
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm

UNSIZED = (80, 24)  # the columns and rows of a terminal that reports no size
LOG_EVERY = 60.0  # seconds: in a log, a line of the bar's figures at most this often, the first after this long


def progress_bar(iterable=None, *, shown: bool, **kwargs) -> tqdm:
    """A tqdm bar over `iterable` (or updated by hand, with total=), where `shown`: drawn on a terminal, written as
    lines to a log (`_Lines`); `kwargs` are tqdm's (desc, unit, total, initial...)."""
    if not shown:
        return tqdm(iterable, disable=True, **kwargs)
    if not _on_a_terminal():  # tqdm's figures alone (ncols=0), each its own line, the last when the work ends
        lines = _Lines(sys.stderr)
        return _LogBar(iterable, file=lines, ncols=0, mininterval=LOG_EVERY, delay=LOG_EVERY, miniters=1, **kwargs)
    columns, rows = _size()
    if isinstance(kwargs.get("desc"), str):
        kwargs["desc"] = _fitted(kwargs["desc"], columns or _width())
    return tqdm(iterable, ncols=columns, nrows=rows, **kwargs)


def announce(text: str, *, shown: bool) -> None:
    """Say `text` on standard error before long work begins, where progress is `shown` (a terminal or a log alike):
    what the work will be, for the bars that follow to count down."""
    if shown:
        print(text, file=sys.stderr, flush=True)


class _LogBar(tqdm):
    """A bar written to a log: tqdm's, but a new postfix or description (`set_postfix`, which redraws at once on a
    terminal) shows at the bar's next line, at its own pace."""

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_description(self, desc=None, refresh=True):
        super().set_description(desc, refresh=False)

    def close(self):
        """tqdm's close, which writes the bar's final line, unless the line written last already says it: a bar
        whose last step came a minute or more after its previous line wrote its 100% line twice."""
        if not self.disable and getattr(self, "last_print_n", None) == self.n:
            self.leave = False  # tqdm then clears the bar instead, which in a log writes nothing
        super().close()


class _Lines:
    """Where a bar writes in a log: each status tqdm draws ("\\rcalibrating:  40%| 12/30 [01:00<01:30, ...]"), one
    line of its own, rather than one line of carriage returns that a log shows whole at the end."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        if line := text.strip("\r\n").rstrip():
            self.stream.write(line + "\n")
            self.stream.flush()

    def flush(self) -> None:
        self.stream.flush()


def _on_a_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (ValueError, AttributeError):  # closed, or no standard error at all
        return False


# the room a terminal bar keeps for its figures ("100% 10/10 [04:10<00:00, 25.00s/layer]") and a bar worth seeing
FIGURES = 48


def _fitted(desc: str, columns: int) -> str:
    """`desc` on a terminal of `columns`: whole where it leaves `FIGURES` columns, else cut in its middle (its start
    and its end kept: the kind of work, and the end of a model's name or path) to leave them."""
    room = max(columns - FIGURES, 16)
    if len(desc) <= room:
        return desc
    head = (room - 3) // 2
    return f"{desc[:head]}...{desc[len(desc) - (room - 3 - head) :]}"


def _width() -> int:
    """The columns of the terminal standard error is, or `UNSIZED`'s where it says none (or cannot be asked)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns or UNSIZED[0]
    except (OSError, ValueError, AttributeError):
        return UNSIZED[0]


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
