"""The PNG figures gqaify draws (eval's report plots, uptrain's recovery plot): matplotlib set up in one place,
with its file-only backend, so that no display is needed and pyplot is imported only when a figure is drawn.
What matplotlib warns of while gqaify draws and saves a figure (a glyph its font lacks, in a model's name) goes to
the log (-v), not the user's terminal; warnings raised by the caller's own drawing block are left to the caller."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator
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


def distinct_colors(count: int) -> list[tuple[float, float, float, float]]:
    """`count` colours, no two alike up to twenty (tab10's up to ten, tab20's beyond): one per model of a report,
    by its place in the report (the parent first), so that each plot of one report draws a model in one colour;
    one per text of a run's panel."""
    import matplotlib

    palette = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    return [palette(i % palette.N) for i in range(count)]


def integer_ticks(ax: Axes, axis: str = "x") -> None:
    """Ticks at whole numbers only on the axis `axis` of `ax` (layers: no tick at layer 2.5; one, where a model has
    one layer)."""
    from matplotlib.ticker import MaxNLocator

    getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


# Round numbers per decade that a log axis is ticked at, the sparsest first (`round_ticks`)
ROUND_MANTISSAS = ((1,), (1, 3), (1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 8))


def log_scale(ax: Axes, axis: str = "y", linear_below: float | None = None) -> None:
    """The axis `axis` ("x" or "y") of `ax` on a log scale, ticked at round numbers written plainly (3, 4, 6; 1.25;
    20k; 1.5M), as many as fit with no label over another (`round_ticks`), never in scientific notation: matplotlib's
    own labels of an axis spanning less than a decade read "3×10⁰4×10⁰6×10⁰". Minor ticks are unlabelled.

    `linear_below`: where 0 is drawn too (a run's start), the smallest positive value drawn: the axis is linear from
    0 to it and logarithmic beyond (symlog), with a tick at 0."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    set_scale = getattr(ax, f"set_{axis}scale")
    if linear_below:
        set_scale("symlog", linthresh=linear_below, linscale=0.4)
    else:
        set_scale("log")
    which = getattr(ax, f"{axis}axis")
    which.set_major_locator(_round_locator()(linear_below))
    which.set_major_formatter(FuncFormatter(lambda value, _: plain_number(value)))
    which.set_minor_formatter(NullFormatter())


def round_ticks(low: float, high: float, fits: Callable[[list[float]], bool]) -> list[float]:
    """Round numbers from `low` to `high` (0 < low) for a log axis where `fits` says which sets of ticks have room for
    their labels: the sparsest set of `ROUND_MANTISSAS` that gives three ticks or more and fits (powers of ten every
    so many decades where even they do not); where none gives three, three or more evenly spaced round numbers
    (1.1, 1.2, 1.3; 0.2, 0.205, 0.21) that fit."""
    if not 0 < low < high:
        return [low] if 0 < low == high else []
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))

    def within(mantissas: tuple, every: int = 1) -> list[float]:
        found = (float(f"{m}e{d}") for d in range(first, last + 1) if d % every == 0 for m in mantissas)
        return [value for value in found if _between(value, low, high)]

    every = 1
    while not fits(best := within((1,), every)) and every <= last - first:
        every += 1
    for mantissas in ROUND_MANTISSAS[1:]:
        denser = within(mantissas)
        if len(best) >= 3 or not fits(denser):
            break
        best = denser
    if len(best) >= 3:
        return best
    from matplotlib.ticker import MaxNLocator

    for enough in (3, len(best) + 1):  # the fewest that give three; else more than `best`, if any fit
        for bins in (3, 4, 5, 6):
            evenly = MaxNLocator(nbins=bins, steps=[1, 2, 5, 10]).tick_values(low, high)
            evenly = [float(value) for value in evenly if _between(value, low, high)]
            if len(evenly) >= enough and fits(evenly):
                return evenly
    return best


def _between(value: float, low: float, high: float) -> bool:
    """`low` <= `value` <= `high`, a rounding error either side (0.21000000000000002 is 0.21) forgiven."""
    return low * (1 - 1e-9) <= value <= high * (1 + 1e-9)


def plain_number(value: float) -> str:
    """A tick's number written plainly, to six significant figures: 0.05, 1.25, 384, 1.5k, 20k, 1.5M, 3B."""
    if value == 0:
        return "0"
    import numpy

    scaled, suffix = value, ""
    for size, name in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            scaled, suffix = value / size, name
            break
    digits = numpy.format_float_positional(abs(scaled), precision=6, fractional=False, trim="-")
    return f"{'-' if value < 0 else ''}{digits}{suffix}"


@functools.cache
def _round_locator():
    """The class of `log_scale`'s locator (made on first use: matplotlib is imported only when a figure is drawn)."""
    import numpy
    from matplotlib.ticker import Locator

    class RoundNumbers(Locator):
        """Ticks at `round_ticks` for the axis's view, as many as its length holds apart (0 and the round numbers
        from `linear_below` up, on a symlog axis)."""

        def __init__(self, linear_below: float | None = None):
            self.linear_below = linear_below

        def __call__(self):
            return self.tick_values(*self.axis.get_view_interval())

        def tick_values(self, vmin, vmax):
            low, high = sorted((vmin, vmax))
            if not self.linear_below:
                return round_ticks(low, high, self._fits)
            zero = [0.0] if low <= 0 <= high else []
            return zero + round_ticks(max(low, self.linear_below), high, lambda ticks: self._fits(zero + ticks))

        def _fits(self, ticks: list[float]) -> bool:
            """Whether the labels of `ticks` stand apart along the axis: their centres at least half their two
            widths (x; heights on y) and a gap apart, a label's width estimated from its characters (a digit is
            0.64 em wide in DejaVu Sans, matplotlib's font)."""
            axis = self.axis
            if axis is None or len(ticks) < 2:
                return len(ticks) <= 9
            ends = sorted(axis.get_view_interval())
            scaled = axis.get_transform().transform(numpy.asarray([*ends, *ticks], dtype=float))
            box = axis.axes.bbox
            length = box.width if axis.axis_name == "x" else box.height
            at = (scaled[2:] - scaled[0]) / (scaled[1] - scaled[0]) * length
            em = axis.get_major_ticks(1)[0].label1.get_fontsize() * axis.axes.figure.dpi / 72
            sizes = [(0.64 * len(plain_number(t)) if axis.axis_name == "x" else 1.0) * em for t in ticks]
            apart = [b - a for a, b in zip(at, at[1:], strict=False)]
            needed = [(a + b) / 2 + 0.6 * em for a, b in zip(sizes, sizes[1:], strict=False)]
            return all(gap >= need for gap, need in zip(apart, needed, strict=True))

    return RoundNumbers
