"""The output planned from the source's metadata, then written tensor by tensor.

plan    every output tensor's name, shape and dtype, in the order the stream produces them
stream  tensors in source order: unchanged ones copied through as bytes; a layer's head-indexed inputs held
        until all have arrived, checked finite, converted by the method (or taken from calibration's fits)
hash    the SHA-256 of each source file, on a second thread, as the stream reads it
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from gqaify.conversion.calibrate import CalibratedLayers
from gqaify.conversion.checkpoint import ShardWriter, TensorMeta, nonfinite_problem, sha256_file
from gqaify.conversion.layout import LayerLayout
from gqaify.conversion.methods import Method, MethodContext, keeps_heads
from gqaify.conversion.source import Source
from gqaify.errors import UserError
from gqaify.model.archs import ArchSpec
from gqaify.model.geometry import Geometry
from gqaify.progress import progress_bar

LOG = logging.getLogger(__name__)


@dataclass
class Plan:
    tensors: dict[str, TensorMeta]  # every output tensor, in the order the stream produces them
    layouts: list[LayerLayout]
    layer_of: dict[str, int]  # input tensor name -> the layer whose K/V it holds
    layer_inputs: list[list[str]]
    layer_outputs: list[list[str]]


def plan_output(
    source: Source,
    spec: ArchSpec,
    geometry: Geometry,
    layouts: list[LayerLayout],
    kv_heads: int,
    cast: torch.dtype | None,
) -> Plan:
    """The output, tensor by tensor, from the source's metadata.

    Raises:
        UserError: the weights disagree with config.json (more layers, missing or misshapen tensors).
    """
    metas = source.tensors.metadata()
    layers = {layer for name in metas if (layer := spec.layer_of(name)) is not None}
    extra = sorted(layers - set(range(geometry.num_layers)))
    if extra:
        example = next(name for name in metas if spec.layer_of(name) == extra[0])
        raise UserError(
            f"the checkpoint has tensors of layer {extra[0]} ({example!r}), but config.json says num_hidden_layers "
            f"= {geometry.num_layers}; check that the weights and config.json belong to the same model"
        )

    def out_meta(meta: TensorMeta, shape: tuple[int, ...]) -> TensorMeta:
        return TensorMeta(shape, cast if cast is not None and meta.dtype.is_floating_point else meta.dtype)

    layer_inputs = [layout.inputs(metas) for layout in layouts]
    layer_outputs = [layout.outputs(names, kv_heads) for layout, names in zip(layouts, layer_inputs, strict=True)]
    layer_of = {name: layer for layer, names in enumerate(layer_inputs) for name in names}
    remaining = [len(names) for names in layer_inputs]
    tensors: dict[str, TensorMeta] = {}
    for name, meta in metas.items():
        layer = layer_of.get(name)
        if layer is None:
            tensors[name] = out_meta(meta, meta.shape)
            continue
        remaining[layer] -= 1
        if remaining[layer] == 0:  # the layer's last K/V input: its outputs are written here
            layout = layouts[layer]
            for out_name in layer_outputs[layer]:
                shape = layout.output_shape(out_name, metas[out_name].shape, kv_heads)
                tensors[out_name] = out_meta(metas[out_name], shape)
    return Plan(tensors, layouts, layer_of, layer_inputs, layer_outputs)


def stream_tensors(
    source, plan: Plan, writer: ShardWriter, converter: LayerConverter, hasher, allow_nonfinite: bool, progress: bool
) -> None:
    """Write every planned tensor: copied through as bytes where it can be, converted layer by layer.

    Raises:
        UserError: a head-indexed input holds NaN or Inf (unless `allow_nonfinite`).
    """
    pending_layers: dict[int, dict[str, torch.Tensor]] = {}
    total = sum(meta.nbytes for meta in plan.tensors.values())
    with progress_bar(total=total, unit="B", unit_scale=True, desc="converting", shown=progress) as bar:
        for item in source.tensors.iter_tensors():
            hasher.reading(item.file)
            layer = plan.layer_of.get(item.name)
            if layer is None:
                if item.bytes is not None and plan.tensors[item.name].dtype == item.meta.dtype:
                    writer.copy(item.name, item.bytes)
                else:
                    writer.write(item.name, item.load().to(plan.tensors[item.name].dtype))
                bar.update(plan.tensors[item.name].nbytes)
                continue
            pending = pending_layers.setdefault(layer, {})
            pending[item.name] = item.load()
            if len(pending) < len(plan.layer_inputs[layer]):
                continue
            inputs = pending_layers.pop(layer)
            finite = _check_finite(inputs, allow_nonfinite)
            converted = converter(layer, plan.layouts[layer], inputs)
            if finite:
                _check_converted_finite(converted, converter.method)
            for name in plan.layer_outputs[layer]:
                writer.write(name, converted[name].to(plan.tensors[name].dtype))
                bar.update(plan.tensors[name].nbytes)


def _check_finite(tensors: dict[str, torch.Tensor], allow_nonfinite: bool) -> bool:
    """Whether every tensor is finite; refuses one that is not, unless `allow_nonfinite`."""
    problem = nonfinite_problem(tensors, "or pass --allow-nonfinite to convert it anyway")
    if problem is None:
        return True
    if not allow_nonfinite:
        raise UserError(problem)
    LOG.warning("%s; converted anyway (--allow-nonfinite)", problem.split(":")[0])
    return False


def _check_converted_finite(tensors: dict[str, torch.Tensor], method: Method) -> None:
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise RuntimeError(f"{name}: the method produced NaN or Inf from finite weights ({method.info.summary})")


class LayerConverter:
    """One layer's conversion: the fitted tensors calibration wrote, or else the method applied to the layer.

    `changed_heads`: without calibration, whether the method changed some K/V head of a group it replaced (pooled
    heads that differed, re-initialised ones); never, where every group's heads were equal.
    """

    def __init__(self, method: Method, kv_heads: int, ctx: MethodContext, calibrated: CalibratedLayers | None):
        self.method, self.kv_heads, self.ctx, self.calibrated = method, kv_heads, ctx, calibrated
        self.changed_heads = False

    def __call__(self, layer: int, layout: LayerLayout, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.calibrated is not None:
            return self.calibrated.load(layer)
        before = layout.split(inputs)
        after = self.method.fn(before, self.kv_heads, self.ctx)
        self.changed_heads = self.changed_heads or not keeps_heads(before, after, self.kv_heads)
        return layout.join(after, self.kv_heads)


class SourceHasher:
    """SHA-256 of the source files on a second thread, each file from the moment the stream starts reading it.

    The hash and the stream then read the same file front to back at about the same pace: whichever is ahead
    brings pages into the page cache and the other finds them there, so the disk is read once.
    """

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gqaify-hash")
        self._jobs: dict[Path, Future] = {}

    def reading(self, path: Path | None) -> None:
        """Start hashing `path` (a source file the stream has reached), once."""
        if path is not None and path not in self._jobs:
            self._jobs[path] = self._pool.submit(sha256_file, path)

    def results(self, files: list[Path]) -> dict[str, str]:
        for path in files:
            self.reading(path)
        return {path.name: self._jobs[path].result() for path in files}

    def __enter__(self) -> SourceHasher:
        return self

    def __exit__(self, *exc_info) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
