"""What gqaify knows about each architecture, as data.

Almost every architecture here implements grouped-query attention natively through `num_key_value_heads`
and transformers' `repeat_kv`, so a converted checkpoint is a plain checkpoint of the same class (the three
that do not ship a class of their own, below). An entry names, relative to one layer's attention module, the
tensors whose rows are indexed by K/V head:

    separate projections   k_proj.weight (KV*d, hidden), v_proj.weight, and their biases when present
    fused projection       qkv_proj.weight ((H + 2*KV)*d, hidden), its rows laid out as `qkv_layout` says:
                           "contiguous"  [Q heads | K heads | V heads]                               (phi3, gpt2)
                           "grouped"     per K/V head: its H/KV query heads, its K head, its V head  (gpt_neox)
                           gpt_neox's MHA rows, [q | k | v] per head, are the grouped layout with H/KV = 1
    K norm, whole width    k_norm.weight (KV*d,): one RMSNorm over all K heads together (olmo2)
    K norm, per head       k_layernorm.norms.{head}.weight (d,): one LayerNorm module per K head (stablelm)

Methods that rewrite queries and outputs too (`aligned`, `lsq`, similarity grouping) also read the tensors
indexed by query head: q_proj rows (or a fused projection's query rows), o_proj columns, and Q norms laid
out as the K norms above. Norms over head_dim that every head shares (qwen3's q_norm/k_norm, weight (d,))
do not depend on the number of heads and are copied through like any other tensor.

Any Q or K norm sits between a projection and RoPE, so a rotation folded into the projection's rows no
longer cancels in the attention scores: the methods that rotate refuse checkpoints that have such norms.
RoPE turns the first `rotary_dim` dimensions of each head in pairs: j with j + rotary_dim/2 (rotate_half) or
2j with 2j + 1 (`rope="interleaved"`); the layout hands the methods rotate_half heads either way.

Weights stored as (in, out) matrices (GPT-2's Conv1D, `transposed`) are read as (out, in) and written back as
stored. A checkpoint saved from the base model (GPT-2's and OPT's originals) lacks `base_model_prefix` in its
tensor names; `stored_as` gives the spec that matches its names.

Three model types have no K/V head count in transformers (gpt2, gpt_neox, opt): their entries name a class of
gqaify's shipped modeling file (`shipped/modeling_gqaify.py`), which the output carries and registers in its
config's `auto_map`, to be loaded with `trust_remote_code=True`.

`gguf` is how llama.cpp knows the architecture where `gqaify convert SRC OUT.gguf` writes one GGUF file
(`conversion/to_gguf.py`); None: GGUF output is refused for it.

Every other model type of transformers with K/V heads is in `REFUSED`, with the reason (`coverage.py` audits
the installed transformers against both tables). Adding an architecture is one entry in `ARCHITECTURES` plus
its tiny config in `testing.ARCH_CONFIGS`; the tests then check it against transformers.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, replace

from gqaify.errors import UserError

_STACKED_NORMS = "its per-head Q/K LayerNorms (weight heads x head_dim) are not described yet"
_SHIPPED = "calibration runs transformers' own classes, which have no K/V heads for this type (not the shipped one)"
_PER_EXPERT = "transformers fuses or renames its stored tensors on loading; calibration loads layers as stored"

LAYER = "{layer}"
HEAD = "{head}"


@dataclass(frozen=True)
class GgufArchitecture:
    """How llama.cpp knows an architecture: its name there, and whether Q/K rows are permuted for its rotary."""

    name: str  # gguf.MODEL_ARCH member
    permute_qk: bool


@dataclass(frozen=True)
class ArchSpec:
    """Where one architecture keeps its K/V-head-indexed tensors.

    Names are relative to `attention`, the module path of one layer's attention; `.weight` / `.bias`
    are appended. Biases and norms are converted when the checkpoint has them.
    """

    model_type: str
    attention: str = f"model.layers.{LAYER}.self_attn"
    q_proj: str | None = "q_proj"
    k_proj: str | None = "k_proj"
    v_proj: str | None = "v_proj"
    o_proj: str = "o_proj"
    qkv_proj: str | None = None
    qkv_layout: str = "contiguous"  # the fused projection's rows: "contiguous" or "grouped" (module docstring)
    transposed: bool = False  # weight matrices stored (in, out), as GPT-2's Conv1D
    base_model_prefix: str = ""  # the attention path's start that a checkpoint of the base model lacks
    # Non-native (no K/V head count in transformers): the class of the shipped modeling file that has one
    shipped_class: str | None = None
    k_norm: str | None = None
    k_norm_per_head: str | None = None
    q_norm: str | None = None
    q_norm_per_head: str | None = None
    # Q/K norms over head_dim, one weight for all heads (copied through): True, or the config.json flag that
    # turns them on where they are optional (phi's qk_layernorm)
    shared_head_norms: bool | str = False
    # RoPE's pairs of dimensions within a head: "half" pairs j with j + r/2 (transformers' rotate_half),
    # "interleaved" pairs 2j with 2j + 1 (cohere, glm). The rotating methods need it; mean does not.
    rope: str = "half"
    # Why calibration cannot run transformers' decoder layer on this checkpoint's tensors as stored (None: it
    # can). Calibrated methods are refused with this reason; mean and norm-mean convert without calibration.
    no_calibration: str | None = None
    # The K/V head count must be a multiple of this, and why (DiffLlama splits the value heads in two halves).
    kv_heads_multiple: tuple[int, str] = (1, "")
    # A config.json flag under which the checkpoint is refused, and why (a variant not described here).
    refused_when: tuple[str, str] | None = None
    # config.json keys. An absent K/V head count means MHA; an absent head_dim (or None here, for classes
    # that ignore the key) means hidden_size // num_attention_heads, as the modeling code computes it.
    num_layers_key: str = "num_hidden_layers"
    num_heads_key: str = "num_attention_heads"
    num_kv_heads_key: str = "num_key_value_heads"
    head_dim_key: str | None = "head_dim"
    hidden_size_key: str = "hidden_size"
    vocab_size_key: str = "vocab_size"
    # The token embedding's module path: its weight is (vocab_size, hidden_size), or (vocab_size, the config key
    # `embed_width_key`) where its width is a setting of its own (OPT's word_embed_proj_dim). config.json is checked
    # against it and the attention projections before a conversion writes anything (`checks.weight_problem`).
    embed_tokens: str = "model.embed_tokens"
    embed_width_key: str | None = None
    # GGUF output (OUT.gguf): only for the types whose output is tested in llama.cpp
    # (tests/conversion/test_gguf_integration.py)
    gguf: GgufArchitecture | None = None

    def __post_init__(self) -> None:
        separate = (self.q_proj, self.k_proj, self.v_proj)
        if self.qkv_proj is None and None in separate:
            raise ValueError(f"{self.model_type}: give q_proj, k_proj and v_proj, or qkv_proj")
        if self.qkv_proj is not None and any(separate):
            raise ValueError(f"{self.model_type}: a fused qkv_proj excludes separate q/k/v projections")
        if LAYER not in self.attention:
            raise ValueError(f"{self.model_type}: attention path needs {LAYER}")
        if self.k_norm and self.k_norm_per_head:
            raise ValueError(f"{self.model_type}: one K norm layout at most")
        if self.q_norm and self.q_norm_per_head:
            raise ValueError(f"{self.model_type}: one Q norm layout at most")
        if self.qkv_layout not in ("contiguous", "grouped"):
            raise ValueError(f"{self.model_type}: qkv_layout is 'contiguous' or 'grouped', not {self.qkv_layout!r}")
        if not self.attention.startswith(self.base_model_prefix):
            raise ValueError(f"{self.model_type}: the attention path does not start with {self.base_model_prefix!r}")
        if not self.embed_tokens.startswith(self.base_model_prefix):
            raise ValueError(f"{self.model_type}: the embedding path does not start with {self.base_model_prefix!r}")
        if self.rope not in ("half", "interleaved"):
            raise ValueError(f"{self.model_type}: rope is 'half' or 'interleaved', not {self.rope!r}")
        for per_head in (self.k_norm_per_head, self.q_norm_per_head):
            if per_head is not None and HEAD not in per_head:
                raise ValueError(f"{self.model_type}: per-head norm paths need {HEAD}")

    def kv_modules(self) -> list[str]:
        """The modules, relative to `attention`, whose tensors are indexed by K/V head: the K and V projections
        (or the fused one, which holds Q too) and the K norm (one per head: their container, `k_layernorm.norms`)."""
        projections = [self.qkv_proj] if self.qkv_proj else [self.k_proj, self.v_proj]
        norm = self.k_norm or (self.k_norm_per_head and self.k_norm_per_head.split(f".{HEAD}")[0])
        return projections + ([norm] if norm else [])

    def shared_norms_in(self, config: dict) -> bool:
        """Whether a checkpoint with this config.json has Q/K norms over head_dim that every head shares."""
        flag = self.shared_head_norms
        return bool(config.get(flag)) if isinstance(flag, str) else flag

    def stored_as(self, names: Collection[str]) -> ArchSpec:
        """This spec with the attention path as a checkpoint with tensor `names` stores it: without
        `base_model_prefix` when none of them has it (a checkpoint saved from the base model)."""
        prefix = self.base_model_prefix
        if not prefix or any(name.startswith(prefix) for name in names):
            return self
        return replace(
            self,
            attention=self.attention.removeprefix(prefix),
            embed_tokens=self.embed_tokens.removeprefix(prefix),
            base_model_prefix="",
        )

    def rope_order(self, head_dim: int, rotary_dim: int) -> list[int] | None:
        """An order of a head's dimensions that puts its RoPE pairs in rotate_half layout; None if they are."""
        if self.rope == "half":
            return None
        return [*range(0, rotary_dim, 2), *range(1, rotary_dim, 2), *range(rotary_dim, head_dim)]

    def module(self, layer: int, name: str) -> str:
        """Full module path of `name` in attention layer `layer`."""
        return f"{self.attention.format(layer=layer)}.{name}"

    @property
    def decoder_layer(self) -> str:
        """Module path of one decoder layer, `{layer}` to be filled in (the attention path up to the index)."""
        return self.attention[: self.attention.index(LAYER) + len(LAYER)]

    def layer_of(self, tensor_name: str) -> int | None:
        """The decoder layer a tensor belongs to, from its name; None for tensors outside the layers."""
        prefix, _, rest = self.decoder_layer.partition(LAYER)
        match = re.match(re.escape(prefix) + r"(\d+)" + re.escape(rest) + r"\.", tensor_name)
        return int(match[1]) if match else None


def _fused(model_type: str) -> ArchSpec:
    return ArchSpec(model_type, q_proj=None, k_proj=None, v_proj=None, qkv_proj="qkv_proj")


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        ArchSpec("llama", gguf=GgufArchitecture("LLAMA", permute_qk=True)),
        ArchSpec("mistral"),
        ArchSpec("qwen2"),  # K/V biases
        ArchSpec("qwen3", shared_head_norms=True),  # q_norm/k_norm over head_dim: copied through
        _fused("phi3"),
        ArchSpec("olmo2", k_norm="k_norm", q_norm="q_norm"),
        ArchSpec("gemma"),
        ArchSpec("gemma2"),
        ArchSpec(
            "stablelm",
            k_norm_per_head=f"k_layernorm.norms.{HEAD}",
            q_norm_per_head=f"q_layernorm.norms.{HEAD}",
            head_dim_key=None,
        ),
        ArchSpec("granite"),
        ArchSpec("apertus", shared_head_norms=True),
        ArchSpec("arcee"),
        ArchSpec("beam", shared_head_norms=True),  # gated attention: the gate is indexed by query head
        ArchSpec("cohere", rope="interleaved", refused_when=("use_qk_norm", _STACKED_NORMS)),
        ArchSpec("cohere2", rope="interleaved"),
        ArchSpec("cwm"),
        ArchSpec("diffllama", kv_heads_multiple=(2, "its differential attention splits the K/V heads in two halves")),
        ArchSpec("ernie4_5", rope="interleaved"),
        ArchSpec("ernie4_5_moe", rope="interleaved", no_calibration=_PER_EXPERT),
        ArchSpec("exaone4", shared_head_norms=True),
        ArchSpec("flex_olmo", k_norm="k_norm", q_norm="q_norm", no_calibration=_PER_EXPERT),
        ArchSpec("gemma3_text", shared_head_norms=True),
        ArchSpec("glm", rope="interleaved"),  # partial rotary, Q/K/V biases
        ArchSpec("glm4", rope="interleaved"),
        ArchSpec("glm4_moe", no_calibration=_PER_EXPERT),
        ArchSpec("gpt_oss"),  # attention sinks, indexed by query head
        ArchSpec("granite_swa"),
        ArchSpec("granitemoe", no_calibration=_PER_EXPERT),
        ArchSpec("granitemoe_swa"),
        ArchSpec("granitemoeshared", no_calibration=_PER_EXPERT),
        ArchSpec("helium", rope="interleaved"),
        ArchSpec("hunyuan_v1_dense", shared_head_norms=True),
        ArchSpec("hunyuan_v1_moe", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("hy_v3", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("hyperclovax"),
        ArchSpec("internlm3"),
        ArchSpec("iquestcoder"),
        ArchSpec("jais2"),
        ArchSpec("kolibri1", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("laguna", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("mellum", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("minimax_m2", k_norm="k_norm", q_norm="q_norm", no_calibration=_PER_EXPERT),
        ArchSpec("minimax_m3_vl_text", shared_head_norms=True),
        ArchSpec("ministral"),
        ArchSpec("ministral3"),
        ArchSpec("mixtral", no_calibration=_PER_EXPERT),
        ArchSpec("nanochat", shared_head_norms=True),  # Q/K RMSNorms without weights
        ArchSpec("nemotron"),  # partial rotary, LayerNorm1P
        ArchSpec("olmo"),
        ArchSpec("olmo3", k_norm="k_norm", q_norm="q_norm"),
        ArchSpec("olmoe", k_norm="k_norm", q_norm="q_norm", no_calibration=_PER_EXPERT),
        ArchSpec("phi", o_proj="dense", shared_head_norms="qk_layernorm"),  # Phi-1/1.5/2: no Q/K norms
        ArchSpec("phimoe", no_calibration=_PER_EXPERT),
        ArchSpec("qwen2_moe", no_calibration=_PER_EXPERT),
        ArchSpec("qwen3_moe", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("seed_oss"),
        ArchSpec("smollm3"),  # every fourth layer without RoPE
        ArchSpec("solar_open", no_calibration=_PER_EXPERT),
        ArchSpec("starcoder2"),
        ArchSpec("vaultgemma"),
        ArchSpec("afmoe", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("aria_text", no_calibration=_PER_EXPERT),
        ArchSpec("cohere2_moe", rope="interleaved", no_calibration=_PER_EXPERT),
        ArchSpec("dots1", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("exaone_moe", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("flint", shared_head_norms=True, no_calibration=_PER_EXPERT),
        ArchSpec("llama4_text", rope="interleaved", shared_head_norms=True),  # weightless L2 Q/K norms
        # Non-native: transformers' classes are MHA only; the output ships a subclass with K/V heads
        ArchSpec(
            "gpt2",
            attention=f"transformer.h.{LAYER}.attn",
            base_model_prefix="transformer.",
            q_proj=None,
            k_proj=None,
            v_proj=None,
            qkv_proj="c_attn",
            o_proj="c_proj",
            transposed=True,
            head_dim_key=None,
            num_layers_key="n_layer",
            num_heads_key="n_head",
            hidden_size_key="n_embd",
            embed_tokens="transformer.wte",
            no_calibration=_SHIPPED,
            refused_when=("add_cross_attention", "its cross-attention reads an encoder, not described"),
            shipped_class="GQAGPT2LMHeadModel",
        ),
        ArchSpec(
            "gpt_neox",
            attention=f"gpt_neox.layers.{LAYER}.attention",
            base_model_prefix="gpt_neox.",
            q_proj=None,
            k_proj=None,
            v_proj=None,
            qkv_proj="query_key_value",
            qkv_layout="grouped",
            o_proj="dense",
            head_dim_key=None,
            embed_tokens="gpt_neox.embed_in",
            no_calibration=_SHIPPED,
            shipped_class="GQAGPTNeoXForCausalLM",
        ),
        ArchSpec(
            "opt",
            attention=f"model.decoder.layers.{LAYER}.self_attn",
            base_model_prefix="model.",
            o_proj="out_proj",
            head_dim_key=None,
            embed_tokens="model.decoder.embed_tokens",
            embed_width_key="word_embed_proj_dim",
            no_calibration=_SHIPPED,
            shipped_class="GQAOPTForCausalLM",
        ),
    )
}

_MLA = "multi-head latent attention: K and V come from one shared latent, there are no K/V heads to pool"
_HYBRID = "hybrid: some layers are state-space, linear-attention or convolution blocks without K/V heads"
_WRAPPER = "a multimodal wrapper; its text model has a model type of its own"

# Model types transformers gives a causal-LM class and a K/V head count that gqaify does not convert, and why.
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        [
            "axk1",
            "axk2",
            "deepseek_v2",
            "deepseek_v3",
            "deepseek_v32",
            "deepseek_v4",
            "dots3_note_text",
            "glm4_moe_lite",
            "glm_moe_dsa",
            "hy_v4",
            "longcat_flash",
            "minicpm3",
            "youtu",
        ],
        _MLA,
    ),
    **dict.fromkeys(
        [
            "bailing_hybrid",
            "bamba",
            "falcon_h1",
            "granitemoehybrid",
            "jamba",
            "kimi_linear",
            "lfm2",
            "lfm2_moe",
            "lfm3",
            "minimax",
            "nemotron_h",
            "olmo_hybrid",
            "qwen3_5_moe_text",
            "qwen3_5_text",
            "qwen3_next",
            "qwen4_exp_text",
            "recurrent_gemma",
            "zamba",
            "zamba2",
            "zaya",
        ],
        _HYBRID,
    ),
    **dict.fromkeys(
        [
            "dots3_note",
            "emu3",
            "gemma3",
            "gemma3n",
            "gemma4",
            "gemma4_unified",
            "got_ocr2",
            "llama4",
            "mllama",
            "moss_transcribe_diarize",
            "phi4_multimodal",
            "qwen3_5",
            "qwen3_5_moe",
            "qwen4_exp",
        ],
        _WRAPPER,
    ),
    # not counted by the audit (no num_key_value_heads), refused for what its cache would be
    "falcon": "transformers' Falcon broadcasts its K/V heads to every query head before caching them: fewer K/V "
    "heads would not shrink its cache",
    "bitnet": "its weights are ternary (BitNet b1.58): a mean of ternary rows is not ternary",
    "whisper": "a speech encoder-decoder; its decoder also attends to the encoder (cross-attention)",
    "moshi": "a speech-text model whose depth decoder is a second transformer, not described",
    "gemma4_assistant": "a drafting head that reads its target model's cache: convert the target",
    "gemma4_unified_assistant": "a drafting head that reads its target model's cache: convert the target",
    "gemma3n_text": "later layers reuse the K/V cache of earlier ones (KV sharing), not described",
    "gemma4_text": "its global layers have a head size of their own (global_head_dim), not described",
    "gemma4_unified_text": "its global layers have a head size of their own (global_head_dim), not described",
    "mimo_v2_flash": "its value heads are larger than its key heads (v_head_dim), not described",
    "jetmoe": "a mixture of attention experts: heads are chosen per token, there are no fixed K/V heads",
    "doge": "its dynamic-mask parameters are indexed by K/V head in a layout not described",
    "gpt_bigcode": "it knows only MHA and MQA (multi_query), under config keys not described",
    "dbrx": "its fused Wqkv sits under a nested attn_config, not described",
    "cohere_compass_text": "not verified by the tests yet (its default layer types do not build)",
    "inkling_text": "its K and V pass through a short convolution per channel (k_sconv, v_sconv), not described",
    "inkling2_text": "its K and V pass through a short convolution per channel (k_sconv, v_sconv), not described",
}


def arch_for(model_type: str, architectures: list[str] | None = None) -> ArchSpec:
    """The spec for a config's `model_type`, or a `UserError` listing the supported ones."""
    spec = ARCHITECTURES.get(model_type)
    if spec is None and model_type in REFUSED:
        raise UserError(f"gqaify does not convert {model_type!r}: {REFUSED[model_type]}")
    if spec is None:
        name = f"{model_type!r}" + (f" ({architectures[0]})" if architectures else "")
        raise UserError(
            f"unsupported architecture {name}; gqaify converts {len(ARCHITECTURES)} model types, listed by "
            "`python -m gqaify.conversion.coverage`. Adding one is an entry in gqaify/model/archs.py."
        )
    return spec


@dataclass(frozen=True)
class TrainedAttention:
    """What `trainable` attention, kv-only and lora train in one architecture: every layer's attention module path
    (`pattern`, a regular expression), the projections LoRA adapts and the K/V ones kv-only trains, relative to
    it; `fused`: one tensor holds Q, K and V (kv-only cannot train K and V alone)."""

    pattern: str
    projections: tuple[str, ...]
    kv: tuple[str, ...]
    fused: bool = False

    @classmethod
    def of(cls, spec: ArchSpec) -> TrainedAttention:
        names = (spec.q_proj, spec.k_proj, spec.v_proj, spec.o_proj, spec.qkv_proj)
        return cls.at(spec.attention, tuple(n for n in names if n), tuple(spec.kv_modules()), spec.qkv_proj is not None)

    @classmethod
    def at(
        cls, attention: str, projections: tuple[str, ...], kv: tuple[str, ...], fused: bool = False
    ) -> TrainedAttention:
        """The attention at the module path `attention` ("model.layers.{layer}.self_attn") of every layer."""
        return cls(re.escape(attention).replace(re.escape(LAYER), r"\d+"), projections, kv, fused)
