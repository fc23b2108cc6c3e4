"""Recovery judged on a panel of texts: SmolLM2-135M-Instruct converted to MQA and uptrained 100k tokens, the recipe's
way (calibrated and trained on WikiText-2) against a mixture (calibrated and trained on WikiText-2, Shakespeare,
TinyStories and text the parent wrote), each judged on five kinds of text, two of which nothing calibrates or
trains on.

    python benchmarks/panel_recovery.py
    python benchmarks/panel_recovery.py --tokens 1000000 --override "--mixed_precision bf16"    # on a GPU

Each variant converts the parent with the recipe's conversion (`lsq`, layer by layer, 64 refinement steps, 32,768
calibration tokens) on its text, then trains with `recipes/smollm2-135m-mqa.yaml`'s training settings (4 x 256
blocks, lr 3e-4, cosine, distill_weight 0.5) on the same text (the mixture: equal weights), run as `python -m
gqaify.uptrain` into OUT/VARIANT (rerunning resumes). The parent-written corpus is `gqaify generate` (32,768 tokens
from the beginning-of-text token, temperature 1, seed 0; or --corpus, e.g. calibration_domains.py's). At the end one
`gqaify eval` puts the parent, each variant's conversion and its uptrained model side by side on the panel of
`calibration_domains.py` (WikiText-2 test, tiny-shakespeare's 2nd half, TinyStories validation, Python code,
Python's licence; 4,096 tokens each), with the local task `story_endings` (tests/tasks). Writes
OUT/panel_recovery.md and .json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import yaml

from commands import REPO, TEXT, convert, evaluate, generate, mixture, panel, uptrain, write_texts
from gqaify.records import read_run

RECIPE = REPO / "recipes" / "smollm2-135m-mqa.yaml"
CORPUS_TOKENS = 32_768  # a quarter of the mixture's 100k training tokens is about 25k
CONVERSION_KEYS = ("kv_heads", "method", "calib_data", "calib_tokens", "calib_mode", "refine_steps")
VARIANTS = ("WikiText-2 (the recipe)", "mixture of four")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/panel-recovery", help="output folder")
    parser.add_argument("--tokens", type=int, default=100_000, help="training tokens per variant")
    parser.add_argument("--override", default="", help="more uptrain options for every variant")
    parser.add_argument("--corpus", type=Path, help="a parent-written corpus to use (default: written into OUT)")
    parser.add_argument(
        "--variant",
        type=int,
        choices=range(len(VARIANTS)),
        help="run this variant alone, without the final evaluation (two at once, each with "
        "OMP_NUM_THREADS=1, use two cores better than one after the other)",
    )
    args = parser.parse_args()

    from gqaify.entry.demo import fetch_default_model

    gguf = fetch_default_model()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    texts = write_texts(out / "texts")
    corpus = args.corpus.resolve() if args.corpus else corpus_once(gguf, out)
    data = {VARIANTS[0]: {"wikitext": TEXT / "wikitext-2-valid-tokenized.txt"}, VARIANTS[1]: mixture(texts, corpus)}
    recipe = yaml.safe_load(RECIPE.read_text())
    training = out / "training-recipe.yaml"
    training.write_text(
        yaml.safe_dump(
            {
                k: v
                for k, v in recipe.items()
                if k not in CONVERSION_KEYS and k not in ("eval_data", "eval_tokens", "eval_seq_len")
            },
            sort_keys=False,
        )
    )
    models = []
    for i, name in enumerate(VARIANTS):
        if args.variant is not None and i != args.variant:
            continue
        converted, run_dir = out / f"converted-{i}", out / f"uptrained-{i}"
        if not converted.is_dir():
            subprocess.run(
                convert(
                    gguf,
                    converted,
                    kv_heads=recipe["kv_heads"],
                    method=recipe["method"],
                    calib_data=data[name],
                    calib_split="train",
                    calib_tokens=recipe["calib_tokens"],
                    calib_mode=recipe["calib_mode"],
                    refine_steps=recipe["refine_steps"],
                    quiet=True,
                ),
                check=True,
            )
        command = uptrain(
            recipe=training,
            model=converted,
            distill_from=gguf,
            output_dir=run_dir,
            max_tokens=args.tokens,
            data=data[name],
            save_every=50,
            extra=args.override.split(),
        )
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        run = read_run(run_dir)
        if not (run is not None and run.completed):
            subprocess.run(command, check=True)
        models += [converted, run_dir / "final"]
    if args.variant is not None:
        return
    report = final_eval(gguf, models, texts, out)
    write_results(out, report, args.tokens)


def corpus_once(gguf: Path, out: Path) -> Path:
    """The parent-written corpus, made once (resumed if a run was stopped)."""
    corpus = out / "parent-corpus"
    command = generate(gguf, corpus, tokens=CORPUS_TOKENS, seed=0, quiet=True)
    subprocess.run(command, check=True)
    return corpus


def final_eval(gguf: Path, models: list[Path], texts: dict[str, Path], out: Path, tasks: bool = True) -> dict:
    """gqaify eval of the parent and every model on the panel, with story_endings (tasks=False: without)."""
    report_dir = out / "final-eval"
    if not (report_dir / "report.json").exists():
        subprocess.run(
            evaluate(
                [gguf, *models],
                data=panel(texts),
                split="train",
                max_tokens=4096,
                seq_len=1024,
                speed=False,
                tasks=["story_endings"] if tasks else None,
                include_path=REPO / "tests" / "tasks" if tasks else None,
                out=report_dir,
                quiet=True,
            ),
            check=True,
        )
    return json.loads((report_dir / "report.json").read_text())


def write_results(out: Path, report: dict, tokens: int) -> None:
    names = ["parent"] + [f"{v}, {stage}" for v in VARIANTS for stage in ("no training", f"{tokens:,} tokens")]
    table = panel_table(names, report)
    (out / "panel_recovery.md").write_text(table + "\n")
    (out / "panel_recovery.json").write_text(json.dumps({"names": names, "report": report}, indent=2))
    print(table)


def panel_table(names: list[str], report: dict, tasks: bool = True) -> str:
    """The panel's markdown table of an eval report: a row per model (`names`), each text's perplexity and ratio to
    the parent, the mean KL, the worst ratio and (with `tasks`) story_endings."""
    texts = [t["name"] for t in report["data"]]
    heads = ["mean KL", "worst × parent", *(["story_endings"] if tasks else [])]
    lines = ["| model | " + " | ".join([*texts, *heads]) + " |", "|---" * (len(texts) + len(heads) + 1) + "|"]
    for name, model in zip(names, report["models"], strict=True):
        cells = [
            f"{t['perplexity']:.2f}" + ("" if t["ratio_to_parent"] is None else f" ({t['ratio_to_parent']:.2f}×)")
            for t in model["texts"]
        ]
        scores = model["panel"]
        cells += [
            "—" if scores is None else f"{scores['mean_kl_to_parent']:.3f}",
            "—" if scores is None else f"{scores['worst_ratio_to_parent']:.2f}× ({scores['worst_text']})",
        ]
        if tasks:
            acc = next((t for t in model.get("tasks") or [] if t["metric"] == "acc_norm"), None)
            cells.append("—" if acc is None else f"{acc['value']:.3f} ± {acc['stderr']:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
