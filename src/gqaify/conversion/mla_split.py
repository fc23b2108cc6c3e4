"""How an MLA cache of a given size is split between the latent and the shared rotary key, when `--kv-cut` fixes the
size and neither `--kv-rank` nor `--rope-dims` is given: a few splits are built from the same calibration
statistics (no fitting) and the one closest to the G-head model on held-out calibration windows is kept.

    candidates   the rotary key taking about 1/8, 1/4, 3/8, 1/2, 5/8 and 3/4 of the values, in whole rotary pairs
                 of every K/V head (`candidate_splits`), the latent the rest
    judged by    the mean KL per token of the built model's next-token distribution to the G-head model's, on the
                 last windows of the calibration text, which the statistics do not read
    recorded     every split tried with its KL (`SplitTrial`, in gqaify.json's "mla")
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from gqaify.conversion.mla import STAT_WINDOW, MlaPlan, MlaShape, build_mla, layer_statistics, plan_mla
from gqaify.conversion.mla_fit import held_out_kl

ROPE_SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)  # of the cache's values, the rotary key's in the splits tried


@dataclass(frozen=True)
class SplitTrial:
    """One split tried: the latent's and the rotary key's values per token and layer, and how far the model built
    with them (no fitting) was from the G-head model on held-out calibration windows, in nats per token."""

    kv_rank: int
    rope_dims: int
    kl: float


def candidate_splits(num_heads: int, kv_groups: int, head_dim: int, budget: int) -> list[tuple[int, int]]:
    """(kv_rank, rope_dims) pairs that cache `budget` values: the rotary key near each of `ROPE_SHARES` of them, in
    whole pairs of each of the G K/V heads, every latent no wider than what it could hold."""
    splits = []
    for share in ROPE_SHARES:
        pairs = max(1, min(head_dim // 2, round(share * budget / (2 * kv_groups))))
        rope = 2 * pairs * kv_groups
        rank = budget - rope
        fits = 1 <= rank <= MlaShape(num_heads, kv_groups, head_dim, pairs, 1).full_rank
        if fits and (rank, rope) not in splits:
            splits.append((rank, rope))
    return splits


def choose_split(
    model, budget: int, ids: torch.Tensor, ladder: bool = False, progress: bool = False, across: bool = True
) -> tuple[MlaPlan, list[SplitTrial]]:
    """The plan of `model` (the G-head model) at `budget` values per token and layer whose split starts closest to it
    on the held-out end of the calibration ids `ids`, and every split tried."""
    config = model.config
    H, G = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // H
    splits = candidate_splits(H, G, d, budget)
    held = min(2 * STAT_WINDOW, len(ids) // 4)
    statistics = layer_statistics(model, ids[: len(ids) - held], MlaShape.exact(H, G, d), progress)
    windows = [w for w in ids[len(ids) - held :].split(STAT_WINDOW) if len(w) > 1]
    plans, trials = [], []
    for rank, rope in tqdm(splits, desc="MLA splits", unit="split", disable=not progress or None):
        plan = plan_mla(model, rank, rope, ladder=ladder, statistics=statistics, across=across)
        trials.append(SplitTrial(rank, rope, held_out_kl(model, build_mla(model, plan), windows)))
        plans.append(plan)
    best = min(range(len(trials)), key=lambda i: trials[i].kl)
    return plans[best], trials
