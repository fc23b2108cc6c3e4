"""What one token caches, counted in values: the keys and the values a model of a config holds per token over every
layer, as the engines hold them (light: the config alone)."""

from __future__ import annotations

from gqaify.conversion.shapes import cached_per_token
from gqaify.model.archs import ARCHITECTURES, ArchSpec
from gqaify.model.geometry import Geometry


def cached_values(config) -> tuple[int, int]:
    """The keys and the values one token caches over every layer of a model of `config`: whole K/V heads a key and a
    value each; a shape that caches otherwise, its values counted as keys (llama.cpp holds them so)."""
    spec = ARCHITECTURES.get(config.model_type) or ArchSpec(config.model_type)
    geometry = Geometry.from_config(spec, config.to_dict()).with_cached(cached_per_token(config))
    if geometry.cached is not None:
        return geometry.num_layers * geometry.cached, 0
    per_layer = geometry.num_kv_heads * geometry.head_dim
    return geometry.num_layers * per_layer, geometry.num_layers * per_layer
