"""The packaged SmolLM2 recipe, run exactly as its first line says (offline, from the repository root, with the local
copies of its data in ../shared), timed end to end, then judged on the panel against its goals.

    python benchmarks/recipe_goals.py                      # about an hour on two CPU cores
    python benchmarks/recipe_goals.py --judge-only         # judge a run already in the recipe's output_dir
    python benchmarks/recipe_goals.py --recipe smollm2-135m-mla --out runs/bench/recipe-goals-mla   # MLA, MQA's cache
    python benchmarks/recipe_goals.py --recipe smollm2-135m-mla --tokens 1000000   # then on from its start (a GPU)

On another machine (a GPU lent for minutes): --texts DIR judges on the panel texts `commands.write_texts` wrote here
(its code and licence come from the running Python's standard library, which differs between machines),
--parent-text-written keeps the parent's text already at the line's path (copied from here, so both machines train
on the same text) instead of writing it anew, and --no-tasks leaves out story_endings (lm-eval).

With --tokens N, after the line (or --judge-only: without it) the recipe's converted start (its output_dir's
`converted`) is trained N tokens with the line's data and the recipe's training settings, into OUT/tokens-N, and that
run is what is judged: recovery past the recipe's tokens, from the same start.

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
GOALS = {"mean_kl": 0.70, "worst_ratio": 2.5, "wikitext": 32.0, "story_endings": 0.66}  # the CPU recipe's
# the keys of a recipe that make its conversion: left out where a run trains a converted start
CONVERSION_KEYS = (
    "kv_heads", "kv_cut", "attention", "kv_rank", "rope_dims", "method", "calib_data", "calib_tokens", "calib_mode",
    "refine_steps",
)  # fmt: skip
_ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # this gqaify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/recipe-goals", help="output folder for the report")
    parser.add_argument("--judge-only", action="store_true", help="judge the run already in the recipe's output_dir")
    parser.add_argument("--recipe", default="smollm2-135m-mqa", help="a packaged recipe whose first line runs it")
    parser.add_argument("--tokens", type=int, help="then train the recipe's converted start this many tokens")
    parser.add_argument("--override", default="", help="more uptrain options for the --tokens run")
    parser.add_argument("--texts", type=Path, help="the panel's texts as write_texts wrote them on another machine")
    parser.add_argument("--parent-text-written", action="store_true", help="keep the parent's text already written")
    parser.add_argument("--no-tasks", action="store_true", help="judge on the panel's texts alone (no lm-eval)")
    args = parser.parse_args()
    recipe_file = RECIPES / f"{args.recipe}.yaml"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    line = recipe_file.read_text().splitlines()[0].removeprefix("# ")
    recipe = yaml.safe_load(recipe_file.read_text())
    run_dir = REPO / recipe["output_dir"]
    timings = json.loads((out / "timings.json").read_text()) if (out / "timings.json").exists() else {}
    if not args.judge_only:
        timings = _run_line(line, skip=("generate",) if args.parent_text_written else ())
        (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    start = run_dir / "converted"
    if args.tokens is not None:
        run_dir, out = _continued(line, start, args.tokens, out, args.override), out / f"tokens-{args.tokens}"
        timings = {**timings, f"uptrain {args.tokens:,} tokens": json.loads((out / "seconds.json").read_text())}
    from gqaify.entry.demo import fetch_default_model

    gguf = fetch_default_model()
    if not args.judge_only or args.tokens is not None:  # a new run: its panel evaluated anew
        shutil.rmtree(out / "final-eval", ignore_errors=True)
    texts = _texts(args.texts) if args.texts else write_texts(out / "texts")
    report = final_eval(gguf, [start, run_dir / "final"], texts, out, tasks=not args.no_tasks)
    results = {"command": line, "seconds": timings, "report": _summary(report), "curve": _curve(run_dir)}
    (out / "recipe_goals.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "recipe_goals.md").write_text(_table(results))
    print(_table(results))


def _line(line: str) -> tuple[str, dict[str, str]]:
    """The recipe's first line split: (its `X=... Y=...` settings, each command by its stage, `gqaify STAGE ...`)."""
    settings, _, commands = line.rpartition("; ")
    return settings, {shlex.split(command)[1]: command for command in commands.split(" && ")}


def _run_line(line: str, skip: tuple[str, ...] = ()) -> dict:
    """Each command of the recipe's first line (`A && B`, after any `X=... Y=...;` settings) run in bash from the
    repository root, timed; the stages in `skip` (`gqaify STAGE`) left out."""
    settings, commands = _line(line)
    timings = {}
    for stage, command in commands.items():
        if stage in skip:
            continue
        started = time.perf_counter()
        subprocess.run(["bash", "-c", f"{settings}; {command}"], cwd=REPO, check=True, env=_ENV)
        timings[stage] = round(time.perf_counter() - started, 1)
    timings["total"] = round(sum(timings.values()), 1)
    return timings


def _continued(line: str, start: Path, tokens: int, out: Path, override: str = "") -> Path:
    """The line's `gqaify uptrain`, its recipe without the conversion's keys, training `start` (a converted model)
    `tokens` tokens into OUT/tokens-N/run (`override`: more options); its seconds in OUT/tokens-N/seconds.json.
    Returns the run's folder."""
    settings, commands = _line(line)
    command = commands["uptrain"]
    words = shlex.split(command)
    recipe = yaml.safe_load((REPO / words[words.index("--recipe") + 1]).read_text())
    folder = out / f"tokens-{tokens}"
    folder.mkdir(exist_ok=True)
    training = folder / "recipe.yaml"
    kept = {k: v for k, v in recipe.items() if k not in CONVERSION_KEYS}
    training.write_text(yaml.safe_dump(kept, sort_keys=False))
    run_dir = folder / "run"
    extra = f"--recipe {training} --model {start} --max_tokens {tokens} --output_dir {run_dir} --save_every 1000000"
    extra += f" {override}"
    started = time.perf_counter()
    subprocess.run(["bash", "-c", f"{settings}; {command} {extra}"], cwd=REPO, check=True, env=_ENV)
    (folder / "seconds.json").write_text(json.dumps(round(time.perf_counter() - started, 1)) + "\n")
    return run_dir


def _texts(folder: Path) -> dict[str, Path]:
    """The panel's texts as `write_texts` wrote them into `folder` (on this machine or another)."""
    return {path.stem: path for path in folder.glob("*.txt")}


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
        f"mean KL ≤ {GOALS['mean_kl']:.2f}": trained["mean_kl"] <= GOALS["mean_kl"],
        f"worst ≤ {GOALS['worst_ratio']:g}×": trained["worst_ratio"] <= GOALS["worst_ratio"],
        f"WikiText-2 ≤ {GOALS['wikitext']:g}": trained["texts"]["wikitext"]["perplexity"] <= GOALS["wikitext"],
        f"story_endings ≥ {GOALS['story_endings']:.2f}": (trained["story_endings"] or 0) >= GOALS["story_endings"],
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
