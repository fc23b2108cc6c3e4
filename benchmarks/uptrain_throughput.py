"""Training throughput and MFU of `gqaify uptrain` on a GPU, under `accelerate launch` with one of our configs.

Runs `recipes/smollm2-135m-mqa.yaml` (SmolLM2-135M-Instruct -> MQA, trained on WikiText-2 validation) for a
fixed number of steps with evaluation and checkpoints off, once per batch shape, and reads the steady-state
tokens/s from the run's metrics.jsonl (the first logged step, which holds the warm-up, excluded). The
conversion is `mean` here: every method writes the same shapes, so the training speed is the same.

MFU: model FLOPs per second over the GPU's dense peak. FLOPs per trained token are those of PaLM's appendix B,
6 N + 12 L d T (N the weights of the matrix products, the tied LM head included, L layers, d the attention
width, T the sequence length); with distillation the teacher's forward pass adds 2 N' + 4 L d T.

    python benchmarks/uptrain_throughput.py                                        # single-gpu.yaml (bf16)
    python benchmarks/uptrain_throughput.py --config recipes/accelerate/fsdp.yaml --processes 1
    python benchmarks/uptrain_throughput.py --shapes 4x256,32x1024 --steps 30 --peak-tflops 989
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from commands import REPO, TEXT, accelerate_launch, uptrain
from gqaify.records import read_run

RECIPE = REPO / "recipes" / "smollm2-135m-mqa.yaml"

# Dense bf16 peak of the GPUs this has run on, TFLOP/s, by the start of torch.cuda.get_device_name()
PEAK_TFLOPS = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H200": 989.4, "NVIDIA H100 PCIe": 756.0, "NVIDIA A100": 312.0}


def matmul_weights(model: Path) -> tuple[int, int, int]:
    """(weights in matrix products, layers, attention width) of a model folder or .gguf file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf = {"gguf_file": model.name} if model.suffix == ".gguf" else {}
    config = AutoConfig.from_pretrained(model.parent if gguf else model, **gguf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(linear.values()), config.num_hidden_layers, config.num_attention_heads * config.head_dim


def flops_per_token(student: Path, teacher: Path | None, seq_len: int) -> float:
    """Training FLOPs per token of `student`, with the forward pass of `teacher` where there is one."""
    n, layers, width = matmul_weights(student)
    flops = 6 * n + 12 * layers * width * seq_len
    if teacher is not None:
        n_t, layers_t, width_t = matmul_weights(teacher)
        flops += 2 * n_t + 4 * layers_t * width_t * seq_len
    return flops


def run(shape: str, args, gguf: Path, out: Path) -> dict:
    micro, seq_len = (int(x) for x in shape.split("x"))
    run_dir = out / f"run-{shape}"
    command = uptrain(
        launcher=accelerate_launch(args.config, args.processes),
        recipe=RECIPE,
        model=gguf,
        distill_from=gguf,
        method="mean",
        calib_data="",
        data=TEXT / "wikitext-2-valid-tokenized.txt",
        eval_data="",
        output_dir=run_dir,
        micro_batch_size=micro,
        seq_len=seq_len,
        max_tokens=args.steps * micro * seq_len * args.processes,
        eval_every=0,
        save_every=0,
        log_every=1,
        progress=False,
        extra=args.override.split(),
    )
    print("==", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"time"' in line]
    tokens_per_s = (rows[-1]["tokens"] - rows[0]["tokens"]) / (rows[-1]["time"] - rows[0]["time"])
    distilled = read_run(run_dir).settings["distill_weight"] > 0
    flops = flops_per_token(run_dir / "final", gguf if distilled else None, seq_len)
    return {
        "shape": shape,
        "tokens_per_s": round(tokens_per_s),
        "flops_per_token": flops,
        "mfu": tokens_per_s * flops / (args.peak_tflops * 1e12),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "recipes" / "accelerate" / "single-gpu.yaml"))
    parser.add_argument("--processes", type=int, default=1, help="accelerate launch --num_processes")
    parser.add_argument("--shapes", default="4x256,32x1024", help="micro-batch x seq_len, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per shape")
    parser.add_argument("--override", default="", help="more recipe overrides, e.g. '--distill_weight 0'")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the GPU (default: from its name)")
    parser.add_argument("--out", help="folder for the runs (default: a temporary folder)")
    args = parser.parse_args()

    import torch

    from gqaify.entry.demo import fetch_default_model

    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    if args.peak_tflops is None:
        args.peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if name.startswith(k)), None)
        if args.peak_tflops is None:
            raise SystemExit(f"error: no peak known for {name}; pass --peak-tflops")
    gguf = fetch_default_model()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gqaify-uptrain-speed-"))
    rows = [run(shape, args, gguf, out) for shape in args.shapes.split(",")]
    print(json.dumps(rows, indent=2))
    print(
        f"\n{name}, {Path(args.config).name}, {args.processes} process(es), {args.steps} steps, peak "
        f"{args.peak_tflops} TFLOP/s {args.override}\n"
    )
    print("| micro-batch x seq_len | tokens/s | GFLOP per token | MFU |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['tokens_per_s']:,} | {r['flops_per_token'] / 1e9:.2f} | {100 * r['mfu']:.1f}% |")


if __name__ == "__main__":
    main()
