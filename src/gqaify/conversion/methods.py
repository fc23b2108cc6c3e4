"""Conversion methods: how the K/V heads of a group become one head.

Grouping is contiguous, the order transformers' `repeat_kv` reads: with H query heads and G K/V heads,
query head i uses K/V head i // (H/G). A source with KV heads (KV = H for MHA) therefore pools its heads
j*g ... j*g + g-1 into new head j, with g = KV/G:

    source K/V heads   k0 k1 | k2 k3 | k4 k5 | k6 k7        KV = 8
    groups (G = 4)       0   |   1   |   2   |   3          g = 2
    query heads        q0 q1 | q2 q3 | q4 q5 | q6 q7        H = 8: q_i reads group i // (H/G)

(`grouping.py` may first reorder the heads so that similar ones are neighbours.)

A method is a pure function of one layer's `Attention` (see `layout.py`) that returns the layer with G K/V
heads. Methods that only pool K/V (`mean`, `first`, `random`, `norm-mean`) leave the queries alone; methods
that fold also rewrite q_proj rows and o_proj columns so that the readers of each head compensate for what
was done to it, and need calibration statistics. A new method is one entry in `conversion.registry.METHOD_INFO` (its
summary, its needs and the name of its function here, as data that --help reads without torch) and its function here;
`METHODS` is built from that table, so a method without its function, or the reverse, fails at import and in
the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import gqaify.conversion.fit as fit
from gqaify.conversion.layout import Attention
from gqaify.conversion.registry import METHOD_INFO, MethodInfo


@dataclass(frozen=True)
class MethodContext:
    """What a method may use besides the layer's tensors."""

    generator: torch.Generator
    init_std: float  # the model's initializer_range, for methods that re-initialise
    rotary_dim: int = 0  # leading dimensions of each head that RoPE rotates
    second_moment: torch.Tensor | None = None  # this layer's calibration statistics (`calibrate.py`)


Fn = Callable[[Attention, int, MethodContext], Attention]


@dataclass(frozen=True)
class Method:
    fn: Fn
    info: MethodInfo  # summary, and whether it is calibrated and folds (`conversion.registry.METHOD_INFO`)

    @property
    def calibrated(self) -> bool:
        return self.info.calibrated

    @property
    def folds(self) -> bool:
        return self.info.folds


def group(heads: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(KV, *rest) -> (G, KV/G, *rest): contiguous groups, as `repeat_kv` reads them."""
    return heads.unflatten(0, (num_groups, heads.shape[0] // num_groups))


def mean_pool(heads: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(KV, *rest) -> (G, *rest): the mean of each group (GQA paper, Ainslie et al. 2023, section 2.1)."""
    return group(heads, num_groups).mean(dim=1)


def keeps_heads(before: Attention, after: Attention, num_groups: int) -> bool:
    """Whether every new K/V head equals each of the heads of its group (to float32 rounding): the conversion lost
    nothing, as where a model's duplicated heads are pooled back."""
    return all(
        torch.isclose(group(t, num_groups), after.kv[key].unsqueeze(1), rtol=1e-6, atol=0).all()  # (G, g, *rest)
        for key, t in before.kv.items()
    )


def mean(attn: Attention, num_groups: int, ctx: MethodContext) -> Attention:
    """Mean-pool every K/V-indexed tensor (projection weights, biases, K norms) over each group."""
    return replace(attn, kv={key: mean_pool(t, num_groups) for key, t in attn.kv.items()})


def first(attn: Attention, num_groups: int, ctx: MethodContext) -> Attention:
    """Keep the first head of each group (the GQA paper's ablation)."""
    return replace(attn, kv={key: group(t, num_groups)[:, 0] for key, t in attn.kv.items()})


def random(attn: Attention, num_groups: int, ctx: MethodContext) -> Attention:
    """Re-initialise the K/V projections as transformers does: weights ~ N(0, initializer_range), biases 0.

    K norms are not projections: they are mean-pooled.
    """
    out = {}
    for key, t in attn.kv.items():
        shape = (num_groups, *t.shape[1:])
        if key in ("k.weight", "v.weight"):
            out[key] = torch.randn(shape, generator=ctx.generator) * ctx.init_std
        elif key in ("k.bias", "v.bias"):
            out[key] = torch.zeros(shape)
        else:
            out[key] = mean_pool(t, num_groups)
    return replace(attn, kv=out)


def norm_mean(attn: Attention, num_groups: int, ctx: MethodContext) -> Attention:
    """Mean-pool, then give every row of each pooled projection the mean norm of the rows it came from.

    Averaging g near-orthogonal heads shrinks each row by about 1/sqrt(g), which flattens attention (K) and
    dims the output (V); restoring the norm keeps each row's direction (the mean's) and its scale (the
    group's). A bias is scaled with its row. K norms are mean-pooled.
    """
    out = {key: mean_pool(t, num_groups) for key, t in attn.kv.items()}
    for proj in ("k", "v"):
        weight = attn.kv[f"{proj}.weight"]  # (KV, d, hidden)
        target = group(weight.norm(dim=-1), num_groups).mean(dim=1)  # (G, d): the group's mean row norm
        scale = target / out[f"{proj}.weight"].norm(dim=-1).clamp_min(torch.finfo(weight.dtype).tiny)  # (G, d)
        out[f"{proj}.weight"] = out[f"{proj}.weight"] * scale.unsqueeze(-1)
        if f"{proj}.bias" in out:
            out[f"{proj}.bias"] = out[f"{proj}.bias"] * scale
    return replace(attn, kv=out)


def aligned(attn: Attention, num_groups: int, ctx: MethodContext) -> Attention:
    """Rotate each head onto its group's first head on calibration data, fold the rotation into its readers, average.

    Values: an orthogonal Procrustes rotation in head_dim, undone in the o_proj columns of the query heads
    that read the head. Keys: one 2×2 rotation per rotary frequency pair (and a Procrustes rotation of any
    dimensions RoPE leaves alone), the transforms that commute with RoPE, undone in the q_proj rows of its
    readers. Where the heads of a group agree up to such rotations, the merge loses nothing. After "Align
    Attention Heads Before Merging Them" (Jin et al., arXiv 2412.20677), whose rotations these are; they
    then prune with L0 masks and training, here the aligned heads are averaged.
    """
    return _merge(attn, num_groups, ctx, fit.align)


def lsq(attn: Attention, num_groups: int, ctx: MethodContext) -> Attention:
    """Fit each group's shared K and V, and the compensation in their readers, in closed form on calibration data.

    Values: the shared V projection and each query head's new o_proj columns minimise the error of every
    query head's per-token output, a weighted PCA of the group's value outputs. Keys: per rotary frequency
    pair, a shared complex row and a complex scale per query head minimise the error of every query head's
    attention scores at all relative positions (the pairs do not interact once averaged over positions).
    Both are `fit.shared_factor`, least squares in the spirit of ECKVH (Yu et al., arXiv 2406.07056), with
    the error weighted by how the readers use each head, and RoPE kept exact.
    """
    return _merge(attn, num_groups, ctx, fit.shared_factor)


def _merge(attn: Attention, num_groups: int, ctx: MethodContext, fitter) -> Attention:
    """Merge K and V with `fitter` (`fit.align` or `fit.shared_factor`) and fold its transforms into the readers."""
    layer = fit.LayerRows(attn, ctx.rotary_dim, ctx.second_moment)
    per_kv = layer.queries_per_kv_head
    key_blocks, query_blocks = [], []
    for keys, queries in zip(layer.key_blocks(), layer.query_blocks(), strict=True):
        readers = fit.cross(queries, layer.c, queries).unflatten(1, (-1, per_kv)).sum(2)  # (B, KV, m, m)
        merged, transforms = fitter(_by_group(keys, num_groups), layer.c, _by_group(readers, num_groups))
        key_blocks.append(merged.unflatten(0, (keys.shape[0], num_groups)))  # (B, G, m, n)
        transforms = transforms.unflatten(0, (keys.shape[0], num_groups)).flatten(1, 2)  # (B, KV, m, m)
        query_blocks.append(transforms.repeat_interleave(per_kv, dim=1).mH @ queries)  # q' = Tᴴ q
    values, outputs = layer.values(), layer.outputs()  # (KV, d, n), (H, hidden, d)
    readers = (outputs.mT @ outputs).unflatten(0, (-1, per_kv)).sum(1)  # (KV, d, d)
    merged, transforms = fitter(_by_group(values[None], num_groups), layer.c, _by_group(readers[None], num_groups))
    outputs = outputs @ transforms.flatten(0, 1).repeat_interleave(per_kv, dim=0)  # O' = O T
    return layer.rebuild(key_blocks, query_blocks, merged, outputs)


def _by_group(t: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(B, KV, ...) -> (B·G, KV/G, ...): each group of contiguous heads as one batch entry."""
    return t.unflatten(1, (num_groups, -1)).flatten(0, 1)


def fit_error(before: Attention, after: Attention, ctx: MethodContext, keys: bool = True) -> dict[str, float | None]:
    """Relative error, on the calibration data, of what every query head reads from K and from V.

    "k": Σ_i ‖scores_i - scores'_i‖² / Σ_i ‖scores_i‖² over pairs of calibration tokens, all relative
    positions (RoPE pairs counted apart, as `lsq` fits them); "v": the same for each query head's per-token
    output through o_proj. None where not measurable (keys behind a Q/K norm).
    """
    old = fit.LayerRows(before, ctx.rotary_dim, ctx.second_moment)
    new = fit.LayerRows(after, ctx.rotary_dim, ctx.second_moment)
    result: dict[str, float | None] = {"k": None, "v": None}
    if keys:
        error = total = 0.0
        for k, q, k2, q2 in zip(
            old.key_blocks(), old.query_blocks(), new.key_blocks(), new.query_blocks(), strict=True
        ):
            e, t = fit.read_error((q, old.per_reader(k)), (q2, new.per_reader(k2)), old.c, old.c)
            error, total = error + e, total + t
        result["k"] = error / total if total else 0.0
    v_old, v_new = old.per_reader(old.values()[None]), new.per_reader(new.values()[None])
    e, t = fit.read_error((old.outputs().mT[None], v_old), (new.outputs().mT[None], v_new), old.c, None)
    result["v"] = e / t if t else 0.0
    return result


# Every method of `conversion.registry.METHOD_INFO`, with the function of this module its entry names
METHODS: dict[str, Method] = {name: Method(globals()[info.function], info) for name, info in METHOD_INFO.items()}
