"""Calibration: the parent reads the calibration text layer by layer, and every layer is fitted as it goes.

    tokens      the first `tokens` tokens of the calibration text, in windows of `seq_len` (at most the
                model's positions)
    capture     every layer's inputs for every window, from transformers' own model (`layer_by_layer.capture`)
    per layer   only that layer's weights are loaded from the source, then:
                1. the parent layer runs on the parent's stream: its outputs are the targets, and the next
                   layer's parent stream
                2. statistics: the second moment E[[x; 1][x; 1]ᵀ] of the attention input, over the stream the
                   fit reads (the converted stream when sequential, the parent's when parallel); the constant
                   1 lets a fit treat a bias as one more input column. Methods and grouping are functions of it
                3. the method fits the layer (after similarity grouping, if asked), and its fit error is measured
                4. sequential only: the converted layer is repaired and refined against the parent's outputs
                   (`repair.py`), then runs on the converted stream, which feeds the next layer
                5. the layer's head-indexed tensors, as they will be saved, go to a file of their own

Memory holds one decoder layer's weights (two while the converted one is built) and the activations of the
calibration windows (the parent's and the converted streams, and the parent attention's outputs for the
repair: a few times tokens x hidden x 4 bytes), never the whole parent. Layers run on the GPU when there is
one; the activations stay in CPU memory and go to the GPU a window at a time.

Calibrate on text other than the text you evaluate on; the benchmarks here do.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import gqaify.conversion.layer_by_layer as layer_by_layer
from gqaify.auto import AUTO
from gqaify.conversion.checkpoint import nonfinite_problem
from gqaify.conversion.grouping import permute, similar_order
from gqaify.conversion.layout import LayerLayout
from gqaify.conversion.methods import Method, MethodContext, fit_error
from gqaify.conversion.repair import Windows, refine, repair_output
from gqaify.conversion.settings import Calibration, CalibrationSource, mixture_sha256
from gqaify.conversion.source import Source
from gqaify.errors import UserError, raise_if_problems
from gqaify.model.archs import ArchSpec
from gqaify.model.geometry import Geometry
from gqaify.model.loading import resolve_device
from gqaify.progress import announce, progress_bar
from gqaify.text.loading import load_text, named_texts, tokenize
from gqaify.text.pins import text_sha256

LOG = logging.getLogger(__name__)

_CHARS_PER_TOKEN = 12  # read at most this many characters per wanted token (English BPE needs about 4)


@dataclass(frozen=True)
class CalibrationText:
    """The calibration tokens, source by source, and what was read of each."""

    parts: list[torch.Tensor]  # (N_i,) the token ids of each source, in calib_data's order
    sources: list[CalibrationSource]  # what gqaify.json records of each
    seconds: float  # spent reading and tokenizing them

    @property
    def tokens(self) -> int:
        return sum(len(part) for part in self.parts)

    @property
    def sha256(self) -> str:
        """What calib_sha256 pins (`conversion.settings.mixture_sha256`): one source's text's own SHA-256 (a text
        file's)."""
        return mixture_sha256(self.sources)

    def windows(self, length: int) -> list[torch.Tensor]:
        """The calibration windows: each source cut into windows of `length` tokens (its last one shorter), the
        sources' windows interleaved evenly (window k of a source of n at (k + 1/2) / n of the way), so that every
        stretch of windows, and the repair's every-8th hold-out, holds each source in its proportion. One source:
        its windows in order."""
        placed = []
        for i, part in enumerate(self.parts):
            cut = part.split(length)
            placed += [((k + 0.5) / len(cut), i, window) for k, window in enumerate(cut)]
        return [window for *_, window in sorted(placed, key=lambda p: p[:2])]


def read_calibration(calibration: Calibration, tokenizer) -> CalibrationText:
    """Each source's share of `calibration.tokens` (`Calibration.shares`; fewer where a source is short: see
    `short_sources`), and the SHA-256 of the text each was read from.

    Raises:
        UserError: a source cannot be read or gives fewer than 2 tokens.
    """
    c, start = calibration, time.perf_counter()
    parts, sources = [], []
    weights = c.weights or [1.0] * len(c.data)
    for named, share, weight in zip(named_texts(c.data), c.shares(), weights, strict=True):
        if share < 2:
            said = " ".join(f"{w:g}" for w in weights)
            raise UserError(
                f"--calib-data {named.source} gets {share} of --calib-tokens {c.tokens:,} by "
                f"--calib-weights {said}; a source needs at least 2: raise its weight or --calib-tokens"
            )
        text = load_text(named.source, c.split, c.text_column, "--calib-data", max_chars=share * _CHARS_PER_TOKEN).text
        ids = tokenize(tokenizer, text, share, f"--calib-data {named.source}").ids
        sha256 = text_sha256(text)
        parts.append(ids)
        sources.append(CalibrationSource(named.name, named.source, weight, share, len(ids), sha256))
    return CalibrationText(parts, sources, time.perf_counter() - start)


def read_beyond(calibration: Calibration, text: CalibrationText, tokenizer, tokens: int) -> CalibrationText | None:
    """Up to `tokens` more of the calibration sources, in their shares, each past what `text`
    (`read_calibration(calibration)`) read of it: text that no statistic or fit on `text` has read. None where no
    source holds 2 tokens more."""
    more = read_calibration(replace(calibration, tokens=calibration.tokens + tokens), tokenizer)
    beyond = [
        (part[len(read) :], source)
        for part, read, source in zip(more.parts, text.parts, more.sources, strict=True)
        if len(part) - len(read) >= 2
    ]
    if not beyond:
        return None
    return CalibrationText([part for part, _ in beyond], [source for _, source in beyond], more.seconds)


def short_sources(text: CalibrationText) -> list[str]:
    """A warning for each source that held fewer tokens than its share (said once the text is not refused)."""
    return [
        f"--calib-data {s.data} holds {s.tokens:,} tokens, fewer than its share {s.tokens_requested:,}"
        for s in text.sources
        if s.tokens < s.tokens_requested
    ]


class SecondMoment:
    """Σ [x; 1][x; 1]ᵀ over the tokens added, in float64; `mean()` is E[[x; 1][x; 1]ᵀ], (n + 1)²."""

    def __init__(self, size: int, device: torch.device):
        self.sum = torch.zeros(size + 1, size + 1, dtype=torch.float64, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """Add one window's tokens: their product in float32 (a window's sum loses ~1e-7 of itself), the running
        sum over windows in float64; twice as fast as float64 throughout on a CPU."""
        x = x.reshape(-1, x.shape[-1]).float()
        x = torch.cat([x, x.new_ones(len(x), 1)], dim=1)
        self.sum += (x.T @ x).double()
        self.count += len(x)

    def mean(self) -> torch.Tensor:
        return (self.sum / self.count).cpu()


@dataclass(frozen=True)
class LayerFit:
    """What calibration measured of one layer: its entry in gqaify.json's `fit_error` (`record()`), and what the
    summary and the model card report. Errors are relative (1 is what writing zeros would score)."""

    k: float | None  # the fitted keys' attention scores (None: not measurable behind a Q/K norm)
    v: float | None  # the fitted values' contribution to the attention output
    # sequential calibration only:
    repaired: bool | None = None  # the o_proj repair was kept (it is kept only where it helps)
    refined: int | None = None  # refinement steps kept
    repair_shrink: float | None = None  # the ridge the repair chose
    attention_error: tuple[float, float] | None = None  # the attention output's error before and after the repair
    refine_loss: tuple[float, float] | None = None  # the layer output's loss before and after refinement
    out: float | None = None  # the converted stream against the parent's, after this layer

    def record(self) -> dict:
        """As gqaify.json holds it: k and v always, then what was measured, in the order of the fields."""
        measured = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        record = {name: value for name, value in measured.items() if name in ("k", "v") or value is not None}
        return {name: list(value) if isinstance(value, tuple) else value for name, value in record.items()}


@dataclass(frozen=True)
class FitRequest:
    """How each layer is fitted: the method, to how many K/V heads, after which grouping, in which context."""

    method: Method
    kv_heads: int
    grouping: str  # "contiguous" or "similarity"
    ctx: MethodContext
    keys_measurable: bool  # no Q/K norm between the keys and the scores (`fit_error`)


@dataclass(frozen=True)
class _Targets:
    """What the parent layer gives the converted one to match: its outputs per window, its attention's outputs
    (for the repair), and the second moment of the attention input on the stream the fit reads."""

    outputs: list[torch.Tensor]
    attention: list[torch.Tensor]
    moment: SecondMoment


@dataclass
class CalibratedLayers:
    """What calibration produced: every layer's fitted tensors on disk (one file a layer) and what was measured."""

    folder: Path
    tokens: int  # calibration tokens read
    fits: list[LayerFit]  # per layer
    orders: list[list[int]] | None  # per layer, the source K/V heads in their new order (similarity grouping)
    seconds: dict[str, float]  # "capture", "fit" (parent pass, statistics, method), "repair", "refine", "run"
    # (the converted layer on the converted stream), "total"
    device: str

    def load(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s head-indexed tensors as the output will hold them (full names, float32)."""
        return load_file(self.folder / _layer_file(layer))


@dataclass
class _Walk:
    """Where the walk stands: the parent's skeleton and the converted one (sequential only;
    `layer_by_layer.skeleton`), the calibration windows as they reach the next layer (the parent's stream, and
    sequentially the converted one), each layer's other inputs per window (masks, positions), the layer in
    progress, the seconds spent by phase."""

    parent_model: torch.nn.Module
    converted_model: torch.nn.Module | None
    parent: list[torch.Tensor]
    ours: list[torch.Tensor] | None
    inputs: list[list[dict]]
    device: torch.device
    seconds: dict[str, float]
    layer: int = 0

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        tick = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - tick


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 4 << 20
MMAP_THRESHOLD_LEFT = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit machines


def _large_allocations_mapped(function: Callable) -> Callable:
    """While `function` runs, every allocation of 4 MB or more gets a memory mapping of its own, returned to the
    system when freed.

    The walk allocates and frees tensors of a few MB to a few hundred MB, layer after layer. glibc raises its
    mmap threshold each time a mapped block is freed (up to 32 MB), so later tensors below it come from the
    heap, whose pages stay with the process when they are freed (what that costs, and why 4 MB:
    docs/benchmarks/conversion.md, calibration memory). glibc can neither report its threshold nor be given its
    adjustment back once it is set, so on leaving the threshold is set to 32 MB, where its own adjustment would
    have taken it after the walk's frees. Other C libraries are left alone.
    """

    @functools.wraps(function)
    def mapped(*args, **kwargs):
        glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
        if glibc:
            ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        try:
            return function(*args, **kwargs)
        finally:
            if glibc:
                ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_LEFT)

    return mapped


@_large_allocations_mapped
def calibrate(
    source: Source,
    spec: ArchSpec,
    geometry: Geometry,
    calibration: Calibration,
    text: CalibrationText,
    request: FitRequest,
    folder: Path,
    progress: bool = True,
) -> CalibratedLayers:
    """Fit every layer of `source` as `request` asks, on `text` (read by `read_calibration` and checked against the
    model's size); write the fits to `folder`.

    Raises:
        UserError: a layer's weights are not finite, or do not match transformers' class for the model.
    """
    c = calibration
    start = time.perf_counter() - text.seconds  # reading the text counts as capture
    if warning := c.size_warning(text.tokens, geometry.hidden_size):
        LOG.warning(warning)
    device = resolve_device(AUTO)
    positions = source.config.get("max_position_embeddings") or c.seq_len
    windows = text.windows(min(c.seq_len, positions))
    metas = source.tensors.metadata()
    parent = layer_by_layer.skeleton(source.config)
    converted = layer_by_layer.skeleton(source.config, request.kv_heads) if c.mode == "sequential" else None
    unused = layer_by_layer.output_weights(parent)  # the LM head: the capture stops after the last layer
    outside = source.tensors.load([name for name in metas if spec.layer_of(name) is None and name not in unused])
    announce(f"capturing every layer's inputs on {len(windows)} windows of calibration text", shown=progress)
    stream, inputs = layer_by_layer.capture(parent, spec, outside, windows, device)  # the parent's stream
    del outside
    ours = [x.clone() for x in stream] if converted is not None else None  # the converted stream
    seconds = {"capture": time.perf_counter() - start, **dict.fromkeys(("fit", "repair", "refine", "run"), 0.0)}
    state = _Walk(parent, converted, stream, ours, inputs, device, seconds)

    folder.mkdir()
    fits, orders = [], [] if request.grouping == "similarity" else None
    bar = progress_bar(range(geometry.num_layers), desc="calibrating", unit="layer", shown=progress)
    for layer in bar:
        state.layer = layer
        weights = source.tensors.load([name for name in metas if spec.layer_of(name) == layer])
        layout = LayerLayout(spec, geometry, layer, with_queries=True, rotary_dim=request.ctx.rotary_dim)
        tensors, fit, order = _fit_layer(spec, layout, c, request, weights, state)
        if order is not None:
            orders.append(order)
        if fit.out is not None:
            bar.set_postfix(out=f"{fit.out:.3f}")
        fits.append(fit)
        save_file({name: t.contiguous() for name, t in tensors.items()}, folder / _layer_file(layer))
    bar.close()
    seconds = {**state.seconds, "total": time.perf_counter() - start}
    seconds = {k: round(v, 2) for k, v in seconds.items()}
    return CalibratedLayers(folder, text.tokens, fits, orders, seconds, str(device))


def _fit_layer(
    spec: ArchSpec,
    layout: LayerLayout,
    c: Calibration,
    request: FitRequest,
    weights: dict[str, torch.Tensor],
    state: _Walk,
) -> tuple[dict, LayerFit, list[int] | None]:
    """The layer in progress (the module docstring's steps 1 to 4): (its head-indexed tensors as they will be
    saved, what was measured, the order of its heads under similarity grouping); `state` moves on by one layer."""
    tick = time.perf_counter()
    prefix = spec.decoder_layer.format(layer=state.layer) + "."
    heads = {name: weights[name] for name in layout.inputs(weights)}
    raise_if_problems(
        nonfinite_problem(
            heads,
            "calibration cannot fit it (convert without --calib-data and with --allow-nonfinite to copy it as it is)",
        )
    )
    local = {name.removeprefix(prefix): t for name, t in weights.items()}
    attention_path = spec.attention.format(layer=state.layer).removeprefix(prefix)
    input_module = f"{attention_path}.{spec.k_proj or spec.qkv_proj}"  # q, k and v read the same input
    with layer_by_layer.loaded(
        state.parent_model.get_submodule(prefix[:-1]), local, state.device, f"layer {state.layer}"
    ) as block:
        targets = _parent_pass(
            block,
            block.get_submodule(input_module),
            block.get_submodule(attention_path),
            state,
            layout.geometry.hidden_size,
            c.repair,
        )
    state.parent = targets.outputs
    ctx = replace(request.ctx, second_moment=targets.moment.mean())
    attn, order = layout.split(heads), None
    if request.grouping == "similarity":
        order = similar_order(attn, request.kv_heads, ctx.rotary_dim, ctx.second_moment)
        attn = permute(attn, order)
    fitted = request.method.fn(attn, request.kv_heads, ctx)
    measured = fit_error(attn, fitted, ctx, request.keys_measurable)
    fit = LayerFit(**{k: None if e is None else round(e, 6) for k, e in measured.items()})
    tensors = layout.join(fitted, request.kv_heads)
    state.seconds["fit"] += time.perf_counter() - tick
    if state.ours is not None:
        ours = {name.removeprefix(prefix): t.clone() for name, t in tensors.items()}
        with layer_by_layer.loaded(
            state.converted_model.get_submodule(prefix[:-1]),
            {**local, **ours},
            state.device,
            f"converted layer {state.layer}",
        ) as block:
            o_proj = block.get_submodule(f"{attention_path}.{spec.o_proj}")
            ours, more = _repair_and_run(block, o_proj, c, state, targets, list(ours))
        tensors = {prefix + name: t for name, t in ours.items()}
        fit = replace(fit, **more)
    return tensors, fit, order


def _parent_pass(block, fit_input, attention, state: _Walk, hidden_size: int, repair: bool) -> _Targets:
    """Run the parent layer `block` on the parent's stream: its outputs, its `attention` module's outputs when the
    repair needs them, and the second moment of the input of `fit_input` (q, k and v's) on the stream the fit
    reads."""
    inputs, device = state.inputs[state.layer], state.device
    moment = SecondMoment(hidden_size, device)
    outputs, attention_outputs = [], []
    with (
        layer_by_layer.watching(fit_input) as attention_input,
        layer_by_layer.watching(attention, output=True) as output,
    ):
        for x, kw in zip(state.parent, inputs, strict=True):
            outputs.append(layer_by_layer.run(block, x, kw, device))
            if state.ours is None:  # parallel: the fit reads the parent's stream
                moment.add(attention_input())
            elif repair:
                attention_outputs.append(output().cpu())
    if state.ours is not None:  # sequential: the fit reads the converted stream (only the layer's input norm runs)
        for x, kw in zip(state.ours, inputs, strict=True):
            moment.add(layer_by_layer.run_until(block, fit_input, x, kw, device))
    return _Targets(outputs, attention_outputs, moment)


def _repair_and_run(
    block, o_proj, c: Calibration, state: _Walk, targets: _Targets, names: list[str]
) -> tuple[dict[str, torch.Tensor], dict]:
    """Repair and refine the converted layer `block` (its `o_proj`; `names`, its tensors that the fit wrote), run
    it on the converted stream (`state.ours` moves on); (those tensors as they now are, what was measured:
    `LayerFit`'s sequential fields)."""
    measured = {"repaired": False, "refined": 0}
    ours, inputs, device = state.ours, state.inputs[state.layer], state.device
    if c.repair:
        with state.timing("repair"):
            result = repair_output(block, o_proj, ours, inputs, targets.attention, device)
        measured.update(
            repaired=result.applied,
            repair_shrink=result.shrink,
            attention_error=(round(result.error_before, 6), round(result.error_after, 6)),
        )
    if c.refine_steps:
        LOG.info("layer %d: refining, %d steps", state.layer, c.refine_steps)
        parameters = dict(block.named_parameters())
        trainable = [parameters[name] for name in names if name in parameters]
        with state.timing("refine"):
            result = refine(
                block,
                trainable,
                Windows(ours, inputs, targets.outputs),
                c.refine_steps,
                c.refine_lr,
                seed=state.layer,
                device=device,
            )
        measured.update(refined=result.steps, refine_loss=(round(result.loss_before, 6), round(result.loss_after, 6)))
    with state.timing("run"), torch.no_grad():
        state.ours = ours = [layer_by_layer.run(block, x, kw, device) for x, kw in zip(ours, inputs, strict=True)]
    parameters = block.state_dict()
    tensors = {name: parameters[name].detach().float().cpu().clone() for name in names}
    error = sum((a - b).pow(2).sum() for a, b in zip(ours, targets.outputs, strict=True))
    size = sum(b.pow(2).sum() for b in targets.outputs)
    measured["out"] = round(float((error / size).sqrt()), 6)  # how far the converted stream is from the parent's
    return tensors, measured


def _layer_file(layer: int) -> str:
    return f"layer-{layer:05d}.safetensors"
