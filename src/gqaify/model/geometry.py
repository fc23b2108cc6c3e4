"""A model's attention shape, read from its config, and what it is called.

Whole K/V heads (MHA, GQA, MQA) cache a key and a value per K/V head for every token and layer; a model of another
attention shape caches what its shape says (`Geometry.cached`, which the shape reads from the config:
`conversion.shapes`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from gqaify.auto import is_auto
from gqaify.errors import raise_if_problems
from gqaify.model.archs import ArchSpec
from gqaify.records import optional


@dataclass(frozen=True)
class Geometry:
    """Attention shape of a model, read from its transformers config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    # the values one token caches per layer where the model's attention shape caches something other than whole K/V
    # heads (`with_cached`); None: whole K/V heads
    cached: int | None = optional()

    @classmethod
    def from_config(cls, spec: ArchSpec, config: dict) -> Geometry:
        """Read from a config.json dict, through the keys `spec` names.

        Raises:
            UserError: a required key is missing, or a key is not a positive integer (see `problems`).
        """
        raise_if_problems(cls.problems(spec, config))
        num_heads, hidden = config[spec.num_heads_key], config[spec.hidden_size_key]
        head_dim = (config.get(spec.head_dim_key) if spec.head_dim_key else None) or hidden // num_heads
        num_kv_heads = config.get(spec.num_kv_heads_key) or num_heads
        return cls(config[spec.num_layers_key], num_heads, num_kv_heads, head_dim, hidden)

    @staticmethod
    def problems(spec: ArchSpec, config: dict) -> list[str]:
        """Every geometry key of `config` that is missing (where required) or not a positive integer."""
        problems = []
        required = (spec.num_layers_key, spec.num_heads_key, spec.hidden_size_key)
        optional = tuple(k for k in (spec.num_kv_heads_key, spec.head_dim_key) if k)
        for key in required + optional:
            value = config.get(key)
            if value is None and key in optional:
                continue
            if value is None:
                problems.append(f"config.json lacks {key!r}, which {spec.model_type} needs; check the checkpoint")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(
                    f"config.json has {key} = {json.dumps(value)}, not a positive whole number; fix config.json"
                )
        return problems

    def with_kv_heads(self, num_kv_heads: int) -> Geometry:
        return Geometry(self.num_layers, self.num_heads, num_kv_heads, self.head_dim, self.hidden_size)

    def with_cached(self, values: int | None) -> Geometry:
        """This model's body caching `values` per token and layer (None: whole K/V heads)."""
        return replace(self, cached=values)

    @property
    def cached_per_token(self) -> int:
        """The values one token adds to one layer's cache: a key and a value per K/V head, or what its shape caches."""
        return self.cached if self.cached is not None else 2 * self.num_kv_heads * self.head_dim

    @property
    def queries_per_kv_head(self) -> int:
        return self.num_heads // self.num_kv_heads


def _reader(config):
    """`get(key, default)` on a transformers config or config.json's dict alike."""
    return config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)


def float16_asked(dtype: str, config, whose: str) -> str | None:
    """How float16 is asked for, for a message: by `--dtype float16`, or by `config` (`whose` config: "the
    source's", "its config's") storing float16 under --dtype auto; None where it is not."""
    # config.json's older key too, but never a config object's torch_dtype: transformers' deprecated alias of its
    # dtype, which said "torch_dtype is deprecated" between gqaify's lines (the demo's, for a GGUF: no dtype)
    older = config.get("torch_dtype") if isinstance(config, dict) else None
    stored = str(_reader(config)("dtype") or older or "").removeprefix("torch.")
    if dtype == "float16":
        return "--dtype float16"
    return f"{whose} float16 (--dtype auto)" if is_auto(dtype) and stored == "float16" else None


def attention_kind(num_kv_heads: int) -> str:
    """What a model with `num_kv_heads` K/V heads is called in the summaries and the card: "MQA" or "GQA-G"."""
    return "MQA" if num_kv_heads == 1 else f"GQA-{num_kv_heads}"


def rotary_dim(model_type: str, config: dict, head_dim: int) -> int:
    """How many leading dimensions of each head RoPE rotates, as transformers' config for the class says."""
    from transformers import AutoConfig

    transformers_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    rope = getattr(transformers_config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(transformers_config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * factor)
