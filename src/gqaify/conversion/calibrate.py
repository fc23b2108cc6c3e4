"""Calibration: the parent reads the calibration text layer by layer, and every layer is fitted as it goes.

    tokens      the first `tokens` tokens of the calibration text, in windows of `seq_len` (at most the
                model's positions)
    capture     every layer's inputs for every window, from transformers' own model (`walk.capture`)
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
import functools
import hashlib
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from gqaify.archs import ArchSpec, Geometry
from gqaify.conversion import walk
from gqaify.conversion.checkpoint import first_nonfinite
from gqaify.conversion.grouping import permute, similar_order
from gqaify.conversion.layout import LayerLayout
from gqaify.conversion.methods import Method, MethodContext, fit_error
from gqaify.conversion.options import Calibration
from gqaify.conversion.repair import refine, repair_output
from gqaify.conversion.source import Source
from gqaify.data import load_text, tokenize
from gqaify.errors import UserError

LOG = logging.getLogger(__name__)

_CHARS_PER_TOKEN = 12  # read at most this many characters per wanted token (English BPE needs about 4)


@dataclass(frozen=True)
class CalibrationText:
    ids: torch.Tensor  # (N,) the first `calibration.tokens` token ids of the text
    sha256: str  # of the text read (UTF-8; rows joined as `load_text` joins them): a text file's own SHA-256
    seconds: float  # spent reading and tokenizing it


def read_calibration(calibration: Calibration, tokenizer) -> CalibrationText:
    """The first `calibration.tokens` token ids of the calibration text (fewer, with a warning, if short), and
    the SHA-256 of the text they were read from.

    Raises:
        UserError: the data cannot be read or gives fewer than 2 tokens.
    """
    c, start = calibration, time.perf_counter()
    text = load_text(c.data, c.split, c.text_column, "--calib-data", max_chars=c.tokens * _CHARS_PER_TOKEN).text
    ids = tokenize(tokenizer, text, c.tokens, f"--calib-data {c.data}").ids
    if len(ids) < c.tokens:
        LOG.warning("--calib-data %s holds %d tokens, fewer than --calib-tokens %d", c.data, len(ids), c.tokens)
    sha256 = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return CalibrationText(ids, sha256, time.perf_counter() - start)


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


@dataclass
class CalibratedLayers:
    """What calibration produced: every layer's fitted tensors on disk (one file a layer) and what was measured."""

    folder: Path
    tokens: int  # calibration tokens read
    errors: list[dict]  # per layer: "k", "v" (the closed-form fit), and sequentially "out", "repaired", "refined"
    orders: list[list[int]] | None  # per layer, the source K/V heads in their new order (similarity grouping)
    seconds: dict[str, float]  # "capture", "fit" (parent pass, statistics, method), "repair", "refine", "run"
    # (the converted layer on the converted stream), "total"
    device: str

    def load(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s head-indexed tensors as the output will hold them (full names, float32)."""
        return load_file(self.folder / _layer_file(layer))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 4 << 20
MMAP_THRESHOLD_LEFT = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit machines


def _large_allocations_mapped(function: Callable) -> Callable:
    """While `function` runs, every allocation of 4 MB or more gets a memory mapping of its own, returned to the
    system when freed.

    The walk allocates and frees tensors of a few MB to a few hundred MB, layer after layer. glibc raises its
    mmap threshold each time a mapped block is freed (up to 32 MB), so later tensors below it come from the
    heap, whose pages stay with the process when they are freed: on a 4-layer, 1B-shaped model that was
    0.23 GiB of a 1.59 GiB peak (1.36 GiB with the threshold at 4 MB; 16 MB kept 1.54 GiB; 1 MB saved no more
    and made SmolLM2's refinement 30% slower, every mapping being faulted in anew). glibc can neither report its
    threshold nor be given its adjustment back once it is set, so on leaving the threshold is set to 32 MB, where
    its own adjustment would have taken it after the walk's frees. Other C libraries are left alone.
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
def calibrate(source: Source, spec: ArchSpec, geometry: Geometry, calibration: Calibration, text: CalibrationText,
              method: Method, kv_heads: int, grouping: str, ctx: MethodContext, keys_measurable: bool, folder: Path,
              progress: bool = True) -> CalibratedLayers:  # fmt: skip
    """Fit every layer of `source` to `kv_heads` K/V heads on `text` (read by `read_calibration` and checked
    against the model's size); write the fits to `folder`.

    Raises:
        UserError: a layer's weights are not finite, or do not match transformers' class for the model.
    """
    c, ids = calibration, text.ids
    seconds = dict.fromkeys(("capture", "fit", "repair", "refine", "run"), 0.0)
    start = time.perf_counter() - text.seconds  # reading the text counts as capture
    if warning := c.size_warning(len(ids), geometry.hidden_size):
        LOG.warning(warning)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    positions = source.config.get("max_position_embeddings") or c.seq_len
    windows = list(ids.split(min(c.seq_len, positions)))
    metas = source.tensors.metadata()
    parent = walk.skeleton(source.config)
    converted = walk.skeleton(source.config, kv_heads) if c.mode == "sequential" else None
    unused = walk.output_weights(parent)  # the LM head: the capture stops after the last layer
    outside = source.tensors.load([name for name in metas if spec.layer_of(name) is None and name not in unused])
    stream, inputs = walk.capture(parent, spec, outside, windows, device)  # the parent's stream
    del outside
    ours = [x.clone() for x in stream] if converted is not None else None  # the converted stream
    seconds["capture"] = time.perf_counter() - start

    folder.mkdir()
    errors, orders = [], [] if grouping == "similarity" else None
    bar = tqdm(range(geometry.num_layers), desc="calibrating", unit="layer", disable=not progress or None)
    for layer in bar:
        tick = time.perf_counter()
        prefix = spec.decoder_layer.format(layer=layer) + "."
        state = source.tensors.load([name for name in metas if spec.layer_of(name) == layer])
        layout = LayerLayout(spec, geometry, layer, with_queries=True, rotary_dim=ctx.rotary_dim)
        heads = {name: state[name] for name in layout.inputs(state)}
        _check_finite(heads)
        local = {name.removeprefix(prefix): t for name, t in state.items()}
        attention_path = spec.attention.format(layer=layer).removeprefix(prefix)
        input_module = f"{attention_path}.{spec.k_proj or spec.qkv_proj}"  # q, k and v read the same input
        with walk.loaded(parent.get_submodule(prefix[:-1]), local, device, f"layer {layer}") as block:
            targets, attention_targets, moment = _parent_pass(
                block, input_module, attention_path, stream, ours, inputs[layer], c.repair, geometry, device
            )
        stream = targets
        layer_ctx = replace(ctx, second_moment=moment.mean())
        attn = layout.split(heads)
        if orders is not None:
            order = similar_order(attn, kv_heads, layer_ctx.rotary_dim, layer_ctx.second_moment)
            attn = permute(attn, order)
            orders.append(order)
        fitted = method.fn(attn, kv_heads, layer_ctx)
        measured = fit_error(attn, fitted, layer_ctx, keys_measurable)
        error = {k: None if e is None else round(e, 6) for k, e in measured.items()}
        tensors = layout.join(fitted, kv_heads)
        seconds["fit"] += time.perf_counter() - tick
        if ours is not None:
            local_fitted = {name.removeprefix(prefix): t.clone() for name, t in tensors.items()}
            with walk.loaded(converted.get_submodule(prefix[:-1]), {**local, **local_fitted}, device,
                             f"converted layer {layer}") as block:  # fmt: skip
                ours, tensors, more = _repair_and_run(
                    block, attention_path, spec, c, ours, inputs[layer], targets, attention_targets, tensors, prefix,
                    layer, device, seconds,
                )  # fmt: skip
            error.update(more)
            bar.set_postfix(out=f"{error['out']:.3f}")
        errors.append(error)
        save_file({name: t.contiguous() for name, t in tensors.items()}, folder / _layer_file(layer))
    bar.close()
    seconds["total"] = time.perf_counter() - start
    return CalibratedLayers(folder, len(ids), errors, orders, {k: round(v, 2) for k, v in seconds.items()}, str(device))


def _parent_pass(block, input_module: str, attention_path: str, stream, ours, inputs, repair: bool,
                 geometry: Geometry, device) -> tuple[list, list, SecondMoment]:  # fmt: skip
    """Run the parent layer `block` on the parent's stream: (its outputs, its attention's outputs when the
    repair needs them, the second moment of the attention input on the stream the fit reads)."""
    moment = SecondMoment(geometry.hidden_size, device)
    targets, attention_targets = [], []
    fit_input = block.get_submodule(input_module)
    attention = block.get_submodule(attention_path)
    with walk.watching(fit_input) as attention_input, walk.watching(attention, output=True) as output:
        for x, kw in zip(stream, inputs, strict=True):
            targets.append(walk.run(block, x, kw, device))
            if ours is None:  # parallel: the fit reads the parent's stream
                moment.add(attention_input())
            elif repair:
                attention_targets.append(output().cpu())
    if ours is not None:  # sequential: the fit reads the converted stream (only the layer's input norm runs)
        for x, kw in zip(ours, inputs, strict=True):
            moment.add(walk.run_until(block, fit_input, x, kw, device))
    return targets, attention_targets, moment


def _repair_and_run(block, attention_path: str, spec: ArchSpec, c: Calibration, ours, inputs, targets,
                    attention_targets, tensors: dict, prefix: str, layer: int, device, seconds: dict):  # fmt: skip
    """Repair and refine the converted layer `block`, run it on the converted stream; (next converted stream,
    the layer's tensors as they now are, what was measured)."""
    measured = {"repaired": False, "refined": 0}
    if c.repair:
        tick = time.perf_counter()
        o_proj = block.get_submodule(f"{attention_path}.{spec.o_proj}")
        result = repair_output(block, o_proj, ours, inputs, attention_targets, device)
        measured.update(repaired=result.applied, repair_shrink=result.shrink,
                        attention_error=[round(result.error_before, 6), round(result.error_after, 6)])  # fmt: skip
        seconds["repair"] += time.perf_counter() - tick
    if c.refine_steps:
        LOG.info("layer %d: refining, %d steps", layer, c.refine_steps)
        tick = time.perf_counter()
        parameters = dict(block.named_parameters())
        trainable = [parameters[n] for n in (name.removeprefix(prefix) for name in tensors) if n in parameters]
        result = refine(block, trainable, ours, inputs, targets, c.refine_steps, c.refine_lr, seed=layer, device=device)
        measured.update(refined=result.steps, refine_loss=[round(result.loss_before, 6), round(result.loss_after, 6)])
        seconds["refine"] += time.perf_counter() - tick
    tick = time.perf_counter()
    with torch.no_grad():
        ours = [walk.run(block, x, kw, device) for x, kw in zip(ours, inputs, strict=True)]
    seconds["run"] += time.perf_counter() - tick
    parameters = block.state_dict()
    tensors = {name: parameters[name.removeprefix(prefix)].detach().float().cpu().clone() for name in tensors}
    error = sum((a - b).pow(2).sum() for a, b in zip(ours, targets, strict=True))
    size = sum(b.pow(2).sum() for b in targets)
    measured["out"] = round(float((error / size).sqrt()), 6)  # how far the converted stream is from the parent's
    return ours, tensors, measured


def _check_finite(tensors: dict[str, torch.Tensor]) -> None:
    if (found := first_nonfinite(tensors)) is not None:
        name, bad = found
        raise UserError(
            f"tensor {name!r} holds {bad:,} NaN or Inf values: the checkpoint is damaged (re-download it); "
            "calibration cannot fit it (convert without --calib-data and with --allow-nonfinite to copy it as it is)"
        )


def _layer_file(layer: int) -> str:
    return f"layer-{layer:05d}.safetensors"
