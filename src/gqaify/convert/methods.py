"""Conversion methods: how the K/V heads of a group become one head.

Grouping is contiguous, the order transformers' `repeat_kv` reads: with H query heads and G K/V heads,
query head i uses K/V head i // (H/G). A source with KV heads (KV = H for MHA) therefore pools its heads
j*g ... j*g + g-1 into new head j, with g = KV/G:

    source K/V heads   k0 k1 | k2 k3 | k4 k5 | k6 k7        KV = 8
    groups (G = 4)       0   |   1   |   2   |   3          g = 2
    query heads        q0 q1 | q2 q3 | q4 q5 | q6 q7        H = 8: q_i reads group i // (H/G)

A method is a pure function of one layer's head-major tensors (see `layout.py`) and returns the same keys
with G heads. Register new ones with `@method("name")`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gqaify.convert.layout import Heads


@dataclass(frozen=True)
class MethodContext:
    """What a method may use besides the layer's tensors."""

    generator: torch.Generator
    init_std: float  # the model's initializer_range, for methods that re-initialise


Method = Callable[[Heads, int, MethodContext], Heads]
METHODS: dict[str, Method] = {}


def method(name: str) -> Callable[[Method], Method]:
    def register(fn: Method) -> Method:
        METHODS[name] = fn
        return fn

    return register


def group(heads: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(KV, *rest) -> (G, KV/G, *rest): contiguous groups, as `repeat_kv` reads them."""
    return heads.unflatten(0, (num_groups, heads.shape[0] // num_groups))


def mean_pool(heads: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(KV, *rest) -> (G, *rest): the mean of each group (GQA paper, Ainslie et al. 2023, section 2.1)."""
    return group(heads, num_groups).mean(dim=1)


@method("mean")
def mean(heads: Heads, num_groups: int, ctx: MethodContext) -> Heads:
    """Mean-pool every K/V-indexed tensor (projection weights, biases, K norms) over each group."""
    return {key: mean_pool(t, num_groups) for key, t in heads.items()}


@method("first")
def first(heads: Heads, num_groups: int, ctx: MethodContext) -> Heads:
    """Keep the first head of each group (the GQA paper's ablation)."""
    return {key: group(t, num_groups)[:, 0] for key, t in heads.items()}


@method("random")
def random(heads: Heads, num_groups: int, ctx: MethodContext) -> Heads:
    """Re-initialise the K/V projections as transformers does: weights ~ N(0, initializer_range), biases 0.

    K norms are not projections: they are mean-pooled.
    """
    out = {}
    for key, t in heads.items():
        shape = (num_groups, *t.shape[1:])
        if key in ("k.weight", "v.weight"):
            out[key] = torch.randn(shape, generator=ctx.generator) * ctx.init_std
        elif key in ("k.bias", "v.bias"):
            out[key] = torch.zeros(shape)
        else:
            out[key] = mean_pool(t, num_groups)
    return out


@method("norm-mean")
def norm_mean(heads: Heads, num_groups: int, ctx: MethodContext) -> Heads:
    """Mean-pool, then give every row of each pooled projection the mean norm of the rows it came from.

    Averaging g near-orthogonal heads shrinks each row by about 1/sqrt(g), which flattens attention (K) and
    dims the output (V); restoring the norm keeps each row's direction (the mean's) and its scale (the
    group's). A bias is scaled with its row. K norms are mean-pooled.
    """
    out = {key: mean_pool(t, num_groups) for key, t in heads.items()}
    for proj in ("k", "v"):
        weight = heads[f"{proj}.weight"]  # (KV, d, hidden)
        target = group(weight.norm(dim=-1), num_groups).mean(dim=1)  # (G, d): the group's mean row norm
        scale = target / out[f"{proj}.weight"].norm(dim=-1).clamp_min(torch.finfo(weight.dtype).tiny)  # (G, d)
        out[f"{proj}.weight"] = out[f"{proj}.weight"] * scale.unsqueeze(-1)
        if f"{proj}.bias" in out:
            out[f"{proj}.bias"] = out[f"{proj}.bias"] * scale
    return out
