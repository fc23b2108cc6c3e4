"""The KV cache and decode speed where users serve: llama.cpp (through llama-cpp-python), on SmolLM2-135M-Instruct's
MHA-9 twin, its GQA-3 self, its MQA conversion and that MQA model rewritten as latent attention (MLA, the same
cache: deepseek2 in llama.cpp), and the speed and memory of writing GGUF.

    python benchmarks/llama_cpp_serving.py                       # contexts 512 ... 8192, 2 threads
    python benchmarks/llama_cpp_serving.py --contexts 512,2048 --threads 1
    python benchmarks/llama_cpp_serving.py --write               # GGUF writing against plain copying
    python benchmarks/llama_cpp_serving.py --caches              # each way to a smaller cache, at 8,192 tokens

The three models are f16 GGUF files gqaify writes: the MHA-9 twin has each of the parent's 3 K/V heads repeated
for its 3 query heads (the same function as the parent, 3x its cache), the GQA-3 one is the parent converted to 3
K/V heads (itself), the MQA one the parent mean-pooled to 1 (its quality does not matter here), the MLA one that
MQA model rewritten exactly (`--attention mla`: a latent of 64 and a rotary key of 64). For each model and
context N, a fresh process loads the model with a context of N + 64, evaluates N seeded random tokens in batches of
512 (prompt processing, tokens/s), then 64 tokens one at a time (decode, tokens/s), with --threads CPU threads;
the KV cache size is what llama.cpp reports when it allocates the cache. Writes OUT/llama_cpp_serving.md, .json and
OUT/llama_cpp_decode.png.

`--write` converts the parent to MQA (float32 safetensors) once, then times writing it as an f16 GGUF file against
reading the same tensors and writing the same f16 bytes to a plain file, each in a fresh process that reports its
own peak resident memory beside the largest tensor.

`--caches` serves each way to a smaller cache at a context of 8,192 (`--contexts`): the parent (GQA-3), its MQA
conversion and its MLA 128 rewrite, each with an f16, a q8_0 and a q4_0 cache (flash attention where llama.cpp
needs it, for a quantized V cache), and measures the decode speed after the prompt and the process's peak resident
memory (its own high-water mark, VmHWM), in a fresh process per run, the runs of every configuration in turns,
`--repeats` times (3). Writes
OUT/llama_cpp_caches.md and .json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from commands import convert

REPO = Path(__file__).resolve().parents[1]
DECODE_TOKENS = 64
REPEATS = 5  # of each writing measurement; the medians are reported
CACHE_REPEATS = 3  # of each (model, cache) at --caches, in turns
CACHES = ["f16", "q8_0", "q4_0"]
# name -> (the file's stem, the conversion's settings; None: the MHA twin, which gqaify does not make)
MODELS = {
    "MHA-9 twin": ("smollm2-kv9", None),
    "GQA-3 (parent)": ("smollm2-kv3", {"kv_heads": 3}),
    "MQA": ("smollm2-kv1", {"kv_heads": 1}),
    "MLA 128 (MQA rewritten)": ("smollm2-mla128", {"kv_heads": 1, "attention": "mla", "dtype": "float32"}),
}

# One measurement, in a process of its own (llama.cpp reports its cache on stderr when it allocates it): with a cache
# type (argv[5], for K and V alike) flash attention where a quantized V cache needs it; without, llama.cpp's defaults.
MEASURE = r"""
import json, re, resource, sys, time
import numpy as np
import llama_cpp
path, n, threads, decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cache = sys.argv[5] if len(sys.argv) > 5 else None
kind = cache and getattr(llama_cpp, f"GGML_TYPE_{cache.upper()}")
types = {} if cache is None else {"type_k": kind, "type_v": kind, "flash_attn": cache != "f16"}
llm = llama_cpp.Llama(model_path=path, n_ctx=n + decode + 32, n_batch=512, n_threads=threads, verbose=True, **types)
tokens = np.random.default_rng(0).integers(100, llm.n_vocab() - 100, n).tolist()
start = time.perf_counter(); llm.eval(tokens); prompt = time.perf_counter() - start
start = time.perf_counter()
for token in tokens[:decode]:
    llm.eval([token])
generate = time.perf_counter() - start
# this process's own peak (VmHWM: its memory since its exec), where ru_maxrss keeps the forking parent's across exec
try:
    peak_kib = int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read())[1])
except (OSError, TypeError):
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"prompt_tok_s": n / prompt, "decode_tok_s": decode / generate, "peak_rss_mib": peak_kib / 1024}))
llm.close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/llama-cpp-serving", help="output folder")
    parser.add_argument("--contexts", default="512,1024,2048,4096,8192", help="comma-separated context lengths")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads llama.cpp uses")
    parser.add_argument("--write", action="store_true", help="measure GGUF writing instead")
    parser.add_argument("--caches", action="store_true", help="each model under f16, q8_0 and q4_0 caches instead")
    parser.add_argument("--repeats", type=int, default=CACHE_REPEATS, help="with --caches: runs of each, in turns")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.write:
        return measure_writing(out)
    if args.caches:
        return measure_caches(out, int(args.contexts.split(",")[-1]), args.threads, args.repeats)
    models = build_models(out)
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for name, path in models.items():
            done = subprocess.run(
                [sys.executable, "-c", MEASURE, str(path), str(context), str(args.threads), str(DECODE_TOKENS)],
                capture_output=True,
                text=True,
                check=True,
            )
            cache = re.search(r"llama_kv_cache: size = +([\d.]+) MiB", done.stderr)
            row = {
                "model": name,
                "context": context,
                **json.loads(done.stdout.strip().splitlines()[-1]),
                "kv_cache_mib": float(cache[1]) if cache else None,
            }
            rows.append(row)
            print(row, flush=True)
            (out / "llama_cpp_serving.json").write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2))
    table = format_table(rows, args.threads)
    (out / "llama_cpp_serving.md").write_text(table + "\n")
    plot(rows, out / "llama_cpp_decode.png", args.threads)
    print(table)


def measure_caches(out: Path, context: int, threads: int, repeats: int) -> None:
    """Each of the parent, MQA and MLA 128 under each of `CACHES` at `context`, in turns, `repeats` times."""
    paths = build_models(out)
    served = {name: paths[name] for name in ("GQA-3 (parent)", "MQA", "MLA 128 (MQA rewritten)")}
    runs: dict[tuple[str, str], list[dict]] = {}
    refused: set[tuple[str, str]] = set()
    for _ in range(repeats):
        for name, path in served.items():
            for cache in CACHES:
                if (name, cache) in refused:
                    continue
                argv = [str(path), str(context), str(threads), str(DECODE_TOKENS), cache]
                done = subprocess.run([sys.executable, "-c", MEASURE, *argv], capture_output=True, text=True)
                if done.returncode:  # llama.cpp cannot hold this model's cache so
                    refused.add((name, cache))
                    print(name, cache, "refused by llama.cpp", flush=True)
                    continue
                size = re.search(r"llama_kv_cache: +size = +([\d.]+) MiB", done.stderr)
                row = {**json.loads(done.stdout.strip().splitlines()[-1]), "kv_cache_mib": float(size[1])}
                runs.setdefault((name, cache), []).append(row)
                print(name, cache, row, flush=True)
    rows = [
        {"model": name, "cache": cache, "context": context, "runs": found,
         **{key: statistics.median(r[key] for r in found) for key in found[0]}}
        for (name, cache), found in runs.items()
    ]  # fmt: skip
    (out / "llama_cpp_caches.json").write_text(json.dumps({"threads": threads, "rows": rows}, indent=2))
    lines = [
        f"llama.cpp, SmolLM2-135M-Instruct f16 weights, {context:,} tokens of context, {threads} CPU threads, "
        f"medians of {repeats} runs in turns (slowest-fastest)",
        "",
        "| model | cache | KV cache (MiB) | decode tok/s | prompt tok/s | peak memory (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = (f(x["decode_tok_s"] for x in r["runs"]) for f in (min, max))
        lines.append(
            f"| {r['model']} | {r['cache']} | {r['kv_cache_mib']:.1f} | {r['decode_tok_s']:.1f} ({low:.1f}-{high:.1f})"
            f" | {r['prompt_tok_s']:,.0f} | {r['peak_rss_mib']:,.0f} |"
        )
    lines += [f"| {name} | {cache} | llama.cpp cannot make this context | | | |" for name, cache in sorted(refused)]
    (out / "llama_cpp_caches.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def build_models(out: Path) -> dict[str, Path]:
    """The f16 GGUF files (made once)."""
    from gqaify.conversion.to_gguf import write_gguf
    from gqaify.entry.demo import fetch_default_model

    parent = fetch_default_model()
    paths = {name: out / f"{stem}.gguf" for name, (stem, _) in MODELS.items()}
    for name, (_, settings) in MODELS.items():
        if not paths[name].is_file() and settings is not None:
            subprocess.run(convert(parent, paths[name], **settings, gguf_type="f16", quiet=True), check=True)
    twin = paths["MHA-9 twin"]
    if not twin.is_file():  # not a conversion gqaify makes (9 heads from 3): repeated heads, written by the same writer
        folder = out / "smollm2-mha9"
        mha_twin(parent, folder)
        write_gguf(folder, twin, "f16", tokenizer_gguf=parent)
    return paths


def mha_twin(gguf: Path, folder: Path) -> None:
    """SmolLM2 with each K/V head repeated for the query heads that read it: an exact MHA version of the parent."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size // heads
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                weight = proj.weight.view(kv, d, -1).repeat_interleave(heads // kv, dim=0).reshape(heads * d, -1)
                proj.weight = torch.nn.Parameter(weight.contiguous())
    config.num_key_value_heads = heads
    plain = {k: v for k, v in config.to_dict().items() if k != "quantization_config"}  # dequantized on loading
    twin = AutoModelForCausalLM.from_config(type(config).from_dict(plain), dtype=torch.float32)
    twin.load_state_dict(model.state_dict())
    twin.save_pretrained(folder)


def measure_writing(out: Path) -> None:
    from gqaify.entry.demo import fetch_default_model

    parent = fetch_default_model()
    folder = out / "smollm2-mqa-f32"
    if not folder.is_dir():
        subprocess.run(convert(parent, folder, kv_heads=1, dtype="float32", quiet=True), check=True)
    runs = {"GGUF f16 (gqaify)": WRITE_GGUF, "plain f16 bytes": WRITE_PLAIN}
    measured: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(REPEATS):  # alternating, so that both meet the page cache in the same states
        for name, code in runs.items():
            target = out / ("written.gguf" if "GGUF" in name else "written.bin")
            done = subprocess.run(
                [sys.executable, "-c", code, str(folder), str(target), str(parent)], capture_output=True, text=True
            )
            if done.returncode:
                sys.exit(f"{name} failed:\n{done.stderr}")
            measured[name].append({**json.loads(done.stdout.strip().splitlines()[-1]), "bytes": target.stat().st_size})
            target.unlink()
            print(name, measured[name][-1], flush=True)
    rows = {
        name: {key: statistics.median(run[key] for run in runs_of) for key in runs_of[0]}
        for name, runs_of in measured.items()
    }
    print("medians:", json.dumps(rows, indent=2))
    (out / "gguf_writing.json").write_text(json.dumps(rows, indent=2))


# Each writer reports the seconds of writing alone, its peak resident memory, and that after its imports; the
# GGUF one copies its vocabulary from the parent (argv[3]), as `gqaify convert` does for a GGUF source.
WRITE_GGUF = """
import json, resource, sys, time
from pathlib import Path
import gguf, torch, safetensors
import gqaify.conversion.to_gguf as to_gguf
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
write_data, data_seconds = to_gguf._write_data, []
def timed(*args):  # the tensors' part alone, beside the metadata's
    start = time.perf_counter()
    write_data(*args)
    data_seconds.append(time.perf_counter() - start)
to_gguf._write_data = timed
start = time.perf_counter()
to_gguf.write_gguf(Path(sys.argv[1]), Path(sys.argv[2]), "f16", tokenizer_gguf=Path(sys.argv[3]))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "tensor_seconds": data_seconds[0],
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_after_imports_mib": base / 1024}))
"""
WRITE_PLAIN = """
import json, resource, sys, time
from pathlib import Path
import gguf, torch, numpy as np
from safetensors import safe_open
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
largest = 0
with safe_open(Path(sys.argv[1]) / "model.safetensors", "pt") as f, open(sys.argv[2], "wb") as out:
    for name in f.keys():
        tensor = f.get_tensor(name)
        largest = max(largest, tensor.numel() * 4)
        (tensor.float() if tensor.dim() == 1 else tensor.to(torch.float16)).numpy().tofile(out)  # torch's fast cast
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_after_imports_mib": base / 1024, "largest_tensor_mib": largest / 2**20}))
"""


def format_table(rows: list[dict], threads: int) -> str:
    lines = [
        f"llama.cpp (llama-cpp-python), SmolLM2-135M-Instruct f16, {threads} CPU threads",
        "",
        "| model | context | KV cache (MiB) | prompt tok/s | decode tok/s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['context']:,} | {r['kv_cache_mib']:.2f} | {r['prompt_tok_s']:,.0f} | "
            f"{r['decode_tok_s']:,.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, threads: int) -> None:
    from gqaify.figures import figure

    with figure(path, (6, 4)) as ax:
        for name in MODELS:
            points = [(r["context"], r["decode_tok_s"]) for r in rows if r["model"] == name]
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"llama.cpp decode, SmolLM2-135M f16, {threads} threads")
        ax.legend()


if __name__ == "__main__":
    main()
