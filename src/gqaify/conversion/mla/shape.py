"""Latent attention as a `conversion.shape_contract.Shape`: the answers gqaify asks of it, each from the module of this
folder that knows it; what needs torch is imported when asked, so that a settings check that asks whether the shape
reads text loads nothing heavy. No module of the folder imports this one."""

from __future__ import annotations

from gqaify.conversion.mla import budget
from gqaify.conversion.mla.written import ARCHS, FLOAT16, latent_below_epsilon


class LatentAttention:
    """The `Shape` of DeepSeek-V3's latent attention, rewritten from the G-head model."""

    float16 = FLOAT16

    def resolve_cut(self, s, geometry):
        return budget.resolve_cut(s, geometry)

    def reads_text(self, s) -> bool:
        return s.widths_given

    def problems(self, s, config: dict, out_is_gguf: bool) -> list[str]:
        from gqaify.conversion.mla.output import problems

        return problems(s, config, out_is_gguf)

    def run_name(self, s) -> str:
        widths = [f"latent {s.kv_rank}" if s.kv_rank else "", f"rotary {s.rope_dims}" if s.rope_dims else ""]
        cache = f"1/{s.kv_cut:g} cache" if s.kv_cut not in (None, 1) else " + ".join(w for w in widths if w)
        return " as MLA, " + (cache or "the source's cache size")

    def planned_config(self, s, config, geometry):
        return budget.planned_config(s, config, geometry)

    def cost_note(self, s, source) -> str | None:
        from gqaify.conversion.mla.output import cost_note

        return cost_note(s, source)

    def rewrite(self, folder, s, text, load_parent, source):
        from gqaify.conversion.mla.output import rewrite

        return rewrite(folder, s, text, load_parent, source)

    def weight_bytes(self, s, config: dict) -> int:
        from gqaify.conversion.mla.output import weight_bytes

        return weight_bytes(s, config)

    def write_gguf(self, folder, out, out_type, tokenizer_gguf, record) -> None:
        from gqaify.conversion.mla.gguf import write_mla_gguf

        write_mla_gguf(folder, out, out_type, tokenizer_gguf, record)

    def covers(self, spec) -> str:
        """Whether the rewrite takes `spec`'s layer as DeepSeek-V3's dense MLA one, or why not, in words."""
        if spec.model_type in ARCHS:
            return "yes (refused with biases or a sliding window)"
        if spec.shipped_class:
            return "no: transformers' class has no K/V heads"
        if spec.qkv_proj:
            return "no: a fused QKV projection, not described yet"
        if spec.no_calibration:
            return "no: the rewrite loads the model as transformers does, which this checkpoint's tensors do not fit"
        if spec.shared_head_norms or spec.k_norm or spec.q_norm or spec.k_norm_per_head or spec.q_norm_per_head:
            return "no: Q/K norms, which DeepSeek-V3's layer lacks"
        if spec.rope == "interleaved":
            return "no: RoPE pairs interleaved, not described yet"
        return "no: its layer is not checked against DeepSeek-V3's dense one yet"

    def wrote(self, config) -> bool:
        return latent_below_epsilon(config)

    def cached(self, config) -> int | None:
        """A latent of `kv_lora_rank` values and one rotary key of `qk_rope_head_dim` every query head shares: any
        DeepSeek-style latent config's, gqaify's rewrite or not."""
        rank = getattr(config, "kv_lora_rank", None)
        return rank + (getattr(config, "qk_rope_head_dim", 0) or 0) if rank else None

    def held(self, model) -> list[str]:
        """The latent's down-projections (`mla.fit.latent_projections`)."""
        from gqaify.conversion.mla.fit import latent_projections

        return latent_projections(model)


MLA = LatentAttention()
