"""Other libraries' log messages where they are not the user's business: `muted` keeps a logger to its errors."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def muted(name: str) -> Iterator[None]:
    """Within, the logger `name` (and its children) says only errors; its level is restored after."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
