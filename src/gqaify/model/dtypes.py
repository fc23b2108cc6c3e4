"""The dtypes a user may name (`--dtype`, `dtype:` in a recipe): the one table, shared by every stage.

auto (`gqaify.auto`) keeps what the checkpoint has: each tensor's own dtype when converting, the config's `dtype` when
loading a model. The names are those of torch and of transformers' config files. torch is imported only
when a name is turned into a dtype, so the command line can list the choices without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from gqaify.auto import AUTO, is_auto

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = (AUTO, "float32", "bfloat16", "float16")
DtypeName = Literal[DTYPE_NAMES]  # the type of a settings field that names one


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype called `name`, or None for "auto".

    Raises:
        ValueError: `name` is not in `DTYPE_NAMES` (settings fields typed `DtypeName` are checked first).
    """
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}")
    if is_auto(name):
        return None
    import torch

    return getattr(torch, name)
