"""An MLA conversion (`mla/layer.py`: DeepSeek-V3, every layer dense, no query low-rank) as one GGUF file that llama.cpp
serves as its `deepseek2` architecture, caching the latent and the shared rotary key per token (absorbed MLA).

    folder (Hugging Face names)                          OUT.gguf (llama.cpp's)
        self_attn.q_proj           (H*(nope+rope), n)  ->  blk.i.attn_q         per head [nope (or 0) | rope laddered]
        self_attn.kv_a_proj_with_mqa (R+rope, n)       ->  blk.i.attn_kv_a_mqa  [latent | rope laddered], always f32
        self_attn.kv_a_layernorm   (R,)                ->  blk.i.attn_kv_a_norm x sqrt(rms_norm_eps / 1e-6)
        self_attn.kv_b_proj        (H*(nope+v), R)     ->  blk.i.attn_k_b (H, R, nope or 1), blk.i.attn_v_b (H, v, R),
                                                                always f32
        o_proj, the MLP, the norms, the embedding, the head: llama.cpp's names, as they are

What llama.cpp reads differently: it rotates a head's dimensions 2m, 2m+1 as a pair at freq_base^(-2m/rope) with
no per-pair factors (deepseek2 loads no rope_freqs), so the pairs are sorted by frequency, interleaved, and
freq_base is that ladder's: a model whose frequencies are no such ladder is refused (`mla_gguf_problem`). It
needs one non-rotary key dimension at least: a model without one gets a zero one, its queries scaled for the
score's divisor sqrt(1 + rope). Its latent norm uses the model's rms_norm_eps, transformers' 1e-6: the norm is
linear over the latent the rewrite keeps (about 1e-8 in size, hence f32 in every file), so its weight is rescaled.
The per-head up-projections attn_k_b and attn_v_b are f32 in every file too: llama.cpp (llama-cpp-python 0.3.36's,
on the CPU) multiplies an f16 attn_v_b of a latent of 32 or more values into garbage (SmolLM2's MQA rewrite: every
position's logits wrong, argmax agreeing on 2%; latents of 8 and 16 are right), and f32 computes them exactly.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import gqaify.conversion.to_gguf as to_gguf
from gqaify.errors import UserError

TRANSFORMERS_LATENT_EPS = 1e-6  # DeepseekV3RMSNorm's default: kv_a_layernorm's epsilon in transformers

_COPIED = {  # Hugging Face name -> llama.cpp's, the values unchanged
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_COPIED = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_F32 = (  # written f32 in every file type (the module's docstring)
    "attn_kv_a_mqa.weight",  # the latent rows, about 1e-8: f16's range ends at 6e-8
    "attn_k_b.weight",  # llama.cpp's CPU computes an f16 attn_v_b wrong from a latent of 32 values
    "attn_v_b.weight",
)
_AS_FOLDER = "or write a folder (OUT without .gguf) and serve it with transformers"


def mla_gguf_problem(config: dict) -> str | None:
    """Why the MLA conversion whose config.json is `config` cannot be written for llama.cpp, or None."""
    layers = config.get("num_hidden_layers", 0)
    if (
        config.get("model_type") != "deepseek_v3"
        or config.get("q_lora_rank") is not None
        or config.get("first_k_dense_replace", 0) < layers
        or config.get("rope_interleave", True)
    ):
        return (
            "a deepseek_v3 GGUF is written for gqaify's MLA conversion only (every layer dense, no q_lora_rank, "
            "rope_interleave false); use llama.cpp's convert_hf_to_gguf.py for another DeepSeek model"
        )
    frequencies = _pair_frequencies(config)
    if frequencies is None:
        kind = (config.get("rope_parameters") or {}).get("rope_type")
        return f"rope_type {kind!r} is no fixed list of frequencies as gqaify's MLA conversion writes; {_AS_FOLDER}"
    if _ladder(frequencies) is not None:
        return None
    if len(set(frequencies.tolist())) < len(frequencies):
        return (
            "this MLA model's rotary key repeats its frequencies (its K/V heads kept the same pairs), and llama.cpp's "
            f"deepseek2 rotates with one ladder of distinct ones; convert with --kv-heads 1, or to a smaller cache "
            f"(--kv-cut: its rotary key turned, one slot per frequency), {_AS_FOLDER}"
        )
    return (
        "this MLA model's rotary frequencies (the pairs --rope-dims kept) are no ladder base^(-2m/rope_dims) from 1, "
        f"the only rotation llama.cpp's deepseek2 has; keep every rotary pair (no --rope-dims), {_AS_FOLDER}"
    )


def _pair_frequencies(config: dict) -> torch.Tensor | None:
    """The rotary frequency of each pair of the shared key (rope_dims / 2) as transformers computes them; None where
    they are not the fixed list `rotary.rope_parameters` writes (the default ladder, or longrope's factor per pair)."""
    dim = config["qk_rope_head_dim"]
    rope = config.get("rope_parameters") or {}
    ladder = rope.get("rope_theta", 10000.0) ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return ladder
    fixed = rope.get("short_factor") == rope.get("long_factor") and rope.get("attention_factor", 1.0) == 1.0
    if kind != "longrope" or not fixed:
        return None
    return ladder / torch.tensor(rope["short_factor"], dtype=torch.float64)


def _ladder(frequencies: torch.Tensor, rtol: float = 1e-5) -> tuple[list[int], float] | None:
    """(the pairs by falling frequency, freq_base) where llama.cpp's slot m, rotated at freq_base^(-m/pairs),
    gives pair order[m] its own frequency; None where no order does (sorted, they must be 1, p, p^2, ...)."""
    order = sorted(range(len(frequencies)), key=lambda i: -float(frequencies[i]))
    sorted_ = frequencies[order]
    pairs = len(order)
    ratio = float(sorted_[-1]) ** (1 / (pairs - 1)) if pairs > 1 else 1e-4  # one pair: any base (slot 0 is 1)
    if not 0 < ratio < 1 or not torch.allclose(sorted_, ratio ** torch.arange(pairs, dtype=torch.float64), rtol=rtol):
        return None
    return order, ratio ** (-pairs)


@dataclass(frozen=True)
class _MlaLayout:
    """How the folder's MLA tensors become llama.cpp's (the module's docstring)."""

    heads: int
    kv_rank: int
    rope: int
    nope: int
    values: int  # a head's value dimensions
    order: list[int]  # the rotary pairs by falling frequency: llama.cpp's slot m rotates pair order[m]
    freq_base: float  # llama.cpp's slot m rotates at freq_base^(-2m/rope)
    latent_norm_scale: float

    @classmethod
    def of(cls, config: dict) -> _MlaLayout:
        order, freq_base = _ladder(_pair_frequencies(config))
        scale = math.sqrt(config["rms_norm_eps"] / TRANSFORMERS_LATENT_EPS)
        shape = (config[key] for key in ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"))
        return cls(*shape, config["v_head_dim"], order, freq_base, scale)

    @property
    def nope_written(self) -> int:
        return max(self.nope, 1)  # llama.cpp asserts at least one non-rotary key dimension

    def outputs(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], Callable]]:
        """(llama.cpp's name, shape, the values from the folder's tensor) of each tensor written from `name`."""
        if name in _COPIED:
            return [(_COPIED[name], shape, _same)]
        found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        part = found[2] if found else None
        if part in _LAYER_COPIED:
            return [(f"blk.{found[1]}.{_LAYER_COPIED[part]}", shape, _same)]
        H, R, nope = self.heads, self.kv_rank, self.nope_written
        written = {
            "self_attn.q_proj.weight": [("attn_q", (H * (nope + self.rope), shape[-1]), self.queries)],
            "self_attn.kv_a_proj_with_mqa.weight": [("attn_kv_a_mqa", shape, self.latent_and_rotary_key)],
            "self_attn.kv_a_layernorm.weight": [("attn_kv_a_norm", shape, self.latent_norm)],
            "self_attn.kv_b_proj.weight": [
                ("attn_k_b", (H, R, nope), self.keys_up),
                ("attn_v_b", (H, self.values, R), self.values_up),
            ],
        }.get(part)
        if written is None:
            raise UserError(f"{name} has no place in llama.cpp's deepseek2 layout; nothing written")
        return [(f"blk.{found[1]}.{gguf_name}.weight", s, make) for gguf_name, s, make in written]

    def _laddered(self, rows: torch.Tensor, heads: int) -> torch.Tensor:
        """Each head's rotary rows (rotate_half's halves) with the pairs in ladder order, interleaved."""
        pairs = rows.reshape(heads, 2, self.rope // 2, -1)[:, :, self.order]
        return to_gguf.permute_rotary(pairs.reshape(rows.shape), heads)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        hidden = q.shape[-1]
        q = q.float().view(self.heads, self.nope + self.rope, hidden)
        rotary = self._laddered(q[:, self.nope :].reshape(-1, hidden), self.heads).view(self.heads, self.rope, hidden)
        zero = torch.zeros(self.heads, self.nope_written - self.nope, hidden)
        scale = math.sqrt((self.nope_written + self.rope) / (self.nope + self.rope))  # llama.cpp's divisor is larger
        return torch.cat([zero, q[:, : self.nope], rotary], 1).reshape(-1, hidden) * scale

    def latent_and_rotary_key(self, kv_a: torch.Tensor) -> torch.Tensor:
        kv_a = kv_a.float()
        return torch.cat([kv_a[: self.kv_rank], self._laddered(kv_a[self.kv_rank :], 1)])

    def latent_norm(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.float() * self.latent_norm_scale

    def keys_up(self, kv_b: torch.Tensor) -> torch.Tensor:
        per_head = kv_b.float().view(self.heads, -1, self.kv_rank)[:, : self.nope]
        zero = torch.zeros(self.heads, self.nope_written - self.nope, self.kv_rank)
        return torch.cat([zero, per_head], 1).transpose(1, 2).contiguous()  # (H, R, nope): ggml's {nope, R, H}

    def values_up(self, kv_b: torch.Tensor) -> torch.Tensor:
        return kv_b.float().view(self.heads, -1, self.kv_rank)[:, self.nope :].contiguous()  # ggml's {R, v, H}


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def write_mla_gguf(
    folder: Path, out: Path, out_type: str = "f16", tokenizer_gguf: Path | None = None, record: str | None = None
) -> None:
    """Write the MLA conversion in `folder` as the GGUF file `out` for llama.cpp's deepseek2, one tensor at a time
    (the arguments as `to_gguf.write_gguf`'s; attn_kv_a_mqa, attn_k_b and attn_v_b stay f32 in every type).

    Raises:
        UserError: the model is one llama.cpp's deepseek2 cannot compute (`mla_gguf_problem`).
    """
    import gguf

    config = json.loads((folder / "config.json").read_text())
    if problem := mla_gguf_problem(config):
        raise UserError(problem)
    layout = _MlaLayout.of(config)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    to_gguf.write_body_hyperparameters(writer, config, out.stem, out_type)
    _write_mla_hyperparameters(writer, config, layout)
    to_gguf.add_tokenizer(writer, folder, tokenizer_gguf)
    plan = []  # (shard, name, [(llama.cpp's name, type, make)]), shard by shard
    for shard, name, shape in to_gguf.folder_tensors(folder):
        outputs = []
        for gguf_name, written, make in layout.outputs(name, shape):
            f32 = gguf_name.endswith(_F32)
            qtype = gguf.GGMLQuantizationType.F32 if f32 else to_gguf.matrix_type(written, out_type)
            to_gguf.add_tensor_info(writer, gguf_name, written, qtype)
            outputs.append((qtype, make))
        plan.append((shard, name, outputs))
    to_gguf.write_header(writer, out, record)
    _write_data(writer, folder, plan)
    writer.close()


def _write_mla_hyperparameters(writer, config: dict, layout: _MlaLayout) -> None:
    """The attention's keys of llama.cpp's deepseek2: one cached "head" of the latent and the rotary key."""
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(layout.freq_base)
    writer.add_rope_dimension_count(layout.rope)
    writer.add_leading_dense_block_count(config["num_hidden_layers"])
    writer.add_q_lora_rank(0)  # read without a default: 0 is "none"
    writer.add_kv_lora_rank(layout.kv_rank)
    writer.add_key_length(layout.kv_rank + layout.rope)
    writer.add_value_length(layout.kv_rank)
    writer.add_key_length_mla(layout.nope_written + layout.rope)
    writer.add_value_length_mla(layout.values)
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_expert_shared_count(0)


def _write_data(writer, folder: Path, plan) -> None:
    from safetensors import safe_open

    for shard, tensors in itertools.groupby(plan, key=lambda entry: entry[0]):  # the plan lists shard by shard
        with safe_open(folder / shard, "pt") as f:
            for _, name, outputs in tensors:
                tensor = f.get_tensor(name)
                for qtype, make in outputs:
                    writer.write_tensor_data(to_gguf.tensor_data(make(tensor), qtype))
