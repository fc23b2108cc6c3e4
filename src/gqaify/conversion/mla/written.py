"""What the MLA rewrite writes, as a model's config tells it: the architectures whose layer it takes, whether a
config is its output, why float16 cannot hold one, and where the class it writes trains. Light: the shape, the
layer, uptraining's fit and the registry's entry (`ShapeInfo.writes`) read it."""

from __future__ import annotations

from gqaify.model.archs import LAYER, TrainedAttention


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

# The class the rewrite writes, which gqaify converts from none: where it trains (`ShapeInfo.writes`). DeepSeek-V3's
# latent attention with no query low-rank: kv_a_proj_with_mqa holds the latent's down-projection, which uptraining
# keeps as converted (`fit.latent_projections`), so LoRA adapts the query, the latent's up-projections (kv_b_proj)
# and o_proj, and kv-only trains kv_b_proj.
TRAINED = {
    "deepseek_v3": TrainedAttention.at(
        f"model.layers.{LAYER}.self_attn", ("q_proj", "kv_b_proj", "o_proj"), ("kv_b_proj",)
    ),
}
