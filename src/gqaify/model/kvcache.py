"""The size of the KV cache: the one place gqaify counts it.

Each token a layer caches costs one key and one value vector per K/V head, or what its attention shape caches instead
(`Geometry.cached_per_token`, the shape's `cached`):

    bytes = sum over layers of  2 (K and V) x kv_heads x head_dim x bytes per element x tokens cached
    other:  sum over layers of  the values its shape caches x bytes per element x tokens cached

A full-attention layer caches every token; a sliding-window layer keeps only the last `window - 1` (what
transformers' `DynamicSlidingWindowLayer` stores). With full attention everywhere, a model with G K/V heads
caches H/G times less than its MHA parent with H heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gqaify.model.geometry import Geometry


def kv_cache_bytes(geometry: Geometry, dtype: torch.dtype, tokens: int, windows: Sequence[int | None] = ()) -> int:
    """Bytes of K/V cache for a sequence of `tokens` tokens (batch 1).

    Args:
        windows: per layer, the sliding window, or None for full attention; empty means all full.
    """
    per_token = geometry.cached_per_token * dtype.itemsize
    windows = windows or [None] * geometry.num_layers
    return sum(per_token * (tokens if w is None else min(tokens, w - 1)) for w in windows)


def kv_cache_bytes_per_token(geometry: Geometry, dtype: torch.dtype) -> int:
    """Bytes one more token adds to the cache of a full-attention model (the growth rate past any window)."""
    return kv_cache_bytes(geometry, dtype, tokens=1)


def sliding_windows(config) -> list[int | None]:
    """Per layer, the sliding window of a transformers config, or None for full attention.

    Read off the cache transformers itself builds for the config (`DynamicCache(config=...)`, what `generate`
    uses), so the count agrees with the cache the model really holds.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    return [layer.sliding_window if getattr(layer, "is_sliding", False) else None for layer in cache.layers]


def measured_kv_cache_bytes(cache) -> int:
    """Bytes held by the key and value tensors of a transformers cache object (e.g. after a prefill)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@dataclass(frozen=True)
class Capacity:
    """What fits in a memory budget beside the weights (K/V cache and weights only; activations not counted)."""

    budget_bytes: int
    weights_bytes: int
    max_context: int | None  # longest sequence whose cache fits at batch 1; None: bounded (every layer slides)
    max_batch: int  # most sequences of `context` tokens
    context: int
    positions: int | None = None  # the model's max_position_embeddings, where it has one

    @property
    def usable_context(self) -> int | None:
        """The longest sequence the model can run at batch 1: the cache's room, capped at the positions."""
        limits = [n for n in (self.max_context, self.positions) if n is not None]
        return min(limits) if limits else None

    @property
    def bound_by(self) -> str:
        """What limits `usable_context`: "memory", "positions", or "nothing" (a sliding cache, no positions)."""
        if self.max_context is None:
            return "positions" if self.positions is not None else "nothing"
        return "positions" if self.positions is not None and self.positions < self.max_context else "memory"


def capacity(
    geometry, dtype, windows, weights_bytes: int, budget_bytes: int, context: int, positions: int | None = None
) -> Capacity:
    free = budget_bytes - weights_bytes
    if free <= 0:
        return Capacity(budget_bytes, weights_bytes, 0, 0, context, positions)
    per_sequence = kv_cache_bytes(geometry, dtype, context, windows)
    max_batch = free // per_sequence if per_sequence else 0
    # kv_cache_bytes grows with tokens (piecewise linear with windows): bisect the longest context that fits
    low, high = 0, 1
    while kv_cache_bytes(geometry, dtype, high, windows) <= free:
        if high >= 1 << 40:
            return Capacity(budget_bytes, weights_bytes, None, max_batch, context, positions)
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if kv_cache_bytes(geometry, dtype, mid, windows) <= free else (low, mid)
    return Capacity(budget_bytes, weights_bytes, low, max_batch, context, positions)
