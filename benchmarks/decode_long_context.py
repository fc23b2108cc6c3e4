"""Decode speed at long context on a GPU: the MHA parent, its GQA conversion and its MQA conversion.

For each shape, three models that differ only in their number of K/V heads: SmolLM2-135M (30 layers, hidden
576, 9 query heads; its exact MHA twin has 9 K/V heads, the original 3, the MQA conversion 1) and Llama-2-7B
(32 layers, hidden 4096, 32 query heads; MHA 32, GQA-8, MQA 1). Weights are random: the speed of a forward
pass depends on the shapes, not on the values, and these are exactly the shapes of the parent and of what
`gqaify convert` writes. bf16, transformers' sdpa attention and DynamicCache, greedy decoding from a prefilled
context, timed by `gqaify.eval.speed.decode_speed`: each model alone, one after the other, with the timer `gqaify
eval` uses (one warm-up, then the prefill and the greedy steps timed apart); `gqaify eval` itself times each model
in turns with the parent (`gqaify.eval.speed.timed_in_turns`). A run that does not fit in GPU memory is reported as
OOM, which is the other half of the story: the context x batch a cache allows.

    python benchmarks/decode_long_context.py                                 # both shapes, the default grid
    python benchmarks/decode_long_context.py --shapes smollm2-135m --contexts 8192 --batches 1,64
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from gqaify.eval.speed import decode_speed
from gqaify.model.archs import ARCHITECTURES
from gqaify.model.geometry import Geometry
from gqaify.model.kvcache import kv_cache_bytes

# name -> (LlamaConfig fields, K/V head counts: the MHA parent first)
SHAPES = {
    "smollm2-135m": (
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            vocab_size=49152,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
        (9, 3, 1),
    ),
    "llama2-7b": (
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            vocab_size=32000,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
        (32, 8, 1),
    ),
}


def build(fields: dict, kv_heads: int, max_positions: int):
    config = LlamaConfig(**fields, num_key_value_heads=kv_heads, max_position_embeddings=max_positions)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def measure(model, context: int, batch: int, new_tokens: int, repeats: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (context,))
    torch.cuda.reset_peak_memory_stats()
    try:
        speed = decode_speed(model, ids, batch, new_tokens, repeats)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"oom": True}
    return {
        "prefill_tok_s": round(speed.prefill_tokens_per_s),
        "decode_tok_s": round(speed.decode_tokens_per_s, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--contexts", default="2048,8192", help="prefilled tokens, comma-separated")
    parser.add_argument("--batches", default="1,16,64", help="sequences decoded together, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens decoded per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median), after one warm-up")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA GPU (it measures decode speed at long context)")
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        fields, heads = SHAPES[shape]
        for kv_heads in heads:
            model = build(fields, kv_heads, max(contexts) + args.new_tokens + 1)
            geometry = Geometry.from_config(ARCHITECTURES["llama"], model.config.to_dict())
            label = {fields["num_attention_heads"]: "MHA", 1: "MQA"}.get(kv_heads, f"GQA-{kv_heads}")
            for context in contexts:
                cache = kv_cache_bytes(geometry, torch.bfloat16, context + args.new_tokens)
                for batch in batches:
                    row = {
                        "shape": shape,
                        "variant": label,
                        "kv_heads": kv_heads,
                        "context": context,
                        "batch": batch,
                        "kv_cache_gib": round(batch * cache / 2**30, 2),
                        **measure(model, context, batch, args.new_tokens, args.repeats),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del model
            torch.cuda.empty_cache()

    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.new_tokens} new tokens, "
        f"median of {args.repeats}\n"
    )
    print("| shape | model | K/V heads | context | batch | KV cache | prefill tok/s | decode tok/s | peak memory |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        speed = (
            ("OOM", "OOM", "—")
            if r.get("oom")
            else (f"{r['prefill_tok_s']:,}", f"{r['decode_tok_s']:,}", f"{r['peak_gib']} GiB")
        )
        print(
            f"| {r['shape']} | {r['variant']} | {r['kv_heads']} | {r['context']:,} | {r['batch']} "
            f"| {r['kv_cache_gib']} GiB | {speed[0]} | {speed[1]} | {speed[2]} |"
        )


if __name__ == "__main__":
    main()
