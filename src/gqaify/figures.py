"""The PNG figures gqaify draws (eval's report plots, uptrain's recovery plot): matplotlib set up in one place,
with its file-only backend, so that no display is needed and pyplot is imported only when a figure is drawn."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes


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
    try:
        yield ax if ncols == 1 else tuple(ax)
        fig.tight_layout()
        fig.savefig(path, dpi=save_dpi)
    finally:
        plt.close(fig)
