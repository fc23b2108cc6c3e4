"""How an MLA cache of a given size is split between the latent and the shared rotary key, when `--kv-cut` fixes the
size and neither `--kv-rank` nor `--rope-dims` is given: a few splits are built from the same calibration
statistics (no fitting) and the one closest to the G-head model on held-out calibration windows is kept.

    candidates   the rotary key taking about 1/8, 1/4, 3/8, 1/2, 5/8 and 3/4 of the values, in whole rotary pairs
                 of every K/V head (`candidate_splits`), the latent the rest
    judged by    the mean KL per token of the built model's next-token distribution to the G-head model's, on the
                 last windows of the calibration text, which the statistics do not read
    fitted       the two closest, each fitted to the parent (`mla.fit`); the closer after its fit is kept, judged on
                 the windows the fit holds out (SmolLM2 at 256 values: the closest start, rotary key 66, fitted to
                 0.285 nats/token on the panel, the second, 96, to 0.213)
    recorded     every split tried with its KL, and the fitted ones' KL after the fit (`SplitTrial`, in gqaify.json's
                 "mla")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gqaify.conversion.mla.fit import fit_and_judge, held_out_kl
from gqaify.conversion.mla.layer import STAT_WINDOW, MlaPlan, MlaShape, build_mla, layer_statistics, plan_mla
from gqaify.errors import UserError
from gqaify.progress import progress_bar
from gqaify.records import optional

ROPE_SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)  # of the cache's values, the rotary key's in the splits tried
FITTED = 2  # the splits closest before the fit that are fitted; the closest after it is kept


@dataclass(frozen=True)
class SplitTrial:
    """One split tried: the latent's and the rotary key's values per token and layer, and how far the model built
    with them (no fitting) was from the G-head model on held-out calibration windows, in nats per token."""

    kv_rank: int
    rope_dims: int
    kl: float
    fitted_kl: float | None = optional()  # one of the `FITTED` closest: the KL after its fit, on the fit's held-out


def candidate_splits(
    num_heads: int, kv_groups: int, head_dim: int, budget: int, ladder: bool = False
) -> list[tuple[int, int]]:
    """(kv_rank, rope_dims) pairs that cache `budget` values: the rotary key near each of `ROPE_SHARES` of them, in
    whole pairs of each of the G K/V heads, every latent no wider than what it could hold; with `ladder`, a rotary
    key of one slot per frequency at most (llama.cpp's: G x pairs no more than a head's d/2)."""
    splits, most = [], head_dim // 2 // (kv_groups if ladder else 1)
    for share in ROPE_SHARES if most else ():
        pairs = max(1, min(most, round(share * budget / (2 * kv_groups))))
        rope = 2 * pairs * kv_groups
        rank = budget - rope
        fits = 1 <= rank <= MlaShape(num_heads, kv_groups, head_dim, pairs, 1).full_rank
        if fits and (rank, rope) not in splits:
            splits.append((rank, rope))
    return splits


def fit_ranked(
    model, parent, plans: list[MlaPlan], trials: list[SplitTrial], windows: list[torch.Tensor], steps: int,
    lr: float, progress: bool = False,
) -> tuple[object, MlaPlan, list[SplitTrial], bool]:  # fmt: skip
    """The `FITTED` first of the ranked `plans` (`ranked_splits`: the splits that start closest) each built from
    `model`, fitted to `parent` (`mla.fit.fit_mla` on the calibration `windows`) and judged on the windows the fit
    holds out; (the closest after its fit, its plan, `trials` with the fitted ones' KLs, whether its fit was
    kept). After `ranked_splits`, what `--kv-cut` alone does."""
    best = None
    for plan in plans[:FITTED]:
        mla = build_mla(model, plan)
        fitted, kl = fit_and_judge(mla, parent, windows, steps, lr, progress)  # on the windows the fit holds out
        index = [(t.kv_rank, t.rope_dims) for t in trials].index((plan.shape.kv_rank, plan.shape.rope_dim))
        trials[index] = dataclasses.replace(trials[index], fitted_kl=kl)
        if best is None or kl < best[0]:
            best = (kl, mla, plan, fitted)
    _, mla, plan, fitted = best
    return mla, plan, trials, fitted


def ranked_splits(
    model, budget: int, ids: torch.Tensor, ladder: bool = False, progress: bool = False, across: bool = True
) -> tuple[list[MlaPlan], list[SplitTrial]]:
    """The plans of `model` (the G-head model) at `budget` values per token and layer, the split that starts closest
    to it on the held-out end of the calibration ids `ids` first, and every split tried (in the order tried)."""
    config = model.config
    H, G = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // H
    splits = candidate_splits(H, G, d, budget, ladder)
    if not splits:
        why = (
            f"gives llama.cpp's deepseek2 one slot per rotary frequency from {G} K/V heads of {d // 2} pairs; convert "
            "with fewer --kv-heads, or name OUT without .gguf"
            if ladder
            else f"leaves a latent beside one rotary pair of each of {G} K/V heads; ask a smaller --kv-cut"
        )
        raise UserError(f"no split of {budget} values per token and layer {why}")
    held = min(2 * STAT_WINDOW, len(ids) // 4)
    statistics = layer_statistics(model, ids[: len(ids) - held], MlaShape.exact(H, G, d), progress)
    windows = [w for w in ids[len(ids) - held :].split(STAT_WINDOW) if len(w) > 1]
    plans, trials = [], []
    for rank, rope in progress_bar(splits, desc="MLA splits", unit="split", shown=progress):
        plan = plan_mla(model, rank, rope, ladder=ladder, statistics=statistics, across=across)
        trials.append(SplitTrial(rank, rope, held_out_kl(model, build_mla(model, plan), windows)))
        plans.append(plan)
    order = sorted(range(len(trials)), key=lambda i: trials[i].kl)
    return [plans[i] for i in order], trials
