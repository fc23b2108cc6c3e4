"""Tiny random models of every architecture gqaify converts, and the references written independently of gqaify
that its tests check it against: what the test suite (tests/conftest.py) and the benchmarks build on.

    build_model("llama", num_kv_heads=4)   a random model of `ARCH_CONFIGS["llama"]`: 4 query heads, 2 layers
    save_with_tokenizer(model, folder)     saved in small shards with a byte-level BPE tokenizer of its vocabulary
    duplicate_kv_heads(model)              the exact MHA twin of a GQA model (every K/V head repeated)
    transformers_doc_loop(model, ids, ...) perplexity by transformers' "Perplexity of fixed-length models" loop

Adding an architecture to `archs.ARCHITECTURES` means adding its tiny config to `ARCH_CONFIGS` here; the tests then
build it and check it against transformers. Nothing in gqaify imports this module.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# One tiny config per supported architecture: 4 query heads, 2 K/V heads, head_dim 16, 2 layers.
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
ARCH_CONFIGS: dict[str, dict] = {
    "llama": dict(tie_word_embeddings=True),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(),  # K/V biases
    "qwen3": dict(),  # per-head-dim q/k norms
    "phi3": dict(pad_token_id=0),  # fused qkv_proj
    "olmo2": dict(pad_token_id=0),  # k_norm over the whole K width
    "gemma": dict(),
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=16),
    "stablelm": dict(qk_layernorm=True, use_qkv_bias=True),  # one k LayerNorm per head, K/V biases
    "granite": dict(),
    "apertus": dict(),  # Q/K norms over head_dim
    "arcee": dict(bos_token_id=0, eos_token_id=0),
    "beam": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=1,
        topk_group=1,
        sliding_window=8,
        layer_types=None,
    ),
    "cohere": dict(eos_token_id=0),  # RoPE pairs interleaved
    "cohere2": dict(sliding_window=8, eos_token_id=0, layer_types=None),
    "cwm": dict(sliding_window=8, bos_token_id=0, layer_types=None),
    "diffllama": dict(),  # differential attention
    "ernie4_5": dict(),
    "ernie4_5_moe": dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=32, pad_token_id=0, bos_token_id=0, eos_token_id=0
    ),
    "exaone4": dict(sliding_window=8, layer_types=None),
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=0),
    "gemma3_text": dict(sliding_window=8, layer_types=None),
    "glm": dict(pad_token_id=0),  # partial rotary, interleaved
    "glm4": dict(pad_token_id=0),
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, layer_types=None),  # sinks
    "granite_swa": dict(sliding_window=8, bos_token_id=0, eos_token_id=0, layer_types=None),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoe_swa": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, layer_types=None),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2),
    "helium": dict(),
    "hunyuan_v1_dense": dict(),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "hy_v3": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1),
    "hyperclovax": dict(),
    "internlm3": dict(),
    "iquestcoder": dict(),
    "jais2": dict(eos_token_id=0),
    "kolibri1": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        sliding_window=8,
        layer_types=None,
    ),
    "laguna": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        sliding_window=8,
        layer_types=None,
    ),
    "mellum": dict(
        num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8, layer_types=None
    ),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0),
    "minimax_m3_vl_text": dict(
        num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, layer_types=None
    ),
    "ministral": dict(sliding_window=8, layer_types=None),
    "ministral3": dict(),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),  # MoE
    "nanochat": dict(),
    "nemotron": dict(),  # partial rotary
    "olmo": dict(eos_token_id=0),
    "olmo3": dict(sliding_window=8, eos_token_id=0, layer_types=None),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, eos_token_id=0),
    "phi": dict(),  # o_proj named dense, partial rotary, LayerNorms with biases; optional Q/K LayerNorms off
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        sliding_window=8,
        layer_types=None,
    ),
    "qwen3_moe": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "seed_oss": dict(),
    "smollm3": dict(pad_token_id=0, bos_token_id=0, eos_token_id=0, layer_types=None),
    "solar_open": dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1
    ),
    "starcoder2": dict(bos_token_id=0, eos_token_id=0),
    "vaultgemma": dict(sliding_window=8, layer_types=None),
    "afmoe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_shared_experts=1,
        sliding_window=8,
        layer_types=None,
    ),
    "aria_text": dict(moe_num_experts=4, moe_topk=2),
    "cohere2_moe": dict(
        num_experts=4, num_experts_per_tok=2, num_shared_experts=1, sliding_window=8, eos_token_id=0, layer_types=None
    ),
    "dots1": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        sliding_window=8,
        layer_types=None,
    ),
    "exaone_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        num_shared_experts=1,
        n_group=1,
        topk_group=1,
        sliding_window=8,
        layer_types=None,
    ),
    "flint": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        sliding_window=8,
        layer_types=None,
    ),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=None),
    # no K/V heads in transformers: built with gqaify's shipped classes (`shipped/modeling_gqaify.py`)
    "gpt2": dict(n_positions=64, bos_token_id=0, eos_token_id=0),  # Conv1D c_attn: [Q | K | V] columns
    "gpt_neox": dict(bos_token_id=0, eos_token_id=0, rotary_pct=0.5),  # grouped fused rows, partial rotary
    "opt": dict(ffn_dim=96, word_embed_proj_dim=64, bos_token_id=0, eos_token_id=0, pad_token_id=0),
}

# Q/K norms the rotating methods cannot pass (they refuse these types; mean is calibrated there)
QK_NORMS = {
    "qwen3",
    "olmo2",
    "apertus",
    "beam",
    "exaone4",
    "gemma3_text",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "hy_v3",
    "kolibri1",
    "laguna",
    "mellum",
    "minimax_m3_vl_text",
    "nanochat",
    "olmo3",
    "olmoe",
    "qwen3_moe",
    "afmoe",
    "dots1",
    "exaone_moe",
    "flint",
    "llama4_text",
    "flex_olmo",
    "minimax_m2",
}


def model_class(model_type: str):
    """The class that builds `model_type` with K/V heads: transformers' own, or gqaify's shipped one."""
    from gqaify.model.archs import ARCHITECTURES
    from gqaify.shipped import modeling_gqaify

    shipped = ARCHITECTURES[model_type].shipped_class
    return getattr(modeling_gqaify, shipped) if shipped else AutoModelForCausalLM


def build_model(model_type: str, num_kv_heads: int = 2, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny model whose every parameter is random (biases and norms included), in eval mode, fp32."""
    config = AutoConfig.for_model(
        model_type, **{**COMMON, **ARCH_CONFIGS[model_type], "num_key_value_heads": num_kv_heads, **overrides}
    )
    torch.manual_seed(seed)
    cls = model_class(model_type)
    build = cls.from_config if cls is AutoModelForCausalLM else cls._from_config
    model = build(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    return model.eval()


def save(model, directory: Path, max_shard_size: str = "40KB", **kwargs) -> Path:
    model.save_pretrained(directory, max_shard_size=max_shard_size, **kwargs)
    return directory


def transformers_doc_loop(model, ids, seq_len, stride):
    """(NLL sum, tokens scored) by the loop of transformers' "Perplexity of fixed-length models" guide."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + seq_len, len(ids))
        trg_len = end - prev_end
        input_ids = ids[begin:end].unsqueeze(0)
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=labels).loss
        valid = (labels[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * valid
        n_tokens += valid
        prev_end = end
        if end == len(ids):
            break
    return nll_sum, n_tokens


def duplicate_kv_heads(model) -> torch.nn.Module:
    """The exact MHA twin of a GQA model: every K/V head repeated for the query heads that read it.

    Written independently of gqaify (tensor names matched by pattern) so that it can serve as the oracle:
    mean-pooling the twin back must reproduce the GQA model.
    """
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    r = heads // kv_heads
    twin_config = type(config).from_dict({**config.to_dict(), "num_key_value_heads": heads})
    twin = AutoModelForCausalLM.from_config(twin_config, attn_implementation="eager")

    def repeat(t):  # (KV*d, ...) -> (H*d, ...), head j repeated r times in place
        return t.unflatten(0, (kv_heads, head_dim)).repeat_interleave(r, dim=0).flatten(0, 1)

    source = model.state_dict()
    state = {}
    for name, target in twin.state_dict().items():
        per_head = re.match(r"(.*\.norms\.)(\d+)(\..*)", name)  # stablelm: one K norm module per head
        if per_head and "k_layernorm" in name:
            state[name] = source[f"{per_head[1]}{int(per_head[2]) // r}{per_head[3]}"]
        elif source[name].shape == target.shape:
            state[name] = source[name]
        elif "qkv_proj" in name:
            q, k, v = source[name].split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            state[name] = torch.cat([q, repeat(k), repeat(v)])
        elif "c_attn" in name:  # GPT-2's Conv1D: columns [Q | K | V] (a bias is one row of them)
            t = source[name].reshape(-1, source[name].shape[-1])
            q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
            state[name] = torch.cat([q, repeat(k.T).T, repeat(v.T).T], dim=1).reshape(target.shape)
        elif "query_key_value" in name:  # GPT-NeoX: rows per K/V head [its r queries | k | v] -> per head [q | k | v]
            grouped = source[name].unflatten(0, (kv_heads, r + 2, head_dim))
            q = grouped[:, :r].flatten(0, 1)  # (H, d, ...)
            k, v = (grouped[:, i].repeat_interleave(r, dim=0) for i in (r, r + 1))
            state[name] = torch.stack([q, k, v], dim=1).flatten(0, 2)
        else:
            state[name] = repeat(source[name])
    twin.load_state_dict(state)
    return twin.eval()


CORPUS = (
    "The quick brown fox jumps over the lazy dog. A grouped-query attention model shares each key and value "
    "head among several query heads, so its cache is smaller. Perplexity measures how surprised a model is. "
) * 8


def save_with_tokenizer(model, directory: Path) -> Path:
    """Save `model` with a byte-level BPE tokenizer trained here on CORPUS, sized to the model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=model.config.vocab_size,
        special_tokens=["<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    assert tokenizer.get_vocab_size() <= model.config.vocab_size
    save(model, directory)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="<s>").save_pretrained(directory)
    return directory
