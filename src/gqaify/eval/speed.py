"""Prefill and greedy-decode throughput with the KV cache, as a serving loop sees it.

One run: prefill a batch of contexts (one forward pass that fills the cache), then decode `new_tokens`
greedy tokens one step at a time from the cache. Models compared are timed in turns (`timed_in_turns`): each
warms up once (allocations, kernel choice; not counted), then `repeats` rounds time each model once, in order
(parent, converted, parent, converted, ...), so that a load on the machine that comes and goes falls on every
model alike, and every run is kept (`Spread`: the slowest, the median, the fastest). Timed one model after the
other, the median of a few runs each, a busy CPU made MQA conversions look 3-4x slower than their parent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gqaify.eval.results import Spread


@dataclass(frozen=True)
class Speed:
    """One model's throughput at one batch and context, over its timed runs (tokens per second)."""

    batch: int
    context: int
    new_tokens: int
    prefill: Spread
    decode: Spread

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill.median

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode.median


@torch.inference_mode()
def timed_in_turns(
    runs: list[tuple[torch.nn.Module, torch.Tensor]],
    batch: int,
    new_tokens: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    tick: Callable[[], object] = lambda: None,
) -> list[Speed]:
    """The throughput of each (model, context_ids (1-D)) in `runs`, prefilling the context repeated `batch` times
    and then decoding greedily: each warmed up once, then `repeats` rounds that time every model once, in order;
    `tick` is called after each run (a progress bar's step).

    Returns:
        One `Speed` per entry of `runs`, in its order.
    """
    timers = [_timer(model, ids, batch, new_tokens, clock) for model, ids in runs]
    for run in timers:  # warm-up
        run()
        tick()
    times: list[list[tuple[float, float]]] = [[] for _ in timers]  # per model: (prefill s, decode s) per round
    for _ in range(repeats):
        for run, kept in zip(timers, times, strict=True):
            kept.append(run())
            tick()
    return [
        Speed(
            batch=batch,
            context=len(ids),
            new_tokens=new_tokens,
            prefill=Spread.of([batch * len(ids) / prefill for prefill, _ in kept]),
            decode=Spread.of([batch * new_tokens / decode for _, decode in kept]),
        )
        for (_, ids), kept in zip(runs, times, strict=True)
    ]


def decode_speed(model, context_ids: torch.Tensor, batch: int, new_tokens: int, repeats: int = 3) -> Speed:
    """Throughput of `model` alone prefilling `context_ids` (1-D) repeated `batch` times, then decoding greedily."""
    return timed_in_turns([(model, context_ids)], batch, new_tokens, repeats)[0]


def pooled(speeds: list[Speed]) -> Speed:
    """One model's `speeds` at the same batch and context (its turns beside several models) as one, every run kept."""
    first = speeds[0]
    return Speed(
        batch=first.batch,
        context=first.context,
        new_tokens=first.new_tokens,
        prefill=Spread.of([r for s in speeds for r in s.prefill.runs]),
        decode=Spread.of([r for s in speeds for r in s.decode.runs]),
    )


def _timer(model, context_ids: torch.Tensor, batch: int, new_tokens: int, clock: Callable[[], float]):
    """A function that runs `model` once (prefill, then `new_tokens` greedy steps) and returns (prefill seconds,
    decode seconds) by `clock`."""
    device = next(model.parameters()).device
    inputs = context_ids.to(device).unsqueeze(0).expand(batch, -1).contiguous()  # (B, context)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run() -> tuple[float, float]:
        sync()
        t0 = clock()
        out = model(inputs, use_cache=True, logits_to_keep=1)
        sync()
        t1 = clock()
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        for _ in range(new_tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        return t1 - t0, clock() - t1

    return run
