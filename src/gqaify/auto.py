"""auto: the value of a setting that gqaify chooses itself when the work begins (a dtype: the checkpoint's; a
device: the GPU when there is one; a micro-batch: the most the device's memory fits), typed once: `Auto` in a
field's type, `AUTO` its value, `is_auto` the one test of it."""

from __future__ import annotations

from typing import Final, Literal

Auto = Literal["auto"]  # in a field's type: `int | Auto`
AUTO: Final[Auto] = "auto"


def is_auto(value: object) -> bool:
    """Whether `value` (a setting's, as read from a file, the command line or Python) asks gqaify to choose."""
    return isinstance(value, str) and value == AUTO
