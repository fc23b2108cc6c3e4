"""Sizes as people write them ("5GB", "500MiB", 1024) in bytes, the spelling transformers and accelerate read.

(accelerate's `convert_file_size_to_int` reads the same strings, but importing accelerate takes seconds; the
command line checks its options before loading anything heavy.)
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int | None:
    """Bytes in `size` (an int, or digits and a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), or None if it is
    not a positive size."""
    if isinstance(size, bool):
        return None
    if isinstance(size, int):
        return size if size > 0 else None
    match = _SIZE.match(str(size))
    if match is None or match[2].upper() not in _UNITS:
        return None
    value = int(float(match[1]) * _UNITS[match[2].upper()])
    return value if value > 0 else None
