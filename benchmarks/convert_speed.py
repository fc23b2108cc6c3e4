"""How fast and how lean is `gqaify convert` against copying the same files?

Builds a synthetic sharded fp16 MHA Llama checkpoint (random weights) of a given shape, then in one run:
copies it with `shutil.copytree`, converts it with `gqaify convert --kv-heads 8` in a child process, and
prints the time ratio (target <= 1.2) and the converter's peak RSS against the largest shard (target <= 1.5x).

    python benchmarks/convert_speed.py                  # 1B-shaped, ~2.5 GB
    python benchmarks/convert_speed.py --shape 7b       # Llama-2-7B dims, 13.5 GB (needs ~45 GB of disk)

The page cache is dropped before each timed step when the machine allows it (root, /proc/sys/vm/drop_caches),
so both read the source cold; otherwise both read it warm, and the output says which. With --repeat N the
two alternate which goes first (the second inherits the disk's write backlog) and medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from commands import convert

SHAPES = {
    # hidden, layers, heads, intermediate, vocab
    "1b": (2048, 16, 32, 5632, 32000),
    "7b": (4096, 32, 32, 11008, 32000),
}


def build_checkpoint(directory: Path, shape: str, shard_bytes: int) -> None:
    """A Llama checkpoint with MHA attention, fp16 random weights, in safetensors shards of ~shard_bytes."""
    hidden, layers, heads, inter, vocab = SHAPES[shape]
    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "dtype": "float16",
        "hidden_act": "silu",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}self_attn.{name}.weight"] = (hidden, hidden)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)

    shards: list[list[str]] = [[]]
    size = 0
    for name, s in shapes.items():
        nbytes = torch.Size(s).numel() * 2
        if size + nbytes > shard_bytes and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for i, names in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).half() for n in names}
        save_file(tensors, directory / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
        del tensors
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# Run in a child: its peak RSS is VmHWM of its own address space (ru_maxrss of a child would include the
# high-water mark of the parent it was forked from).
PEAK_RSS = "re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)"
CONVERT = (
    f"import re, sys; from gqaify.entry.cli import main; code = main(sys.argv[1:]); print({PEAK_RSS}); sys.exit(code)"
)
IMPORTS = f"import re, gqaify.entry.cli, transformers.utils.hub, huggingface_hub; print({PEAK_RSS})"


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--source-shard-size", type=float, default=1.0, help="GB per source shard (default 1)")
    parser.add_argument("--max-shard-size", default="2GB", help="output shard cap (default 2GB)")
    parser.add_argument("--workdir", type=Path, help="where to build (default: a temp folder, removed after)")
    parser.add_argument("--repeat", type=int, default=1, help="copy/convert pairs to run; medians reported")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gqaify-bench-", dir="."))
    src, copy, out = workdir / "src", workdir / "copy", workdir / "out"
    try:
        if not src.exists():
            print(f"building a {args.shape}-shaped fp16 checkpoint in {src} ...", flush=True)
            build_checkpoint(src, args.shape, int(args.source_shard_size * 1e9))
        shards = sorted(src.glob("*.safetensors"))
        total = sum(p.stat().st_size for p in shards)
        largest = max(p.stat().st_size for p in shards)
        cmd = convert(
            src,
            out,
            kv_heads=args.kv_heads,
            max_shard_size=args.max_shard_size,
            quiet=True,
            program=[sys.executable, "-c", CONVERT],
        )
        copies, converts, peaks = [], [], []

        def run_copy() -> None:
            t0 = time.perf_counter()
            shutil.copytree(src, copy)
            os.sync()
            copies.append(time.perf_counter() - t0)

        def run_convert() -> None:
            t0 = time.perf_counter()
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            os.sync()
            converts.append(time.perf_counter() - t0)
            peaks.append(int(done.stdout.split()[-1]) * 1024)

        # The step that runs second inherits the disk's backlog from the first one's writes: alternate.
        for i in range(args.repeat):
            for step in (run_copy, run_convert) if i % 2 == 0 else (run_convert, run_copy):
                for path in (copy, out):
                    shutil.rmtree(path, ignore_errors=True)
                cold = drop_caches()
                step()
        t_copy, t_convert, peak_rss = statistics.median(copies), statistics.median(converts), max(peaks)
        baseline = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True)
        import_rss = int(baseline.stdout.split()[-1]) * 1024

        result = {
            "shape": args.shape,
            "checkpoint_gb": round(total / 1e9, 2),
            "source_shards": len(shards),
            "largest_shard_gb": round(largest / 1e9, 2),
            "cache": "cold (dropped before each step)" if cold else "warm (could not drop the page cache)",
            "repeats": args.repeat,
            "copytree_s": round(t_copy, 2),
            "convert_s": round(t_convert, 2),
            "copytree_runs_s": [round(t, 2) for t in copies],
            "convert_runs_s": [round(t, 2) for t in converts],
            "time_ratio": round(t_convert / t_copy, 3),
            "peak_rss_gb": round(peak_rss / 1e9, 2),
            "rss_over_largest_shard": round(peak_rss / largest, 3),
            "import_rss_gb": round(import_rss / 1e9, 2),
        }
        print(json.dumps(result, indent=2))
        print(
            f"\n{args.shape}: convert {t_convert:.1f} s vs copytree {t_copy:.1f} s -> ratio {t_convert / t_copy:.2f} "
            f"(target <= 1.2); peak RSS {peak_rss / 1e9:.2f} GB = {peak_rss / largest:.2f}x the largest shard "
            f"of {largest / 1e9:.2f} GB (target <= 1.5; python + torch + transformers alone: {import_rss / 1e9:.2f} GB)"
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
