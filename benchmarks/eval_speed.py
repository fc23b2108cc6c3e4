"""Is `gqaify eval` fast, and how much faster does a smaller KV cache decode?

1. Perplexity throughput: gqaify's perplexity (batched windows, only the scoring logits computed) against
   the loop of transformers' "Perplexity of fixed-length models" guide (the reference the tests check it
   against), same model, same tokens, same windows, in one run. Target: >= 1.0x.
2. Decode speed, MHA vs GQA vs MQA: greedy decoding with the cache at batch 1 and 8 (prefill and decode
   tok/s, median of repeats). ref-mha-6L: MHA-8 and its mean-pooled GQA-2 and MQA. SmolLM2-135M-Instruct:
   its exact MHA twin (every K/V head duplicated), the GQA-3 original and its MQA conversion.

    python benchmarks/eval_speed.py            # needs ../shared/assets (ref-mha-6L, WikiText-2)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import gqaify
from gqaify.entry.demo import fetch_default_model
from gqaify.eval.perplexity import perplexity
from gqaify.eval.speed import decode_speed
from gqaify.testing import duplicate_kv_heads, transformers_doc_loop  # the references the tests validate

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO.parent / "shared" / "assets"  # ../shared/assets beside the checkout


def ppl_throughput(model, ids: torch.Tensor, seq_len: int, stride: int, batch_size: int) -> dict:
    t0 = time.perf_counter()
    ours = perplexity(model, ids, seq_len, stride, batch_size=batch_size, progress=False)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    nll_sum, n_tokens = transformers_doc_loop(model, ids, seq_len, stride)
    t_loop = time.perf_counter() - t0
    assert n_tokens == ours.tokens_scored and abs(nll_sum - ours.nll_sum) <= 1e-4 * abs(nll_sum)
    return {
        "seq_len": seq_len,
        "stride": stride,
        "batch_size": batch_size,
        "tokens_scored": n_tokens,
        "gqaify_tok_s": round(n_tokens / t_ours, 1),
        "loop_tok_s": round(n_tokens / t_loop, 1),
        "speedup": round(t_loop / t_ours, 2),
    }


def decode_row(name: str, model, ids: torch.Tensor, context: int, tokens: int, repeats: int) -> dict:
    single = decode_speed(model, ids[:context], 1, tokens, repeats)
    batched = decode_speed(model, ids[:context], 8, tokens, repeats)
    return {
        "model": name,
        "kv_heads": model.config.num_key_value_heads,
        "context": context,
        "prefill_tok_s": round(single.prefill_tokens_per_s, 1),
        "decode_tok_s_b1": round(single.decode_tokens_per_s, 1),
        "decode_tok_s_b8": round(batched.decode_tokens_per_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of WikiText-2 for perplexity (4096)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    text = (ASSETS / "text" / "wikitext-2-raw-test.txt").read_text()
    results: dict = {"perplexity": [], "decode": [], "threads": torch.get_num_threads()}

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gguf = fetch_default_model()
        smol = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        ids = torch.tensor(tok(text, verbose=False).input_ids[: args.tokens])
        for stride, batch in ((1024, 1), (1024, 4), (512, 1)):
            results["perplexity"].append({"model": "SmolLM2-135M", **ppl_throughput(smol, ids, 1024, stride, batch)})

        gqaify.convert(gguf, tmp / "smol-mqa", kv_heads=1, progress=False)
        duplicate_kv_heads(smol).save_pretrained(tmp / "smol-mha")  # reloaded below like the others (same attention)
        variants = [
            ("SmolLM2 MHA twin", AutoModelForCausalLM.from_pretrained(tmp / "smol-mha").eval()),
            ("SmolLM2 GQA-3", smol),
            ("SmolLM2 MQA", AutoModelForCausalLM.from_pretrained(tmp / "smol-mqa").eval()),
        ]
        for name, model in variants:
            results["decode"].append(decode_row(name, model, ids, 1024, args.decode_tokens, args.repeats))

        ref = ASSETS / "models" / "ref-mha-6L"
        ref_ids = torch.tensor(AutoTokenizer.from_pretrained(ref)(text, verbose=False).input_ids[: args.tokens])
        results["perplexity"].append(
            {
                "model": "ref-mha-6L",
                **ppl_throughput(AutoModelForCausalLM.from_pretrained(ref).eval(), ref_ids, 512, 512, 1),
            }
        )
        for g, name in ((8, "MHA-8"), (2, "GQA-2"), (1, "MQA")):
            path = ref if g == 8 else tmp / f"ref-{g}"
            if g != 8:
                gqaify.convert(ref, path, kv_heads=g, progress=False)
            model = AutoModelForCausalLM.from_pretrained(path).eval()
            results["decode"].append(
                decode_row(f"ref-mha-6L {name}", model, ref_ids, 256, args.decode_tokens, args.repeats)
            )

    print(json.dumps(results, indent=2))
    print("\n| model | seq_len / stride | batch | gqaify tok/s | guide loop tok/s | speedup |")
    print("|---|---|---|---|---|---|")
    for r in results["perplexity"]:
        print(
            f"| {r['model']} | {r['seq_len']} / {r['stride']} | {r['batch_size']} | {r['gqaify_tok_s']:,} "
            f"| {r['loop_tok_s']:,} | {r['speedup']}x |"
        )
    print("\n| model | K/V heads | context | prefill tok/s | decode tok/s, batch 1 | decode tok/s, batch 8 |")
    print("|---|---|---|---|---|---|")
    for r in results["decode"]:
        print(
            f"| {r['model']} | {r['kv_heads']} | {r['context']} | {r['prefill_tok_s']:,} | {r['decode_tok_s_b1']:,} "
            f"| {r['decode_tok_s_b8']:,} |"
        )


if __name__ == "__main__":
    main()
