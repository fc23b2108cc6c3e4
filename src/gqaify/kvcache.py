"""The size of the KV cache: the one place gqaify counts it.

Each generated or prefilled token stores one key and one value vector per K/V head in every layer:

    bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element

so a model with G K/V heads caches H/G times less than its MHA parent with H heads.
"""

from __future__ import annotations

import torch

from gqaify.convert.archs import Geometry


def kv_cache_bytes_per_token(geometry: Geometry, dtype: torch.dtype) -> int:
    """Bytes of K/V cache one token occupies with full attention in every layer."""
    return 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * dtype.itemsize


def measured_kv_cache_bytes(cache) -> int:
    """Bytes held by the key and value tensors of a transformers cache object (e.g. after a prefill)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
