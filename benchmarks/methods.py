"""Conversion methods compared: perplexity with no training, and after the same 100k-token uptraining.

    python benchmarks/methods.py                     # both parts
    python benchmarks/methods.py --skip-uptrain      # zero-training table only (about 15 minutes on 2 cores)
    python benchmarks/methods.py --skip-zero-training   # uptraining only; the zero-training rows are kept

Zero training: every method converts SmolLM2-135M-Instruct (GQA-3 -> MQA) and ref-mha-6L (MHA-8 -> GQA-4,
GQA-2, MQA); `gqaify eval` then measures the parent and every conversion on WikiText-2 raw test (SmolLM2:
4,096 tokens, windows of 1,024; ref-mha-6L: 8,192 tokens, windows of 512). Calibrated methods read 32,768
tokens of WikiText-2 *validation* (the tokenized copy): never the evaluation text. Similarity grouping is
only run where there is a choice (G > 1 and groups of more than one head).

Uptraining: the recipe `recipes/smollm2-135m-mqa.yaml` (half distillation, lr 1e-3, 100k tokens) from mean and
from lsq, as the variants of `benchmarks/uptrain_recovery.py` (a completed run is read, not rerun).

Writes OUT/methods.json, OUT/methods.md and OUT/methods.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "assets" / "text"
MODELS = REPO.parent / "shared" / "assets" / "models"
EVAL_TEXT = TEXT / "wikitext-2-raw-test.txt"
CALIB_TEXT = TEXT / "wikitext-2-valid-tokenized.txt"

METHODS = ["mean", "norm-mean", "aligned", "lsq"]
GROUPED = ["aligned", "lsq"]  # also run with --grouping similarity where groups can differ
UPTRAIN_VARIANTS = ["mean (half distilled, lr 1e-3)", "lsq (half distilled, lr 1e-3)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/methods", help="output folder")
    parser.add_argument("--calib-tokens", type=int, default=32768)
    parser.add_argument("--skip-uptrain", action="store_true")
    parser.add_argument("--skip-zero-training", action="store_true")
    parser.add_argument("--uptrain-out", default="runs/bench/uptrain", help="where the uptraining runs live")
    args = parser.parse_args()

    from gqaify.demo import fetch_default_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = fetch_default_model()
    cases = [
        ("SmolLM2-135M-Instruct", str(gguf), 3, [1], 4096, 1024),
        ("ref-mha-6L", str(MODELS / "ref-mha-6L"), 8, [4, 2, 1], 8192, 512),
    ]
    saved = json.loads((out / "methods.json").read_text()) if (out / "methods.json").exists() else {}
    rows, uptrain = saved.get("zero_training", []), saved.get("uptraining")
    if not args.skip_zero_training:
        rows = []
        for model, src, source_kv, groups, tokens, seq_len in cases:
            for kv_heads in groups:
                rows += zero_training(out, model, src, source_kv, kv_heads, tokens, seq_len, args.calib_tokens)
    if not args.skip_uptrain:
        sys.path.insert(0, str(Path(__file__).parent))
        from uptrain_recovery import recovery

        uptrain = recovery(gguf, Path(args.uptrain_out), UPTRAIN_VARIANTS, 100_000, 10, name="methods")
    (out / "methods.json").write_text(json.dumps({"zero_training": rows, "uptraining": uptrain}, indent=2) + "\n")
    table = methods_table(rows)
    (out / "methods.md").write_text(table + "\n")
    plot(rows, out / "methods.png")
    print(table)


def zero_training(out: Path, model: str, src: str, source_kv: int, kv_heads: int, tokens: int, seq_len: int,
                  calib_tokens: int) -> list[dict]:  # fmt: skip
    """Convert `src` with every method, evaluate all beside the parent; one row per method."""
    from gqaify.conversion.core import convert
    from gqaify.conversion.options import Calibration
    from gqaify.eval.core import evaluate
    from gqaify.eval.settings import EvalSettings

    calibration = Calibration(str(CALIB_TEXT), tokens=calib_tokens, seq_len=seq_len)
    variants = [(m, "contiguous") for m in METHODS]
    if kv_heads > 1 and source_kv // kv_heads > 1:
        variants += [(m, "similarity") for m in GROUPED]
    converted, fits = [], {}
    for method, grouping in variants:
        name = f"{model}-G{kv_heads}-{method}-{grouping}"
        path = out / "models" / name
        print(f"== {name}", flush=True)
        # every method gets the calibration: the fitted ones use it, and it measures the fit error of all
        result = convert(src, path, kv_heads, method=method, grouping=grouping, calibration=calibration,
                         force=True, progress=False)  # fmt: skip
        converted.append(str(path))
        errors = result.fit_errors or []
        fits[str(path)] = {
            key: sum(e[key] for e in errors) / len(errors) if errors and errors[0][key] is not None else None
            for key in ("k", "v")
        }
    settings = EvalSettings(seq_len=seq_len, max_tokens=tokens, speed=False, progress=False)
    report = evaluate([src, *converted], str(EVAL_TEXT), out / "eval" / f"{model}-G{kv_heads}", settings)
    parent = report.models[0].perplexity
    rows = []
    for (method, grouping), entry in zip(variants, report.models[1:], strict=True):
        rows.append({"model": model, "source_kv_heads": source_kv, "kv_heads": kv_heads, "method": method,
                     "grouping": grouping, "perplexity": entry.perplexity, "parent_perplexity": parent,
                     "fit_error_scores": fits[entry.model]["k"], "fit_error_outputs": fits[entry.model]["v"],
                     "eval_tokens": entry.tokens_scored, "calib_tokens": calib_tokens})  # fmt: skip
    return rows


def methods_table(rows: list[dict]) -> str:
    """One row per (model, G), one column per method: perplexity with no training."""
    columns = [(m, "contiguous") for m in METHODS] + [(m, "similarity") for m in GROUPED]
    head = "| model | K/V heads | parent | " + " | ".join(_label(m, g) for m, g in columns) + " |"
    lines = [head, "|---" * (len(columns) + 3) + "|"]
    for key in dict.fromkeys((r["model"], r["source_kv_heads"], r["kv_heads"]) for r in rows):
        found = {
            (r["method"], r["grouping"]): r for r in rows if (r["model"], r["source_kv_heads"], r["kv_heads"]) == key
        }
        best = min(r["perplexity"] for r in found.values())
        cells = []
        for column in columns:
            r = found.get(column)
            cell = "—" if r is None else f"{r['perplexity']:,.1f}"
            cells.append(f"**{cell}**" if r is not None and r["perplexity"] == best else cell)
        parent = next(iter(found.values()))["parent_perplexity"]
        lines.append(f"| {key[0]} | {key[1]} → {key[2]} | {parent:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _label(method: str, grouping: str) -> str:
    return method if grouping == "contiguous" else f"{method} + similarity"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["model"], r["kv_heads"]) for r in rows))
    labels = list(dict.fromkeys(_label(r["method"], r["grouping"]) for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs, ys = [], []
        for j, case in enumerate(cases):
            for r in rows:
                if (r["model"], r["kv_heads"]) == case and _label(r["method"], r["grouping"]) == label:
                    xs.append(j + (i - (len(labels) - 1) / 2) * width)
                    ys.append(r["perplexity"])
        ax.bar(xs, ys, width, label=label)
    for j, case in enumerate(cases):
        parent = next(r["parent_perplexity"] for r in rows if (r["model"], r["kv_heads"]) == case)
        ax.hlines(parent, j - 0.45, j + 0.45, colors="black", linestyles="dashed", label="parent" if j == 0 else None)
    ax.set_xticks(range(len(cases)), [f"{m}\n→ {'MQA' if g == 1 else f'GQA-{g}'}" for m, g in cases])
    ax.set_yscale("log")
    ax.set_ylabel("WikiText-2 perplexity, no training (log)")
    ax.set_title("Conversion methods: perplexity straight after conversion")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
