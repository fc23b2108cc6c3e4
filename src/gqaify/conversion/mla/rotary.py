"""The rotary part of an MLA layer: which K/V head's rotary pair each dimension of the shared rotary key carries, in
every layer, at the one list of frequencies DeepSeek-V3's class takes for the whole model.

The shared key has F slots (rope_dim = 2F; in rotate_half, slot j is dimensions j and F + j), each turning at one
source pair's frequency (`RotaryLayout.pairs`, the model's list). In each layer, each slot carries one K/V head's
pair at that frequency (`RotaryLayout.heads`): a frequency listed n times is kept by n heads of every layer, but
which heads may change from layer to layer, and a head may keep more pairs than another. A head's pairs not kept
lose their rotation and join the latent.

    exact      every pair of every head: the G heads' blocks side by side, the same in every layer
    chosen     the F (head, pair) choices that carry most of the attention scores on calibration text (MHA2MLA's
               norm product, weighed by what dropping a pair's rotation costs over a window): the list of
               frequencies by greedy marginal gain over the layers (optimal, since each frequency's gain is concave
               in how often it is listed), then in each layer each listed frequency given to the heads that score
               most on it.
    ladder     the pairs 0, c, 2c, ... for every head: one base's ladder from 1, the only frequencies llama.cpp's MLA
               (`deepseek2`) turns (it reads no per-pair factors); turned (below), one slot per frequency of the
               ladder, each carrying that frequency's best component in each layer, so no frequency repeats

Turned across heads (TransMLA's RoRoPE, `across_heads`): an orthogonal G x G mixing of the G heads' pairs of one
frequency commutes with the rotation, so in each layer and at each frequency the keys' pairs are first mixed into
their principal components on calibration text, and the slots carry components instead of heads: one component
can hold most of what G heads' pairs of a frequency hold. A query head then reads every kept component of its
frequency, weighted by its own head's share in it, and each head's key keeps, unrotated in the latent, what the
kept components leave of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gqaify.errors import UserError

# The rope types whose frequencies are fixed (one list for every length): the rewrite lists them per pair.
STATIC_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RotaryLayout:
    """Slot j of the shared rotary key turns at source pair `pairs[j]`'s frequency and carries, in layer l, K/V head
    `heads[l, j]`'s pair `pairs[j]` (slots of one frequency are distinct heads); with `mixing`, component
    `heads[l, j]` of the heads' pairs `pairs[j]` mixed (see the module docstring)."""

    pairs: torch.Tensor  # (F,), source pair per slot: the model's list of frequencies
    heads: torch.Tensor  # (layers, F), the K/V head (or, mixed, the component) each slot carries in each layer
    # (layers, d/2, G, G), orthogonal: column c of [l, p] is component c's weights on the G heads' pairs p
    mixing: torch.Tensor | None = None

    def kept(self, layer: int, head: int) -> list[int]:
        """The pairs K/V head (or component) `head` keeps rotary in `layer`, sorted."""
        return sorted(self.pairs[self.heads[layer] == head].tolist())

    def dropped(self, layer: int, head: int, head_dim: int) -> torch.Tensor:
        """K/V head `head`'s dimensions the latent holds in `layer` (all of a pair's whose rotation it does not keep
        whole), in order."""
        half = head_dim // 2
        if self.mixing is None:
            kept = set(self.kept(layer, head))
        else:  # what the kept components leave of each head's pair: nothing only where all G are kept
            counts = torch.bincount(self.pairs, minlength=half).tolist()
            kept = {pair for pair, count in enumerate(counts) if count == self.mixing.shape[-1]}
        pairs = [j for j in range(half) if j not in kept]
        return torch.tensor(pairs + [j + half for j in pairs], dtype=torch.long)

    def basis(self, layer: int, kv_groups: int, head_dim: int) -> torch.Tensor:
        """(rope_dim, G, d), float64: each rotary dimension of `layer` (rotate_half order) as weights on the G heads'
        key dimensions; its rows are orthonormal."""
        F, half = len(self.pairs), head_dim // 2
        if self.mixing is None:
            weights = torch.nn.functional.one_hot(self.heads[layer], kv_groups).double()
        else:
            weights = self.mixing[layer, self.pairs, :, self.heads[layer]].double()  # (F, G)
        basis = torch.zeros(2 * F, kv_groups, head_dim, dtype=torch.float64)
        slots = torch.arange(F)
        basis[slots, :, self.pairs] = weights
        basis[slots + F, :, self.pairs + half] = weights
        return basis

    def nope_dim(self, kv_groups: int, head_dim: int) -> int:
        """A query head's non-rotary key dimensions: the most any K/V head leaves to the latent in any layer (heads
        that leave fewer leave the rest of theirs zero)."""
        return max(len(self.dropped(layer, g, head_dim)) for layer in range(len(self.heads)) for g in range(kv_groups))

    def per_layer(self, kv_groups: int) -> list[list[list[int]]]:
        """Per layer, per K/V head (or component), its pairs kept (gqaify.json's record)."""
        return [[self.kept(layer, g) for g in range(kv_groups)] for layer in range(len(self.heads))]

    @classmethod
    def same_in_every_layer(cls, pairs: torch.Tensor, layers: int) -> RotaryLayout:
        """Each K/V head g keeping `pairs[g]` ((G, p)) in every layer: the heads' blocks side by side."""
        G, p = pairs.shape
        heads = torch.arange(G).repeat_interleave(p)
        return cls(pairs.reshape(-1).clone(), heads.expand(layers, G * p).clone())


def choose_layout(
    scores: torch.Tensor | None,
    kv_groups: int,
    head_dim: int,
    pairs: int,
    layers: int,
    ladder: bool = False,
    turned: bool = False,
) -> RotaryLayout:
    """The layout keeping `pairs` x G (head, pair) choices: every pair where that is all of them, else the ones that
    score most (`scores`, (layers, G, d/2), weighed by `rotation_weight`; see the module docstring); with `ladder`,
    the spacing c whose pairs 0, c, 2c, ... score most, in every head, or (`turned`: `scores` per component) one
    slot per pair of the ladder, each the pair's best component in each layer."""
    half, G = head_dim // 2, kv_groups
    if pairs == half and not (ladder and turned):
        return RotaryLayout.same_in_every_layer(torch.arange(half).expand(G, half), layers)
    if scores is None:
        raise ValueError("choosing fewer rotary pairs than a head has needs their scores")
    if ladder:
        slots = pairs * G if turned else pairs
        if slots > half:
            raise UserError(
                f"llama.cpp's deepseek2 turns one ladder of distinct frequencies: a rotary key of {2 * slots} values "
                f"from {G} K/V heads repeats some of the {half} a head has; ask at most --rope-dims {2 * half}"
            )
        spacings = range(1, (half - 1) // max(slots - 1, 1) + 1)
        total = scores.amax(1).sum(0) if turned else scores.sum((0, 1))
        chosen = max((torch.arange(slots) * c for c in spacings), key=lambda kept: total[kept].sum())
        if turned:
            return RotaryLayout(chosen, scores[:, :, chosen].argmax(1))
        return RotaryLayout.same_in_every_layer(chosen.expand(G, pairs), layers)
    ranked = scores.sort(dim=1, descending=True).values.sum(0)  # (G, half): the n-th best head's score, over layers
    counts = torch.zeros(half, dtype=torch.long)
    for _ in range(pairs * G):  # the list of frequencies, by greedy marginal gain
        gain = torch.where(counts < G, ranked[counts.clamp(max=G - 1), torch.arange(half)], -torch.inf)
        counts[int(gain.argmax())] += 1
    listed = torch.arange(half).repeat_interleave(counts)
    heads = torch.empty(layers, len(listed), dtype=torch.long)
    for layer in range(layers):
        for pair in counts.nonzero().flatten().tolist():
            slots = (listed == pair).nonzero().flatten()
            heads[layer, slots] = scores[layer, :, pair].topk(int(counts[pair])).indices.sort().values
    return RotaryLayout(listed, heads)


def across_heads(
    key_moments: torch.Tensor, query_moments: torch.Tensor, kv_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each frequency's principal components across the G heads (TransMLA's RoRoPE): (mixing, (d/2, G, G), column c
    component c; the components' scores, (G, d/2), as `pair_scores` scores heads). key_moments: (d/2, G, G), the
    keys' pairs' second moments between heads (a pair's two dimensions summed); query_moments: (H, d/2), each query
    head's pairs' second moment. A component's score is its root mean square times its queries': each query head's,
    weighted by its own head's share in the component."""
    values, vectors = torch.linalg.eigh(key_moments)  # ascending
    values, mixing = values.flip(-1).clamp_min(0), vectors.flip(-1)
    H = query_moments.shape[0]
    queries = query_moments.clamp_min(0).sqrt().view(kv_groups, H // kv_groups, -1).sum(1)  # (G, d/2)
    reads = torch.einsum("pgc,gp->cp", mixing.abs(), queries)
    return mixing, values.sqrt().T * reads


def pair_moments(
    q: torch.Tensor, k: torch.Tensor, covariance: torch.Tensor, num_heads: int, kv_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the keys' pairs' second moments between heads, (d/2, G, G); each query head's pairs', (H, d/2)) of inputs
    with second moment `covariance`. q: (H*d, hidden), k: (G*d, hidden)."""
    hidden = covariance.shape[0]
    q, k = q.double().view(num_heads, -1, hidden), k.double().view(kv_groups, -1, hidden)
    half = k.shape[1] // 2
    keys = torch.einsum("gjh,hi,fji->jgf", k, covariance, k)
    queries = torch.einsum("ajh,hi,aji->aj", q, covariance, q)
    return keys[:half] + keys[half:], queries[:, :half] + queries[:, half:]


def source_frequencies(config) -> torch.Tensor:
    """The source's rotary frequencies, one per pair (d/2), as its own transformers class computes them.

    Raises:
        UserError: a rope type whose frequencies change with the length or that scales the scores.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = getattr(config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    if kind not in STATIC_ROPE:
        raise UserError(
            f"rope_type {kind!r} changes its frequencies with the length; an MLA rewrite lists fixed ones "
            f"({', '.join(STATIC_ROPE)}): convert a model with one of those"
        )
    if kind == "default":
        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    if scaling != 1.0:
        raise UserError(f"rope_type {kind!r} scales the attention scores by {scaling}; an MLA rewrite cannot")
    return inv_freq.double()


def rope_parameters(frequencies: torch.Tensor, base: float, positions: int) -> dict:
    """DeepSeek-V3's `rope_parameters` for these per-pair frequencies: the default ladder of `base` where they are
    it, else `longrope` with one factor per pair (short and long the same, no attention factor)."""
    dim = 2 * len(frequencies)
    ladder = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if torch.allclose(frequencies, ladder, rtol=1e-6, atol=0):
        return {"rope_type": "default", "rope_theta": base}
    factors = (1.0 / (frequencies * base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))).tolist()
    return {
        "rope_type": "longrope",
        "rope_theta": base,
        "short_factor": factors,
        "long_factor": factors,
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": positions,
    }


def rotation_weight(frequencies: torch.Tensor, distance: int) -> torch.Tensor:
    """What dropping each pair's rotation costs a score of unit size, (d/2,): 1 - cos(theta x delta), averaged over
    the distances delta from 0 to `distance`. A pair that turns slowly barely changes over a window, so its
    rotation can go at little cost however large its norms are (where MHA2MLA's norm criterion alone would keep
    it): SmolLM2 keeping 16 of each head's 32 pairs, with the whole latent, was 2.42 nats/token of KL from its parent
    on WikiText-2 with the norms alone, 0.061 with their product with this weight (1,024 tokens, windows of 512)."""
    deltas = torch.arange(distance, dtype=torch.float64)
    return 1 - torch.cos(frequencies[:, None] * deltas[None, :]).mean(dim=1)


def pair_scores(q: torch.Tensor, k: torch.Tensor, num_heads: int, kv_groups: int) -> torch.Tensor:
    """How much each rotary pair of each K/V head contributes to the scores, (G, d/2): over calibration tokens, the
    mean norm of the pair in the head's queries times its mean norm in its key (MHA2MLA's 2-norm criterion; a
    pair's norm does not depend on the rotation). q: (tokens, H, d), k: (tokens, G, d)."""
    half = q.shape[-1] // 2

    def pair_norms(x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x[..., :half] ** 2 + x[..., half:] ** 2).mean(0)

    return pair_norms(q).view(kv_groups, num_heads // kv_groups, half).sum(1) * pair_norms(k)
