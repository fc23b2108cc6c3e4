"""Calibration text against evaluation text: does a conversion calibrated on one kind of text hold on another, and
does text the parent wrote (`gqaify generate`) do as well as text of the evaluation's own kind? Zero training.

    python benchmarks/calibration_domains.py                       # both models
    python benchmarks/calibration_domains.py --models ref-mha-6L   # one

Each model is converted to MQA with the default calibrated method (`lsq`, layer by layer, output repaired) on
16,384 tokens of each calibration text, and with parent-written text also without the repair; each conversion
and the parent are evaluated (`gqaify eval`, 4,096 tokens) on each evaluation text. The texts, all from
../shared/assets/text, never overlap between calibration and evaluation:

    calibration   WikiText-2 validation | tiny-shakespeare, first half | TinyStories train sample | parent-written
    evaluation    WikiText-2 test       | tiny-shakespeare, second half | TinyStories validation

The parent-written text is `gqaify generate PARENT --tokens 32768` (from the beginning-of-text token, temperature 1,
seed 0). Writes OUT/calibration_domains.md and .json.
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
CALIB_TOKENS = 16_384
EVAL_TOKENS = 4_096
# model -> (its window for evaluation and calibration, K/V heads after conversion)
SETUPS = {"ref-mha-6L": (512, 1), "SmolLM2-135M-Instruct": (1024, 1)}
# evaluation text -> the calibration text of its own kind
OWN_KIND = {"WikiText-2 test": "WikiText-2 validation", "Shakespeare, 2nd half": "Shakespeare, 1st half",
            "TinyStories validation": "TinyStories train"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/calibration-domains", help="output folder")
    parser.add_argument("--models", default=",".join(SETUPS), help="comma-separated, of: " + ", ".join(SETUPS))
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    evals = eval_texts(out)
    results = {}
    for name in args.models.split(","):
        results[name] = measure(name, out / name, evals)
        (out / "calibration_domains.json").write_text(json.dumps(results, indent=2))
    table = "\n\n".join(format_table(name, rows) for name, rows in results.items())
    (out / "calibration_domains.md").write_text(table + "\n")
    print(table)


def eval_texts(out: Path) -> dict[str, Path]:
    """The evaluation texts (the halves of tiny-shakespeare written into OUT/texts)."""
    folder = out / "texts"
    folder.mkdir(exist_ok=True)
    shakespeare = (TEXT / "tinyshakespeare.txt").read_text()
    half = shakespeare.index("\n\n", len(shakespeare) // 2)
    (folder / "shakespeare-1.txt").write_text(shakespeare[:half])
    (folder / "shakespeare-2.txt").write_text(shakespeare[half:].lstrip())
    return {"WikiText-2 test": TEXT / "wikitext-2-raw-test.txt", "Shakespeare, 2nd half": folder / "shakespeare-2.txt",
            "TinyStories validation": TEXT / "tinystories-valid-head.txt"}  # fmt: skip


def measure(name: str, out: Path, evals: dict[str, Path]) -> dict:
    """{conversion label: {evaluation text: perplexity}} for `name`, the parent's under "parent"."""
    from gqaify.demo import fetch_default_model

    source = MODELS / name if (MODELS / name).is_dir() else fetch_default_model()
    window, kv_heads = SETUPS[name]
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "parent-corpus"
    cli = [sys.executable, "-m", "gqaify.cli"]
    subprocess.run([*cli, "generate", str(source), str(corpus), "--tokens", str(2 * CALIB_TOKENS), "-q"], check=True)
    calibrations = {"WikiText-2 validation": TEXT / "wikitext-2-valid-tokenized.txt",
                    "Shakespeare, 1st half": out.parent / "texts" / "shakespeare-1.txt",
                    "TinyStories train": TEXT / "tinystories-train-sample.txt", "parent-written": corpus}  # fmt: skip
    conversions = {}
    for label, calib in [*calibrations.items(), ("parent-written, no repair", corpus)]:
        folder = out / label.replace(" ", "-").replace(",", "")
        if not folder.is_dir():
            extra = ["--no-repair"] if "no repair" in label else []
            split = ["--calib-split", "train"] if calib == corpus else []
            subprocess.run([*cli, "convert", str(source), str(folder), "--kv-heads", str(kv_heads), "--method", "lsq",
                            "--calib-data", str(calib), "--calib-tokens", str(CALIB_TOKENS), "--calib-seq-len",
                            str(window), *split, *extra, "-q"], check=True)  # fmt: skip
        conversions[label] = folder
    rows: dict[str, dict[str, float]] = {"parent": {}, **{label: {} for label in conversions}}
    for text, path in evals.items():
        report = out / f"eval-{text.replace(' ', '-').replace(',', '')}"
        if not (report / "report.json").exists():
            subprocess.run([*cli, "eval", str(source), *map(str, conversions.values()), "--data", str(path),
                            "--split", "train", "--max-tokens", str(EVAL_TOKENS), "--seq-len", str(window),
                            "--no-speed", "--out", str(report), "-q"], check=True)  # fmt: skip
        models = json.loads((report / "report.json").read_text())["models"]
        for label, model in zip(rows, models, strict=True):
            rows[label][text] = model["perplexity"]
    return rows


def format_table(name: str, rows: dict[str, dict[str, float]]) -> str:
    texts = list(OWN_KIND)
    lines = [f"**{name}**, MQA, zero training (perplexity; bold: the calibration of the evaluation text's own kind)",
             "", "| calibration text | " + " | ".join(texts) + " |", "|---" * (len(texts) + 1) + "|"]  # fmt: skip
    for label, by_text in rows.items():
        cells = [f"**{by_text[t]:.2f}**" if OWN_KIND[t] == label else f"{by_text[t]:.2f}" for t in texts]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    own = {t: rows[OWN_KIND[t]][t] for t in texts}
    ratio = [rows["parent-written"][t] / own[t] for t in texts]
    lines.append("\nparent-written / own kind: " + ", ".join(f"{r:.3f}" for r in ratio)
                 + " (goal: each <= 1.05); parent-written with repair / without: "
                 + ", ".join(f"{rows['parent-written'][t] / rows['parent-written, no repair'][t]:.3f}" for t in texts)
                 + " (goal: each <= 1)")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
