"""The packaged SmolLM2 recipe, run exactly as its first line says (offline, from the repository root, with the local
copies of its data in ../shared), timed end to end, then judged on the panel against its goals.

    python benchmarks/recipe_goals.py                      # about an hour on two CPU cores
    python benchmarks/recipe_goals.py --judge-only         # judge a run already in the recipe's output_dir
    python benchmarks/recipe_goals.py --recipe smollm2-135m-mla --out runs/bench/recipe-goals-mla   # MLA, MQA's cache

Every command of the recipe's first line (the parent-written corpus, then the uptraining with its conversion) runs
as written, each timed. Then one `gqaify eval` puts the parent, the conversion before training and the uptrained
model side by side on `calibration_domains.py`'s panel (WikiText-2 test, tiny-shakespeare's 2nd half, TinyStories
validation, Python code, Python's licence; 4,096 tokens each, windows of 1,024) with the local task
`story_endings`. The recipe's own curve is checked too: its forecast made from the first half of its tokens
against its final mean KL. Writes OUT/recipe_goals.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from commands import write_texts
from gqaify.uptrain.curve import CurvePoint
from gqaify.uptrain.metrics import read_metrics
from panel_recovery import final_eval
from recovery_curve import first_half_law

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
GOALS = {"mean_kl": 0.70, "worst_ratio": 3.5, "wikitext": 32.0, "story_endings": 0.66}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/recipe-goals", help="output folder for the report")
    parser.add_argument("--judge-only", action="store_true", help="judge the run already in the recipe's output_dir")
    parser.add_argument("--recipe", default="smollm2-135m-mqa", help="a packaged recipe whose first line runs it")
    args = parser.parse_args()
    recipe_file = RECIPES / f"{args.recipe}.yaml"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    line = recipe_file.read_text().splitlines()[0].removeprefix("# ")
    recipe = yaml.safe_load(recipe_file.read_text())
    run_dir = REPO / recipe["output_dir"]
    timings = json.loads((out / "timings.json").read_text()) if (out / "timings.json").exists() else {}
    if not args.judge_only:
        timings = _run_line(line)
        (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    from gqaify.entry.demo import fetch_default_model

    gguf = fetch_default_model()
    if not args.judge_only:  # a new run: its panel evaluated anew
        shutil.rmtree(out / "final-eval", ignore_errors=True)
    report = final_eval(gguf, [run_dir / "converted", run_dir / "final"], write_texts(out / "texts"), out)
    results = {"command": line, "seconds": timings, "report": _summary(report), "curve": _curve(run_dir)}
    (out / "recipe_goals.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "recipe_goals.md").write_text(_table(results))
    print(_table(results))


def _run_line(line: str) -> dict:
    """Each command of the recipe's first line (`A && B`, after any `X=... Y=...;` settings) run in bash from the
    repository root, timed."""
    settings, _, commands = line.rpartition("; ")
    timings = {}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # this gqaify
    for command in commands.split(" && "):
        started = time.perf_counter()
        subprocess.run(["bash", "-c", f"{settings}; {command}"], cwd=REPO, check=True, env=env)
        timings[shlex.split(command)[1]] = round(time.perf_counter() - started, 1)
    timings["total"] = round(sum(timings.values()), 1)
    return timings


def _summary(report: dict) -> list[dict]:
    rows = []
    for name, model in zip(("parent", "converted, no training", "uptrained"), report["models"], strict=True):
        acc = next((t for t in model.get("tasks") or [] if t["metric"] == "acc_norm"), None)
        rows.append(
            {
                "model": name,
                "texts": {
                    t["text"]: {"perplexity": t["perplexity"], "ratio": t["ratio_to_parent"]} for t in model["texts"]
                },
                "mean_kl": None if model["panel"] is None else model["panel"]["mean_kl_to_parent"],
                "worst_ratio": None if model["panel"] is None else model["panel"]["worst_ratio_to_parent"],
                "worst_text": None if model["panel"] is None else model["panel"]["worst_text"],
                "story_endings": None if acc is None else acc["value"],
            }
        )
    return rows


def _curve(run_dir: Path) -> dict:
    """The run's own forecast of its end, made from the first half of its tokens, against its end."""
    points = [p for p in map(CurvePoint.of, read_metrics(run_dir / "metrics.jsonl")) if p is not None]
    end = points[-1]
    law = first_half_law(points)
    predicted = None if law is None else law.at(end.tokens)
    return {
        "final_mean_kl": end.mean_kl,
        "predicted_from_first_half": predicted,
        "error": None if predicted is None else predicted / end.mean_kl - 1,
        "points": [{"tokens": p.tokens, "seconds": p.seconds, "mean_kl": p.mean_kl} for p in points],
    }


def _table(results: dict) -> str:
    seconds = results["seconds"]
    lines = [
        f"`{results['command']}`",
        "",
        "wall-clock: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items()),
        "",
        "| model | wikitext | shakespeare | tinystories | code | licence | mean KL | worst × parent | story_endings |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["report"]:
        cells = [
            f"{t['perplexity']:.2f}" + ("" if t["ratio"] is None else f" ({t['ratio']:.2f}×)")
            for t in row["texts"].values()
        ]
        cells += [
            "—" if row["mean_kl"] is None else f"{row['mean_kl']:.3f}",
            "—" if row["worst_ratio"] is None else f"{row['worst_ratio']:.2f}× ({row['worst_text']})",
            "—" if row["story_endings"] is None else f"{row['story_endings']:.3f}",
        ]
        lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
    trained = results["report"][-1]
    met = {
        "mean KL ≤ 0.70": trained["mean_kl"] <= GOALS["mean_kl"],
        "worst ≤ 3.5×": trained["worst_ratio"] <= GOALS["worst_ratio"],
        "WikiText-2 ≤ 32": trained["texts"]["wikitext"]["perplexity"] <= GOALS["wikitext"],
        "story_endings ≥ 0.66": (trained["story_endings"] or 0) >= GOALS["story_endings"],
        "≤ 60 min": seconds.get("total", 0) <= 3600,
    }
    lines += ["", "goals: " + ", ".join(f"{k} {'met' if v else 'missed'}" for k, v in met.items())]
    curve = results["curve"]
    if curve["predicted_from_first_half"] is not None:
        lines.append(
            f"curve: final mean KL {curve['final_mean_kl']:.3f} (the recipe's eval texts); the first half predicted "
            f"{curve['predicted_from_first_half']:.3f} ({curve['error']:+.1%})"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
