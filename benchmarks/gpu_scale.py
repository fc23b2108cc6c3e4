"""The SmolLM2 MQA recipe taken to 10M tokens in one lent GPU call: its conversion, then one long uptraining judged
on the five-text panel at log-spaced points, each point appended to a results file as it is measured.

    # on a lent GPU, in one call (OUT the call's $OUT; the GGUF, texts and wheels carried: docs/gpu.md)
    python benchmarks/gpu_scale.py --gguf .gpu/SmolLM2-135M-Instruct.Q4_1.gguf --texts .gpu/texts --out $OUT
    # the rehearsal on the CPU, at a tiny budget (minutes; tests/benchmarks/test_gpu_scale_integration.py runs it)
    G=~/.cache/gqaify/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/gpu_scale.py --gguf $G --tiny --out runs/bench/gpu-cpu --results runs/bench/gpu-cpu.json

What runs, from the recipe `recipes/smollm2-135m-mqa.yaml`:

1. `gqaify convert`: the recipe's conversion (MQA, `lsq`, layer by layer, 64 refinement steps, 32,768 calibration
   tokens) on the training mixture.
2. `python -m gqaify.uptrain`: the recipe's training (all KL to the parent, AdamW, cosine after a 5% warm-up) for
   `--tokens` tokens at a batch sized for the GPU, with the panel (`commands.PANEL`: WikiText-2 test,
   tiny-shakespeare's second half, TinyStories validation, Python code, Python's licence; 4,096 tokens each,
   windows of 1,024) as its eval texts, evaluated at `--points` points spaced evenly in log(tokens).

The mixture is the panel benchmarks' (`commands.mixture`: WikiText-2 validation, tiny-shakespeare's first half,
the TinyStories sample) with Python code of five PyPI packages (`python-packages-code.txt`): no text of the panel is
trained on, and the panel's code is the standard library's.

The batch, learning rate and schedule for the budget: 10M tokens at the recipe's 4 x 256 would be 9,766 optimizer
steps at a few thousand tokens/s, more than a window holds; at 32 x 1,024 they are 305 steps, each 32x the recipe's
tokens. The learning rate grows with the batch by the square root of its size (Adam's rule for keeping the update's
noise scale), capped: 3e-4 x sqrt(32) = 1.7e-3 is past where the recipe's own sweep found 1e-3 worse at its small
batch, so the default is 6e-4, between the two. Warm-up 5% of the steps, cosine to 0, as the recipe.

Each evaluation becomes a row of the results file (`--results`, default benchmarks/results/gpu_recovery.json; a
copy under `--out`), appended as soon as it is logged: recipe, tokens, device, mean_kl, worst_ratio, texts (each:
perplexity, ratio_to_parent, kl_to_parent), tokens_per_s, mfu (teacher counted; None on a CPU), micro_batch_size,
seq_len, seconds. The run stops at `--deadline` seconds (SIGTERM: its last row stays) so that a window's limit cuts
the run, not the results. At the end the curve's forecast from the first half of its points is checked against
the last point (`forecast` in the results' last line).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from commands import REPO, TEXT, convert, mixture, panel, uptrain, write_texts

RECIPE = REPO / "recipes" / "smollm2-135m-mqa.yaml"
RESULTS = REPO / "benchmarks" / "results" / "gpu_recovery.json"
CODE = "python-packages-code.txt"
TRAINING_KEYS = ("distill_weight", "temperature", "trainable", "warmup", "schedule")  # the recipe's, kept
# --tiny: the same pipeline at a budget a 2-core CPU runs in a few minutes
TINY = dict(
    tokens=4096, calib_tokens=2048, refine_steps=2, micro_batch_size=2, seq_len=128, eval_tokens=256, eval_seq_len=256,
    points=3,
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="the parent: SmolLM2's GGUF, or any model folder")
    parser.add_argument("--out", type=Path, required=True, help="folder for the conversion, the run and a copy")
    parser.add_argument("--texts", type=Path, help="the panel's made texts as write_texts wrote them (another machine)")
    parser.add_argument("--text-dir", type=Path, default=TEXT, help="the folder of ../shared/assets/text's files")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON file the rows are appended to")
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--calib-tokens", type=int, help="default: the recipe's")
    parser.add_argument("--refine-steps", type=int, help="default: the recipe's")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--eval-seq-len", type=int, default=1024)
    parser.add_argument("--points", type=int, default=8, help="evaluations, spaced evenly in log(tokens)")
    parser.add_argument("--deadline", type=float, default=480, help="seconds from the start: the run stops there")
    parser.add_argument("--precision", default=None, help="mixed precision (default: bf16 on a GPU, else no)")
    parser.add_argument("--override", default="", help="more uptrain options, as words")
    parser.add_argument("--tiny", action="store_true", help="the rehearsal's budget (TINY), for a CPU")
    args = parser.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            if key not in ("tokens",) or args.tokens == parser.get_default("tokens"):
                setattr(args, key, value)
    started = time.monotonic()

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    precision = args.precision or ("bf16" if device != "cpu" else "no")
    recipe = yaml.safe_load(RECIPE.read_text())
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    texts = _texts(args.texts) if args.texts else write_texts(out / "texts")
    data = _here(args.text_dir, {**mixture(texts), "code": TEXT / CODE})
    judged = _here(args.text_dir, panel(texts))

    converted = out / "converted"
    seconds = {}
    if not converted.is_dir():
        begun = time.monotonic()
        command = convert(
            args.gguf,
            converted,
            kv_heads=recipe["kv_heads"],
            method=recipe["method"],
            calib_data=data,
            calib_split="train",
            calib_tokens=args.calib_tokens or recipe["calib_tokens"],
            calib_mode=recipe["calib_mode"],
            refine_steps=recipe["refine_steps"] if args.refine_steps is None else args.refine_steps,
            quiet=True,
        )
        print("==", " ".join(map(str, command[1:])), flush=True)
        subprocess.run(command, check=True)
        seconds["convert"] = round(time.monotonic() - begun, 1)

    run_dir = out / "run"
    training = out / "training.yaml"
    training.write_text(yaml.safe_dump({k: recipe[k] for k in TRAINING_KEYS}, sort_keys=False))
    command = uptrain(
        recipe=training,
        model=converted,
        distill_from=args.gguf,
        data=data,
        split="train",
        eval_data=judged,
        eval_split="train",
        eval_tokens=args.eval_tokens,
        eval_seq_len=args.eval_seq_len,
        eval_points=args.points,
        max_tokens=args.tokens,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        mixed_precision=precision,
        save_every=0,
        log_every=1,
        progress=False,
        output_dir=run_dir,
        extra=args.override.split(),
    )
    print("==", " ".join(map(str, command[1:])), flush=True)
    flops = _flops_per_token(args.gguf, args.seq_len)
    peak = _peak_tflops(device)
    row_of = _Rows(args, device, flops, peak)
    process = subprocess.Popen(command, start_new_session=True)
    written = 0
    while process.poll() is None:
        time.sleep(2)
        written = _append(row_of, run_dir, written, [args.results, out / "gpu_recovery.json"])
        if time.monotonic() - started > args.deadline:
            print(f"== the deadline ({args.deadline:g} s) stops the run", flush=True)
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
    written = _append(row_of, run_dir, written, [args.results, out / "gpu_recovery.json"])
    forecast = _forecast(run_dir)
    summary = {"forecast": forecast, "seconds": seconds, "returncode": process.returncode, "device": device}
    (out / "gpu_scale.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if written else 1


def _here(text_dir: Path, texts: dict[str, Path]) -> dict[str, Path]:
    """`texts` with each file of ../shared/assets/text read from `text_dir` (where another machine has them)."""
    return {name: text_dir / Path(path).name if Path(path).parent == TEXT else path for name, path in texts.items()}


def _texts(folder: Path) -> dict[str, Path]:
    return {path.stem: path for path in folder.glob("*.txt")}


class _Rows:
    """The results' row of an evaluation logged in metrics.jsonl (with the run's parent perplexities)."""

    def __init__(self, args, device: str, flops: float, peak: float | None):
        self.args, self.device, self.flops, self.peak = args, device, flops, peak

    def __call__(self, row: dict, rate: float | None, parents: dict) -> dict:
        names = [k.removeprefix("eval_perplexity/") for k in row if k.startswith("eval_perplexity/")]
        texts = {
            name: {
                "perplexity": row[f"eval_perplexity/{name}"],
                "ratio_to_parent": row[f"eval_perplexity/{name}"] / parents[name] if name in parents else None,
                "kl_to_parent": row.get(f"eval_kl/{name}"),
            }
            for name in names
        }
        return {
            "recipe": RECIPE.stem,
            "tokens": row["tokens"],
            "device": self.device,
            "mean_kl": row.get("eval_kl_mean"),
            "worst_ratio": row.get("eval_ratio_worst"),
            "texts": texts,
            "tokens_per_s": rate,
            "mfu": None if rate is None or self.peak is None else rate * self.flops / (self.peak * 1e12),
            "micro_batch_size": self.args.micro_batch_size,
            "seq_len": self.args.seq_len,
            "lr": self.args.lr,
            "seconds": row.get("train_seconds"),
        }


def _append(row_of: _Rows, run_dir: Path, written: int, files: list[Path]) -> int:
    """Append the rows of the evaluations logged since `written` to each of `files`; returns how many are written."""
    metrics, record = run_dir / "metrics.jsonl", run_dir / "run.json"
    if not metrics.is_file() or not record.is_file():
        return written
    lines = metrics.read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.endswith("}")]
    parents = json.loads(record.read_text()).get("parent_perplexities") or {}
    evaluations = [r for r in rows if "eval_kl_mean" in r]
    new = []
    for row in evaluations[written:]:
        rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] <= row["step"]]
        new.append(row_of(row, rates[-1] if rates and row["tokens"] > 0 else None, parents))
    for file in files:
        file.parent.mkdir(parents=True, exist_ok=True)
        found = json.loads(file.read_text()) if file.is_file() else []
        file.write_text(json.dumps([*found, *new], indent=1) + "\n")
    for row in new:
        print(f"== {row['tokens']:>11,} tokens: mean KL {row['mean_kl']:.4f}, worst {row['worst_ratio']:.2f}x, "
              f"{row['tokens_per_s'] or 0:,.0f} tokens/s", flush=True)  # fmt: skip
    return written + len(new)


def _forecast(run_dir: Path) -> dict | None:
    """The run's own forecast of its last point from the first half of its tokens, against the measured point."""
    from gqaify.uptrain.curve import CurvePoint
    from gqaify.uptrain.metrics import read_metrics
    from recovery_curve import first_half_law

    points = [p for p in map(CurvePoint.of, read_metrics(run_dir / "metrics.jsonl")) if p is not None]
    if len(points) < 3:
        return None
    law = first_half_law(points)
    end = points[-1]
    predicted = None if law is None else law.at(end.tokens)
    return {
        "tokens": end.tokens,
        "measured_mean_kl": end.mean_kl,
        "predicted_from_first_half": predicted,
        "error": None if predicted is None else predicted / end.mean_kl - 1,
    }


def _flops_per_token(parent: Path, seq_len: int) -> float:
    """Training FLOPs per token of the MQA student with the parent's forward pass (`uptrain_throughput`'s count):
    the student's weights in matrix products are the parent's less the K/V it no longer has, close enough that the
    parent's count is used for both (an overcount of under 2% for SmolLM2)."""
    from uptrain_throughput import flops_per_token

    return flops_per_token(parent, parent, seq_len)


def _peak_tflops(device: str) -> float | None:
    from uptrain_throughput import PEAK_TFLOPS

    return next((v for k, v in PEAK_TFLOPS.items() if device.startswith(k)), None)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
