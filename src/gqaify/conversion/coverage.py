"""Which of the installed transformers' decoder model types gqaify converts, and why not the others.

`audit()` walks transformers' causal-LM model types whose config counts K/V heads (`num_key_value_heads`,
directly or on its text config) and places each one: native (an entry of `archs.ARCHITECTURES`: the output is
a checkpoint of transformers' own class), refused (an entry of `archs.REFUSED`, with its reason), or
unaccounted for, which the test suite does not allow. The entries for types without K/V heads in transformers
are listed too: "shipped code" (the output carries gqaify's modeling file) or refused.
The architecture table of the docs (docs/architectures.md, between its `TABLE_START` and `TABLE_END` lines) is
`markdown()`: `python -m gqaify.conversion.coverage --write docs/architectures.md` writes it there,
`python -m gqaify.conversion.coverage` prints it (a test keeps the page and the table equal).
"""

from __future__ import annotations

import argparse
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

from gqaify.conversion.registry import METHOD_INFO
from gqaify.conversion.shapes import rewriting, shape
from gqaify.model.archs import ARCHITECTURES, REFUSED, ArchSpec


@dataclass(frozen=True)
class Row:
    model_type: str
    status: str  # "native", "shipped code", "refused" or "unaccounted"
    detail: str  # the tensors rewritten, or why it is refused
    methods: str = ""
    shapes: tuple[str, ...] = ()  # per shape a rewrite makes (`shapes.rewriting`): whether it rewrites it, or why not


@functools.cache
def kv_head_types() -> tuple[str, ...]:
    """transformers' model types with a causal-LM class whose (text) config has a K/V head count (read once: it
    builds every type's default config, seconds).

    A type whose default config cannot be built is counted too: nothing says it has no K/V heads.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = CONFIG_MAPPING[model_type]()
            except Exception:  # noqa: BLE001 (any failure to build a default config: counted, not guessed)
                found.append(model_type)
                continue
        try:
            text = config.get_text_config()
        except ValueError:  # several text configs (an encoder and a decoder)
            text = config
        if "num_key_value_heads" in type(text).__dict__.get("__annotations__", {}) or _has_attribute(text):
            found.append(model_type)
    return tuple(found)


def _has_attribute(config) -> bool:
    try:
        return getattr(config, "num_key_value_heads", None) is not None
    except Exception:  # noqa: BLE001 (per-layer attributes refuse global reads: there are K/V heads)
        return True


def audit() -> list[Row]:
    """One row per model type gqaify converts or refuses, and per K/V-head type it does neither for."""
    rows = [
        Row(t, "shipped code" if spec.shipped_class else "native", tensors(spec), methods(spec), rewritten(spec))
        for t, spec in ARCHITECTURES.items()
    ]
    rows += [Row(t, "refused", reason) for t, reason in REFUSED.items()]
    known = set(ARCHITECTURES) | set(REFUSED)
    rows += [Row(t, "unaccounted", "") for t in kv_head_types() if t not in known]
    order = ("native", "shipped code", "refused", "unaccounted")
    return sorted(rows, key=lambda row: (order.index(row.status), row.model_type))


def tensors(spec: ArchSpec) -> str:
    """The K/V-indexed tensors a conversion of `spec` rewrites, in words."""
    if spec.qkv_proj:
        layout = {"contiguous": "Q, K, V rows in turn", "grouped": "rows grouped per K/V head"}[spec.qkv_layout]
        stored = ", stored (in, out)" if spec.transposed else ""
        parts = [f"the K and V rows of the fused `{spec.qkv_proj}` ({layout}{stored})"]
    else:
        parts = [f"`{spec.k_proj}`, `{spec.v_proj}`"]
    if spec.k_norm:
        parts.append(f"`{spec.k_norm}` (all K heads: pooled like them)")
    if spec.k_norm_per_head:
        parts.append(f"the per-head `{spec.k_norm_per_head.replace('{head}', '{h}')}`")
    notes = []
    if isinstance(spec.shared_head_norms, str):
        notes.append(f"with `{spec.shared_head_norms}`, Q/K norms over `head_dim` copied through")
    elif spec.shared_head_norms:
        notes.append("Q/K norms over `head_dim` copied through")
    if spec.rope == "interleaved":
        notes.append("RoPE pairs interleaved")
    if spec.refused_when:
        notes.append(f"refused with `{spec.refused_when[0]}`: {spec.refused_when[1]}")
    return ", ".join(parts) + (f" ({'; '.join(notes)})" if notes else "")


def rewritten(spec: ArchSpec) -> tuple[str, ...]:
    """Whether each shape a rewrite makes rewrites `spec`'s layer, or why not, in words."""
    return tuple(shape(name).covers(spec) for name in rewriting())


def methods(spec: ArchSpec) -> str:
    """Which methods apply to `spec`, in words."""
    plain = [name for name, info in METHOD_INFO.items() if not info.calibrated]
    if spec.no_calibration:
        return f"{', '.join(plain)} (no calibration: {spec.no_calibration})"
    if isinstance(spec.shared_head_norms, str):
        flag = spec.shared_head_norms
        return f"all; with `{flag}`, {', '.join(plain)}, calibrated or not (Q/K norms stop the rotating ones)"
    if spec.shared_head_norms or spec.k_norm or spec.q_norm:
        return f"{', '.join(plain)}, calibrated or not (Q/K norms stop the rotating ones)"
    return "all"


TABLE_START = "<!-- the table is written by: python -m gqaify.conversion.coverage --write docs/architectures.md -->\n"
TABLE_END = "<!-- end of the table -->\n"


def markdown() -> str:
    """The architecture table of the docs, a Markdown table."""
    names = rewriting()
    lines = [
        "| `model_type` | status | K/V-indexed tensors rewritten, or why not | methods |"
        + "".join(f" `--attention {name}` |" for name in names),
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for r in audit():
        shapes = r.shapes or ("",) * len(names)
        lines.append(f"| {r.model_type} | {r.status} | {r.detail} | {r.methods} |" + "".join(f" {s} |" for s in shapes))
    return "\n".join(lines) + "\n"


def write_into(page: Path) -> None:
    """Replace what lies between `page`'s TABLE_START and TABLE_END lines with `markdown()`."""
    text = page.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"{page} has no {TABLE_START.strip()} ... {TABLE_END.strip()} lines to write between")
    before, rest = text.split(TABLE_START, 1)
    after = rest.split(TABLE_END, 1)[1]
    page.write_text(f"{before}{TABLE_START}\n{markdown()}\n{TABLE_END}{after}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gqaify.conversion.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, metavar="PAGE", help="write the table into PAGE instead of printing it")
    args = parser.parse_args(argv)
    if args.write:
        write_into(args.write)
    else:
        print(markdown(), end="")


if __name__ == "__main__":
    main()
