"""What a user names as a model: a local folder, a `.gguf` file, or a Hugging Face hub id.

The one resolver of a model name: `gqaify convert` opens what it finds (`conversion/source.py`), eval and
uptrain load it (`loading.py`). Nothing is fetched here, so a name is classified, or refused, at once.
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gqaify.model.gguf_header as gguf_header
from gqaify.errors import UserError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # owner/name, or a bare name (e.g. gpt2)


def is_repo_id(name: str) -> bool:
    """Whether `name` is written as a hub repository id (a model's or a dataset's): owner/name, or a bare name."""
    return _REPO_ID.fullmatch(name) is not None


def exists(name: str | os.PathLike) -> bool:
    """Whether the path a user named (`~` expanded) is there: the one existence check of a user's names. False,
    never an error, where the file system cannot even look the name up (pathlib's exists() raises ENAMETOOLONG for
    a name longer than it allows); `lookup_problem` says why."""
    return os.path.exists(os.path.expanduser(os.fspath(name)))


def lookup_problem(name: str | os.PathLike, option: str) -> str | None:
    """Why the file system refuses even to look up the path a user named (a name in it longer than it allows, a
    path longer than it allows, a NUL character), or None: such a name is no path, nor any hub id."""
    try:
        os.stat(os.path.expanduser(os.fspath(name)))
    except ValueError:  # "embedded null byte"
        return f"{option} {name!r} holds a NUL character, which no path or hub id holds; check the name"
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            size = max(len(os.fsencode(part)) for part in Path(name).parts)
            shown = name if len(name) <= 60 else f"{name[:40]}..."
            return (
                f"{option} {shown} names a path longer than the file system allows (its longest name {size} bytes, "
                f"{len(os.fsencode(name)):,} bytes in all); check the path or name"
            )
    return None


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
    if (problem := lookup_problem(name, option)) is not None:
        raise UserError(problem)
    path = Path(name).expanduser()
    if os.path.isdir(path):
        return Location(name, "local", path)
    if os.path.isfile(path):
        if path.suffix == ".gguf":
            if (problem := gguf_header.problem(path, option)) is not None:  # read bounded, before transformers
                raise UserError(problem)
            return Location(name, "gguf", path)
        raise UserError(f"{option} {name} is a file but not a .gguf; point it at a model folder, hub id, or .gguf file")
    if path.suffix == ".gguf" or name.startswith((".", "/", "~")) or not is_repo_id(name):
        raise UserError(f"{option} not found: {name} does not exist; check the path")
    return Location(name, "hub")


def local_positions(name: str | os.PathLike | None) -> int | None:
    """The positions of the model `name` as this machine already holds it, with no transformers and nothing fetched:
    what a command line's checks can say before any model is loaded. A folder's config.json (read as JSON), a GGUF's
    header (`ARCH.context_length`), a hub id's config.json in the hub's local cache. None where `name` is none, or
    nothing here says a whole number."""
    if not name:
        return None
    path = Path(os.path.expanduser(os.fspath(name)))
    if path.suffix == ".gguf" and path.is_file():
        try:
            fields = gguf_header.read(path).fields
        except (OSError, ValueError):
            return None
        return _positive(fields.get(f"{fields.get('general.architecture')}.context_length"))
    if not path.is_dir() and is_repo_id(os.fspath(name)):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(os.fspath(name), "config.json")
        path = Path(cached).parent if isinstance(cached, str) else path
    try:
        with open(path / "config.json", "rb") as file:
            config = json.loads(file.read(1 << 20))  # a config.json is a few KB
    except (OSError, ValueError):
        return None
    return _positive(config.get("max_position_embeddings") if isinstance(config, dict) else None)


def _positive(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
