"""The contract between gqaify and an attention shape: what a shape answers (`Shape`), what its rewrite records
(`ShapeRecord`) and returns (`Rewritten`). A shape's folder imports this module and nothing of `conversion.shapes`,
which finds the shapes (by name, from `ATTENTION_INFO`): so the arrows run from the lookup to the shapes and from
the shapes to this contract, never back.

    the request      what `--kv-cut` means for it, whether it reads calibration text, what it refuses, how a run
                     that converts to it is named
    the conversion   the memory plan's config, the note before a long rewrite, the rewrite of the G-head folder the
                     stream wrote, its bytes on disk, its GGUF file, which architectures' layers it takes
    its record       a `ShapeRecord` kept in gqaify.json under the shape's name: the model's name, its cache per
                     token, its summary and card lines
    the model        what uptraining and eval ask of a model, by its config: what it caches, whether the shape
                     wrote it, what float16 cannot hold, the parameters uptraining keeps as converted
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gqaify.conversion.registry import ATTENTION_INFO
from gqaify.records import named_type

if TYPE_CHECKING:
    from gqaify.model.archs import ArchSpec
    from gqaify.model.geometry import Geometry


@dataclass(frozen=True, kw_only=True)
class ShapeRecord:
    """What a shape's rewrite records in gqaify.json (`ConversionRecord.rewrite`, under the shape's name): a shape's
    own record derives from this one and is read back as itself, told by `shape` (`variant`)."""

    shape: str = ""  # the `ATTENTION_INFO` name it was written by (the pipeline fills it in: `named`)

    @classmethod
    def variant(cls, value: dict) -> type:
        """The record type of the JSON object `value`: its shape's (`ShapeInfo.record`).

        Raises:
            ValueError: a shape this gqaify does not know, or one that records no rewrite.
        """
        if cls is not ShapeRecord:
            return cls
        info = ATTENTION_INFO.get(value.get("shape"))
        if info is None or info.record is None:
            raise ValueError(f"a rewrite into shape {value.get('shape')!r}, which this gqaify does not write")
        return named_type(info.record)

    def named(self, name: str) -> ShapeRecord:
        return dataclasses.replace(self, shape=name)

    @property
    def cached_per_token(self) -> int:
        """The values one token caches per layer in the model written."""
        raise NotImplementedError

    def attention(self, kind: str) -> str:
        """What the model written is called, `kind` being the G-head model's ("GQA-2", "MQA")."""
        raise NotImplementedError

    def heads(self, source_kv_heads: int, num_heads: int) -> str | None:
        """The summary's K/V heads line where the G-head conversion is not what was kept (None: it is)."""
        return None

    def summary_lines(self) -> list[str]:
        """What the rewrite did, as lines of the conversion's summary."""
        return []

    def card_line(self, record) -> str:
        """What the rewrite did, as a bullet of the model card (`record`: the whole `ConversionRecord`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Rewritten:
    """The folder after a rewrite: its record, and what the sink's summary counts (as a `ShardWriter` says it)."""

    record: ShapeRecord
    num_shards: int
    bytes_written: int


@runtime_checkable
class Shape(Protocol):
    """What a shape answers, the whole of what gqaify asks of it. `s` is the settings of a conversion (or of an
    uptraining's conversion), `geometry` and `source` the source's `Geometry`, `config` its config.json."""

    float16: str | None  # why float16 cannot hold the models it writes (None: it can): "X is held below ..."

    def resolve_cut(self, s, geometry: Geometry) -> tuple[object, list[str]]:
        """`s` with what `--kv-cut` (given) decides for this shape filled in, and the request's problems."""

    def reads_text(self, s) -> bool:
        """Whether the rewrite `s` asks for is fitted on calibration text (beyond what its method reads)."""

    def problems(self, s, config: dict, out_is_gguf: bool) -> list[str]:
        """What a request for this shape cannot be, before anything is read or written."""

    def run_name(self, s) -> str:
        """How a run that converts to this shape is named, after the model: " as GQA-2", " as GQA, 1/2 cache"."""

    def covers(self, spec: ArchSpec) -> str:
        """Whether its rewrite takes the layer of the architecture `spec`, or why not, in words (the architecture
        table's column for the shape, docs/architectures.md)."""

    def planned_config(self, s, config, geometry: Geometry):
        """The transformers `config` (G K/V heads already set, changed in place) of the model the conversion
        writes, at its widest where calibration chooses: what a memory plan counts."""

    def cost_note(self, s, source: Geometry) -> str | None:
        """What the rewrite will do, said before a long one begins (None: nothing to say)."""

    def rewrite(self, folder: Path, s, text, load_parent: Callable[[], object], source: Geometry) -> Rewritten | None:
        """The G-head folder the stream wrote, made this shape in place (None: it is the output as it is)."""

    def weight_bytes(self, s, config: dict) -> int:
        """The bytes of the weights the rewrite writes, at most (the disk plan counts them)."""

    def write_gguf(self, folder: Path, out: Path, out_type: str, tokenizer_gguf, record) -> None:
        """The folder as one GGUF file llama.cpp loads."""

    def wrote(self, config) -> bool:
        """Whether `config` (a transformers config, or config.json's dict) is a model this shape's rewrite wrote."""

    def cached(self, config) -> int | None:
        """The values one token caches per layer in a model of this shape, read from its `config` (a transformers
        config); None: not a model of this shape, or one that caches whole K/V heads."""

    def held(self, model) -> list[str]:
        """The parameter names of `model` (one it wrote) that uptraining keeps as converted."""


def float16_problem(why: str | None, said: str | None, fix: str) -> str | None:
    """The refusal of float16, asked for as `said` (None: it was not), for models of a shape float16 cannot hold
    (`why`, its `Shape.float16`; None: it can)."""
    return f"{why}, which {said} cannot hold; {fix}" if why and said else None


CONTRACT = sorted({*Shape.__annotations__, *(name for name in vars(Shape) if not name.startswith("_"))})
