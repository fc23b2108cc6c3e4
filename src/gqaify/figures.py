"""The PNG figures gqaify draws (eval's report plots, uptrain's recovery plot): matplotlib set up in one place,
with its file-only backend, so that no display is needed and pyplot is imported only when a figure is drawn.
What matplotlib warns of while gqaify draws and saves a figure (a glyph its font lacks, in a model's name) goes to
the log (-v), not the user's terminal; warnings raised by the caller's own drawing block are left to the caller."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from gqaify.logs import muted

if TYPE_CHECKING:
    from matplotlib.axes import Axes

LOG = logging.getLogger(__name__)


@contextlib.contextmanager
def figure(
    path: str | os.PathLike,
    size: tuple[float, float],
    dpi: float = 120,
    save_dpi: float | str = "figure",
    ncols: int = 1,
) -> Iterator[Axes]:
    """The axes of one figure, laid out and saved to `path` (PNG) when the block completes; closed either way.

    Args:
        size: width and height in inches.
        dpi: the resolution the figure is laid out at.
        save_dpi: the resolution of the saved image ("figure": `dpi`).
        ncols: axes side by side: with more than one, a tuple of them is yielded.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size, dpi=dpi, ncols=ncols)
    fig.set_label(os.fspath(path))  # the name `_drawing` logs under, in `readable_xticks` too
    try:
        with muted("matplotlib"):
            yield ax if ncols == 1 else tuple(ax)
            with _drawing(fig):
                fig.tight_layout()
                fig.savefig(path, dpi=save_dpi)
    finally:
        plt.close(fig)


@contextlib.contextmanager
def _drawing(fig) -> Iterator[None]:
    """gqaify's own calls that draw `fig` (lay it out, save it, measure its texts): what is warned of meanwhile (a
    glyph the font lacks, in a model's name) goes to the log (-v) under the figure's file, once per call, not
    to the user's terminal. Only these calls: a warning raised in the caller's `with figure()` block reaches the
    caller as any other."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        yield
    for message in dict.fromkeys(str(w.message) for w in said):
        LOG.info("%s: %s", fig.get_label(), message)


def readable_xticks(ax: Axes, fontsize: float = 8) -> None:
    """The x tick labels as set where none overprints its neighbour or leaves the figure; else each upright (rotated
    90 degrees) and the figure widened and heightened so that each label has its own column and fits (8 texts and
    more, long names).
    Call it after the labels are set, before the figure is laid out."""
    fig = ax.figure
    with _drawing(fig):
        _upright_where_needed(ax, fig, fontsize)


def _upright_where_needed(ax: Axes, fig, fontsize: float) -> None:
    """`readable_xticks` itself, which measures the labels drawn (under `_drawing`)."""
    renderer = fig.canvas.get_renderer()
    labels = [label for label in ax.get_xticklabels() if label.get_text()]

    def boxes():
        return sorted((label.get_window_extent(renderer) for label in labels), key=lambda box: box.x0)

    placed = boxes()
    apart = all(a.x1 <= b.x0 for a, b in zip(placed, placed[1:], strict=False))  # each beside the next
    inside = all(box.x0 >= 0 and box.x1 <= fig.bbox.x1 for box in placed)
    if apart and inside:
        return
    for label in labels:
        label.set(rotation=90, ha="center", fontsize=fontsize)
    line = max(box.width for box in boxes()) / fig.dpi  # inches: a label's width, upright
    tallest = max(box.height for box in boxes()) / fig.dpi  # inches: the longest label, upright
    width, height = fig.get_size_inches()
    columns = len(labels) * max(1, len(ax.containers))  # one column per bar at least
    fig.set_size_inches(max(width, 1.5 + columns * max(line * 1.6, 0.25)), height + tallest)
