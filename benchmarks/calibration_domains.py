"""Calibration text against a panel of evaluation texts: does a conversion calibrated on one kind of text (or on a
mixture of kinds, or on text the parent wrote) hold on every kind its parent is good at? Zero training.

    python benchmarks/calibration_domains.py                       # both models
    python benchmarks/calibration_domains.py --models ref-mha-6L   # one

Each model is converted to MQA with the default calibrated method (`lsq`, layer by layer, output repaired) on
16,384 tokens of each calibration text (a mixture: the same 16,384 tokens in all, shared equally), and every
conversion is evaluated beside the parent by one `gqaify eval` on the panel (4,096 tokens of each text): perplexity,
its ratio to the parent's, and the KL from the parent. Calibration and evaluation texts never overlap:

    calibration   WikiText-2 validation | tiny-shakespeare, 1st half | TinyStories train sample | Python code A
                  | parent-written | the three kinds mixed | the three kinds and parent-written mixed
    evaluation    WikiText-2 test | tiny-shakespeare, 2nd half | TinyStories validation | Python code B | licence

Python code A and B are disjoint sets of modules of the standard library of the Python running this script (real
code nobody here wrote); the licence is that Python's LICENSE.txt (legal prose). Nothing calibrates on the licence
text, and only the code calibration (kept as the code's own-kind reference) on code. The parent-written text is
`gqaify generate PARENT --tokens 32768` (from the beginning-of-text token, temperature 1, seed 0). Writes
OUT/calibration_domains.md and .json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from commands import MODELS, TEXT, convert, evaluate, generate, panel, write_texts

CALIB_TOKENS = 16_384
EVAL_TOKENS = 4_096
# model -> (its window for evaluation and calibration, K/V heads after conversion)
SETUPS = {"ref-mha-6L": (512, 1), "SmolLM2-135M-Instruct": (1024, 1)}
# evaluation text (its name in the panel) -> the calibration of its own kind (None: no calibration is of its kind)
OWN_KIND = {
    "wikitext": "WikiText-2 validation",
    "shakespeare": "Shakespeare, 1st half",
    "tinystories": "TinyStories train",
    "code": "Python code A",
    "licence": None,
}
MIXED_3 = ["WikiText-2 validation", "Shakespeare, 1st half", "TinyStories train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/calibration-domains", help="output folder")
    parser.add_argument("--models", default=",".join(SETUPS), help="comma-separated, of: " + ", ".join(SETUPS))
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    texts = write_texts(out / "texts")
    results = {}
    for name in args.models.split(","):
        results[name] = measure(name, out / name, texts)
        (out / "calibration_domains.json").write_text(json.dumps(results, indent=2))
    table = "\n\n".join(format_table(name, rows) for name, rows in results.items())
    (out / "calibration_domains.md").write_text(table + "\n")
    print(table)


def measure(name: str, out: Path, texts: dict[str, Path]) -> dict:
    """{conversion label: {"texts": {text: {perplexity, ratio, kl}}, "panel": {...}}} for `name`, the parent's
    under "parent"."""
    from gqaify.entry.demo import fetch_default_model

    source = MODELS / name if (MODELS / name).is_dir() else fetch_default_model()
    window, kv_heads = SETUPS[name]
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "parent-corpus"
    if not corpus.is_dir():
        subprocess.run(generate(source, corpus, tokens=2 * CALIB_TOKENS, quiet=True), check=True)
    single = {
        "WikiText-2 validation": TEXT / "wikitext-2-valid-tokenized.txt",
        "Shakespeare, 1st half": texts["shakespeare-1"],
        "TinyStories train": TEXT / "tinystories-train-sample.txt",
        "Python code A": texts["code-a"],
        "parent-written": corpus,
    }
    calibrations = {label: [str(path)] for label, path in single.items()}
    calibrations["the three kinds mixed"] = [str(single[k]) for k in MIXED_3]
    calibrations["the three kinds + parent-written"] = [*calibrations["the three kinds mixed"], str(corpus)]
    conversions = {}
    for label, sources in calibrations.items():
        folder = out / label.replace(" ", "-").replace(",", "").replace("+", "and")
        if not folder.is_dir():
            subprocess.run(
                convert(
                    source,
                    folder,
                    kv_heads=kv_heads,
                    method="lsq",
                    calib_data=sources,
                    calib_tokens=CALIB_TOKENS,
                    calib_seq_len=window,
                    calib_split="train",
                    quiet=True,
                ),
                check=True,
            )
        conversions[label] = folder
    report = out / "eval-panel"
    if not (report / "report.json").exists():
        subprocess.run(
            evaluate(
                [source, *conversions.values()],
                data=panel(texts),
                split="train",
                max_tokens=EVAL_TOKENS,
                seq_len=window,
                speed=False,
                out=report,
                quiet=True,
            ),
            check=True,
        )
    models = json.loads((report / "report.json").read_text())["models"]
    rows = {}
    for label, model in zip(["parent", *conversions], models, strict=True):
        rows[label] = {
            "texts": {
                t["text"]: {"perplexity": t["perplexity"], "ratio": t["ratio_to_parent"], "kl": t["kl_to_parent"]}
                for t in model["texts"]
            },
            "panel": model["panel"],
        }
    return rows


def format_table(name: str, rows: dict[str, dict]) -> str:
    texts = list(OWN_KIND)
    lines = [
        f"**{name}**, MQA, zero training: perplexity (× the parent's); bold: the calibration of the text's own kind",
        "",
        "| calibration text | " + " | ".join(texts) + " | worst × parent | mean KL |",
        "|---" * (len(texts) + 3) + "|",
    ]
    for label, row in rows.items():
        cells = []
        for t in texts:
            found = row["texts"][t]
            cell = f"{found['perplexity']:,.2f}" + ("" if found["ratio"] is None else f" ({found['ratio']:.2f}×)")
            cells.append(f"**{cell}**" if OWN_KIND[t] == label else cell)
        scores = row["panel"]
        summary = (
            ["—", "—"]
            if scores is None
            else [
                f"{scores['worst_ratio_to_parent']:.2f}× ({scores['worst_text']})",
                f"{scores['mean_kl_to_parent']:.3f}",
            ]
        )
        lines.append(f"| {label} | " + " | ".join(cells + summary) + " |")
    lines.append("")
    for label in ("parent-written", "the three kinds mixed", "the three kinds + parent-written"):
        own = [
            rows[label]["texts"][t]["perplexity"] / rows[OWN_KIND[t]]["texts"][t]["perplexity"]
            for t in texts
            if OWN_KIND[t]
        ]
        lines.append(f"- {label} / own kind: " + ", ".join(f"{r:.2f}" for r in own) + f" (worst {max(own):.2f})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
