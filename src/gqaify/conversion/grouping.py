"""Which source K/V heads share a new head: contiguous (as the checkpoint has them) or by similarity.

`similarity` grouping clusters a layer's K/V heads into G groups of equal size by how well their keys and
values agree once aligned (`fit.similarity`), then reorders the heads inside the layer so that each group is
contiguous. The reorder moves whole heads: K/V heads, and with each K/V head the query heads that read it
(q_proj rows, Q norms, o_proj columns). Attention sums its heads, so the reordered layer computes exactly
what the original did, and the saved checkpoint keeps transformers' contiguous `repeat_kv` reading.
"""

from __future__ import annotations

import itertools

import torch

import gqaify.conversion.fit as fit
from gqaify.conversion.layout import Attention


def similar_order(attn: Attention, num_groups: int, rotary_dim: int, second_moment: torch.Tensor) -> list[int]:
    """The source K/V heads in group order: groups of KV/G heads that agree most, each contiguous."""
    layer = fit.LayerRows(attn, rotary_dim, second_moment)
    keys = fit.similarity(layer.key_blocks(), layer.c)
    values = fit.similarity([layer.values()[None]], layer.c)
    return balanced_groups((keys + values) / 2, num_groups)


def balanced_groups(similarity: torch.Tensor, num_groups: int) -> list[int]:
    """Split heads into `num_groups` equal groups with high total within-group similarity; their order.

    Greedy, then local search: each group starts from the most similar free pair and grows by the free head
    most similar to its members on average; then any swap of two heads between groups that raises the total
    is made, best first, until none does. Deterministic; groups are listed by their smallest head.
    """
    count = similarity.shape[0]
    size = count // num_groups
    if size == 1 or num_groups == 1:
        return list(range(count))
    sim = similarity.double().clone()
    sim.fill_diagonal_(0)
    free = list(range(count))
    groups: list[list[int]] = []
    while free:
        a, b = max(itertools.combinations(free, 2), key=lambda p: sim[p[0], p[1]].item())
        members = [a, b]
        while len(members) < size:
            members.append(max((h for h in free if h not in members), key=lambda h: sim[h, members].mean().item()))
        groups.append(members)
        free = [h for h in free if h not in members]

    def gain(g1: list[int], g2: list[int], a: int, b: int) -> float:  # swapping a (in g1) with b (in g2)
        rest1, rest2 = [h for h in g1 if h != a], [h for h in g2 if h != b]
        return (sim[b, rest1].sum() + sim[a, rest2].sum() - sim[a, rest1].sum() - sim[b, rest2].sum()).item()

    for _ in range(count * count):
        best, move = 1e-12, None
        for i, j in itertools.combinations(range(len(groups)), 2):
            for a in groups[i]:
                for b in groups[j]:
                    if (g := gain(groups[i], groups[j], a, b)) > best:
                        best, move = g, (i, j, a, b)
        if move is None:
            break
        i, j, a, b = move
        groups[i][groups[i].index(a)], groups[j][groups[j].index(b)] = b, a
    return [h for members in sorted(sorted(g) for g in groups) for h in members]


def permute(attn: Attention, order: list[int]) -> Attention:
    """The layer with its K/V heads in `order`, each followed by the query heads that read it."""
    kv_index = torch.tensor(order)
    per_kv = attn.queries["q.weight"].shape[0] // len(order)
    q_index = (kv_index[:, None] * per_kv + torch.arange(per_kv)).flatten()
    return Attention(
        {key: t[kv_index] for key, t in attn.kv.items()},
        {key: t[q_index] for key, t in attn.queries.items()},
    )
