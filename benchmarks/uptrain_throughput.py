"""Training throughput, MFU and peak memory of `gqaify uptrain`, on a GPU under `accelerate launch` with one of our
configs, or on the CPU (`--cpu`: one process, `recipes/accelerate/cpu.yaml`).

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
    python benchmarks/uptrain_throughput.py --cpu --shapes 4x256 --steps 8          # MFU only with --peak-tflops
    python benchmarks/uptrain_throughput.py --override=--no_fused_loss               # the plain loss, to compare
    python benchmarks/uptrain_throughput.py --override=--compile                     # each layer compiled

Peak memory: on a GPU the most `nvidia-smi` saw the run's processes hold (polled every half second, CUDA context
included); on the CPU the largest resident memory of the run's processes (psutil, polled alike).
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
    peak = _run_watching_memory(command, args.cpu)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"time"' in line]
    tokens_per_s = (rows[-1]["tokens"] - rows[0]["tokens"]) / (rows[-1]["time"] - rows[0]["time"])
    distilled = read_run(run_dir).settings["distill_weight"] > 0
    flops = flops_per_token(run_dir / "final", gguf if distilled else None, seq_len)
    return {
        "shape": shape,
        "tokens_per_s": round(tokens_per_s),
        "flops_per_token": flops,
        "mfu": None if args.peak_tflops is None else tokens_per_s * flops / (args.peak_tflops * 1e12),
        "peak_gib": peak / 2**30,
    }


def _run_watching_memory(command: list[str], cpu: bool) -> int:
    """Run `command` to its end (raising if it fails) and return the most bytes its processes held at once, polled."""
    import time

    import psutil

    process = subprocess.Popen(command)
    peak = 0
    while process.poll() is None:
        peak = max(peak, _cpu_bytes(psutil.Process(process.pid)) if cpu else _gpu_bytes())
        time.sleep(0.5)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    return peak


def _cpu_bytes(parent) -> int:
    import psutil

    try:
        return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
    except psutil.Error:  # ended between the poll and the read
        return 0


def _gpu_bytes() -> int:
    found = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    )
    return sum(int(line) for line in found.stdout.split() if line.isdigit()) * 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "recipes" / "accelerate" / "single-gpu.yaml"))
    parser.add_argument("--processes", type=int, default=1, help="accelerate launch --num_processes")
    parser.add_argument("--shapes", default="4x256,32x1024", help="micro-batch x seq_len, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per shape")
    parser.add_argument("--override", default="", help="more recipe overrides, e.g. '--distill_weight 0'")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the GPU (default: from its name)")
    parser.add_argument("--out", help="folder for the runs (default: a temporary folder)")
    parser.add_argument("--cpu", action="store_true", help="on the CPU, one process (recipes/accelerate/cpu.yaml)")
    args = parser.parse_args()

    import torch

    from gqaify.entry.demo import fetch_default_model

    if args.cpu:
        args.config, args.processes, name = str(REPO / "recipes" / "accelerate" / "cpu.yaml"), 1, "CPU"
    elif not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here; pass --cpu to measure on the CPU")
    else:
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
    print("| micro-batch x seq_len | tokens/s | GFLOP per token | MFU | peak memory |\n|---|---|---|---|---|")
    for r in rows:
        mfu = "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        gflop = r["flops_per_token"] / 1e9
        print(f"| {r['shape']} | {r['tokens_per_s']:,} | {gflop:.2f} | {mfu} | {r['peak_gib']:.2f} GiB |")


if __name__ == "__main__":
    main()
