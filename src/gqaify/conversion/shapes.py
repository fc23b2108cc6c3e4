"""The attention shapes a conversion writes, one per `ATTENTION_INFO` entry: what checks a request for it, rewrites
the G-head folder the stream wrote into it, and writes it as one GGUF file.

A shape's module (its entry's `module`) defines four functions, looked up when called:

    problems(settings, config, out_is_gguf) -> list[str]   what the request cannot be, before anything is written
    rewrite(folder, settings, text, load_parent, source_geometry) -> Rewritten   the G-head folder made this shape
    write_gguf(folder, out, out_type, tokenizer_gguf, record)   the folder as llama.cpp loads it
    weight_bytes(settings, config) -> int   the weights the rewrite writes, at most (the disk plan's)
    cost_note(settings, source_geometry) -> str | None   what the rewrite will do, said before a long one begins

GQA is the stream's own output: no problems of its own, no rewrite, `to_gguf.write_gguf`, the stream's plan.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import gqaify.conversion.to_gguf as to_gguf
from gqaify.conversion.settings import ATTENTION_INFO, ShapeInfo


@dataclass(frozen=True)
class Shape:
    name: str
    info: ShapeInfo

    @property
    def module(self) -> ModuleType | None:
        return None if self.info.module is None else importlib.import_module(self.info.module)

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
