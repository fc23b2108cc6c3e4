"""`--kv-cut X`: the cache as users think of it, 1/X of the source's, for either attention shape.

    gqa   the K/V heads that cache 1/X of the source's: G = source heads / X, a whole number that divides them, or
          refused in one line naming the cuts the model allows (and MLA, which takes any)
    mla   the values per token and layer, 2 x source heads x head_dim / X (rounded down), split between the latent
          (`--kv-rank`) and the shared rotary key (`--rope-dims`): the one not given is the rest; neither given, the
          split is chosen on the calibration text (`conversion/mla/split.py`) and recorded. Neither given and whole
          K/V heads making the cache (`whole_heads`), the G-head model is that GQA conversion, whose exact rewrite
          is one start; the parent compressed to the cut is the other, and the closer is kept (`mla.output`)

`resolve_cut` turns the request into the settings a conversion runs with (G, and the split where it is fixed), once
the source's config.json is read; its problems are the request's, raised before anything is written.
"""

from __future__ import annotations

import dataclasses
import math

from gqaify.conversion.settings import ConvertSettings
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


def resolve_cut(s: ConvertSettings, geometry: Geometry) -> tuple[ConvertSettings, list[str]]:
    """`s` with what `--kv-cut` decides filled in (G; for MLA the split where one width is given), and the problems
    of the request against the source's `geometry`."""
    if s.kv_cut is None:
        return s, []
    heads, head_dim = geometry.num_kv_heads, geometry.head_dim
    cut = s.kv_cut
    if s.attention == "gqa":
        allowed = [heads // g for g in range(heads, 0, -1) if heads % g == 0]
        g = heads / cut
        if not g.is_integer() or heads % int(g):
            shown = ", ".join(f"{a:g}" for a in allowed)
            said = f"{cut:g}" if float(f"{cut:g}") == cut else repr(cut)  # 1.0000000001 is not 1
            return s, [
                f"--kv-cut {said}: no whole number of the source's {heads} K/V heads caches 1/{said} of them; GQA "
                f"cuts this model by {shown}, or pass --attention mla, whose latent takes any cut"
            ]
        if s.kv_heads is not None and s.kv_heads != int(g):
            return s, [f"--kv-heads {s.kv_heads} and --kv-cut {cut:g} disagree (the cut means {int(g)} K/V heads)"]
        return dataclasses.replace(s, kv_heads=int(g)), []
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
        if rope % (2 * kv_heads):
            return s, [
                f"--kv-cut {cut:g} with --kv-rank {rank} leaves a rotary key of {rope} values, not a multiple of "
                f"{2 * kv_heads} (two per rotary pair of each of {kv_heads} K/V heads); give --rope-dims instead"
            ]
    elif rope is not None and rank is None:
        rank = budget - rope
    if (rank is not None and rank < 1) or (rope is not None and rope < 2):
        return s, [f"--kv-cut {cut:g} leaves {budget} values; the latent needs at least 1 and the rotary key 2"]
    return dataclasses.replace(s, kv_heads=kv_heads, kv_rank=rank, rope_dims=rope), []


def planned_config(s: ConvertSettings, config):
    """The config (a transformers config, changed in place) of the model the conversion `s` writes from a source of
    `config`, for a memory plan: its K/V heads, or its MLA shape. What calibration chooses is counted at its widest,
    so that a plan never counts short: an MLA split `--kv-cut` chooses, the widest candidate
    (`mla.split.candidate_splits`); a smaller cache's non-rotary key, chosen per layer, the source's head_dim.

    Raises:
        UserError: a cut the conversion refuses.
    """
    from gqaify.conversion.mla.layer import mla_config, shape_for
    from gqaify.conversion.mla.split import candidate_splits
    from gqaify.errors import raise_if_problems
    from gqaify.model.archs import ARCHITECTURES

    spec = ARCHITECTURES.get(config.model_type)
    if spec is None:  # the conversion's own checks refuse it before training
        return config
    geometry = Geometry.from_config(spec, config.to_dict())
    s, problems = resolve_cut(s, geometry)
    raise_if_problems(problems)
    rank, rope, kv_heads = s.kv_rank, s.rope_dims, s.kv_heads
    if s.attention == "mla" and s.kv_cut is not None and rank is None and rope is None:
        H, d, hidden = geometry.num_heads, geometry.head_dim, config.hidden_size
        budget = cut_values(geometry, s.kv_cut)
        # a whole-head cut tries the parent compressed too (`mla.output`): its splits are of the source's heads
        starts = {kv_heads, geometry.num_kv_heads} if whole_heads(geometry, budget) == kv_heads else {kv_heads}

        def weights(split: tuple[int, int]) -> int:  # kv_a, kv_b and q_proj, the non-rotary key at its widest
            r, k = split
            return hidden * (r + k) + r * H * 2 * d + hidden * H * (d + k)

        options = [(g, split) for g in sorted(starts) for split in candidate_splits(H, g, d, budget)]
        kv_heads, (rank, rope) = max(options, key=lambda option: weights(option[1]))
    if kv_heads is not None:
        setattr(config, spec.num_kv_heads_key, kv_heads)
    if s.attention != "mla":
        return config
    shape, _ = shape_for(config.to_dict(), kv_heads, rank, rope)
    if shape is None:  # the conversion's own checks refuse it before training
        return config
    exact = rank is None and rope is None
    return mla_config(config, shape, {"rope_type": "default"}, shape.nope_dim if exact else shape.head_dim)
