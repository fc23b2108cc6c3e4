"""What a converted folder says about itself: config.json, the side files, gqaify.json and the model card.

config.json   the source's, with the new num_key_value_heads (and dtype, when cast)
side files    tokenizer, generation config, chat template, licence: copied as they are
modeling_gqaify.py   only for a type transformers has no K/V head count for (gpt2, gpt_neox, opt): the
              class with K/V heads, registered in config.json's `auto_map` for `trust_remote_code=True`
README.md     the model card (`card.py`)
gqaify.json   provenance: source (name, revision, SHA-256 of every weight file), method, groups, grouping,
              calibration (with the SHA-256 of its text) and fit error, tool version, the settings (a rerun),
              and every file written (what --force may replace)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from gqaify.auto import is_auto
from gqaify.conversion.registry import ATTENTION_INFO
from gqaify.conversion.settings import CalibrationRecord
from gqaify.conversion.shape_contract import ShapeRecord
from gqaify.conversion.source import Source
from gqaify.model.archs import ArchSpec
from gqaify.model.geometry import Geometry, attention_kind
from gqaify.records import (
    CONVERSION,
    UPTRAINED,
    Provenance,
    Uptraining,
    optional,
    read_provenance,
    read_record,
)
from gqaify.shipped import SHIPPED_FILE, SHIPPED_MODULE


def kv_groups(source_kv_heads: int, kv_heads: int) -> list[list[int]]:
    """The source K/V heads that make up each of the `kv_heads` new heads (contiguous, as `repeat_kv`)."""
    size = source_kv_heads // kv_heads
    return [list(range(g * size, (g + 1) * size)) for g in range(kv_heads)]


def write_config_and_side_files(source: Source, spec: ArchSpec, folder: Path, kv_heads: int, dtype: str) -> None:
    """config.json with the new num_key_value_heads (and dtype when cast); tokenizer and friends as they are; the
    shipped modeling file where transformers' class has no K/V heads."""
    config = {**source.config, "num_key_value_heads": kv_heads}
    if spec.shipped_class is not None:
        config["auto_map"] = {"AutoModelForCausalLM": f"{SHIPPED_MODULE}.{spec.shipped_class}"}
        shutil.copyfile(SHIPPED_FILE, folder / SHIPPED_FILE.name)
    if not is_auto(dtype):
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.side_files():
        shutil.copyfile(path, folder / path.name)


@dataclass(frozen=True)
class SourceRecord:
    """What was converted: the source as named, where it was read, its revision, and every weight file's SHA-256."""

    name: str  # `Source.recorded_name`: a hub id, or an absolute path
    kind: str  # local, hub or gguf
    path: str | None  # a local folder's
    revision: str | None  # a hub source's commit
    sha256: dict[str, str]  # weight file: its SHA-256
    gguf_file: str | None = optional()  # a GGUF source's file name

    @classmethod
    def of(cls, source: Source, hashes: dict[str, str]) -> SourceRecord:
        path = str(source.directory) if source.kind == "local" else None
        return cls(source.recorded_name, source.kind, path, source.revision, hashes, **source.provenance)


@dataclass(frozen=True, kw_only=True)
class ConversionRecord(Provenance):
    """A conversion's record: gqaify.json in its folder, `to_gguf.RECORD_KEY` inside its GGUF file (`as_json`),
    read back with `read` (`records.read_record`). Enough to rerun it (`settings`, with `gqaify convert --config`)
    and to check it (the source's hashes, the calibration text's). An uptrained model's final/ keeps it, with
    `uptrain` and the kind `UPTRAINED` (`uptrained`)."""

    kind: str = CONVERSION
    source: SourceRecord
    model_type: str
    method: str
    kv_heads: int
    source_geometry: Geometry
    groups: list[list[int]]  # the source K/V heads pooled into each new one (contiguous)
    dtype: str
    shipped: str | None  # the class of modeling_gqaify.py the output loads with, if any
    card: dict  # the source's hub id and licence, for the model card (`card.source_metadata`)
    seed: int | None = optional()  # --method random's
    grouping: str
    calibration: CalibrationRecord | None
    settings: dict  # as resolved (`core.resolved_record`): a rerun's
    rotary_dim: int | None = optional(unless_none="calibration")
    permutations: list[list[int]] | None = optional(unless_none="calibration")  # per layer (similarity)
    fit_error: list[dict] | None = optional(unless_none="calibration")  # per layer (`calibrate.LayerFit.record`)
    rewrite: ShapeRecord | None = optional()  # the G-head model rewritten as another shape: that shape's record
    uptrain: Uptraining | None = optional()  # in an uptrained model's final/: how it was uptrained
    files: list[str] | None = (
        optional()
    )  # in a folder: every file gqaify wrote there (`output.destination.write_provenance`)

    @classmethod
    def read(cls, folder: Path) -> ConversionRecord | None:
        """The record in `folder`'s gqaify.json; None where there is none, or it records no conversion (another
        kind, one a later gqaify writes included).

        Raises:
            ValueError: a conversion's record that cannot be read (damaged, or with fields of a later gqaify).
        """
        header = read_provenance(folder)
        if header is None or header.kind not in (CONVERSION, UPTRAINED):
            return None
        record = read_record(folder)
        return record if isinstance(record, cls) else None

    def stored(self, value: dict) -> dict:
        """The JSON `as_json` made, the rewrite under its shape's name, where it stays put (as gqaify 0.2 wrote)."""
        if self.rewrite is None:
            return value
        inner = {key: item for key, item in value["rewrite"].items() if key != "shape"}  # the key says it
        return dict((self.rewrite.shape, inner) if key == "rewrite" else (key, item) for key, item in value.items())

    @classmethod
    def from_stored(cls, value: dict) -> dict:
        """`stored` read back: the key that names a shape is the rewrite (`ShapeRecord.variant` reads it as its own)."""
        named = {key for key, item in value.items() if key in ATTENTION_INFO and isinstance(item, dict)}
        return {
            ("rewrite" if key in named else key): {"shape": key, **item} if key in named else item
            for key, item in value.items()
        }

    @property
    def attention(self) -> str:
        """What the converted model's attention is called: "GQA-2", "MQA", or its shape's name for it
        (`ShapeRecord.attention`)."""
        kind = attention_kind(self.kv_heads)
        return kind if self.rewrite is None else self.rewrite.attention(kind)

    @property
    def output_geometry(self) -> Geometry:
        """The converted model's attention shape: G K/V heads, or the cache its shape's rewrite made of them."""
        geometry = self.source_geometry.with_kv_heads(self.kv_heads)
        return geometry if self.rewrite is None else geometry.with_cached(self.rewrite.cached_per_token)

    def uptrained(self, uptrain: Uptraining) -> ConversionRecord:
        """This conversion's record as the final/ of its uptraining holds it."""
        return replace(self, kind=UPTRAINED, uptrain=uptrain, files=None)
