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
from dataclasses import asdict
from pathlib import Path

from gqaify._version import __version__
from gqaify.archs import ArchSpec, Geometry
from gqaify.conversion.card import source_metadata
from gqaify.conversion.source import Source
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
    if dtype != "auto":
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.side_files():
        shutil.copyfile(path, folder / path.name)


def provenance(
    source: Source,
    spec: ArchSpec,
    geometry: Geometry,
    kv_heads: int,
    method: str,
    dtype: str,
    seed: int,
    hashes: dict[str, str],
) -> dict:
    """The record of a conversion (without what calibration adds, and without the file list)."""
    record = {
        "tool": "gqaify",
        "version": __version__,
        "source": {
            "name": source.name,
            "kind": source.kind,
            "path": str(source.directory) if source.kind == "local" else None,
            "revision": source.revision,
            "sha256": hashes,
            **source.provenance,
        },
        "model_type": spec.model_type,
        "method": method,
        "kv_heads": kv_heads,
        "source_geometry": asdict(geometry),
        "groups": kv_groups(geometry.num_kv_heads, kv_heads),
        "dtype": dtype,
        "shipped": spec.shipped_class,  # the class of modeling_gqaify.py the output loads with, if any
        "card": source_metadata(source.directory, source.kind, source.name),  # hub id and licence, for the card
    }
    if method == "random":
        record["seed"] = seed
    return record
