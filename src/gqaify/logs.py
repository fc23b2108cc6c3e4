"""Other libraries' log messages where they are not the user's business: `muted` keeps a logger to its errors."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def muted(name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Within, the logger `name` (and its children) says only messages of `level` and above (default: errors);
    its level is restored after. `logging.CRITICAL + 1` silences it, for an error gqaify reports itself."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
