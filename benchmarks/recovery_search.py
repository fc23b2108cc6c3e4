"""The uptraining grid on a small real model, before the costly one: data x loss x what trains.

    python benchmarks/recovery_search.py                  # stories260K's MHA twin -> MQA, 24,576 tokens per run
    python benchmarks/recovery_search.py --tokens 49152

The parent is `stories260K-mha` (../shared/assets/models: an exact MHA version of stories260K, trained on
TinyStories); it is converted once to MQA with `lsq` calibrated on 8,192 tokens of the TinyStories train sample.
Each run uptrains that conversion (`python -m gqaify.uptrain`, 128-token blocks, 4 per step, cosine, 5% warm-up)
on one of two texts: the TinyStories train sample, or 49,152 tokens the parent wrote (`gqaify generate`, from the
beginning-of-text token, temperature 1, seed 0); with half or full distillation; training all weights, the
attention modules, or LoRA adapters of rank 8 on the attention projections (each at its own learning rate:
3e-3 for all and attention, 1e-2 for LoRA, whose adapters start from zero). Every run is evaluated on the first
4,096 tokens of TinyStories validation (windows of 256): perplexity and the KL to the parent. Writes
OUT/recovery_search.md and .json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
from pathlib import Path

from commands import convert, generate, gqaify
from gqaify.records import read_run

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "assets" / "text"
PARENT = REPO.parent / "shared" / "assets" / "models" / "stories260K-mha"
TRAIN = TEXT / "tinystories-train-sample.txt"
EVAL = TEXT / "tinystories-valid-head.txt"
TRAINABLE = {
    "all": ["--lr", "3e-3"],
    "attention": ["--trainable", "attention", "--lr", "3e-3"],
    "LoRA r8": ["--trainable", "lora", "--lora_rank", "8", "--lora_alpha", "16", "--lr", "1e-2"],
}
LOSSES = {"half KL": "0.5", "KL": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/recovery-search", help="output folder")
    parser.add_argument("--tokens", type=int, default=24_576, help="training tokens per run")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    corpus, converted = out / "parent-text", out / "mqa"
    subprocess.run(generate(PARENT, corpus, tokens=49152, length=256, quiet=True), check=True)
    if not converted.is_dir():
        subprocess.run(
            convert(
                PARENT,
                converted,
                kv_heads=1,
                method="lsq",
                calib_data=TRAIN,
                calib_tokens=8192,
                calib_seq_len=256,
                quiet=True,
            ),
            check=True,
        )
    rows = []
    for (data_name, data), (loss, weight), (trainable, extra) in itertools.product(
        {"TinyStories": TRAIN, "parent-written": corpus}.items(), LOSSES.items(), TRAINABLE.items()
    ):
        run_dir = out / f"{data_name}-{loss}-{trainable}".replace(" ", "_")
        if not (run_dir / "final").is_dir():
            subprocess.run(
                gqaify(
                    "uptrain",
                    model=converted,
                    data=data,
                    distill_from=PARENT,
                    distill_weight=weight,
                    max_tokens=args.tokens,
                    seq_len=128,
                    micro_batch_size=4,
                    eval_data=EVAL,
                    eval_split="train",
                    eval_tokens=4096,
                    eval_seq_len=256,
                    output_dir=run_dir,
                    save_every=0,
                    progress=False,
                    extra=extra,
                ),
                check=True,
                stdout=subprocess.DEVNULL,
            )
        evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in evals if "eval_kl" in r]
        rows.append({"data": data_name, "loss": loss, "trainable": trainable, "start": evals[0], "end": evals[-1]})
        print(rows[-1], flush=True)
    parent = read_run(run_dir).parent_perplexity
    start = rows[0]["start"]
    lines = [
        f"stories260K-mha -> MQA (`lsq`), {args.tokens:,} tokens per run, TinyStories validation: parent "
        f"perplexity {parent:.2f}; the conversion {start['eval_perplexity']:.2f}, KL {start['eval_kl']:.3f}",
        "",
        "| data | loss | trains | perplexity | KL to parent (nats/token) |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["end"]["eval_kl"]):
        lines.append(
            f"| {r['data']} | {r['loss']} | {r['trainable']} | {r['end']['eval_perplexity']:.2f} | "
            f"{r['end']['eval_kl']:.4f} |"
        )
    (out / "recovery_search.md").write_text("\n".join(lines) + "\n")
    (out / "recovery_search.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
