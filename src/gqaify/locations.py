"""What a user names as a model: a local folder, a `.gguf` file, or a Hugging Face hub id.

The one resolver of a model name: `gqaify convert` opens what it finds (`conversion/source.py`), eval and
uptrain load it (`models.py`). Nothing is fetched here, so a name is classified, or refused, at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gqaify.gguf_header as gguf_header
from gqaify.errors import UserError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # owner/name, or a bare name (e.g. gpt2)


@dataclass(frozen=True)
class Location:
    name: str  # as the user wrote it
    kind: Literal["local", "gguf", "hub"]
    path: Path | None = None  # the folder or .gguf file, for local and gguf


def locate(name: str | Path, option: str = "MODEL") -> Location:
    """Where `name` is: an existing folder, an existing .gguf file, or else a hub id.

    Raises:
        UserError: `name` is a file other than a .gguf, or a .gguf gqaify cannot read (`gguf_header.problem`), or
            looks like a path (or like no hub id) and does not exist.
    """
    name = str(name)
    if not name.strip():
        raise UserError(f"{option} is empty; name a model folder, hub id or .gguf file")
    path = Path(name).expanduser()
    if path.is_dir():
        return Location(name, "local", path)
    if path.is_file():
        if path.suffix == ".gguf":
            if (problem := gguf_header.problem(path, option)) is not None:  # read bounded, before transformers
                raise UserError(problem)
            return Location(name, "gguf", path)
        raise UserError(f"{option} {name} is a file but not a .gguf; point it at a model folder, hub id, or .gguf file")
    if path.suffix == ".gguf" or name.startswith((".", "/", "~")) or not _REPO_ID.match(name):
        raise UserError(f"{option} not found: {name} does not exist; check the path")
    return Location(name, "hub")
