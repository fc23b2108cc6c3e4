"""Uptraining recovery of SmolLM2-135M-Instruct converted to MQA, and our loop's speed against transformers' Trainer.

    python benchmarks/uptrain_recovery.py                       # both parts, 100k tokens per variant
    python benchmarks/uptrain_recovery.py --tokens 1000000      # the longer curve (a GPU helps)
    python benchmarks/uptrain_recovery.py --skip-recovery       # the Trainer comparison only
    python benchmarks/uptrain_recovery.py --override "--mixed_precision bf16"   # on a GPU, as single-gpu.yaml

Recovery: each variant is `recipes/smollm2-135m-mqa.yaml` with a few overrides, run as
`python -m gqaify.uptrain` into OUT/VARIANT (rerunning resumes an interrupted variant). Training text is
WikiText-2 validation, evaluation WikiText-2 raw test (4,096 tokens, windows of 1,024), both from
../shared/assets/text. Writes OUT/recovery.png (all curves, the parent as a line), OUT/recovery.md and
OUT/recovery.json.

Speed: the same converted model, batch (4 x 256), learning rate and LM loss, trained for --speed-steps steps
by `gqaify.uptrain` and by `transformers.Trainer`, alternating, in this one process; steady-state tokens/s
(the first step of each run excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from commands import REPO, TEXT, options, uptrain
from gqaify.records import read_run

RECIPE = REPO / "recipes" / "smollm2-135m-mqa.yaml"

# name -> (folder under OUT, overrides of the recipe: every variant trains all weights of the converted model).
# The mean-pooled variants drop the recipe's calibration text: with it, the conversion would repair mean's layers.
MEAN = ["--method", "mean", "--calib_data", ""]
VARIANTS = {
    "mean (LM loss)": ("mean-LM_loss", [*MEAN, "--distill_weight", "0", "--lr", "3e-4"]),
    "mean (distilled)": ("mean-distilled", [*MEAN, "--distill_weight", "1", "--lr", "3e-4"]),
    "mean (half distilled, lr 1e-3)": (
        "mean-half-distilled-lr1e-3",
        [*MEAN, "--distill_weight", "0.5", "--lr", "1e-3"],
    ),  # the recipe's, before lr 3e-4
    # the same uptraining from calibrated conversions, calibrated on the training text (never the eval text):
    # lsq fitted on the parent's activations (gqaify's first calibration), then layer by layer with repair and
    # 64 refinement steps per layer (the best measured in benchmarks/methods.py)
    "lsq parallel (half distilled, lr 1e-3)": (
        "lsq-half-distilled-lr1e-3",
        [
            "--method",
            "lsq",
            "--calib_mode",
            "parallel",
            "--distill_weight",
            "0.5",
            "--lr",
            "1e-3",
            "--calib_data",
            str(TEXT / "wikitext-2-valid-tokenized.txt"),
        ],
    ),
    "lsq sequential refine 64 (half distilled, lr 1e-3)": (
        "lsq-sequential-refine64-half-distilled-lr1e-3",
        [
            "--method",
            "lsq",
            "--calib_mode",
            "sequential",
            "--refine_steps",
            "64",
            "--distill_weight",
            "0.5",
            "--lr",
            "1e-3",
            "--calib_data",
            str(TEXT / "wikitext-2-valid-tokenized.txt"),
        ],
    ),
    # the recipe's setting: a lower peak rate keeps more of the calibrated start (measured on a GPU, README)
    "lsq sequential refine 64 (half distilled, lr 3e-4)": (
        "lsq-sequential-refine64-half-distilled-lr3e-4",
        [
            "--method",
            "lsq",
            "--calib_mode",
            "sequential",
            "--refine_steps",
            "64",
            "--distill_weight",
            "0.5",
            "--lr",
            "3e-4",
            "--calib_data",
            str(TEXT / "wikitext-2-valid-tokenized.txt"),
        ],
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000, help="training tokens per variant")
    parser.add_argument("--variants", default="|".join(VARIANTS), help=f"separated by |, of: {' | '.join(VARIANTS)}")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--out", default="runs/bench/uptrain", help="output folder")
    parser.add_argument("--override", default="", help="more recipe overrides for every variant")
    parser.add_argument("--speed-steps", type=int, default=6, help="steps per timed run in the Trainer comparison")
    parser.add_argument("--speed-repeats", type=int, default=2, help="timed runs of each loop, alternating")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()

    from gqaify.entry.demo import fetch_default_model

    gguf = fetch_default_model()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.skip_recovery:
        recovery(gguf, out, args.variants.split("|"), args.tokens, args.eval_every, overrides=args.override.split())
    if not args.skip_speed:
        speed(gguf, out, args.speed_steps, args.speed_repeats)


# -- recovery -------------------------------------------------------------------------------------------------


def recovery(
    gguf: Path,
    out: Path,
    variants: list[str],
    tokens: int,
    eval_every: int,
    name: str = "recovery",
    overrides: list[str] = (),
) -> dict:
    """Run (or read) each variant; write OUT/NAME.png, .md and .json; return what the .json holds."""
    from gqaify.uptrain.metrics import eval_curve, plot_recovery, read_metrics

    curves, parent, rows = {}, None, []
    for variant in variants:
        folder, variant_overrides = VARIANTS[variant]
        run_dir = out / folder
        command = uptrain(
            recipe=RECIPE,
            model=gguf,
            distill_from=gguf,
            output_dir=run_dir,
            max_tokens=tokens,
            eval_every=eval_every,
            data=TEXT / "wikitext-2-valid-tokenized.txt",
            eval_data=TEXT / "wikitext-2-raw-test.txt",
            extra=[*variant_overrides, *overrides],
        )
        print(f"== {variant}: {' '.join(command[1:])}", flush=True)
        run = read_run(run_dir)
        if not (run is not None and run.completed):  # else: measured before
            subprocess.run(command, check=True)
        metrics = read_metrics(run_dir / "metrics.jsonl")
        curves[variant] = eval_curve(metrics)
        run = read_run(run_dir)
        parent = run.parent_perplexity if run.parent_perplexity is not None else parent
        rate = [r["tokens_per_s"] for r in metrics if "tokens_per_s" in r][-1]
        rows.append(
            {
                "variant": variant,
                "overrides": [*variant_overrides, *overrides],
                "curve": list(zip(*curves[variant], strict=True)),
                "tokens_per_s": rate,
            }
        )
    plot_recovery(curves, parent, out / f"{name}.png", f"SmolLM2-135M-Instruct -> MQA, {tokens:,} tokens")
    result = {"parent_perplexity": parent, "variants": rows}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    table = recovery_table(rows, parent)
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    return result


def recovery_table(rows: list[dict], parent: float) -> str:
    milestones = sorted({t for row in rows for t, _ in row["curve"]})
    shown = [t for t in milestones if t == 0 or t == milestones[-1] or t in _quarters(milestones)]
    head = "| variant | " + " | ".join(f"{t:,} tok" for t in shown) + " | tok/s |"
    lines = [head, "|---" * (len(shown) + 2) + "|"]
    for row in rows:
        at = dict(row["curve"])
        cells = [f"{at[t]:,.1f}" if t in at else "—" for t in shown]
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + f" | {row['tokens_per_s']:.0f} |")
    lines.append(f"\nparent: {parent:.2f}; goal at the last column: <= {1.3 * parent:.1f} (1.3x the parent)")
    return "\n".join(lines)


def _quarters(milestones: list[int]) -> set[int]:
    last = milestones[-1]
    return {min(milestones, key=lambda t, q=q: abs(t - q * last / 4)) for q in (1, 2, 3)}


# -- speed ------------------------------------------------------------------------------------------------------


def speed(gguf: Path, out: Path, steps: int, repeats: int) -> None:
    from gqaify.conversion.core import convert

    model_dir = out / "speed-model"
    if not model_dir.is_dir():
        convert(gguf, model_dir, 1, method="mean", progress=False)
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(ours_tokens_per_s(model_dir, steps))
        theirs.append(trainer_tokens_per_s(model_dir, steps))
        print(f"gqaify.uptrain {ours[-1]:.1f} tok/s, Trainer {theirs[-1]:.1f} tok/s", flush=True)
    result = {
        "steps": steps,
        "batch": "4 x 256",
        "ours": ours,
        "trainer": theirs,
        "ratio": statistics.median(ours) / statistics.median(theirs),
    }
    (out / "speed.json").write_text(json.dumps(result, indent=2))
    print(
        f"median: gqaify.uptrain {statistics.median(ours):.1f} tok/s, Trainer {statistics.median(theirs):.1f} "
        f"tok/s, ratio {result['ratio']:.2f} (goal >= 1.0)"
    )


def ours_tokens_per_s(model_dir: Path, steps: int) -> float:
    from gqaify.uptrain.metrics import read_metrics
    from gqaify.uptrain.settings import parse
    from gqaify.uptrain.train import run as uptrain

    with tempfile.TemporaryDirectory() as tmp:
        settings = parse(
            options(
                "uptrain",
                model=model_dir,
                output_dir=tmp,
                data=TEXT / "wikitext-2-valid-tokenized.txt",
                seq_len=256,
                micro_batch_size=4,
                max_tokens=steps * 1024,
                lr="3e-4",
                save_every=0,
                progress=False,
            )
        )
        uptrain(settings)
        rows = [r for r in read_metrics(Path(tmp) / "metrics.jsonl") if "time" in r]
    return (rows[-1]["tokens"] - rows[0]["tokens"]) / (rows[-1]["time"] - rows[0]["time"])


def trainer_tokens_per_s(model_dir: Path, steps: int) -> float:
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from gqaify.uptrain.data import packed_blocks

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    blocks = packed_blocks(str(TEXT / "wikitext-2-valid-tokenized.txt"), "train", "text", tokenizer, 256)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=4,
            max_steps=steps,
            learning_rate=3e-4,
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            max_grad_norm=1.0,
            save_strategy="no",
            report_to="none",
            logging_steps=steps,
            use_cpu=True,
            dataloader_drop_last=True,
            disable_tqdm=True,
        )
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        Trainer(model=model, args=args, train_dataset=blocks, data_collator=collator, callbacks=[Clock()]).train()
    return (len(stamps) - 1) * 1024 / (stamps[-1] - stamps[0])


if __name__ == "__main__":
    main()
