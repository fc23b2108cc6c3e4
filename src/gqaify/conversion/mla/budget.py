"""What `--kv-cut X` means for latent attention, and the model a memory plan counts.

The values per token and layer, 2 x source heads x head_dim / X (rounded down), are split between the latent
(`--kv-rank`) and the shared rotary key (`--rope-dims`): the one not given is the rest; neither given, the split is
chosen on the calibration text (`mla.split`) and recorded. Neither given and whole K/V heads making the cache
(`whole_heads`), the G-head model is that GQA conversion, whose exact rewrite is one start; the parent
compressed to the cut is the other, and the closer is kept (`mla.output`).
"""

from __future__ import annotations

import dataclasses
import math

from gqaify.model.geometry import Geometry


def cut_values(geometry: Geometry, cut: float) -> int:
    """The values per token and layer `--kv-cut cut` leaves of a source's cache (rounded down)."""
    return math.floor(geometry.cached_per_token / cut + 1e-9)


def whole_heads(geometry: Geometry, budget: int) -> int | None:
    """The K/V heads fewer than the source's whose keys and values cache exactly `budget` values (None: no whole
    number of heads that divides the source's does)."""
    heads, fits = divmod(budget, 2 * geometry.head_dim)
    if fits or not 1 <= heads < geometry.num_kv_heads or geometry.num_kv_heads % heads:
        return None
    return heads


def resolve_cut(s, geometry: Geometry):
    """`s` with G and the split `--kv-cut` fixes filled in, and the problems of the request against `geometry`."""
    heads, head_dim, cut = geometry.num_kv_heads, geometry.head_dim, s.kv_cut
    budget = cut_values(geometry, cut)
    split_free = s.kv_rank is None and s.rope_dims is None
    kv_heads = s.kv_heads or (split_free and whole_heads(geometry, budget)) or heads
    held = 2 * kv_heads * head_dim
    if budget > held:
        return s, [
            f"--kv-cut {cut:g} leaves {budget} values per token and layer, more than the {kv_heads}-K/V-head model "
            f"caches ({held}); give a larger cut, or more --kv-heads"
        ]
    if budget < 2 * kv_heads + 1:
        return s, [
            f"--kv-cut {cut:g} leaves {budget} values per token and layer, too few for a rotary pair of each of "
            f"{kv_heads} K/V heads and a latent; give a smaller cut, or --kv-heads 1"
        ]
    rank, rope = s.kv_rank, s.rope_dims
    if rank is not None and rope is not None and rank + rope != budget:
        return s, [
            f"--kv-rank {rank} and --rope-dims {rope} cache {rank + rope} values, where --kv-cut {cut:g} means "
            f"{budget}; give two of the three"
        ]
    if rank is not None and rope is None:
        rope = budget - rank
    elif rope is not None and rank is None:
        rank = budget - rope
    if (rank is not None and rank < 1) or (rope is not None and rope < 2):
        return s, [_no_room_problem(s, cut, budget, 2 * kv_heads)]
    if s.rope_dims is None and rope is not None and rope % (2 * kv_heads):
        return s, [
            f"--kv-cut {cut:g} with --kv-rank {rank} leaves a rotary key of {rope} values, not a multiple of "
            f"{2 * kv_heads} (two per rotary pair of each of {kv_heads} K/V heads); give --rope-dims instead"
        ]
    return dataclasses.replace(s, kv_heads=kv_heads, kv_rank=rank, rope_dims=rope), []


def _no_room_problem(s, cut: float, budget: int, pairs: int) -> str:
    """The problem of a latent or a rotary key left without room by the width the user gave the other (`--rope-dims`
    or `--kv-rank` taking every value `--kv-cut` leaves): said naming that option, with the widths that fit (a
    rotary key the rest of a --kv-rank makes holds whole `pairs`: two values per rotary pair of each K/V head)."""
    leaves = f"--kv-cut {cut:g} leaves {budget} values per token and layer"
    if s.rope_dims is not None and s.kv_rank is None:
        takes = "every one" if s.rope_dims == budget else "more than that"
        return (
            f"{leaves}, and --rope-dims {s.rope_dims} takes {takes}, "
            f"leaving the latent none (it needs at least 1); give --rope-dims below {budget}, or a smaller --kv-cut"
        )
    if s.kv_rank is not None and s.rope_dims is None:
        return (
            f"{leaves}, and --kv-rank {s.kv_rank} leaves the rotary key {max(budget - s.kv_rank, 0)} (it needs at "
            f"least 2); give --kv-rank at most {budget - pairs}, or a smaller --kv-cut"
        )
    return f"{leaves}; the latent needs at least 1 and the rotary key 2"


def planned_config(s, config, geometry: Geometry):
    """The DeepSeek-V3 config of the MLA model `s` writes from the G-head `config`. What calibration chooses is
    counted at its widest, so that a plan never counts short: a split `--kv-cut` chooses, the widest candidate
    (`mla.split.candidate_splits`); a smaller cache's non-rotary key, chosen per layer, the source's head_dim."""
    from gqaify.conversion.mla.layer import mla_config, shape_for
    from gqaify.conversion.mla.split import candidate_splits

    rank, rope, kv_heads = s.kv_rank, s.rope_dims, s.kv_heads
    if s.kv_cut is not None and rank is None and rope is None:
        H, d, hidden = geometry.num_heads, geometry.head_dim, config.hidden_size
        budget = cut_values(geometry, s.kv_cut)
        # a whole-head cut tries the parent compressed too (`mla.output`): its splits are of the source's heads
        starts = {kv_heads, geometry.num_kv_heads} if whole_heads(geometry, budget) == kv_heads else {kv_heads}

        def weights(split: tuple[int, int]) -> int:  # kv_a, kv_b and q_proj, the non-rotary key at its widest
            r, k = split
            return hidden * (r + k) + r * H * 2 * d + hidden * H * (d + k)

        options = [(g, split) for g in sorted(starts) for split in candidate_splits(H, g, d, budget)]
        kv_heads, (rank, rope) = max(options, key=lambda option: weights(option[1]))
        config.num_key_value_heads = kv_heads
    shape, _ = shape_for(config.to_dict(), kv_heads, rank, rope)
    if shape is None:  # the conversion's own checks refuse it before training
        return config
    exact = rank is None and rope is None
    return mla_config(config, shape, {"rope_type": "default"}, shape.nope_dim if exact else shape.head_dim)
