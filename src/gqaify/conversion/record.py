"""What a converted folder says about itself: config.json, the side files, gqaify.json and the model card.

    config.json   the source's, with the new num_key_value_heads (and dtype, when cast)
    side files    tokenizer, generation config, chat template, licence: copied as they are
    modeling_gqaify.py   only for a type transformers has no K/V head count for (gpt2, gpt_neox, opt): the
                  class with K/V heads, registered in config.json's `auto_map` for `trust_remote_code=True`
    README.md     a short model card
    gqaify.json   provenance: source (name, revision, SHA-256 of every weight file), method, groups, grouping,
                  calibration and fit error, tool version, and every file written (what --force may replace)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from gqaify import __version__
from gqaify.archs import ArchSpec, Geometry
from gqaify.conversion.options import METHOD_INFO
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


def provenance(source: Source, spec: ArchSpec, geometry: Geometry, kv_heads: int, method: str, dtype: str,
               seed: int, hashes: dict[str, str]) -> dict:  # fmt: skip
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
    }
    if method == "random":
        record["seed"] = seed
    return record


def model_card(record: dict) -> str:
    """README.md of a converted folder, from its provenance record."""
    src, g = record["source"], record["source_geometry"]
    kind = "MQA" if record["kv_heads"] == 1 else f"GQA-{record['kv_heads']}"
    base = f"base_model: {src['name']}\n" if src["kind"] == "hub" else ""
    rewritten = "K/V projections rewritten"
    if METHOD_INFO[record["method"]].folds or record.get("grouping") == "similarity" or record.get("calibration"):
        rewritten = "K/V projections, q_proj rows and o_proj columns rewritten"
    grouping = ""
    if record.get("grouping") == "similarity":
        grouping = ", heads reordered within each layer so that similar ones share a K/V head"
    if calibration := record.get("calibration"):
        how = "on the parent's activations"
        if calibration["mode"] == "sequential":
            how = "layer by layer, each layer repaired against the parent's outputs"
        if calibration.get("refine_steps"):
            how += f", {calibration['refine_steps']} refinement steps per layer"
        grouping += f" (calibrated on {calibration['tokens']:,} tokens of `{calibration['data']}`, {how})"
    return f"""---
{base}library_name: transformers
tags: [gqaify, {kind.lower()}]
---
# {Path(src["name"]).name} → {kind}

Converted by [gqaify](https://pypi.org/project/gqaify/) {record["version"]} from `{src["name"]}`
({src["kind"]}{", revision " + src["revision"] if src["revision"] else ""}).

- Attention: {g["num_heads"]} query heads; K/V heads {g["num_kv_heads"]} → {record["kv_heads"]} \
(KV cache {g["num_kv_heads"] // record["kv_heads"]}× smaller).
- Method: `{record["method"]}`{grouping}; query head i reads K/V head i // {g["num_heads"] // record["kv_heads"]} \
(contiguous groups, as transformers' `repeat_kv`).
- {rewritten}; everything else is copied from the source unchanged. `gqaify.json` records the groups, \
calibration, per-layer fit error and source hashes.

A converted model loses quality until it is uptrained briefly (GQA paper, Ainslie et al. 2023); \
compare it with its parent before use.
"""
