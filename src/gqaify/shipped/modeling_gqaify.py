# Shipped by gqaify (https://pypi.org/project/gqaify/) beside a converted checkpoint, and registered in its
# config.json's auto_map: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) loads it.
"""Grouped-query attention for transformers' GPT-2, GPT-NeoX (Pythia) and OPT, which know only MHA.

Each class is transformers' own causal-LM class with every attention module replaced by a subclass whose
key/value projections have `config.num_key_value_heads` (G) heads instead of `num_attention_heads` (H). The
cache holds G heads per layer; query head h reads K/V head h // (H/G), as `repeat_kv` repeats them:

    H = 4, G = 2     query heads   q0  q1  q2  q3
                     K/V heads     k0  k0  k1  k1

Attention runs through transformers' attention interface (sdpa, flash and flex take the G heads as they are;
eager gets them repeated), and nothing else changes: with G = H every class computes what its parent class
computes. Serving engines (vLLM, TGI, llama.cpp) load native classes only and will not load these.

Fused projections keep the parent's layout, generalised to G heads:

    GPT-2 c_attn     columns [Q heads | K heads | V heads]  (Conv1D: weight stored (in, out))
    GPT-NeoX         rows per K/V head: its H/G query heads, then its K head, then its V head; with G = H this
                     is GPT-NeoX's own [q | k | v] per head
"""

from __future__ import annotations

import torch
from transformers.cache_utils import EncoderDecoderCache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.gpt_neox import modeling_gpt_neox
from transformers.models.opt import modeling_opt
from transformers.pytorch_utils import Conv1D


def _kv_heads(config) -> int:
    """G, checked against the H query heads."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads = {kv_heads} does not divide num_attention_heads = {heads}")
    return kv_heads


def _attend(module, eager, query, key, value, attention_mask, **kwargs):
    """transformers' attention function for the model's implementation, on H query and G K/V heads.

    sdpa repeats (or packs) the K/V heads by `module.num_key_value_groups`, flash and flex take them as they are;
    the parent class's `eager` knows only MHA, so it gets them repeated.
    """

    def eager_gqa(module, query, key, value, *args, **kw):
        groups = module.num_key_value_groups
        return eager(module, query, repeat_kv(key, groups), repeat_kv(value, groups), *args, **kw)

    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_gqa)
    return interface(module, query, key, value, attention_mask, **kwargs)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(batch, seq, n*d) -> (batch, n, seq, d)"""
    return x.unflatten(-1, (-1, head_dim)).transpose(1, 2)


class GQAGPT2Attention(modeling_gpt2.GPT2Attention):
    def __init__(self, config, layer_idx=None):
        super().__init__(config, is_cross_attention=False, layer_idx=layer_idx)
        self.num_key_value_heads = _kv_heads(config)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        kv_width = self.num_key_value_heads * self.head_dim
        self.c_attn = Conv1D(self.embed_dim + 2 * kv_width, self.embed_dim)
        self.split_sizes = [self.embed_dim, kv_width, kv_width]

    def forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, output_attentions=False, **kwargs):  # fmt: skip
        if encoder_hidden_states is not None:
            raise ValueError("gqaify's GPT-2 converts self-attention only, not cross-attention")
        query, key, value = (_heads(x, self.head_dim) for x in self.c_attn(hidden_states).split(self.split_sizes, -1))
        if past_key_values is not None:
            if isinstance(past_key_values, EncoderDecoderCache):
                past_key_values = past_key_values.self_attention_cache
            key, value = past_key_values.update(key, value, self.layer_idx)
        if self.config._attn_implementation == "eager" and self.reorder_and_upcast_attn:
            groups = self.num_key_value_groups
            output, weights = self._upcast_and_reordered_attn(
                query, repeat_kv(key, groups), repeat_kv(value, groups), attention_mask
            )
        else:
            output, weights = _attend(self, modeling_gpt2.eager_attention_forward, query, key, value, attention_mask,
                                      dropout=self.attn_dropout.p if self.training else 0.0, scaling=self.scaling,
                                      **kwargs)  # fmt: skip
        output = self.c_proj(output.reshape(*output.shape[:-2], -1).contiguous())
        return self.resid_dropout(output), weights


class GQAGPTNeoXAttention(modeling_gpt_neox.GPTNeoXAttention):
    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx)
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = _kv_heads(config)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        rows = (self.num_heads + 2 * self.num_key_value_heads) * self.head_size
        self.query_key_value = torch.nn.Linear(config.hidden_size, rows, bias=config.attention_bias)

    def forward(self, hidden_states, attention_mask, layer_past=None, position_embeddings=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        # (batch, seq, G*(r + 2)*d) -> (batch, G, seq, r + 2, d): per K/V head, r query heads, then K, then V
        grouped = self.query_key_value(hidden_states)
        grouped = grouped.view(*input_shape, self.num_key_value_heads, -1, self.head_size).transpose(1, 2)
        query = grouped[..., :-2, :].transpose(2, 3).flatten(1, 2)  # (batch, H, seq, d), group-major
        key, value = grouped[..., -2, :], grouped[..., -1, :]  # (batch, G, seq, d)
        cos, sin = position_embeddings
        query, key = modeling_gpt_neox.apply_rotary_pos_emb(query, key, cos, sin)
        if layer_past is not None:
            key, value = layer_past.update(key, value, self.layer_idx)
        output, weights = _attend(self, modeling_gpt_neox.eager_attention_forward, query, key, value, attention_mask,
                                  scaling=self.scaling, dropout=0.0 if not self.training else self.attention_dropout,
                                  **kwargs)  # fmt: skip
        return self.dense(output.reshape(*input_shape, -1).contiguous()), weights


class GQAOPTAttention(modeling_opt.OPTAttention):
    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx)
        self.num_key_value_heads = _kv_heads(config)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        kv_width = self.num_key_value_heads * self.head_dim
        self.k_proj = torch.nn.Linear(self.embed_dim, kv_width, bias=self.enable_bias)
        self.v_proj = torch.nn.Linear(self.embed_dim, kv_width, bias=self.enable_bias)

    def forward(self, hidden_states, past_key_values=None, attention_mask=None, output_attentions=False, **kwargs):
        batch, length, _ = hidden_states.size()
        query = _heads(self.q_proj(hidden_states) * self.scaling, self.head_dim)  # OPT scales before attention
        key, value = (_heads(proj(hidden_states), self.head_dim) for proj in (self.k_proj, self.v_proj))
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        output, weights = _attend(self, modeling_opt.eager_attention_forward, query, key, value, attention_mask,
                                  dropout=0.0 if not self.training else self.dropout, scaling=1.0,
                                  **kwargs)  # fmt: skip
        return self.out_proj(output.reshape(batch, length, -1).contiguous()), weights


def _with_gqa(model, blocks, name: str, attention_class) -> None:
    """Replace attribute `name` of every decoder block by `attention_class`, then initialise what is new."""
    for index, block in enumerate(blocks):
        setattr(block, name, attention_class(model.config, layer_idx=index))
    model.post_init()


class GQAGPT2LMHeadModel(modeling_gpt2.GPT2LMHeadModel):
    def __init__(self, config):
        super().__init__(config)
        if config.add_cross_attention:
            raise ValueError("gqaify's GPT-2 converts self-attention only, not cross-attention")
        _with_gqa(self, self.transformer.h, "attn", GQAGPT2Attention)


class GQAGPTNeoXForCausalLM(modeling_gpt_neox.GPTNeoXForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        _with_gqa(self, self.gpt_neox.layers, "attention", GQAGPTNeoXAttention)


class GQAOPTForCausalLM(modeling_opt.OPTForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        _with_gqa(self, self.model.decoder.layers, "self_attn", GQAOPTAttention)


def _stored_names_as(parent, ours) -> None:
    """Let `ours` read checkpoints as `parent` does: transformers renames some stored tensors when it loads its own
    classes (GPT-NeoX's `embed_out` is its `lm_head`), and a class from a modeling file only when registered."""
    mapping = get_checkpoint_conversion_mapping(parent.__name__)
    if mapping is not None:
        register_checkpoint_conversion_mapping(ours.__name__, mapping, overwrite=True)


for _parent, _ours in ((modeling_gpt2.GPT2LMHeadModel, GQAGPT2LMHeadModel),
                       (modeling_gpt_neox.GPTNeoXForCausalLM, GQAGPTNeoXForCausalLM),
                       (modeling_opt.OPTForCausalLM, GQAOPTForCausalLM)):  # fmt: skip
    _stored_names_as(_parent, _ours)
