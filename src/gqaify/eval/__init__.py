"""Perplexity beside the parent, KV-cache savings (analytic and measured), decode speed, diagnostics.

    gqaify.eval.run(gqaify.EvalSettings(models=[parent, converted], data=[text], out="report"))
    gqaify.evaluate([parent, converted], text, "report")                  (the same)

The entry point is `run` (`core.run`), its settings `settings.EvalSettings`. Names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["run"]

if TYPE_CHECKING:
    from gqaify.eval.core import run


def __getattr__(name: str):
    if name != "run":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from gqaify.eval.core import run

    globals()[name] = run
    return run
