"""The linear algebra of merging heads on calibration statistics: alignment, shared factors, fit error.

Everything is expressed through C = E[x xᵀ], the second moment of a layer's attention input over the
calibration tokens (see `calibrate.py`): for projections W₁, W₂ the data inner product of their outputs is
W₁ C W₂ᴴ, so no activation is ever kept. A projection with a bias is handled as one more input column
against the constant input 1 (`augment`).

RoPE blocks. A rotation folded into a key head must commute with RoPE. RoPE turns dimension pair
(j, j + r/2) of the first r = rotary_dim dimensions (transformers' rotate_half layout) by an angle that
depends on position: on the complex number z_j = k_j + i·k_{j+r/2} it is a multiplication by e^{iθ_j·pos}.
So a key head splits into blocks that any transform of the right kind commutes with:

    r/2 rotary pairs    each one complex row:  transforms are complex scalars (a 2×2 rotation and scale)
    d - r other dims    one real block:        any real d-r × d-r transform

A value head is one real block of d rows. A score is Re(qᴴ z) summed over blocks, so a key transform T
(z ≈ T z') is undone by q' = Tᴴ q in the query's rows; a value transform by O' = O T in o_proj's columns.

Block tensors are shaped (B, S, m, n): B independent blocks (the rotary pairs of a head, or 1), S heads,
m rows per block, n inputs. Consumer metrics K, shaped (B, S, m, m), weigh errors in each head's output by
how its readers use it: Σ U C Uᴴ over the query rows U that read a key head, Σ Oᵀ O over the o_proj
columns O that read a value head.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gqaify.conversion.layout import Attention

Tensor = torch.Tensor
_EPS = 1e-10  # relative size below which an eigen- or singular value counts as zero
_MAX_SPREAD = 4.0  # how far a shared head's output sizes may stray from the group's mean (`shared_factor`)


def augment(weight: Tensor, bias: Tensor | None) -> Tensor:
    """(n, d, hidden) weight and (n, d) bias -> (n, d, hidden + 1): the bias as the column of input 1."""
    return weight if bias is None else torch.cat([weight, bias.unsqueeze(-1)], dim=-1)


def key_blocks(rows: Tensor, rotary_dim: int) -> list[Tensor]:
    """(S, d, n) key or query rows -> RoPE blocks: [(r/2, S, 1, n) complex pairs, (1, S, d - r, n) real]."""
    half = rotary_dim // 2
    blocks = []
    if half:
        pairs = torch.complex(rows[:, :half], rows[:, half:rotary_dim])  # (S, r/2, n)
        blocks.append(pairs.transpose(0, 1).unsqueeze(2))
    if rotary_dim < rows.shape[1]:
        blocks.append(rows[:, rotary_dim:].unsqueeze(0))
    return blocks


def from_key_blocks(blocks: list[Tensor], rotary_dim: int) -> Tensor:
    """Inverse of `key_blocks`."""
    parts, rest = [], blocks
    if rotary_dim // 2:
        pairs = blocks[0].squeeze(2).transpose(0, 1)  # (S, r/2, n)
        parts, rest = [pairs.real, pairs.imag], blocks[1:]
    return torch.cat(parts + [block.squeeze(0) for block in rest], dim=1)


def cross(a: Tensor, c: Tensor | None, b: Tensor) -> Tensor:
    """a C bᴴ for blocks a (..., m, n), b (..., p, n): (..., m, p); C None is the identity."""
    return (a if c is None else a @ c.to(a.dtype)) @ b.mH


def _gram(w: Tensor, c: Tensor) -> Tensor:
    """(N, S, m, n) -> (N, S·m, S·m): the data inner products of all rows of all heads."""
    flat = w.flatten(1, 2)
    return cross(flat, c, flat)


def _psd_sqrt(k: Tensor) -> Tensor:
    values, vectors = torch.linalg.eigh(k)
    return (vectors * values.clamp_min(0).sqrt().unsqueeze(-2)) @ vectors.mH


def _scale(w: Tensor, c: Tensor) -> Tensor:
    """(N,) root mean square of the rows' outputs over the heads of each group."""
    energy = torch.diagonal(_gram(w, c), dim1=-2, dim2=-1).real  # (N, S·m)
    return energy.mean(-1).sqrt()


def align(w: Tensor, c: Tensor, consumers: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Rotate every head of each group onto the group's first head, then average.

    For each head h the rotation R_h (orthogonal; a unit complex number per rotary pair) maximises the
    data agreement Re tr(R_h W_h C W_0ᴴ): the orthogonal Procrustes solution R_h = V Uᴴ of the SVD
    W_h C W_0ᴴ = U Σ Vᴴ. Then W' = mean_h R_h W_h and z_h = R_hᴴ (R_h z_h) ≈ R_hᴴ z'.

    Args:
        w: (N, S, m, n) groups of S heads.
        consumers: unused (the alignment is unweighted), for the signature `shared_factor` has.

    Returns:
        (W' (N, m, n), T (N, S, m, m)) with z_h ≈ T_h z'.
    """
    m = cross(w, c, w[:, :1])  # (N, S, m, m): W_h C W_0ᴴ
    u, _, vh = torch.linalg.svd(m)
    rotation = vh.mH @ u.mH  # R_h = V Uᴴ
    return (rotation @ w).mean(dim=1), rotation.mH


def shared_factor(w: Tensor, c: Tensor, consumers: Tensor) -> tuple[Tensor, Tensor]:
    """The shared projection W' and per-head transforms T_h minimising the consumer-weighted data error.

    Minimises Σ_h E_x ‖K_h^{1/2} (W_h x - T_h W' x)‖² over the group. With A the stacked W_h, G = A C Aᴴ,
    F = blockdiag(K_h^{1/2}) and the top m eigenpairs (V, Σ) of F G F, the optimum is

        W' = Σ^{-1/2} Vᴴ F A        (rows in the span of the group's rows; W' C W'ᴴ = I)
        T_h = G_{h,:} F V Σ^{-1/2}   (the least-squares map from the shared output back to head h's)

    a weighted PCA of the heads' outputs (cf. ECKVH, arXiv 2406.07056, which takes the plain SVD of the
    concatenated caches). Exact when the group's heads span at most m dimensions, e.g. duplicates; a group
    of one head is returned as it is.

    Args:
        w: (N, S, m, n) groups of S heads.
        consumers: (N, S, m, m) Hermitian PSD weights K_h.

    Returns:
        (W' (N, m, n), T (N, S, m, m)) with z_h ≈ T_h z'.
    """
    n_groups, heads, rows, _ = w.shape
    if heads == 1:  # nothing to share: the head as it is
        return w[:, 0], torch.eye(rows, dtype=w.dtype).expand(n_groups, 1, rows, rows)
    gram = _gram(w, c)  # (N, S·m, S·m)
    f = _block_diag(_psd_sqrt(consumers))  # (N, S·m, S·m)
    values, vectors = torch.linalg.eigh(f @ gram @ f)
    values, vectors = values[:, -rows:].flip(-1), vectors[:, :, -rows:].flip(-1)  # top m, largest first
    keep = values > _EPS * values[:, :1].clamp_min(torch.finfo(values.dtype).tiny)
    inv_sqrt = torch.where(keep, values.clamp_min(torch.finfo(values.dtype).tiny).rsqrt(), 0.0)  # (N, m)
    basis = f @ vectors * inv_sqrt.unsqueeze(-2)  # (N, S·m, m): F V Σ^{-1/2}
    merged = basis.mH @ w.flatten(1, 2)  # (N, m, n)
    transforms = (gram @ basis).unflatten(1, (heads, rows))  # (N, S, m, m)
    # Any invertible M gives the same fit as (M W', T M⁻¹). The natural M is T_0, which puts the shared head
    # in the coordinates of the group's first head (exact for duplicates: W' is then head 0 itself). But where
    # head 0 is poorly represented, T_0 is near singular and the other readers need huge compensation, which
    # leaves a model that uptraining breaks at once. So M = s R P', from T_0 = s R P, the polar decomposition
    # relative to the whitened W' (s the heads' mean output size, R unitary), and P' = P with its eigenvalues
    # clipped to [1/_MAX_SPREAD, _MAX_SPREAD]: T_0 itself where head 0 is an ordinary member of its group.
    scale = _scale(w, c).to(transforms.dtype)[:, None, None]
    u, sigma, vh = torch.linalg.svd(transforms[:, 0] / scale)
    sigma = sigma.clamp(1 / _MAX_SPREAD, _MAX_SPREAD).to(u.dtype)
    change = scale * u @ (sigma.unsqueeze(-1) * vh)  # s R P' = s U Σ' Vᴴ
    return change @ merged, torch.linalg.solve(change.unsqueeze(1), transforms, left=False)


def _block_diag(blocks: Tensor) -> Tensor:
    """(N, S, m, m) -> (N, S·m, S·m) block diagonal."""
    n, s, m, _ = blocks.shape
    out = blocks.new_zeros(n, s, m, s, m)
    index = torch.arange(s)
    out[:, index, :, index, :] = blocks.transpose(0, 1)
    return out.reshape(n, s * m, s * m)


def similarity(blocks: list[Tensor], c: Tensor) -> Tensor:
    """Blocks (B, S, m, n) of S heads -> (S, S): how well each pair of heads agrees once aligned.

    The cosine of heads h, g after the best rotation of each block, Σ ‖W_h C W_gᴴ‖_* / √(E_h E_g), the sum
    over all blocks and E the heads' output energies: 1 for heads equal up to rotation, near 0 for unrelated.
    """
    agreement = 0
    for w in blocks:
        _, s, m, _ = w.shape
        pairs = _gram(w, c).unflatten(1, (s, m)).unflatten(3, (s, m)).transpose(2, 3)  # (B, S, S, m, m)
        agreement = agreement + torch.linalg.matrix_norm(pairs, ord="nuc").sum(0)
    energy = torch.diagonal(agreement)
    return agreement / (energy.unsqueeze(0) * energy.unsqueeze(1)).sqrt().clamp_min(torch.finfo(c.dtype).tiny)


def trace_product(p: Tensor, k: Tensor) -> Tensor:
    """Σ over leading dims of Re tr(P K), for (..., m, m) matrices."""
    return torch.einsum("...ij,...ji->", p, k).real


def read_error(old: tuple[Tensor, Tensor], new: tuple[Tensor, Tensor], c: Tensor, reader_c: Tensor | None):
    """(squared error, squared size) of what readers get from the heads they read, summed over readers.

    `old` and `new` are (readers, rows): readers (B, H, m, n_r), one per reader (query rows, or o_proj
    columns transposed), and rows (B, H, m, n), the head each reader reads. Reader i gets the bilinear map
    Rᵢᴴ Zᵢ; its error on the data, ‖X_r (Rᵢᴴ Zᵢ - R'ᵢᴴ Z'ᵢ) Xᵀ‖², expands into traces of m × m products
    (`reader_c` is the reader side's second moment: C for queries, None (the identity) for outputs).
    """
    (r, z), (r2, z2) = old, new
    total = trace_product(cross(r, reader_c, r), cross(z, c, z))
    error = total - 2 * trace_product(cross(r2, reader_c, r), cross(z, c, z2))
    error = error + trace_product(cross(r2, reader_c, r2), cross(z2, c, z2))
    return max(error.item(), 0.0), total.item()


class LayerRows:
    """One layer's projections as float64 rows for fitting, biases as one more input column, C to match."""

    def __init__(self, attn: Attention, rotary_dim: int, second_moment: Tensor):
        self.attn = attn
        self.rotary_dim = rotary_dim
        inputs = attn.kv["k.weight"].shape[-1]
        self.biased = any(f"{part}.bias" in {**attn.kv, **attn.queries} for part in "qkv")
        self.c = second_moment.double() if self.biased else second_moment.double()[:inputs, :inputs]
        self.queries_per_kv_head = attn.queries["q.weight"].shape[0] // attn.kv["k.weight"].shape[0]

    def _rows(self, heads: dict[str, Tensor], part: str) -> Tensor:
        """(n, d, hidden [+ 1]) float64: with a bias column (zeros for a part without one) if any part has one."""
        weight = heads[f"{part}.weight"].double()
        if not self.biased:
            return weight
        bias = heads.get(f"{part}.bias")
        return augment(weight, weight.new_zeros(weight.shape[:2]) if bias is None else bias.double())

    def key_blocks(self) -> list[Tensor]:
        return key_blocks(self._rows(self.attn.kv, "k"), self.rotary_dim)

    def query_blocks(self) -> list[Tensor]:
        return key_blocks(self._rows(self.attn.queries, "q"), self.rotary_dim)

    def values(self) -> Tensor:
        """(KV, d, n)"""
        return self._rows(self.attn.kv, "v")

    def outputs(self) -> Tensor:
        """(H, hidden, d): o_proj's columns of each query head."""
        return self.attn.queries["o.weight"].double()

    def per_reader(self, blocks: Tensor) -> Tensor:
        """(B, KV, m, n) -> (B, H, m, n): the head each query head reads."""
        return blocks.repeat_interleave(self.attn.queries["q.weight"].shape[0] // blocks.shape[1], dim=1)

    def rebuild(self, keys: list[Tensor], queries: list[Tensor], values: Tensor, outputs: Tensor) -> Attention:
        """The layer with new key, query and value rows (blocks as `key_blocks` gives them) and o_proj columns."""
        kv, q = dict(self.attn.kv), dict(self.attn.queries)
        rows = {"k": (kv, from_key_blocks(keys, self.rotary_dim)), "v": (kv, values)}
        rows["q"] = (q, from_key_blocks(queries, self.rotary_dim))
        for part, (heads, t) in rows.items():  # a part without a bias keeps a zero bias column: dropped
            if self.biased:
                t, bias = t[..., :-1], t[..., -1]
                if f"{part}.bias" in heads:
                    heads[f"{part}.bias"] = bias.float()
            heads[f"{part}.weight"] = t.float()
        q["o.weight"] = outputs.float()
        return replace(self.attn, kv=kv, queries=q)
