"""Grouped-query attention, the shape the stream writes (`conversion.shapes`): G whole K/V heads, G = 1 being MQA.
The G-head conversion is its output, so it rewrites nothing, refuses nothing of its own, reads no text beyond what
its method does, and is written to GGUF as the stream wrote it (`to_gguf`)."""

from __future__ import annotations

import dataclasses

from gqaify.conversion.registry import ATTENTION_INFO


class GroupedQueryAttention:
    """The `Shape` of G whole K/V heads."""

    float16 = None

    def resolve_cut(self, s, geometry):
        """G = the source's K/V heads / X: a whole number that divides them, or refused naming the cuts the model
        allows (and the shapes that make any)."""
        heads, cut = geometry.num_kv_heads, s.kv_cut
        g = heads / cut
        if not g.is_integer() or heads % int(g):
            allowed = ", ".join(f"{heads // k:g}" for k in range(heads, 0, -1) if heads % k == 0)
            said = f"{cut:g}" if float(f"{cut:g}") == cut else repr(cut)  # 1.0000000001 is not 1
            others = " or ".join(f"--attention {name}" for name, info in ATTENTION_INFO.items() if info.any_cut)
            return s, [
                f"--kv-cut {said}: no whole number of the source's {heads} K/V heads caches 1/{said} of them; GQA "
                f"cuts this model by {allowed}" + (f", or pass {others}, which takes any cut" if others else "")
            ]
        if s.kv_heads is not None and s.kv_heads != int(g):
            return s, [f"--kv-heads {s.kv_heads} and --kv-cut {cut:g} disagree (the cut means {int(g)} K/V heads)"]
        return dataclasses.replace(s, kv_heads=int(g)), []

    def reads_text(self, s) -> bool:
        return False

    def problems(self, s, config: dict, out_is_gguf: bool) -> list[str]:
        return []

    def run_name(self, s) -> str:
        if s.kv_cut is not None:
            return f" as GQA, 1/{s.kv_cut:g} cache"
        return " as MQA" if s.kv_heads == 1 else f" as GQA-{s.kv_heads}"

    def planned_config(self, s, config, geometry):
        return config

    def cost_note(self, s, source) -> None:
        return None

    def rewrite(self, folder, s, text, load_parent, source) -> None:
        return None

    def weight_bytes(self, s, config: dict) -> int:
        return 0  # the stream's plan counts the G-head model

    def write_gguf(self, folder, out, out_type, tokenizer_gguf, record) -> None:
        from gqaify.conversion.to_gguf import write_gguf

        write_gguf(folder, out, out_type, tokenizer_gguf, record)

    def covers(self, spec) -> str:
        return "yes"  # every architecture gqaify converts: the stream's output is the conversion

    def wrote(self, config) -> bool:
        return False  # whole K/V heads are any model's: the stream's output is told by none of its own

    def cached(self, config) -> None:
        return None  # whole K/V heads: `Geometry` counts them

    def held(self, model) -> list[str]:
        return []


GQA = GroupedQueryAttention()
