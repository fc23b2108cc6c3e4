"""An MLA model brought back to its parent layer by layer, on calibration windows: what the PCA latent lost.

Each decoder layer of the MLA model, in order, takes the MLA model's own stream (the layers below it already fitted)
and is brought to the parent decoder layer's output on the parent's stream, as `repair` does for GQA:

    values     each query head's value rows of kv_b_proj refitted by least squares so that the head's attention
               output matches the parent head's (linear in them, given the MLA layer's own attention weights)
    o_proj     refitted by least squares so that the MLA attention's output matches the parent attention's, shrunk
               towards the current o_proj by the ridge strength that predicts the held-out windows best
    refine     Adam steps on the attention's projections minimising the whole layer's squared error against the
               parent layer's output, one window a step; kept only where the held-out windows say it helped

The latent's rows of `kv_a_proj_with_mqa` are held below its norm's epsilon (`mla/layer.py`), tens of millions of times
smaller than the rotary rows beside them; Adam moves every weight by about its learning rate, which would throw them
out of that range at once. So they train here through `RowScale`, a parametrization that lets Adam see them at the
rotary rows' scale (`preconditioned`); uptraining holds them as converted (`latent_projections`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.utils import parametrize

from gqaify.conversion.mla.written import latent_below_epsilon
from gqaify.conversion.repair import holdout
from gqaify.kl import kl_sum
from gqaify.progress import progress_bar

LOG = logging.getLogger(__name__)

_SHRINKS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # ridge strengths tried for o_proj, relative to its inputs' mean energy


class RowScale(nn.Module):
    """weight = stored x scale per row: what the optimizer sees is the weight divided by `scale`."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        return stored * self.scale[:, None].to(stored.dtype)

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.scale[:, None].to(weight.dtype)


def preconditioned(model) -> list[nn.Module]:
    """Every MLA layer's `kv_a_proj_with_mqa` of `model` given a `RowScale` that brings its latent rows to its rotary
    rows' scale (the modules changed: `parametrize.remove_parametrizations(m, "weight")` undoes it)."""
    changed = []
    for layer in model.model.layers:
        attn = layer.self_attn
        proj = getattr(attn, "kv_a_proj_with_mqa", None)
        if proj is None or parametrize.is_parametrized(proj, "weight"):
            continue
        rank = attn.kv_lora_rank
        if (ratio := _latent_ratio(proj.weight, rank)) >= 1e-2:
            continue  # a latent at the scale of its neighbours needs nothing
        scale = torch.ones(proj.weight.shape[0], device=proj.weight.device)
        scale[:rank] = ratio
        parametrize.register_parametrization(proj, "weight", RowScale(scale))
        changed.append(proj)
    return changed


def latent_projections(model) -> list[str]:
    """The parameter names of `model`'s MLA down-projections when it is gqaify's MLA rewrite (read from the config,
    `latent_below_epsilon`, so a model on the meta device answers too): uptraining holds them, since AdamW moves
    each weight by about its learning rate, which would throw a latent row of 1e-8 out of the range where the norm
    is linear at the first step."""
    if not latent_below_epsilon(model.config):
        return []
    return [f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight" for i in range(model.config.num_hidden_layers)]


def _latent_ratio(weight: torch.Tensor, rank: int) -> float:
    """The latent rows' RMS over the rotary rows' (inf where either is zero or absent)."""
    with torch.no_grad():
        rows = weight.float().pow(2).mean(dim=1).sqrt()
        latent, rotary = rows[:rank].mean(), rows[rank:].mean() if len(rows) > rank else torch.tensor(0.0)
    return float(latent / rotary) if latent > 0 and rotary > 0 else float("inf")


def _positions(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the positions, the causal mask) of a window of hidden states (1, tokens, hidden), on its device."""
    length, dtype = hidden.shape[1], hidden.dtype
    mask = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype, device=hidden.device).triu(1)
    return torch.arange(length, device=hidden.device)[None], mask[None, None]


def _layer(layer, hidden: torch.Tensor, rotary) -> torch.Tensor:
    positions, mask = _positions(hidden)
    out = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary(hidden, positions))
    return out[0] if isinstance(out, tuple) else out


def _attention(layer, hidden: torch.Tensor, rotary) -> torch.Tensor:
    positions, mask = _positions(hidden)
    normed = layer.input_layernorm(hidden)
    return layer.self_attn(normed, position_embeddings=rotary(hidden, positions), attention_mask=mask)[0]


@torch.no_grad()
def _refit_o_proj(layer, parent_layer, mla_in, parent_in, rotary, parent_rotary, held) -> None:
    """o_proj by ridge least squares towards its current value, the strength the held-out windows choose."""
    o_proj = layer.self_attn.o_proj
    captured = []
    handle = o_proj.register_forward_pre_hook(lambda module, args: captured.append(args[0].flatten(0, 1).double()))
    try:
        targets = [_attention(parent_layer, x, parent_rotary).flatten(0, 1).double() for x in parent_in]
        for x in mla_in:
            _attention(layer, x, rotary)
    finally:
        handle.remove()
    fit = [i for i, h in enumerate(held) if not h]
    z = torch.cat([captured[i] for i in fit])
    y = torch.cat([targets[i] for i in fit])
    current = o_proj.weight.double()
    gram, cross = z.T @ z, z.T @ y
    energy = gram.diagonal().mean()
    best, best_error = current, _error(current, captured, targets, held)
    for shrink in _SHRINKS:
        ridge = shrink * energy * torch.eye(len(gram), dtype=gram.dtype, device=gram.device)
        candidate = torch.linalg.solve(gram + ridge, cross + ridge @ current.T).T
        if (error := _error(candidate, captured, targets, held)) < best_error:
            best, best_error = candidate, error
    o_proj.weight.copy_(best.to(o_proj.weight.dtype))


@torch.no_grad()
def _refit_values(layer, parent_layer, mla_in, parent_in, rotary, parent_rotary, held) -> None:
    """Each query head's value rows of `kv_b_proj` by ridge least squares, so that the head's attention output
    (o_proj's input) matches the parent head's: given the MLA layer's own attention weights A and latent c, a head's
    output A c W^T is linear in its value rows W. The strength is the one the held-out windows choose."""
    attn, parent_attn = layer.self_attn, parent_layer.self_attn
    H, R, nope, dv = attn.num_heads, attn.kv_lora_rank, attn.qk_nope_head_dim, attn.v_head_dim
    latents, parent_outputs = [], []
    hooks = [
        attn.kv_a_layernorm.register_forward_hook(lambda module, args, out: latents.append(out[0].double())),
        parent_attn.o_proj.register_forward_pre_hook(lambda module, args: parent_outputs.append(args[0][0].double())),
    ]
    implementation = attn.config._attn_implementation
    attn.config._attn_implementation = "eager"  # its attention weights
    designs = []
    try:
        for x in parent_in:
            _attention(parent_layer, x, parent_rotary)
        for x in mla_in:
            positions, mask = _positions(x)
            weights = attn(layer.input_layernorm(x), position_embeddings=rotary(x, positions), attention_mask=mask)[1]
            designs.append(weights[0].double() @ latents[-1])  # (H, tokens, R): A c per head
    finally:
        attn.config._attn_implementation = implementation
        for hook in hooks:
            hook.remove()
    targets = [y.view(y.shape[0], H, dv).transpose(0, 1) for y in parent_outputs]  # (H, tokens, dv)
    kv_b = attn.kv_b_proj.weight.view(H, nope + dv, R)
    fit = [i for i, h in enumerate(held) if not h]
    check = [i for i, h in enumerate(held) if h] or fit
    for h in range(H):
        z = torch.cat([designs[i][h] for i in fit])
        y = torch.cat([targets[i][h] for i in fit])
        current = kv_b[h, nope:].double()  # (dv, R)
        gram, cross = z.T @ z, z.T @ y
        energy = gram.diagonal().mean()

        held_z, held_y = [designs[i][h] for i in check], [targets[i][h] for i in check]
        best, best_error = current, _error(current, held_z, held_y, [True] * len(check))
        for shrink in _SHRINKS:
            ridge = shrink * energy * torch.eye(R, dtype=gram.dtype, device=gram.device)
            candidate = torch.linalg.solve(gram + ridge, cross + ridge @ current.T).T
            if (e := _error(candidate, held_z, held_y, [True] * len(check))) < best_error:
                best, best_error = candidate, e
        kv_b[h, nope:] = best.to(kv_b.dtype)


def _error(weight, inputs, targets, held) -> float:
    chosen = [i for i, h in enumerate(held) if h] or range(len(inputs))
    return sum(((inputs[i] @ weight.T - targets[i]) ** 2).sum().item() for i in chosen)


def _refine(layer, mla_in, parent_out, rotary, held, steps: int, lr: float) -> None:
    """`steps` Adam steps on the layer's attention against the parent layer's output; undone if the held-out
    windows do not improve."""
    attn = layer.self_attn
    params = [p for name, p in attn.named_parameters() if "layernorm" not in name]
    fit = [i for i, h in enumerate(held) if not h]
    check = [i for i, h in enumerate(held) if h] or fit

    def held_error() -> float:
        with torch.no_grad():
            return sum(((_layer(layer, mla_in[i], rotary) - parent_out[i]) ** 2).mean().item() for i in check)

    before = held_error()
    saved = {name: t.detach().clone() for name, t in attn.state_dict().items()}
    optimizer = torch.optim.Adam(params, lr=lr)
    for step in range(steps):
        i = fit[step % len(fit)]
        target = parent_out[i]
        loss = ((_layer(layer, mla_in[i], rotary) - target) ** 2).mean() / target.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if held_error() >= before:
        attn.load_state_dict(saved)


def held_out_kl(reference, model, windows: list[torch.Tensor]) -> float:
    """The mean KL per token of `model`'s next-token distribution to `reference`'s, over the token windows (both
    models on one device, where it runs)."""
    return held_out_kls(reference, [model], windows)[0]


def held_out_kls(reference, models: list, windows: list[torch.Tensor]) -> list[float]:
    """`held_out_kl` of each of `models`, the reference's distribution computed once a window for all of them."""
    totals, count = [0.0] * len(models), 0
    with torch.no_grad():
        for window in windows:
            ids = window[None].to(models[0].device)
            expected = torch.log_softmax(reference(ids).logits[0].double(), dim=-1)
            for i, model in enumerate(models):
                got = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
                totals[i] += kl_sum(got, expected).item()
            count += len(window)
    return [total / count for total in totals]


def held_out(windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The windows the fit judges by and does not fit on (`repair.holdout`; all of them where there is one)."""
    return [w for w, h in zip(windows, holdout(len(windows)), strict=True) if h] or windows


def fit_mla(mla, parent, windows: list[torch.Tensor], steps: int, lr: float = 1e-3, progress: bool = True) -> bool:
    """`mla` (float32) fitted to `parent`, layer by layer, on the token windows `windows` (1-D each); kept only if
    the whole model comes closer to the parent on the held-out windows (its next-token KL), else undone: each
    layer's steps are judged on that layer's output, which does not always add up over the layers. It runs on the
    device the two models are on. Returns whether the fit was kept (`fit_and_judge` says its KL too)."""
    return fit_and_judge(mla, parent, windows, steps, lr, progress)[0]


def fit_and_judge(
    mla, parent, windows: list[torch.Tensor], steps: int, lr: float = 1e-3, progress: bool = True
) -> tuple[bool, float]:
    """`fit_mla`: whether the fit was kept, and the KL to the parent on the held-out windows (`held_out`) of the
    model as it leaves it, fitted or as it was, which a caller comparing fits need not measure again."""
    mla.train(False)
    parent.train(False)
    windows = [w.to(mla.device) for w in windows]  # it runs where the models are
    held, check = holdout(len(windows)), held_out(windows)
    unfitted = {name: t.detach().clone() for name, t in mla.state_dict().items()}
    before = held_out_kl(parent, mla, check)
    changed = preconditioned(mla)
    with torch.no_grad():
        mla_in = [mla.model.embed_tokens(w[None]) for w in windows]
        parent_in = [parent.model.embed_tokens(w[None]).float() for w in windows]
    rotary, parent_rotary = mla.model.rotary_emb, parent.model.rotary_emb
    layers = list(zip(mla.model.layers, parent.model.layers, strict=True))
    for layer, parent_layer in progress_bar(layers, desc="fitting MLA layers", unit="layer", shown=progress):
        with torch.no_grad():
            parent_out = [_layer(parent_layer, x, parent_rotary) for x in parent_in]
        _refit_values(layer, parent_layer, mla_in, parent_in, rotary, parent_rotary, held)
        _refit_o_proj(layer, parent_layer, mla_in, parent_in, rotary, parent_rotary, held)
        if steps:
            with torch.enable_grad():
                _refine(layer, mla_in, parent_out, rotary, held, steps, lr)
        with torch.no_grad():
            mla_in = [_layer(layer, x, rotary) for x in mla_in]
        parent_in = parent_out
    for proj in changed:
        parametrize.remove_parametrizations(proj, "weight", leave_parametrized=True)
    after = held_out_kl(parent, mla, check)
    if after >= before:
        mla.load_state_dict(unfitted)
        LOG.warning(
            "the layer-by-layer fit took the MLA model further from its parent on the held-out calibration windows "
            "(KL %.3f -> %.3f nats/token): it is kept as the PCA made it",
            before,
            after,
        )
        return False, before
    LOG.info(
        "fitted %d MLA layers on %d calibration windows: KL %.3f -> %.3f", len(layers), len(windows), before, after
    )
    return True, after
