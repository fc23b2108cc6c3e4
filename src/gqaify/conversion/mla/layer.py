"""Multi-head latent attention (MLA): a GQA or MQA layer rewritten as DeepSeek-V3's dense MLA layer.

An MLA layer caches, per token and layer, a latent c of `kv_rank` values (after an RMSNorm) and one rotary key of
`rope_dim` values that every query head shares; each query head reads its non-rotary key and its value out of the
latent through its own rows of `kv_b_proj`. transformers' `DeepseekV3ForCausalLM` with every layer dense
(`first_k_dense_replace` = the layer count) and no query low-rank (`q_lora_rank` None) is that layer on a Llama
body: the same embedding, MLP, norms and head, and a cache that holds the latent (`DynamicCache` stores c and the
rotary key, not the expanded heads). So the output is a plain checkpoint: `AutoModelForCausalLM` loads it.

A layer with G K/V heads of d dimensions, keeping rope_dim / 2 (K/V head, rotary pair) choices (all: exact):

    rotary key   one key of rope_dim values every query head shares, in transformers' rotate_half layout, at one
                 list of frequencies for the model (`longrope`'s per-pair factors give any list: `rope_parameters`);
                 each dimension carries one K/V head's pair at its frequency, the head may change from layer to
                 layer (`mla.rotary.RotaryLayout`); a query head's rotary query is its own head's pairs in their
                 places, zeros elsewhere. Turned (a smaller cache, `across`): each dimension carries a mix of the
                 heads' pairs of its frequency, and a query head reads it by its own head's share in the mix
    latent       the values of the G heads, and what the rotary key leaves of each head's key (unrotated);
                 all of them (exact), or their first `kv_rank` principal components on calibration
                 activations, K and V balanced to equal energy first (`Latent`)
    the norm     RMSNorm(c) = c / sqrt(mean(c^2) + eps) x w is linear where mean(c^2) << eps: `kv_a_proj` scales
                 the latent down so that mean(c^2) <= 1e-6 eps for any input the layer's own input norm can give
                 (bounded by the weights, not by text), and the norm's weight scales it back up: exact to about
                 5e-7 relatively, and the weight stays free to train
    scaling      the class divides the scores by sqrt(nope + rope_dim); the queries carry the difference
    nope         each query head's non-rotary key, read from the latent: as wide as the most any K/V head leaves
                 unrotated in a layer, zeros past its own
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from gqaify.conversion.mla.latent import Latent, latent_from_covariance, target_metric
from gqaify.conversion.mla.rotary import (
    STATIC_ROPE,
    RotaryLayout,
    across_heads,
    choose_layout,
    pair_moments,
    pair_scores,
    rope_parameters,
    rotation_weight,
    source_frequencies,
)
from gqaify.conversion.mla.written import ARCHS
from gqaify.errors import UserError, raise_if_problems
from gqaify.progress import progress_bar

STAT_WINDOW = 512  # calibration tokens a forward pass of the statistics reads, and the distances pairs are judged over
LINEAR_MARGIN = 1e-6  # mean(c^2) / eps at most, for any input: the latent norm's relative error is half of it


@dataclass(frozen=True)
class MlaShape:
    """The cache of one MLA layer: `kv_rank` latent values and `rope_dim` = 2 x pairs x G rotary ones per token."""

    num_heads: int
    kv_groups: int  # G, the source's K/V heads
    head_dim: int  # d, the source's
    pairs: int  # rotary pairs kept of each K/V head's d/2
    kv_rank: int

    @property
    def rope_dim(self) -> int:
        return 2 * self.pairs * self.kv_groups

    @property
    def nope_dim(self) -> int:
        """A query head's non-rotary key dimensions: its K/V head's dimensions whose pairs are not kept."""
        return self.head_dim - 2 * self.pairs

    @property
    def values_per_token(self) -> int:
        """What one token costs the cache of one layer, in values."""
        return self.kv_rank + self.rope_dim

    @property
    def full_rank(self) -> int:
        """The latent that holds everything: every value and every non-rotary key dimension of the G heads."""
        return self.kv_groups * (self.nope_dim + self.head_dim)

    @classmethod
    def exact(cls, num_heads: int, kv_groups: int, head_dim: int) -> MlaShape:
        """The rewrite that loses nothing: every pair rotary, the latent the G heads' values (the source's cache)."""
        return cls(num_heads, kv_groups, head_dim, head_dim // 2, kv_groups * head_dim)


def mla_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    targets: torch.Tensor,
    input_norm: torch.Tensor,
    shape: MlaShape,
    rotary: tuple[torch.Tensor, list[torch.Tensor], int],
    latent: Latent,
    eps: float,
) -> dict[str, torch.Tensor]:
    """One layer's MLA tensors (names relative to the attention module) from its GQA projections.

    q: (H*d, hidden), k: (G*d, hidden), rows by head, rotate_half layout; `targets` the latent's target rows,
    float64 (`residual_keys`, then the G heads' values: what `latent` was built on); `input_norm` the weight of the
    RMSNorm before the layer (it bounds the latent, see the module docstring); `rotary` this layer's rotary key as
    weights on the heads' key dimensions (`RotaryLayout.basis`), each K/V head's dimensions the latent holds
    (`RotaryLayout.dropped`), and the model's non-rotary width (`RotaryLayout.nope_dim`: heads that leave fewer
    leave the rest of theirs zero).
    """
    H, G, d = shape.num_heads, shape.kv_groups, shape.head_dim
    rep = H // G
    q, k = q.double().view(H, d, -1), k.double().view(G, d, -1)
    hidden = q.shape[-1]
    basis, nope, width = rotary

    # queries: per head [nope | rope], scaled from the source's 1/sqrt(d) to the class's 1/sqrt(nope + rope)
    scale = math.sqrt((width + shape.rope_dim) / d)
    q_out = torch.zeros(H, width + shape.rope_dim, hidden, dtype=torch.float64)
    for h in range(H):
        g = h // rep
        q_out[h, : len(nope[g])] = q[h, nope[g]]
        q_out[h, width:] = basis[:, g] @ q[h]
    q_out *= scale

    k_rope = torch.einsum("sgd,gdh->sh", basis, k)  # (rope_dim, hidden)
    down = latent.down.double() @ targets  # (R, hidden)
    bound = torch.linalg.matrix_norm(down, ord=2) * math.sqrt(hidden) * input_norm.double().abs().max()
    shrink = math.sqrt(LINEAR_MARGIN * eps * shape.kv_rank) / max(float(bound), 1e-30)

    up = latent.up.double()  # (targets, R)
    starts = [sum(len(n) for n in nope[:g]) for g in range(G + 1)]
    kv_b = torch.zeros(H, width + d, shape.kv_rank, dtype=torch.float64)
    for h in range(H):
        g = h // rep
        kv_b[h, : len(nope[g])] = up[starts[g] : starts[g + 1]]
        kv_b[h, width:] = up[starts[G] + g * d : starts[G] + (g + 1) * d]
    return {
        "q_proj.weight": q_out.reshape(-1, hidden),
        "kv_a_proj_with_mqa.weight": torch.cat([down * shrink, k_rope]),
        "kv_a_layernorm.weight": torch.full((shape.kv_rank,), math.sqrt(eps) / shrink, dtype=torch.float64),
        "kv_b_proj.weight": kv_b.reshape(-1, shape.kv_rank),
    }


def residual_keys(k: torch.Tensor, basis: torch.Tensor, nope: list[torch.Tensor]) -> torch.Tensor:
    """The rows of each K/V head's key the latent holds, stacked ((sum of len(nope[g]), hidden)): what the rotary key
    (`basis`, `RotaryLayout.basis`) leaves of the head, on its dimensions `nope[g]`. k: (G, d, hidden), float64."""
    left = k - torch.einsum("sgd,sh->gdh", basis, torch.einsum("sgd,gdh->sh", basis, k))
    return torch.cat([left[g, rows] for g, rows in enumerate(nope)])


def shape_for(config: dict, kv_heads: int | None, kv_rank: int | None, rope_dim: int | None):
    """(the MLA shape of a G-head model of the source `config` (a config.json dict), or None; what is wrong with the
    request): G = `kv_heads` (None: the source's), the rest as `plan_mla` takes them. Read before any work."""
    H = config.get("num_attention_heads")
    if not isinstance(H, int) or H < 1:
        return None, []  # config.json's own checks say so
    G = kv_heads or config.get("num_key_value_heads") or H
    d = config.get("head_dim") or config.get("hidden_size", 0) // H
    problems = []
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (kind := rope.get("rope_type", rope.get("type", "default"))) not in STATIC_ROPE:
        problems.append(
            f"rope_type {kind!r} changes its frequencies with the length; an MLA rewrite lists fixed ones "
            f"({', '.join(STATIC_ROPE)}): convert a model with one of those"
        )
    if rope_dim is not None and rope_dim % (2 * G):
        problems.append(f"--rope-dims must be a multiple of {2 * G} (two per rotary pair, for each of {G} K/V heads)")
    pairs = d // 2 if rope_dim is None else rope_dim // (2 * G)
    if rope_dim is not None and not 1 <= pairs <= d // 2:
        problems.append(
            f"--rope-dims keeps 1 to {d // 2} rotary pairs of each of the {G} K/V heads: give {2 * G} to {G * d}"
        )
    full_rank = MlaShape(H, G, d, min(max(pairs, 0), d // 2), 1).full_rank
    if kv_rank is not None and kv_rank > full_rank:
        problems.append(f"--kv-rank {kv_rank} is wider than all it could hold ({full_rank}): give at most that")
    shape = MlaShape(H, G, d, pairs, full_rank if kv_rank is None else kv_rank)
    return (None if problems else shape), problems


# -- a checkpoint -----------------------------------------------------------------------------------------------

# What carries over from a Llama-shaped config to DeepSeek-V3's, unchanged.
_CARRIED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
)


def mla_problem(config: dict) -> str | None:
    """Why a source's config.json cannot be rewritten as DeepSeek-V3's dense MLA layer (None: it can)."""
    model_type = config.get("model_type")
    if model_type not in ARCHS:
        return (
            f"an MLA rewrite is described for {', '.join(sorted(ARCHS))}, "
            f"not {model_type!r} (its layer differs from DeepSeek-V3's dense one)"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            return f"{flag} is set: DeepSeek-V3's dense MLA layer has no such biases"
    if config.get("sliding_window"):
        return "sliding_window is set: DeepSeek-V3's MLA layer attends to every token"
    return None


def mla_config(config, shape: MlaShape, rope: dict, nope_dim: int):
    """DeepSeek-V3's config of the rewritten model: every layer dense, the MLA shape, the source's body."""
    from transformers import DeepseekV3Config

    carried = {key: getattr(config, key) for key in _CARRIED if getattr(config, key, None) is not None}
    return DeepseekV3Config(
        **carried,
        num_key_value_heads=shape.num_heads,  # the class expands the latent to every head itself
        first_k_dense_replace=config.num_hidden_layers,
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=config.intermediate_size,
        q_lora_rank=None,
        kv_lora_rank=shape.kv_rank,
        qk_rope_head_dim=shape.rope_dim,
        qk_nope_head_dim=nope_dim,
        v_head_dim=shape.head_dim,
        rope_parameters=rope,
        rope_interleave=False,
        attention_bias=False,
    )


@dataclass
class LayerStatistics:
    """What calibration text says of one layer's inputs: their second moment, and the rotary pairs' scores."""

    covariance: torch.Tensor  # (hidden, hidden), the mean of x x^T over tokens
    scores: torch.Tensor  # (G, d/2), `pair_scores`


def layer_statistics(
    model, ids: torch.Tensor, shape: MlaShape, progress: bool = False, block: int = STAT_WINDOW
) -> list[LayerStatistics]:
    """Per layer, the statistics of the attention inputs of `model` (the GQA source) on the token ids `ids`."""
    layers = model.model.layers
    hidden = model.config.hidden_size
    device = model.device  # the passes run where the model is; the statistics come back on the CPU
    sums = [torch.zeros(hidden, hidden, dtype=torch.float64, device=device) for _ in layers]
    scores = [torch.zeros(shape.kv_groups, shape.head_dim // 2, dtype=torch.float64, device=device) for _ in layers]
    counted = [0]

    def hook(index):
        def capture(module, args, kwargs):
            x = (kwargs.get("hidden_states", args[0] if args else None)).reshape(-1, hidden).double()
            sums[index] += x.T @ x
            attn = layers[index].self_attn
            q = (x @ attn.q_proj.weight.double().T).view(len(x), shape.num_heads, shape.head_dim)
            k = (x @ attn.k_proj.weight.double().T).view(len(x), shape.kv_groups, shape.head_dim)
            scores[index] += pair_scores(q, k, shape.num_heads, shape.kv_groups) * len(x)

        return capture

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            starts = range(0, len(ids) - 1, block)
            for start in progress_bar(starts, desc="MLA statistics", unit="window", shown=progress):
                window = ids[start : start + block]
                model(window.unsqueeze(0).to(device))
                counted[0] += len(window)
    finally:
        for handle in handles:
            handle.remove()
    n = counted[0]
    return [LayerStatistics((s / n).cpu(), (c / n).cpu()) for s, c in zip(sums, scores, strict=True)]


@dataclass(frozen=True)
class MlaPlan:
    """An MLA rewrite worked out for one model: its shape, the rotary layout, the per-layer statistics."""

    shape: MlaShape
    layout: RotaryLayout  # which K/V head's pair each rotary dimension carries, in each layer
    rope: dict  # DeepSeek-V3's rope_parameters
    statistics: list[LayerStatistics] | None  # None: the exact rewrite, which reads no text

    @property
    def exact(self) -> bool:
        return self.statistics is None

    @property
    def nope_dim(self) -> int:
        return self.layout.nope_dim(self.shape.kv_groups, self.shape.head_dim)


def plan_mla(
    model,
    kv_rank: int | None = None,
    rope_dim: int | None = None,
    ids: torch.Tensor | None = None,
    ladder: bool = False,
    progress: bool = False,
    statistics: list[LayerStatistics] | None = None,
    across: bool = True,
) -> MlaPlan:
    """The rewrite of `model` (a loaded GQA, MQA or MHA transformers model) at this shape: exact without `kv_rank` and
    `rope_dim` (the source's cache), else fitted on the token ids `ids` (calibration text); `ladder`: rotary pairs
    llama.cpp can turn (`choose_layout`); `statistics`: `layer_statistics` already read (of any shape of this
    model), else read from `ids`; `across`: each frequency's pairs turned across the K/V heads first where there are
    several (`across_heads`; with `ladder`, one slot per frequency).

    Raises:
        UserError: an architecture or a shape the rewrite does not take, or a smaller cache without text.
    """
    config = model.config
    if problem := mla_problem(config.to_dict()):
        raise UserError(problem)
    shape, problems = shape_for(config.to_dict(), None, kv_rank, rope_dim)
    raise_if_problems(problems)
    compressed = shape.pairs < shape.head_dim // 2 or shape.kv_rank < shape.full_rank
    if compressed and ids is None and statistics is None:
        raise UserError("an MLA cache smaller than the source's is fitted on calibration text: pass --calib-data")
    if not compressed:
        statistics = None
    elif statistics is None:
        statistics = layer_statistics(model, ids, shape, progress)
    source = source_frequencies(config)
    scores = mixing = None
    if statistics is not None and across and shape.kv_groups > 1:
        mixing, scores = _across_heads(model, statistics, shape)
    elif statistics is not None:
        scores = torch.stack([s.scores for s in statistics])
    if scores is not None:
        scores = scores * rotation_weight(source, STAT_WINDOW)
    layers = config.num_hidden_layers
    turned = mixing is not None
    layout = choose_layout(scores, shape.kv_groups, shape.head_dim, shape.pairs, layers, ladder, turned)
    if mixing is not None:
        layout = dataclasses.replace(layout, mixing=mixing)
    rope = rope_parameters(
        source[layout.pairs], float(config.rope_parameters["rope_theta"]), config.max_position_embeddings
    )
    return MlaPlan(shape, layout, rope, statistics)


def _across_heads(model, statistics: list[LayerStatistics], shape: MlaShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, each frequency's mixing across the K/V heads and its components' scores (`across_heads`)."""
    mixings, scores = [], []
    for layer, stats in zip(model.model.layers, statistics, strict=True):
        attn = layer.self_attn
        q, k = attn.q_proj.weight.detach().cpu(), attn.k_proj.weight.detach().cpu()
        keys, queries = pair_moments(q, k, stats.covariance, shape.num_heads, shape.kv_groups)
        mixing, score = across_heads(keys, queries, shape.kv_groups)
        mixings.append(mixing)
        scores.append(score)
    return torch.stack(mixings), torch.stack(scores)


def build_mla(model, plan: MlaPlan):
    """The DeepSeek-V3 dense MLA model `plan` describes, in float32, its body `model`'s, on `model`'s device (built
    on the CPU, where the plan's tensors are)."""
    from transformers import DeepseekV3ForCausalLM

    shape, layout, G, d = plan.shape, plan.layout, plan.shape.kv_groups, plan.shape.head_dim
    target = mla_config(model.config, shape, plan.rope, plan.nope_dim)
    state = {name: t.detach().float().cpu() for name, t in model.state_dict().items()}
    eps = 1e-6  # DeepSeek-V3's latent norm keeps RMSNorm's default epsilon, whatever rms_norm_eps says
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}.self_attn."
        q, k, v = (state.pop(prefix + f"{p}_proj.weight") for p in "qkv")
        hidden = q.shape[1]
        nope = [layout.dropped(i, g, d) for g in range(G)]
        basis = layout.basis(i, G, d)
        key_rows = residual_keys(k.double().view(G, d, hidden), basis, nope)
        targets = torch.cat([key_rows, v.double()])
        covariance = None if plan.statistics is None else plan.statistics[i].covariance
        metric = None
        if covariance is not None:
            metric = target_metric(q, state[prefix + "o_proj.weight"], covariance, shape.num_heads, nope)
        latent = latent_from_covariance(targets, covariance, shape.kv_rank, len(key_rows), metric)
        norm = layer.input_layernorm.weight.detach().cpu()
        rotary = (basis, nope, plan.nope_dim)
        for name, tensor in mla_layer(q, k, targets, norm, shape, rotary, latent, eps).items():
            state[prefix + name] = tensor.float()
    mla = DeepseekV3ForCausalLM(target).eval()
    missing, unexpected = mla.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (target.tie_word_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"the MLA model's tensors disagree: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if target.tie_word_embeddings:
        mla.tie_weights()
    mla.generation_config = model.generation_config
    return mla.to(model.device)


def rewrite_as_mla(
    model,
    kv_rank: int | None = None,
    rope_dim: int | None = None,
    ids: torch.Tensor | None = None,
    across: bool = True,
):
    """`model` rewritten as a DeepSeek-V3 dense MLA model (`plan_mla`, then `build_mla`).

    Raises:
        UserError: as `plan_mla`.
    """
    return build_mla(model, plan_mla(model, kv_rank, rope_dim, ids, across=across))
