"""The attention shapes a conversion writes, one per `ATTENTION_INFO` entry: what checks a request for it, rewrites
the G-head folder the stream wrote into it, and writes it as one GGUF file.

A shape is one folder: a package (its entry's `module`, e.g. `gqaify.conversion.mla`) that is a `ShapeModule`,
the five functions the pipeline calls. GQA is the stream's own output: no problems of its own, no rewrite,
`to_gguf.write_gguf`, the stream's plan, nothing to announce.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import gqaify.conversion.to_gguf as to_gguf
from gqaify.conversion.settings import ATTENTION_INFO, ShapeInfo

if TYPE_CHECKING:
    from gqaify.model.geometry import Geometry


@runtime_checkable
class ShapeModule(Protocol):
    """What a shape's package defines: the contract between the conversion pipeline and a shape."""

    def problems(self, settings, config: dict, out_is_gguf: bool) -> list[str]:
        """What a request for this shape cannot be, from the settings and the source's config.json, before
        anything is read or written."""

    def rewrite(self, folder: Path, settings, text, load_parent: Callable[[], object], source: Geometry):
        """The G-head folder the stream wrote, made this shape in place (its weights and config.json); returns what
        the summary counts (a record, the shards written, their bytes)."""

    def write_gguf(self, folder: Path, out: Path, out_type: str, tokenizer_gguf, record) -> None:
        """The rewritten folder as one GGUF file llama.cpp loads."""

    def weight_bytes(self, settings, config: dict) -> int:
        """The bytes of the weights the rewrite writes, at most (the disk plan counts them)."""

    def cost_note(self, settings, source: Geometry) -> str | None:
        """What the rewrite will do, said before a long one begins (None: nothing to say)."""


@dataclass(frozen=True)
class Shape:
    name: str
    info: ShapeInfo

    @property
    def module(self) -> ShapeModule | None:
        """The shape's package (None: GQA, the stream's own output)."""
        if self.info.module is None:
            return None
        module = importlib.import_module(self.info.module)
        if not isinstance(module, ShapeModule):  # a new shape's package that misses one of the five
            raise TypeError(f"{self.info.module} is not a ShapeModule: it lacks one of {_CONTRACT}")
        return module

    def problems(self, s, config: dict, out_is_gguf: bool) -> list[str]:
        return [] if self.module is None else self.module.problems(s, config, out_is_gguf)

    @property
    def rewrite(self) -> Callable | None:
        """The rewrite of the G-head folder into this shape (None: the G-head conversion is the output)."""
        return None if self.module is None else self.module.rewrite

    def write_gguf(self, *args) -> None:
        return (to_gguf if self.module is None else self.module).write_gguf(*args)

    def cost_note(self, s, source_geometry) -> str | None:
        """What this shape's rewrite will do, said before a conversion begins where it is long (None: nothing to
        say; GQA's stream is the conversion)."""
        return None if self.module is None else self.module.cost_note(s, source_geometry)

    def weight_bytes(self, s, config: dict) -> int:
        """The bytes of the weights this shape's rewrite writes, at most (0: it writes none; the stream's plan
        counts the G-head model)."""
        return 0 if self.module is None else self.module.weight_bytes(s, config)


SHAPES: dict[str, Shape] = {name: Shape(name, info) for name, info in ATTENTION_INFO.items()}


_CONTRACT = ", ".join(name for name in vars(ShapeModule) if not name.startswith("_"))
