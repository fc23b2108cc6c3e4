"""The latent of an MLA layer: what its down-projection keeps of the G heads' non-rotary keys and values, and how
each head reads them back (`conversion/mla/layer.py`).

Exact where the latent is as wide as its targets. Narrower, it is the leading principal components of the target
activations on calibration text, in the metric the layer is judged by: a key's error by what its queries read of
it (the scores), a value's by what o_proj makes of it (the output); keys and values then weighted to equal energy
(TransMLA's BKV).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Latent:
    """The latent of one layer: c = down @ x from the stacked targets, targets ~ up @ c. Rows of the targets: the
    G heads' non-rotary key dimensions (G x nope_dim), then their values (G x d)."""

    down: torch.Tensor  # (kv_rank, targets)
    up: torch.Tensor  # (targets, kv_rank)


def latent_from_covariance(
    targets: torch.Tensor,
    covariance: torch.Tensor | None,
    kv_rank: int,
    n_keys: int,
    metric: torch.Tensor | None = None,
) -> Latent:
    """The latent of `targets` (the stacked target rows of the projection, (T, hidden), its first `n_keys` the
    keys'): every target where kv_rank holds them all, else the leading principal components of the target
    activations under `covariance` (of the layer's inputs, (hidden, hidden)), measured in `metric` ((T, T),
    invertible: the error of a target vector t is |metric (t' - t)|; None: the identity), keys and values weighted to
    equal energy first (TransMLA's BKV)."""
    n_targets = targets.shape[0]
    if kv_rank >= n_targets:
        eye = torch.eye(n_targets, dtype=targets.dtype)
        pad = torch.zeros(kv_rank - n_targets, n_targets, dtype=targets.dtype)
        return Latent(torch.cat([eye, pad]), torch.cat([eye, pad.T], dim=1))
    if covariance is None:
        raise ValueError("a latent narrower than its targets needs calibration activations")
    metric = torch.eye(n_targets, dtype=targets.dtype) if metric is None else metric.to(targets.dtype)
    measured = metric @ targets
    energy = torch.einsum("th,hk,tk->t", measured, covariance, measured)
    key_energy, value_energy = energy[:n_keys].sum(), energy[n_keys:].sum()
    balance = torch.ones(n_targets, dtype=targets.dtype)
    if n_keys and key_energy > 1e-12 * value_energy:  # keys all but zero (all rotary) are not scaled up
        balance[:n_keys] = torch.sqrt(value_energy / key_energy)
    weight = balance[:, None] * metric  # (T, T): targets to the space where the error is measured
    weighted = weight @ targets
    eigenvalues, vectors = torch.linalg.eigh(weighted @ covariance @ weighted.T)
    basis = vectors[:, eigenvalues.argsort(descending=True)[:kv_rank]]  # (T, R), orthonormal
    return Latent(basis.T @ weight, torch.linalg.solve(weight, basis))


def root(gram: torch.Tensor) -> torch.Tensor:
    """The symmetric square root of a positive semi-definite `gram`, its eigenvalues floored at 1e-6 of the
    largest (so that it inverts)."""
    values, vectors = torch.linalg.eigh(gram)
    values = values.clamp_min(1e-6 * values.max().clamp_min(1e-300))
    return (vectors * values.sqrt()) @ vectors.T


def target_metric(
    q: torch.Tensor, o: torch.Tensor, covariance: torch.Tensor, num_heads: int, nope: list[torch.Tensor]
) -> torch.Tensor:
    """The metric the latent's error is measured in ((T, T), block diagonal, rows as `Latent`'s): a K/V head's
    non-rotary key dimensions by what its queries read of them (the root of the queries' second moment on those
    dimensions: the error of the scores), its values by what o_proj makes of them (the root of its columns' Gram
    matrix: the error of the layer's output). q: (H*d, hidden), o: (hidden, H*d); `nope[g]` K/V head g's
    dimensions in the latent."""
    H, G, d = num_heads, len(nope), q.shape[0] // num_heads
    rep = H // G
    q, o = q.double().view(H, d, -1), o.double().view(-1, H, d)
    blocks = []
    for g in range(G):
        heads = range(g * rep, (g + 1) * rep)
        if len(nope[g]):
            reads = sum(q[h, nope[g]] @ covariance @ q[h, nope[g]].T for h in heads)
            blocks.append(root(reads))
    for g in range(G):
        heads = range(g * rep, (g + 1) * rep)
        blocks.append(root(sum(o[:, h].T @ o[:, h] for h in heads)))
    return torch.block_diag(*blocks)
