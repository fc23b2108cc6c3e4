"""The attention shapes a conversion writes, one per `ATTENTION_INFO` entry: what checks a request for it, rewrites
the G-head folder the stream wrote into it, and writes it as one GGUF file.

A shape's module (its entry's `module`) defines three functions:

    problems(settings, config, out_is_gguf) -> list[str]   what the request cannot be, before anything is written
    rewrite(folder, settings, text, load_parent) -> Rewritten   the G-head folder made this shape, in place
    write_gguf(folder, out, out_type, tokenizer_gguf, record)   the folder as llama.cpp loads it

GQA is the stream's own output: no problems of its own, no rewrite, `to_gguf.write_gguf`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from gqaify.conversion.settings import ATTENTION_INFO, ShapeInfo
from gqaify.conversion.to_gguf import write_gguf


@dataclass(frozen=True)
class Shape:
    name: str
    info: ShapeInfo
    problems: Callable[..., list[str]]
    rewrite: Callable | None  # None: the G-head conversion is the output
    write_gguf: Callable[..., None]


def _shape(name: str, info: ShapeInfo) -> Shape:
    if info.module is None:
        return Shape(name, info, lambda *_: [], None, write_gguf)
    module = importlib.import_module(info.module)
    return Shape(name, info, module.problems, module.rewrite, module.write_gguf)


SHAPES: dict[str, Shape] = {name: _shape(name, info) for name, info in ATTENTION_INFO.items()}
