"""What distillation from stored top-k log-probabilities loses against a teacher that runs, and what it saves.

    python benchmarks/stored_logprobs.py                      # stories260K's MHA twin -> MQA, 24,576 tokens a run
    python benchmarks/stored_logprobs.py --tokens 49152
    python benchmarks/stored_logprobs.py --cost               # what each teacher costs a step on SmolLM2

The parent is `stories260K-mha` (../shared/assets/models: an exact MHA version of stories260K, vocabulary 512),
converted once to MQA with `lsq` calibrated on 8,192 tokens of the TinyStories train sample. The parent writes as
many tokens as a run trains on, once (`gqaify generate --top-logprobs 512`, from the beginning-of-text token,
temperature 1, seed 0); copies of that corpus keep the first k of each position's stored tokens, k in 1, 8, 64
and 512 (the whole vocabulary). Each run uptrains the conversion on the same sampled text with full distillation
(distill_weight 1), the attention modules training (lr 3e-3, 128-token blocks, 4 per step, cosine, 5% warm-up),
the teacher being either the parent running (`distill_from`, on the corpus's text) or the stored top-k
(`distill_from_data`). Every final model is scored on the first 4,096 tokens of TinyStories validation (windows
of 256): perplexity and the KL to the parent per token. Writes OUT/stored_logprobs.md and .json.

`--cost` measures what the teacher costs on SmolLM2-135M-Instruct converted to MQA (mean): 8 optimizer steps of
4 x 256 tokens, all weights training, full KL, with the parent running or from its top-64 stored with 8,192 tokens
it wrote: training tokens per second over the last 4 steps, and the process's peak resident memory. Writes
OUT/teacher_cost.md and .json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from commands import convert, generate, gqaify

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "assets" / "text"
PARENT = REPO.parent / "shared" / "assets" / "models" / "stories260K-mha"
TRAIN = TEXT / "tinystories-train-sample.txt"
EVAL = TEXT / "tinystories-valid-head.txt"
KS = (1, 8, 64, 512)
EVAL_TOKENS, EVAL_WINDOW = 4096, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/stored-logprobs", help="output folder")
    parser.add_argument("--tokens", type=int, default=24_576, help="training tokens per run")
    parser.add_argument("--cost", action="store_true", help="measure each teacher's cost on SmolLM2 instead")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.cost:
        return teacher_cost(out)
    corpus, converted = out / "parent-text-k512", out / "mqa"
    subprocess.run(
        generate(PARENT, corpus, tokens=args.tokens, length=256, top_logprobs=max(KS), quiet=True), check=True
    )
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
    teachers = {"parent running": {"distill_from": PARENT, "data": corpus}}
    for k in KS:
        teachers[f"stored top-{k}"] = {"distill_from_data": True, "data": keep_top(corpus, k, out)}
    rows = {"conversion": score(converted)}
    for name, teacher in teachers.items():
        run_dir = out / name.replace(" ", "-")
        if not (run_dir / "final").is_dir():
            subprocess.run(
                gqaify(
                    "uptrain",
                    model=converted,
                    **teacher,
                    distill_weight=1,
                    trainable="attention",
                    lr="3e-3",
                    max_tokens=args.tokens,
                    seq_len=128,
                    micro_batch_size=4,
                    save_every=0,
                    output_dir=run_dir,
                    progress=False,
                ),
                check=True,
            )
        rows[name] = score(run_dir / "final")
        print(name, rows[name], flush=True)
        (out / "stored_logprobs.json").write_text(json.dumps(rows, indent=2))
    rows["parent"] = score(PARENT)
    (out / "stored_logprobs.json").write_text(json.dumps(rows, indent=2))
    table = format_table(rows, args.tokens)
    (out / "stored_logprobs.md").write_text(table + "\n")
    print(table)


def teacher_cost(out: Path) -> None:
    from gqaify.entry.demo import fetch_default_model

    gguf = fetch_default_model()
    corpus, converted = out / "smollm2-text-k64", out / "smollm2-mqa"
    subprocess.run(generate(gguf, corpus, tokens=8192, top_logprobs=64, quiet=True), check=True)
    if not converted.is_dir():
        subprocess.run(convert(gguf, converted, kv_heads=1, quiet=True), check=True)
    teachers = {"parent running": {"distill_from": gguf}, "stored top-64": {"distill_from_data": True}}
    rows = {}
    for name, teacher in teachers.items():
        run_dir = out / ("cost-" + name.replace(" ", "-"))
        # a process of its own, which reports its own peak resident memory
        code = (
            "import resource, sys; from gqaify.entry.cli import main; assert main(sys.argv[1:]) == 0; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
        )
        command = gqaify(
            "uptrain",
            model=converted,
            data=corpus,
            **teacher,
            distill_weight=1,
            max_tokens=8 * 4 * 256,
            seq_len=256,
            micro_batch_size=4,
            save_every=0,
            output_dir=run_dir,
            progress=False,
            program=[sys.executable, "-c", code],
        )
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "loss" in m]
        rate = (steps[-1]["tokens"] - steps[-5]["tokens"]) / (steps[-1]["time"] - steps[-5]["time"])
        rows[name] = {"tokens_per_s": round(rate, 1), "peak_rss_gib": round(int(done.stdout.split()[-1]) / 2**20, 2)}
        print(name, rows[name], flush=True)
    (out / "teacher_cost.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "SmolLM2-135M-Instruct MQA, 4 x 256 tokens a step, all weights, full KL",
        "",
        "| teacher | training tokens/s | peak resident memory (GiB) |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {r['tokens_per_s']:,.0f} | {r['peak_rss_gib']:.2f} |" for name, r in rows.items()]
    (out / "teacher_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def keep_top(corpus: Path, k: int, out: Path) -> Path:
    """A copy of `corpus`'s shards that keeps the first k stored tokens of each position (the top-k of the top-K)."""
    if k == max(KS):
        return corpus
    folder = out / f"parent-text-k{k}"
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for shard in sorted((corpus / "data").glob("*.jsonl")):
        rows = [json.loads(line) for line in shard.read_text().splitlines() if line.strip()]
        for row in rows:
            row["top_ids"] = [ids[:k] for ids in row["top_ids"]]
            row["top_logprobs"] = [values[:k] for values in row["top_logprobs"]]
        (folder / "data" / shard.name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def score(model_dir: Path) -> dict:
    """Perplexity and KL to the parent on the evaluation text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gqaify.eval.perplexity import perplexity

    tokenizer = AutoTokenizer.from_pretrained(PARENT)
    ids = tokenizer(EVAL.read_text(), return_tensors="pt").input_ids[0, :EVAL_TOKENS]
    parent = AutoModelForCausalLM.from_pretrained(PARENT, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    found = perplexity(model, ids, EVAL_WINDOW, EVAL_WINDOW, progress=False, parent=parent)
    return {"perplexity": round(found.perplexity, 3), "kl": round(found.kl, 4)}


def format_table(rows: dict, tokens: int) -> str:
    lines = [
        f"stories260K-mha -> MQA, {tokens:,} tokens of parent-written text, full KL, attention trains; "
        f"TinyStories validation, {EVAL_TOKENS:,} tokens",
        "",
        "| teacher | perplexity | KL to parent (nats/token) |",
        "|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['perplexity']:.2f} | {row['kl']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
