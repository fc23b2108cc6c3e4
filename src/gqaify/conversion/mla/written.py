"""What the MLA rewrite writes, as a model's config tells it: the architectures whose layer it takes, whether a
config is its output, and why float16 cannot hold one. Light: the shape, the layer and uptraining's fit read it."""

from __future__ import annotations


def latent_below_epsilon(config) -> bool:
    """Whether `config` (a transformers config, or config.json's dict) is gqaify's MLA rewrite: DeepSeek-V3 with every
    layer dense and no query low-rank, whose latent is held below its norm's epsilon (about 1e-8, `mla.layer`) so
    that the norm is linear; float16, whose smallest normal value is 6e-5, cannot hold it."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    dense = (get("first_k_dense_replace", 0) or 0) >= (get("num_hidden_layers", 0) or 0)
    return get("model_type") == "deepseek_v3" and get("q_lora_rank", 0) is None and dense


# why float16 cannot hold the rewrite (`Shape.float16`)
FLOAT16 = "an MLA latent is held below its norm's epsilon (about 1e-8)"
ARCHS = ("llama", "mistral")  # whose layer the rewrite is checked against DeepSeek-V3's dense one (`mla.layer`)
