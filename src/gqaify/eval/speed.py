"""Prefill and greedy-decode throughput with the KV cache, as a serving loop sees it.

One run: prefill a batch of contexts (one forward pass that fills the cache), then decode `new_tokens`
greedy tokens one step at a time from the cache. The first run warms up (allocations, kernel choice) and is
not counted; the median of `repeats` runs is reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Speed:
    batch: int
    context: int
    new_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@torch.inference_mode()
def decode_speed(model, context_ids: torch.Tensor, batch: int, new_tokens: int, repeats: int = 3) -> Speed:
    """Throughput of `model` prefilling `context_ids` (1-D) repeated `batch` times, then decoding greedily."""
    device = next(model.parameters()).device
    inputs = context_ids.to(device).unsqueeze(0).expand(batch, -1).contiguous()  # (B, context)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run() -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        out = model(inputs, use_cache=True, logits_to_keep=1)
        sync()
        t1 = time.perf_counter()
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        for _ in range(new_tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        return t1 - t0, time.perf_counter() - t1

    run()  # warm-up
    prefill, decode = zip(*(run() for _ in range(repeats)), strict=True)
    return Speed(
        batch=batch,
        context=inputs.shape[1],
        new_tokens=new_tokens,
        prefill_tokens_per_s=batch * inputs.shape[1] / statistics.median(prefill),
        decode_tokens_per_s=batch * new_tokens / statistics.median(decode),
    )
