"""The model card (README.md) of a converted or uptrained folder, through huggingface_hub's `ModelCard`.

Its YAML metadata is what the Hub reads: `base_model` (the source's hub id, where it has one) with
`base_model_relation: finetune` (of the Hub's four relations, the one for weights derived from the parent),
`library_name: transformers`, the tags `gqaify` and the shape's name (`gqa`, plus `mqa` for one K/V head, or the
shape a rewrite made; `custom_code` where the output carries its modeling file), and the source's licence, copied
from the source's own card. The body says what was done, from the provenance record (`gqaify.json`): the heads, the
method and its calibration, the fit error, and after uptraining the tokens trained and the perplexities, with the
recovery plot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gqaify.conversion.papers import cited
from gqaify.conversion.record import ConversionRecord
from gqaify.conversion.registry import METHOD_INFO, STREAM_SHAPE

LICENCE_KEYS = ("license", "license_name", "license_link")
_HUB_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def source_metadata(directory: Path | None, kind: str, name: str) -> dict:
    """What the card takes from the source: its hub id (`base_model`) and licence, where known.

    A local folder that is a snapshot in the Hugging Face cache (models--org--name/snapshots/...) has a hub id.
    """
    from huggingface_hub import ModelCard

    found = {}
    if kind == "hub":
        found["base_model"] = name
    elif directory is not None and (match := _HUB_CACHE_SNAPSHOT.search(directory.resolve().as_posix())):
        found["base_model"] = f"{match['org']}/{match['name']}"
    card = directory / "README.md" if directory is not None else None
    if card is not None and card.is_file():
        try:
            data = ModelCard.load(card, ignore_metadata_errors=True).data.to_dict()
        except Exception:  # noqa: BLE001 (a card that does not parse carries no licence to copy)
            data = {}
        found.update({key: data[key] for key in LICENCE_KEYS if data.get(key)})
    return found


@dataclass(frozen=True)
class Uptrained:
    """What an uptrained model's card says of its uptraining (`gqaify.uptrain.run_folder`)."""

    tokens: int
    steps: int
    data: list[str]
    eval_data: list[str] | None
    distill_from: str | None
    perplexity_before: float | None  # on eval_data's first text
    perplexity_after: float | None
    parent_perplexity: float | None
    plot: str | None = None  # the recovery plot's file, beside the card


def model_card(record: ConversionRecord, uptrained: Uptrained | None = None):
    """The `huggingface_hub.ModelCard` of a folder with the conversion `record` (and `uptrained`)."""
    from huggingface_hub import ModelCard, ModelCardData

    src, g, kv_heads = record.source, record.source_geometry, record.kv_heads
    kind = record.attention
    shape = [record.rewrite.shape] if record.rewrite else [STREAM_SHAPE] + (["mqa"] if kv_heads == 1 else [])
    tags = ["gqaify", *shape] + (["custom_code"] if record.shipped else [])
    meta = record.card
    data = ModelCardData(
        base_model=meta.get("base_model"),
        base_model_relation="finetune" if meta.get("base_model") else None,
        library_name="transformers",
        tags=tags,
        **{key: meta[key] for key in LICENCE_KEYS if meta.get(key)},
    )
    lines = [
        f"# {Path(src.name).name} → {kind}",
        "",
        f"Converted by [gqaify](https://pypi.org/project/gqaify/) {record.version} from `{src.name}` "
        f"({src.kind}{', revision ' + src.revision if src.revision else ''}).",
        "",
        f"- Attention: {g.num_heads} query heads; K/V heads {g.num_kv_heads} → {kv_heads} (KV cache "
        f"{g.cached_per_token / record.output_geometry.cached_per_token:g}× smaller).",
        f"- Method: `{record.method}` ({METHOD_INFO[record.method].summary}{_from_paper(record.method)})"
        f"{_grouping(record)}; query head i "
        f"reads K/V head i // {g.num_heads // kv_heads} (contiguous groups, as transformers' `repeat_kv`).",
        f"- {_rewritten(record)}; everything else is copied from the source unchanged. `gqaify.json` records the "
        "groups, calibration, per-layer fit error and source hashes.",
    ]
    if record.rewrite is not None:
        lines.append(record.rewrite.card_line(record))
    if fit := _fit_summary(record.fit_error):
        lines.append(f"- Fit error on the calibration text (relative, per layer): {fit}.")
    if record.shipped:
        lines.append(
            "- transformers knows this architecture as MHA only: `modeling_gqaify.py` here adds the K/V heads. Load "
            "with `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`; serving engines (vLLM, TGI) "
            "load native classes only."
        )
    if uptrained:
        lines += ["", "## Uptraining", "", _uptrained(uptrained)]
        if uptrained.plot:
            lines += ["", f"![eval perplexity against tokens trained]({uptrained.plot})"]
    else:
        lines += [
            "",
            "A converted model loses quality until it is uptrained briefly (GQA paper, Ainslie et al. 2023); compare "
            "it with its parent before use.",
        ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def _grouping(record: ConversionRecord) -> str:
    text = ""
    if record.grouping == "similarity":
        text = ", heads reordered within each layer so that similar ones share a K/V head"
    if calibration := record.calibration:
        how = "on the parent's activations"
        if calibration.mode == "sequential":
            how = "layer by layer, each layer repaired against the parent's outputs"
        if calibration.refine_steps:
            how += f", {calibration.refine_steps} refinement steps per layer"
        sources = calibration.sources
        read = " and ".join(
            f"`{source.data}`" + (f" ({source.tokens:,})" if len(sources) > 1 else "") for source in sources
        )
        text += f", calibrated on {calibration.tokens:,} tokens of {read} {how}"
    return text


def _rewritten(record: ConversionRecord) -> str:
    if METHOD_INFO[record.method].folds or record.grouping == "similarity" or record.calibration:
        return "K/V projections, q_proj rows and o_proj columns rewritten"
    return "K/V projections rewritten"


def _fit_summary(errors: list[dict] | None) -> str | None:
    """The median and worst per-layer error of keys and values, e.g. "keys 0.012 median, 0.040 worst (layer 3)"."""
    if not errors:
        return None
    parts = []
    for key, what in (("k", "keys"), ("v", "values"), ("out", "layer outputs")):
        values = [(e[key], layer) for layer, e in enumerate(errors) if e.get(key) is not None]
        if values:
            ordered = sorted(v for v, _ in values)
            worst, layer = max(values)
            parts.append(f"{what} {ordered[len(ordered) // 2]:.4f} median, {worst:.4f} worst (layer {layer})")
    return "; ".join(parts) or None


def _uptrained(u: Uptrained) -> str:
    from gqaify.text.loading import NamedText

    text = f"Uptrained by gqaify on {u.tokens:,} tokens of {' and '.join(f'`{d}`' for d in u.data)} ({u.steps:,} steps)"
    if u.distill_from:
        text += f", distilled from `{u.distill_from}`"
    if u.perplexity_before is not None and u.perplexity_after is not None:
        first = NamedText.parse(u.eval_data[0]).source  # the text eval_data's perplexity is measured on
        text += f". Perplexity on `{first}`: {u.perplexity_before:.2f} before, **{u.perplexity_after:.2f} after**"
        if u.parent_perplexity is not None:
            text += f" (the parent: {u.parent_perplexity:.2f})"
    return text + "."


def _from_paper(method: str) -> str:
    """ "; after <the paper, arXiv id>" for a method from a paper (`MethodInfo.reference`), "" for gqaify's own."""
    reference = METHOD_INFO[method].reference
    return "" if reference is None else f"; after {cited(reference)}"
