"""The memory plan (`gqaify uptrain --plan CONFIG`) against the peaks measured on CPU processes.

    python benchmarks/memory_plan.py                       # writes runs/memory-plan/results.json
    python benchmarks/memory_plan.py --layers 12 --hidden 768
    python benchmarks/memory_plan.py --threshold 4194304      # glibc keeps freed allocations under 4 MiB

A parent MHA Llama of ref-mha-6L's shape family, widened (random weights, ref-mha-6L's tokenizer: memory does not
depend on the values), is converted to GQA-2 and uptrained a few steps, distilling from the parent, under each
launch: one process; two CPU processes with the packaged FSDP2 config, the teacher sharded and whole; two with
DDP. Each process records its resident memory just before the student is loaded (and resets its peak there, Linux's
clear_refs: the main process converted the model before) and its peak resident memory when training ends (before
final/ is gathered and saved): the difference is what training added, which is what the plan counts. Every
launch runs alone, each process with one thread, glibc returning every freed allocation of 128 KiB or more
(`THRESHOLD`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from commands import MODELS, REPO, TEXT, accelerate_launch, options, uptrain

REF = MODELS / "ref-mha-6L"
GIB = 2**30
# one thread per process; glibc gives every allocation of THRESHOLD bytes or more a mapping of its own and returns it
# when freed: with its default, freed tensors stay in its heaps and the resident peak counts them after they are gone
# (FSDP's shards and gathered layers are a few MB each). --threshold changes it.
THRESHOLD = 128 * 2**10
MEASURING = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}


def child() -> None:
    """One process of a launch: gqaify.uptrain, with its memory recorded at the two moments the plan counts."""
    import psutil

    import gqaify.uptrain.train as train
    from gqaify.uptrain.__main__ import main

    record, load_model, save_final = {}, train.load_model, train.save_final

    def loading(*args, **kwargs):
        if "before_bytes" not in record:  # the first load: the student
            Path("/proc/self/clear_refs").write_text("5")  # the peak so far (the main one converted) is forgotten
            record["before_bytes"] = psutil.Process().memory_info().rss
        return load_model(*args, **kwargs)

    def saving(*args, **kwargs):
        record["peak_bytes"] = peak_resident()
        return save_final(*args, **kwargs)

    train.load_model, train.save_final = loading, saving
    status = main(sys.argv[2:])
    rank = os.environ.get("RANK", "0")
    Path(os.environ["MEMORY_RECORD"] + f".{rank}").write_text(json.dumps(record))
    sys.exit(status)


def peak_resident() -> int:
    """This process's peak resident bytes since /proc/self/clear_refs was last told 5 (Linux's VmHWM)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def parent_model(folder: Path, layers: int, hidden: int) -> Path:
    """A random MHA Llama of `layers` x `hidden` with ref-mha-6L's tokenizer, in float32."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(REF)
    heads = hidden // 64
    config.update(
        {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": 64,
            "intermediate_size": hidden * 8 // 3,
        }
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(REF).save_pretrained(folder)
    return folder


def launch_config(folder: Path, kind: str, processes: int) -> Path:
    """An accelerate config: the packaged fsdp.yaml for `processes` CPU processes in full precision, or DDP."""
    import yaml

    if kind == "fsdp":
        config = yaml.safe_load((REPO / "recipes" / "accelerate" / "fsdp.yaml").read_text())
    else:
        config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU" if processes > 1 else "NO"}
    config |= {"num_processes": processes, "mixed_precision": "no", "num_machines": 1, "machine_rank": 0}
    path = folder / f"{kind}-{processes}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def measure(name: str, config: Path, processes: int, settings: dict, root: Path, threshold: int) -> dict:
    """Plan and measured peak per process of one launch (`settings`: uptrain's, by field)."""
    out, record = root / name, root / f"{name}.memory"
    plan = subprocess.run(
        uptrain(**settings, output_dir=out, plan=config),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    env = {**os.environ, **MEASURING, "MEMORY_RECORD": str(record), "MALLOC_MMAP_THRESHOLD_": str(threshold)}
    launch = accelerate_launch(config)
    if processes == 1:
        launch = [sys.executable]
    argv = [*launch, __file__, "--child", *options("uptrain", **settings, output_dir=out, progress=False)]
    subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    ranks = [json.loads(Path(f"{record}.{r}").read_text()) for r in range(processes)]
    added = [r["peak_bytes"] - r["before_bytes"] for r in ranks]
    total = next(line for line in plan.splitlines() if line.strip().startswith("total"))
    planned = float(total.split()[-2]) * GIB
    return {
        "launch": name,
        "plan": plan,
        "planned_bytes": planned,
        "measured_bytes": added,
        "ratio": [planned / a for a in added],
    }


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child()
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "memory-plan")
    parser.add_argument("--threshold", type=int, default=THRESHOLD, help="glibc's mmap threshold, in bytes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    parent = parent_model(args.out / "parent", args.layers, args.hidden)
    steps = 3
    settings = {
        "model": parent,
        "kv_heads": 2,
        "method": "mean",
        "data": TEXT / "tinystories-train-sample.txt",
        "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch,
        "max_tokens": steps * 2 * args.micro_batch * args.seq_len,
        "save_every": 0,
        "distill_from": parent,
    }
    launches = [
        ("one-process", launch_config(args.out, "ddp", 1), 1, {}),
        ("fsdp2-2", launch_config(args.out, "fsdp", 2), 2, {}),
        ("fsdp2-2-whole-teacher", launch_config(args.out, "fsdp", 2), 2, {"shard_teacher": False}),
        ("ddp-2", launch_config(args.out, "ddp", 2), 2, {}),
    ]
    rows = []
    for name, config, processes, extra in launches:
        row = measure(
            name, config, processes, {**settings, "grad_accum": 2 // processes, **extra}, args.out, args.threshold
        )
        rows.append(row)
        measured = ", ".join(f"{m / GIB:.3f}" for m in row["measured_bytes"])
        print(
            f"{name:<24} planned {row['planned_bytes'] / GIB:.3f} GiB   measured per process {measured} GiB   "
            f"plan / measured {', '.join(f'{r:.2f}' for r in row['ratio'])}",
            flush=True,
        )
        (args.out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
