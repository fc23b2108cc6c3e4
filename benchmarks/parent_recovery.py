"""Recovery on the parent's own text: SmolLM2-135M-Instruct converted to MQA, uptrained 100k tokens on WikiText-2 or
on text the parent wrote (`gqaify generate`), with half or full distillation; perplexity, KL to the parent and the
story_endings task against tokens.

    python benchmarks/parent_recovery.py                         # every variant, then the final evaluation
    python benchmarks/parent_recovery.py --variants "parent-written, KL"
    python benchmarks/parent_recovery.py --tokens 1000000 --override "--mixed_precision bf16"    # on a GPU

Every variant starts from one conversion, the recipe's (`lsq`, layer by layer, 64 refinement steps, calibrated on
32,768 tokens of WikiText-2 validation), made once into OUT/converted; the parent-written corpus is made once into
OUT/parent-corpus (`gqaify generate`, 102,400 tokens from the beginning-of-text token, temperature 1, seed 0).
Each variant is `recipes/smollm2-135m-mqa.yaml`'s training settings (4 x 256 blocks, lr 3e-4, cosine) with its
data and distill_weight, run as `python -m gqaify.uptrain` into OUT/VARIANT (rerunning resumes), evaluated every
25 steps on the first 4,096 tokens of WikiText-2 raw test (windows of 1,024): perplexity and the KL to the parent
in nats per token (`eval_kl`). At the end `gqaify eval` puts the parent, the conversion and every final model
side by side on the same text with the local task `story_endings` (tests/tasks). Writes OUT/parent_recovery.md,
.json and .png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import yaml

from commands import REPO, TEXT, convert, evaluate, generate, uptrain
from gqaify.records import read_run

RECIPE = REPO / "recipes" / "smollm2-135m-mqa.yaml"
WIKI_TRAIN = TEXT / "wikitext-2-valid-tokenized.txt"
WIKI_TEST = TEXT / "wikitext-2-raw-test.txt"
CORPUS_TOKENS = 102_400
CONVERSION_KEYS = ("kv_heads", "method", "calib_data", "calib_tokens", "calib_mode", "refine_steps")

# name -> (folder, the data: "wikitext" or "parent", distill_weight, more overrides); all weights train unless said
VARIANTS = {
    "WikiText-2, half KL (the recipe before)": ("wiki-half", "wikitext", 0.5, []),
    "WikiText-2, KL": ("wiki-kl", "wikitext", 1.0, []),
    "WikiText-2, KL, attention": ("wiki-kl-attention", "wikitext", 1.0, ["--trainable", "attention"]),
    "parent-written, KL": ("parent-kl", "parent", 1.0, []),
    "parent-written, half KL": ("parent-half", "parent", 0.5, []),
    "parent-written, KL, attention": ("parent-kl-attention", "parent", 1.0, ["--trainable", "attention"]),
    # adapters learn from zero: LoRA's usual higher rate
    "parent-written, KL, LoRA r16 (lr 1e-3)": (
        "parent-kl-lora",
        "parent",
        1.0,
        ["--trainable", "lora", "--lr", "1e-3"],
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/parent-recovery", help="output folder")
    parser.add_argument("--tokens", type=int, default=100_000, help="training tokens per variant")
    parser.add_argument("--variants", default="|".join(VARIANTS), help=f"separated by |, of: {' | '.join(VARIANTS)}")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    parser.add_argument("--override", default="", help="more uptrain options for every variant")
    parser.add_argument("--skip-final-eval", action="store_true", help="no gqaify eval with the task at the end")
    args = parser.parse_args()

    from gqaify.entry.demo import fetch_default_model

    gguf = fetch_default_model()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = args.variants.split("|")
    converted = convert_once(gguf, out)
    corpus = corpus_once(gguf, out) if any(VARIANTS[name][1] == "parent" for name in names) else None
    recipe = training_recipe(out)
    finals = {}
    for name in names:
        folder, data, weight, extra = VARIANTS[name]
        run_dir = out / folder
        command = uptrain(
            recipe=recipe,
            model=converted,
            distill_from=gguf,
            output_dir=run_dir,
            max_tokens=args.tokens,
            eval_every=args.eval_every,
            distill_weight=weight,
            data=WIKI_TRAIN if data == "wikitext" else corpus,
            extra=[*extra, *args.override.split()],
        )
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        run = read_run(run_dir)
        if not (run is not None and run.completed):
            subprocess.run(command, check=True)
        finals[name] = run_dir / "final"
    report = None if args.skip_final_eval else final_eval(gguf, converted, finals, out)
    write_results(out, finals, report, args.tokens)


def convert_once(gguf: Path, out: Path) -> Path:
    """The recipe's conversion of the parent, made once."""
    recipe = yaml.safe_load(RECIPE.read_text())
    converted = out / "converted"
    if not converted.is_dir():
        calib = str(WIKI_TRAIN)  # the recipe calibrates on its data; this benchmark on WikiText-2 alone, as it says
        subprocess.run(
            convert(
                gguf,
                converted,
                kv_heads=recipe["kv_heads"],
                method=recipe["method"],
                calib_data=calib,
                calib_tokens=recipe["calib_tokens"],
                calib_mode=recipe["calib_mode"],
                refine_steps=recipe["refine_steps"],
                quiet=True,
            ),
            check=True,
        )
    return converted


def corpus_once(gguf: Path, out: Path) -> Path:
    """The parent-written corpus, made once (resumed if a run was stopped)."""
    corpus = out / "parent-corpus"
    command = generate(gguf, corpus, tokens=CORPUS_TOKENS, length=256, batch_size=16, seed=0)
    subprocess.run(command, check=True)
    return corpus


def training_recipe(out: Path) -> Path:
    """The SmolLM2 recipe without its conversion keys (every variant starts from OUT/converted)."""
    recipe = {k: v for k, v in yaml.safe_load(RECIPE.read_text()).items() if k not in CONVERSION_KEYS}
    recipe["eval_data"] = str(WIKI_TEST)
    path = out / "training-recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def final_eval(gguf: Path, converted: Path, finals: dict[str, Path], out: Path) -> dict:
    """gqaify eval of the parent, the conversion and the final models: perplexity, KL, story_endings."""
    report_dir = out / "final-eval"
    models = [str(gguf), str(converted), *map(str, finals.values())]
    if not (report_dir / "report.json").exists():
        subprocess.run(
            evaluate(
                models,
                data=WIKI_TEST,
                max_tokens=4096,
                seq_len=1024,
                diag_tokens=1024,
                speed=False,
                tasks=["story_endings"],
                include_path=REPO / "tests" / "tasks",
                generate=True,
                out=report_dir,
                quiet=True,
            ),
            check=True,
        )
    return json.loads((report_dir / "report.json").read_text())


def write_results(out: Path, finals: dict[str, Path], report: dict | None, tokens: int) -> None:
    from gqaify.uptrain.metrics import eval_curve, plot_recovery, read_metrics

    curves, rows, parent = {}, [], None
    for name, final in finals.items():
        metrics = read_metrics(final.parent / "metrics.jsonl")
        curves[name] = eval_curve(metrics)
        run = read_run(final.parent)
        parent = run.parent_perplexity if run.parent_perplexity is not None else parent
        kl = [(r["tokens"], r["eval_kl"]) for r in metrics if "eval_kl" in r]
        rows.append({"variant": name, "perplexity": list(zip(*curves[name], strict=True)), "kl": kl})
    plot_recovery(curves, parent, out / "parent_recovery.png", f"SmolLM2-135M-Instruct -> MQA, {tokens:,} tokens")
    lines = ["| variant | perplexity (start → end) | KL to parent, nats/token (start → end) |", "|---|---|---|"]
    for row in rows:
        (_, p0), (t1, p1) = row["perplexity"][0], row["perplexity"][-1]
        k0, k1 = row["kl"][0][1], row["kl"][-1][1]
        lines.append(f"| {row['variant']} | {p0:.2f} → {p1:.2f} ({t1:,} tokens) | {k0:.3f} → {k1:.3f} |")
    lines.append(f"\nparent perplexity {parent:.2f}")
    if report is not None:
        lines += ["", "| model | ppl | KL (diagnostics, nats/token) | story_endings acc_norm |", "|---|---|---|---|"]
        names = ["parent", "converted, no training", *finals]
        for name, model in zip(names, report["models"], strict=True):
            acc = next((t for t in model.get("tasks") or [] if t["metric"] == "acc_norm"), None)
            kl = (model.get("diagnostics") or {}).get("kl_nats_per_token")
            accuracy = "—" if acc is None else f"{acc['value']:.3f} ± {acc['stderr']:.3f}"
            lines.append(f"| {name} | {model['perplexity']:.2f} | {'—' if kl is None else f'{kl:.3f}'} | {accuracy} |")
    table = "\n".join(lines)
    (out / "parent_recovery.md").write_text(table + "\n")
    (out / "parent_recovery.json").write_text(
        json.dumps({"parent_perplexity": parent, "variants": rows, "report": report}, indent=2)
    )
    print(table)


if __name__ == "__main__":
    main()
