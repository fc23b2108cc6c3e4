"""Conversion methods and calibration modes compared: perplexity with no training, conversion time and peak
memory, and the perplexity after the same 100k-token uptraining.

    python benchmarks/methods.py                          # both parts
    python benchmarks/methods.py --skip-uptrain           # the zero-training table only
    python benchmarks/methods.py --skip-zero-training     # uptraining only; the zero-training rows are kept
    python benchmarks/methods.py --models ref-mha-6L      # one model (ref-mha-6L, SmolLM2-135M-Instruct)

Zero training: SmolLM2-135M-Instruct (GQA-3 -> MQA) and ref-mha-6L (MHA-8 -> GQA-4, GQA-2, MQA) are converted
with every variant below, each conversion in a process of its own (its wall time and peak RSS are the
columns), and `gqaify eval` measures the parent and every conversion on WikiText-2 raw test (SmolLM2: 4,096
tokens, windows of 1,024; ref-mha-6L: 8,192 tokens, windows of 512). Calibration reads 32,768 tokens of
WikiText-2 *validation* (the tokenized copy), in windows of the eval length: never the evaluation text.

Uptraining: the recipe `recipes/smollm2-135m-mqa.yaml` (half distillation, lr 1e-3, 100k tokens) from mean and
from the calibrated conversions, as the variants of `benchmarks/uptrain_recovery.py` (a completed run is read,
not rerun).

Writes OUT/methods.json, OUT/methods.md and OUT/methods.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "assets" / "text"
MODELS = REPO.parent / "shared" / "assets" / "models"
EVAL_TEXT = TEXT / "wikitext-2-raw-test.txt"
CALIB_TEXT = TEXT / "wikitext-2-valid-tokenized.txt"
REFINE_STEPS = 64

# label -> (method, grouping, calibration settings beyond data/tokens/seq_len; None: no calibration at all)
VARIANTS = {
    "mean": ("mean", "contiguous", None),  # the GQA paper
    "lsq, parallel": ("lsq", "contiguous", {"calib_mode": "parallel"}),  # fitted on the parent's activations
    "lsq, sequential, no repair": ("lsq", "contiguous", {"repair": False}),  # fitted on the converted stream
    "lsq, sequential": ("lsq", "contiguous", {}),  # + o_proj repaired against the parent's attention output
    f"lsq, sequential, refine {REFINE_STEPS}": ("lsq", "contiguous", {"refine_steps": REFINE_STEPS}),
    "aligned, sequential": ("aligned", "contiguous", {}),
    "mean, sequential": ("mean", "contiguous", {}),  # the repair alone, on the paper's merge
    "lsq, sequential, similarity": ("lsq", "similarity", {}),  # only where grouping has a choice
}
UPTRAIN_VARIANTS = [
    "mean (half distilled, lr 1e-3)",
    "lsq parallel (half distilled, lr 1e-3)",
    f"lsq sequential refine {REFINE_STEPS} (half distilled, lr 1e-3)",
]

# Converts in a fresh process and prints what it took: wall time and the process's own peak RSS.
_CHILD = """
import json, resource, sys, time
import gqaify
args = json.loads(sys.argv[1])
start = time.perf_counter()
result = gqaify.convert(args["src"], args["out"], args["kv_heads"], method=args["method"], grouping=args["grouping"],
                        force=True, progress=False, **(args["calibration"] or {}))
print(json.dumps({"seconds": time.perf_counter() - start, "fit_errors": [fit.record() for fit in result.fits or []],
                  "calibration_seconds": result.calibration_seconds,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/methods", help="output folder")
    parser.add_argument("--calib-tokens", type=int, default=32768)
    parser.add_argument("--models", default="SmolLM2-135M-Instruct,ref-mha-6L", help="comma-separated")
    parser.add_argument("--variants", default="|".join(VARIANTS), help=f"separated by |, of: {' | '.join(VARIANTS)}")
    parser.add_argument("--skip-uptrain", action="store_true")
    parser.add_argument("--skip-zero-training", action="store_true")
    parser.add_argument("--uptrain-out", default="runs/bench/uptrain", help="where the uptraining runs live")
    parser.add_argument("--uptrain-variants", default="|".join(UPTRAIN_VARIANTS), help="separated by |")
    args = parser.parse_args()

    from gqaify.entry.demo import fetch_default_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = fetch_default_model()
    cases = {
        "SmolLM2-135M-Instruct": (str(gguf), 3, [1], 4096, 1024),
        "ref-mha-6L": (str(MODELS / "ref-mha-6L"), 8, [4, 2, 1], 8192, 512),
    }
    saved = json.loads((out / "methods.json").read_text()) if (out / "methods.json").exists() else {}
    rows, uptrain = saved.get("zero_training", []), saved.get("uptraining")
    if not args.skip_zero_training:
        chosen = args.models.split(",")
        rows = [r for r in rows if r["model"] not in chosen]  # the models not rerun keep their rows
        for model in chosen:
            src, source_kv, groups, tokens, seq_len = cases[model]
            for kv_heads in groups:
                rows += zero_training(
                    out, model, src, source_kv, kv_heads, tokens, seq_len, args.calib_tokens, args.variants.split("|")
                )
        (out / "methods.json").write_text(json.dumps({"zero_training": rows, "uptraining": uptrain}, indent=2) + "\n")
    if not args.skip_uptrain:
        sys.path.insert(0, str(Path(__file__).parent))
        from uptrain_recovery import recovery

        variants = args.uptrain_variants.split("|")
        uptrain = recovery(gguf, Path(args.uptrain_out), variants, 100_000, 10, name="methods")
    (out / "methods.json").write_text(json.dumps({"zero_training": rows, "uptraining": uptrain}, indent=2) + "\n")
    table = methods_table(rows)
    (out / "methods.md").write_text(table + "\n")
    plot(rows, out / "methods.png")
    print(table)


def zero_training(
    out: Path,
    model: str,
    src: str,
    source_kv: int,
    kv_heads: int,
    tokens: int,
    seq_len: int,
    calib_tokens: int,
    variants: list[str],
) -> list[dict]:
    """Convert `src` with every variant (each in its own process), evaluate all beside the parent."""
    from gqaify.eval.core import evaluate
    from gqaify.eval.settings import EvalSettings

    chosen = []
    for label in variants:
        method, grouping, calibration = VARIANTS[label]
        if grouping == "similarity" and (kv_heads == 1 or source_kv // kv_heads == 1):
            continue  # one group, or groups of one head: nothing to choose
        chosen.append(label)
    converted, measured = [], {}
    for label in chosen:
        method, grouping, calibration = VARIANTS[label]
        path = out / "models" / f"{model}-G{kv_heads}-{label.replace(', ', '-').replace(' ', '_')}"
        print(f"== {model} -> {kv_heads} K/V heads: {label}", flush=True)
        if calibration is not None:
            calibration = {
                "calib_data": str(CALIB_TEXT),
                "calib_tokens": calib_tokens,
                "calib_seq_len": seq_len,
                **calibration,
            }
        request = {
            "src": src,
            "out": str(path),
            "kv_heads": kv_heads,
            "method": method,
            "grouping": grouping,
            "calibration": calibration,
        }
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(request)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{label}: conversion failed\n{done.stderr[-3000:]}")
        measured[str(path)] = json.loads(done.stdout.strip().splitlines()[-1])
        converted.append(str(path))
        print(
            f"   {measured[str(path)]['seconds']:.1f} s, peak RSS {measured[str(path)]['peak_rss'] / 2**30:.2f} GiB",
            flush=True,
        )
    settings = EvalSettings(seq_len=seq_len, max_tokens=tokens, speed=False, progress=False, force=True)
    report = evaluate([src, *converted], str(EVAL_TEXT), out / "eval" / f"{model}-G{kv_heads}", settings)
    parent = report.models[0].perplexity
    rows = []
    for label, entry in zip(chosen, report.models[1:], strict=True):
        m = measured[entry.model]
        errors = m["fit_errors"] or []
        rows.append(
            {
                "model": model,
                "source_kv_heads": source_kv,
                "kv_heads": kv_heads,
                "variant": label,
                "perplexity": entry.perplexity,
                "parent_perplexity": parent,
                "seconds": m["seconds"],
                "peak_rss": m["peak_rss"],
                "calibration_seconds": m["calibration_seconds"],
                "fit_error_scores": _mean([e["k"] for e in errors]),
                "fit_error_outputs": _mean([e["v"] for e in errors]),
                "out_error_last_layer": errors[-1].get("out") if errors else None,
                "eval_tokens": entry.tokens_scored,
                "calib_tokens": calib_tokens if VARIANTS[label][2] is not None else 0,
            }
        )
    return rows


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def methods_table(rows: list[dict]) -> str:
    """Rows: variants; columns: perplexity for each (model, G), then time and peak RSS of the SmolLM2 conversion."""
    cases = list(dict.fromkeys((r["model"], r["source_kv_heads"], r["kv_heads"]) for r in rows))
    at = {(r["model"], r["source_kv_heads"], r["kv_heads"], r["variant"]): r for r in rows}
    heads = [f"{m.split('-')[0]} {s} → {g}" for m, s, g in cases]
    main = next((c for c in cases if c[0].startswith("SmolLM2")), cases[0])
    parents = " | ".join(f"{at_any(at, c)['parent_perplexity']:.2f}" for c in cases)
    lines = [
        "| variant | " + " | ".join(heads) + f" | {main[0].split('-')[0]} time | peak RSS |",
        "|---" * (len(cases) + 3) + "|",
        f"| parent | {parents} | | |",
    ]
    best = {c: min(r["perplexity"] for key, r in at.items() if key[:3] == c) for c in cases}
    for label in dict.fromkeys(r["variant"] for r in rows):
        cells = []
        for case in cases:
            r = at.get((*case, label))
            cell = "—" if r is None else f"{r['perplexity']:,.1f}"
            cells.append(f"**{cell}**" if r is not None and r["perplexity"] == best[case] else cell)
        r = at.get((*main, label))
        time = "—" if r is None else f"{r['seconds']:,.0f} s"
        rss = "—" if r is None else f"{r['peak_rss'] / 2**30:.2f} GiB"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {time} | {rss} |")
    return "\n".join(lines)


def at_any(at: dict, case: tuple) -> dict:
    return next(r for key, r in at.items() if key[:3] == case)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["model"], r["kv_heads"]) for r in rows))
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs, ys = [], []
        for j, case in enumerate(cases):
            for r in rows:
                if (r["model"], r["kv_heads"]) == case and r["variant"] == label:
                    xs.append(j + (i - (len(labels) - 1) / 2) * width)
                    ys.append(r["perplexity"])
        ax.bar(xs, ys, width, label=label)
    for j, case in enumerate(cases):
        parent = next(r["parent_perplexity"] for r in rows if (r["model"], r["kv_heads"]) == case)
        ax.hlines(parent, j - 0.45, j + 0.45, colors="black", linestyles="dashed", label="parent" if j == 0 else None)
    ax.set_xticks(range(len(cases)), [f"{m}\n→ {'MQA' if g == 1 else f'GQA-{g}'}" for m, g in cases])
    ax.set_yscale("log")
    ax.set_ylabel("WikiText-2 perplexity, no training (log)")
    ax.set_title("Conversion methods and calibration: perplexity straight after conversion")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
