"""Bringing a converted layer back to its parent's outputs, on the calibration windows, through the real softmax.

Both take the converted stream as input and the parent's outputs on the parent's stream as targets, so a
layer sees, and corrects, what the layers below it changed (the asymmetric calibration of GPTAQ, arXiv
2504.02692, here for merged heads rather than quantized weights). Every eighth window is held out: what is
fitted on the others is kept only if it predicts the held-out windows better, so a little (or unlike)
calibration text is not memorised, and a layer that nothing changed (G = H, duplicated heads) stays exactly
as it was.

    repair_output   closed form. The converted attention's per-head outputs (what o_proj reads) are computed
                    with its real softmax on the converted stream; o_proj is refitted by least squares so that
                    the attention's output matches the parent attention's, shrunk towards the current o_proj
                    (ridge on O - O₀) by the strength that predicts the held-out windows best.
    refine          Adam steps on the converted attention's parameters (the shared K/V and the readers' q/o
                    compensation, whatever the layout rewrites) minimising the mean squared error of the whole
                    decoder layer's output against the parent layer's: the objective the layer is judged by (cf.
                    StiefAttention, arXiv 2601.21686), for any architecture, since it needs nothing but the
                    layer's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gqaify.conversion.layer_by_layer import forward, run_until

HOLDOUT_EVERY = 8  # window i is held out when i % 8 == 7 (the last window when there are fewer than 8)
_SHRINKS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # ridge strengths tried, relative to the inputs' mean energy


def holdout(count: int) -> list[bool]:
    """Which of `count` windows are held out (none when there is only one)."""
    if count < 2:
        return [False] * count
    if count < HOLDOUT_EVERY:
        return [i == count - 1 for i in range(count)]
    return [i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 for i in range(count)]


@dataclass(frozen=True)
class RepairResult:
    applied: bool
    shrink: float | None  # the ridge strength chosen on the held-out windows; None: o_proj kept
    error_before: float  # relative squared error of the attention's output on the held-out windows
    error_after: float


class _Moments:
    """Σ h hᵀ and Σ t hᵀ over tokens: o_proj's least-squares problem."""

    def __init__(self, n: int, width: int, device: torch.device):
        self.hh = torch.zeros(n, n, dtype=torch.float64, device=device)
        self.th = torch.zeros(width, n, dtype=torch.float64, device=device)

    def add(self, h: torch.Tensor, t: torch.Tensor) -> None:
        """One window's tokens: products in float32, sums over windows in float64 (as `SecondMoment`)."""
        self.hh += (h.T @ h).double()
        self.th += (t.T @ h).double()

    def solve(self, shrink: float, towards: torch.Tensor) -> torch.Tensor:
        """argmin_O Σ ‖t - O h‖² + λ ‖O - O₀‖², λ = shrink x the mean of Σ h²."""
        ridge = shrink * self.hh.diagonal().mean().clamp_min(torch.finfo(torch.float64).tiny)
        eye = torch.eye(len(self.hh), dtype=self.hh.dtype, device=self.hh.device)
        return torch.linalg.solve(self.hh + ridge * eye, (self.th + ridge * towards).T).T


def _relative_error(windows: list[tuple[torch.Tensor, torch.Tensor]], o: torch.Tensor) -> float:
    """Σ ‖t - O h‖² / Σ ‖t‖² over `windows`, from the residuals themselves (in float64: no cancellation, so a
    layer that nothing changed reads as ~1e-14, not as the rounding of a difference of large sums)."""
    error = sum((t.double() - h.double() @ o.T).pow(2).sum() for h, t in windows)
    total = sum(t.double().pow(2).sum() for _, t in windows)
    return float(error / total.clamp_min(torch.finfo(torch.float64).tiny))


def repair_output(
    layer: torch.nn.Module,
    o_proj: torch.nn.Linear,
    hidden: list[torch.Tensor],
    kwargs: list[dict],
    targets: list[torch.Tensor],
    device: torch.device,
) -> RepairResult:
    """Refit `o_proj` (in place) so that the attention's output on `hidden` matches `targets`.

    Args:
        layer: the converted decoder layer, holding its weights; `o_proj` is its attention's output projection.
        hidden: the converted stream, a (1, T, hidden) tensor per window; `kwargs` its keyword inputs.
        targets: the parent attention's output on the parent's stream, (1, T, hidden) per window.
    """
    n, width = o_proj.in_features, o_proj.out_features
    fit, held = _Moments(n, width, device), []
    bias = o_proj.bias.detach() if o_proj.bias is not None else 0.0
    with torch.no_grad():
        for x, kw, target, out in zip(hidden, kwargs, targets, holdout(len(hidden)), strict=True):
            h = run_until(layer, o_proj, x, kw, device).reshape(-1, n).float()  # (T, n): the heads, concatenated
            t = (target.to(device) - bias).reshape(-1, width).float()  # (T, width)
            if not out:
                fit.add(h, t)
            if out or len(hidden) == 1:  # one window only: judged on itself
                held.append((h, t))
    old = o_proj.weight.detach().double()
    before = _relative_error(held, old)
    after, shrink = min((_relative_error(held, fit.solve(shrink, old)), shrink) for shrink in _SHRINKS)
    if before < 1e-12 or not after < before * (1 - 1e-6):  # nothing to repair, or no repair that generalises
        return RepairResult(False, None, before, before)
    for h, t in held if len(hidden) > 1 else []:
        fit.add(h, t)
    o_proj.weight.data.copy_(fit.solve(shrink, old).to(o_proj.weight.dtype))
    return RepairResult(True, shrink, before, after)


@dataclass(frozen=True)
class RefineResult:
    steps: int  # steps taken; 0 when they did not help the held-out windows and were undone
    loss_before: float  # mean squared error of the layer's output on the held-out windows, before and after
    loss_after: float


@dataclass(frozen=True)
class Windows:
    """The calibration windows as one layer sees them: its input hidden states, its other inputs (masks,
    positions), and the outputs it is fitted towards (the parent layer's)."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]
    targets: list[torch.Tensor]


def refine(
    layer: torch.nn.Module,
    trainable: list[torch.nn.Parameter],
    windows: Windows,
    steps: int,
    lr: float,
    seed: int,
    device: torch.device,
) -> RefineResult:
    """`steps` Adam steps on `trainable` (parameters of `layer`), one fitting window each in a seeded order,
    minimising the mean squared error of the layer's output on the windows against their targets; undone if the
    held-out windows end up worse."""
    hidden, kwargs, targets = windows.hidden, windows.kwargs, windows.targets
    held = holdout(len(hidden))
    train = [i for i, out in enumerate(held) if not out]
    judge = [i for i, out in enumerate(held) if out] or train

    def held_out_loss() -> float:
        with torch.no_grad():
            errors = [forward(layer, hidden[i], kwargs[i], device) - targets[i].to(device) for i in judge]
        return float(sum(e.pow(2).mean() for e in errors) / len(errors))

    before = held_out_loss()
    start = [p.detach().clone() for p in trainable]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(trainable, lr=lr)
    # one permutation of every step, read modulo the windows: at most REFINE_STEPS_MAX + windows entries (settings.py)
    order = torch.randperm(len(train) * -(-steps // len(train)), generator=torch.Generator().manual_seed(seed))
    try:
        with torch.enable_grad():
            for step in range(steps):
                i = train[int(order[step]) % len(train)]
                loss = (forward(layer, hidden[i], kwargs[i], device) - targets[i].to(device)).pow(2).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    finally:
        for p in trainable:
            p.requires_grad_(False)
            p.grad = None
    after = held_out_loss()
    if after < before:
        return RefineResult(steps, before, after)
    with torch.no_grad():
        for p, value in zip(trainable, start, strict=True):
            p.copy_(value)
    return RefineResult(0, before, before)
