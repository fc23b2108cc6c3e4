"""The recovery curve and what stored log-probabilities buy: a model converted to MQA once, then uptrained on the
panel benchmark's mixture twice from the same start, distilling from the live parent and from the parent's top-K
stored once (`gqaify generate --score-data`); each run's curve judged on the panel, and each run's forecast made
from the first half of its points checked against its own end. --extra adds live-teacher runs with other options
from the same start (a recipe's choices compared at equal tokens and seconds); --start adds runs from other
conversions (calibration's minutes against training's), each trained with --start-train, and every run's mean KL
is read at one budget of seconds, conversion included.

    python benchmarks/recovery_curve.py --model ref-mha-6L --tokens 262144 --points 10         # minutes
    python benchmarks/recovery_curve.py --model smollm2 --tokens 49152 --points 10             # about 40 minutes
    python benchmarks/recovery_curve.py --model smollm2 --tokens 12288 --points 1 --variants none \
        --parent-text runs/smollm2-parent-text --out runs/bench/choices \
        --extra "half=--distill_weight 0.5" --extra "kl=--distill_weight 1" \
        --extra "kl-attention=--distill_weight 1 --trainable attention"
    python benchmarks/recovery_curve.py --model smollm2 --tokens 12288 --points 3 --variants none \
        --parent-text runs/smollm2-parent-text --out runs/bench/choices-1core \
        --extra "kl=--distill_weight 1" --extra "lr-1e-3=--distill_weight 1 --lr 1e-3" \
        --start "calib-4k=--calib-tokens 4096" --start "refine-64=--refine-steps 64"

The conversion is the recipe's kind (`lsq`, layer by layer, on the training mixture: WikiText-2 validation,
tiny-shakespeare's first half, the TinyStories sample, and with --parent-text a parent-written corpus); the panel
is `calibration_domains.py`'s five texts (WikiText-2 test, tiny-shakespeare's 2nd half, TinyStories validation,
Python code, Python's licence), none of them trained on. Each run evaluates at the start and at --points steps
spaced evenly in log(tokens), and its seconds are its training wall-clock (`train_seconds`); the stored run's
figures add the scoring's seconds, once. Writes OUT/MODEL/recovery_curve.json and .md; a rerun reuses what OUT
holds.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

from commands import MODELS, convert, generate, mixture, panel, uptrain, write_texts
from gqaify.records import read_run
from gqaify.uptrain.curve import CurvePoint, forecast
from gqaify.uptrain.metrics import read_metrics

SETUPS = {  # model -> (seq_len, lr, eval window)
    "ref-mha-6L": (256, 1e-3, 512),
    "smollm2": (256, 3e-4, 1024),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SETUPS), default="ref-mha-6L")
    parser.add_argument("--out", default="runs/bench/recovery-curve", help="output folder")
    parser.add_argument("--tokens", type=int, default=131_072, help="training tokens per run")
    parser.add_argument("--points", type=int, default=10, help="evaluations after the start")
    parser.add_argument("--top-k", type=int, default=32, help="stored log-probabilities per position")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="tokens of each panel text")
    parser.add_argument("--calib-tokens", type=int, default=16_384)
    parser.add_argument(
        "--parent-text", type=Path, help="a parent-written corpus (gqaify generate) as the mixture's fourth source"
    )
    parser.add_argument("--variants", default="live,stored", help="comma-separated: live, stored (or neither)")
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME=OPTIONS",
        help="one more live-teacher run with these uptrain options, e.g. 'kl-only=--distill_weight 1'",
    )
    parser.add_argument(
        "--start",
        action="append",
        default=[],
        metavar="NAME=OPTIONS",
        help="one more conversion with these convert options, e.g. 'refine-64=--refine-steps 64', trained once",
    )
    parser.add_argument(
        "--start-train", default="--distill_weight 1", help="the uptrain options of the runs from --start conversions"
    )
    args = parser.parse_args()

    seq_len, lr, window = SETUPS[args.model]
    parent = _parent(args.model)
    out = Path(args.out).resolve() / args.model
    out.mkdir(parents=True, exist_ok=True)
    texts = write_texts(out / "texts")
    texts_trained = mixture(texts, args.parent_text.resolve() if args.parent_text else None)

    def timed_conversion(folder: Path, options: list[str]) -> float:
        return _timed(folder / "convert.seconds", convert(
            parent, folder / "converted", kv_heads=1, method="lsq", calib_data=texts_trained, calib_split="train",
            calib_tokens=args.calib_tokens, calib_seq_len=seq_len, quiet=True, extra=options,
        ))  # fmt: skip

    seconds = {"convert": timed_conversion(out, [])}
    common = dict(
        data=texts_trained, split="train", seq_len=seq_len, micro_batch_size=4, max_tokens=args.tokens, lr=lr,
        eval_data=panel(texts), eval_split="train", eval_tokens=args.eval_tokens, eval_seq_len=window,
        eval_points=args.points, save_every=0, progress=False,
    )  # fmt: skip
    start = {"model": out / "converted"}
    runs = {}  # name -> (run folder, uptrain's settings, its extra words, seconds spent before training)
    variants = args.variants.split(",")
    if "live" in variants:
        runs["live teacher"] = (
            out / "live", {**start, **common, "distill_from": parent, "output_dir": out / "live"}, [],
            seconds["convert"],
        )  # fmt: skip
    for extra in args.extra:
        name, _, options = extra.partition("=")
        folder = out / name
        runs[name] = (
            folder,
            {**start, **common, "distill_from": parent, "output_dir": folder},
            options.split(),
            seconds["convert"],
        )
    for other in args.start:
        name, _, options = other.partition("=")
        folder = out / f"start-{name}"
        seconds[f"convert {name}"] = timed_conversion(folder, options.split())
        settings = {"model": folder / "converted", **common, "distill_from": parent, "output_dir": folder / "run"}
        runs[f"start {name}"] = (folder / "run", settings, args.start_train.split(), seconds[f"convert {name}"])
    if "stored" in variants:
        scored = out / "scored"
        seconds["score"] = _timed(out / "score.seconds", generate(
            parent, scored, score_data=texts_trained, score_split="train", length=seq_len, top_logprobs=args.top_k,
            tokens=args.tokens, batch_size=8, quiet=True,
        ))  # fmt: skip
        stored = {**start, **common, "data": [scored], "distill_from_data": True, "parent": parent}
        stored["output_dir"] = out / "stored"  # last, as the other runs' output_dir
        runs[f"stored top-{args.top_k}"] = (out / "stored", stored, [], seconds["convert"] + seconds["score"])
    results = {"model": args.model, "tokens": args.tokens, "top_k": args.top_k, "seconds": seconds, "runs": {}}
    for name, (folder, settings, words, before) in runs.items():
        run = read_run(folder)
        if not (run is not None and run.completed):
            print(f"== {name}", flush=True)
            subprocess.run(uptrain(**settings, extra=words), check=True)
        results["runs"][name] = _judged(folder, before)
        (out / "recovery_curve.json").write_text(json.dumps(results, indent=2) + "\n")
    live, stored = results["runs"].get("live teacher"), results["runs"].get(f"stored top-{args.top_k}")
    if live and stored:  # the live teacher's curve at the stored run's wall-clock, scoring included
        results["live_at_stored_seconds"] = _at_seconds(live, stored["total_seconds"])
    # every run read at one budget: the shortest run's wall-clock, its conversion (and scoring) included
    results["budget_seconds"] = min(run["total_seconds"] for run in results["runs"].values())
    for run in results["runs"].values():
        run["mean_kl_at_budget"] = _at_seconds(run, results["budget_seconds"])
    (out / "recovery_curve.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "recovery_curve.md").write_text(_table(results))
    print(_table(results))


def _parent(model: str) -> str:
    if model == "smollm2":
        from gqaify.entry.demo import fetch_default_model

        return str(fetch_default_model())
    return str(MODELS / model)


def _timed(record: Path, command: list[str]) -> float:
    """Seconds `command` took, run once (kept in `record`: a rerun reuses it)."""
    if record.exists():
        return float(record.read_text())
    started = time.perf_counter()
    subprocess.run(command, check=True)
    took = time.perf_counter() - started
    record.write_text(f"{took:.1f}\n")
    return took


def first_half_law(points: list[CurvePoint]):
    """The trend a user read halfway through a run (`points`, its evaluations): the run's own forecast rule applied
    to the points up to half its tokens (None where they are too few)."""
    return forecast([p for p in points if p.tokens <= points[-1].tokens / 2], target_kl=1e-9).law


def _judged(folder: Path, before: float) -> dict:
    """A run's curve, its tokens/s, and the forecast of its end from the first half of its tokens; `before` is the
    wall-clock spent before its training (its conversion, and the scoring of stored log-probabilities)."""
    rows = read_metrics(folder / "metrics.jsonl")
    points = [p for p in map(CurvePoint.of, rows) if p is not None]
    end = points[-1]
    law = first_half_law(points)
    predicted = law.at(end.tokens) if law else None
    return {
        "tokens_per_s": end.tokens / end.seconds if end.seconds else None,  # training alone, evaluations left out
        "train_seconds": end.seconds,
        "seconds_before": before,
        "total_seconds": end.seconds + before,
        "points": [
            {"tokens": p.tokens, "seconds": p.seconds, "mean_kl": p.mean_kl, "worst_ratio": p.worst_ratio}
            for p in points
        ],
        "final": {"mean_kl": end.mean_kl, "worst_ratio": end.worst_ratio, "perplexities": end.perplexities},
        "forecast_from_first_half": None
        if law is None
        else {
            "points": law.points,
            "exponent": law.exponent,
            "exponent_se": law.exponent_se,
            "predicted_final_kl": predicted,
            "error": predicted / end.mean_kl - 1,
        },
    }


def _table(results: dict) -> str:
    lines = [
        f"{results['model']}, {results['tokens']:,} tokens; "
        + ", ".join(f"{step} {took:.0f} s" for step, took in results["seconds"].items()),
        "",
        "| run | training tokens/s | training s | all s (conversion, scoring) | mean KL "
        f"| mean KL at {results['budget_seconds']:.0f} s | worst × parent | first half predicts | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in results["runs"].items():
        f = run["forecast_from_first_half"]
        lines.append(
            f"| {name} | {run['tokens_per_s']:.0f} | {run['train_seconds']:.0f} | {run['total_seconds']:.0f} "
            f"| {run['final']['mean_kl']:.3f} | "
            + ("—" if run["mean_kl_at_budget"] is None else f"{run['mean_kl_at_budget']:.3f}")
            + f" | {run['final']['worst_ratio']:.2f}× | "
            + ("— | —" if f is None else f"{f['predicted_final_kl']:.3f} (b = {f['exponent']:.3f}) | {f['error']:+.1%}")
            + " |"
        )
    if results.get("live_at_stored_seconds") is not None:
        lines += [
            "",
            f"The live teacher's mean KL at the stored run's wall-clock: {results['live_at_stored_seconds']:.3f}.",
        ]
    lines += [
        "",
        "| run | " + " | ".join(f"{p['tokens']:,}" for p in next(iter(results["runs"].values()))["points"]) + " |",
    ]
    lines.append("|---" * (1 + len(next(iter(results["runs"].values()))["points"])) + "|")
    for name, run in results["runs"].items():
        lines.append(f"| {name} | " + " | ".join(f"{p['mean_kl']:.3f}" for p in run["points"]) + " |")
    return "\n".join(lines) + "\n"


def _at_seconds(run: dict, seconds: float) -> float | None:
    """A run's mean KL at `seconds` of wall-clock, what came before its training included, interpolated in log-log
    between its evaluations (None before its first: it was still converting)."""
    timed = [(run["seconds_before"] + p["seconds"], p["mean_kl"]) for p in run["points"]]
    timed = [(s, k) for s, k in timed if s > 0]
    for (s0, k0), (s1, k1) in zip(timed, timed[1:], strict=False):
        if s0 <= seconds <= s1:
            w = (math.log(seconds) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return math.exp(math.log(k0) + w * (math.log(k1) - math.log(k0)))
    return None


if __name__ == "__main__":
    main()
