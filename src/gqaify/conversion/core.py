"""Convert a checkpoint's attention from KV to G key/value heads, streaming, into a new folder.

check   every problem with the request at once, before anything is read: the options, OUT, SRC, and
        config.json (value types, G against the K/V heads, calibration size against the hidden size)
plan    read every tensor's name, shape and dtype; list the output tensors, their shards and headers
fit     with calibration text only: run the parent over it and keep each layer's input statistics
stream  take tensors in source order: copy unchanged ones through as bytes; hold a layer's head-indexed
        inputs until all have arrived, check they are finite, convert them with the method, write them
commit  config.json, side files, the model card and gqaify.json go into the staging folder beside OUT,
        which is renamed to OUT only when everything is there (`gqaify.outputs`)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from gqaify import __version__
from gqaify.archs import ARCHITECTURES, ArchSpec, Geometry, arch_for, attention_kind, rotary_dim
from gqaify.conversion.calibrate import CalibratedLayers, calibrate
from gqaify.conversion.card import model_card
from gqaify.conversion.checkpoint import ShardWriter, TensorMeta, sha256_file
from gqaify.conversion.layout import LayerLayout
from gqaify.conversion.methods import METHODS, Method, MethodContext
from gqaify.conversion.options import CONVERT, NOT_RECORDED, Calibration, ConvertSettings, method_problems
from gqaify.conversion.record import kv_groups, provenance, write_config_and_side_files
from gqaify.conversion.source import Source, open_source, read_config
from gqaify.dtypes import torch_dtype
from gqaify.errors import UserError, raise_if_problems
from gqaify.hub import push_folder, repo_id_problem
from gqaify.kvcache import kv_cache_bytes_per_token
from gqaify.locations import locate
from gqaify.outputs import destination_problems, remove_leftovers, resolve_out, space_problem, staged, write_provenance
from gqaify.settings import recorded, required_problems, type_problems
from gqaify.sizes import parse_size

LOG = logging.getLogger(__name__)

_SPACE_MARGIN = 1 << 20  # bytes beyond the planned tensors: shard headers, index, config, card, provenance
_FITS = ".gqaify-fits"  # the fitted layers, in the staging folder while the stream writes them


@dataclass(frozen=True)
class ConversionResult:
    out: Path
    model_type: str
    method: str
    num_heads: int
    source_kv_heads: int
    kv_heads: int
    groups: list[list[int]]  # the source K/V heads pooled into each new K/V head (contiguous grouping)
    kv_bytes_per_token_before: int
    kv_bytes_per_token_after: int
    tensors_converted: int
    tensors_copied: int
    num_shards: int
    bytes_written: int
    seconds: float
    grouping: str = "contiguous"
    permutations: list[list[int]] | None = None  # per layer, the source K/V heads in their new order
    fit_errors: list[dict] | None = None  # per layer, what calibration measured (`calibrate.CalibratedLayers`)
    calibration_seconds: dict | None = None  # time spent capturing, fitting, repairing and refining


def convert(src: str | os.PathLike, out: str | os.PathLike, kv_heads: int, **settings) -> ConversionResult:
    """Convert the checkpoint `src` to `kv_heads` key/value heads and save it as a plain checkpoint at `out`.

    Args:
        src: a local model folder, a Hugging Face hub id, or a `.gguf` file. Never modified.
        out: the folder to create. Written beside, renamed into place when complete.
        kv_heads: G, the new number of K/V heads; must divide the source's. 1 is MQA.
        settings: the other fields of `ConvertSettings` (method, calib_data, dtype, force, push_to_hub, ...),
            the same as the command line's options.

    Raises:
        UserError: bad input; nothing is written. Or the push failed; `out` is complete.
        ResourceError: the disk filled up while writing; nothing is left behind.
    """
    return convert_with(ConvertSettings(src=os.fspath(src), out=os.fspath(out), kv_heads=kv_heads, **settings))


def convert_with(settings: ConvertSettings) -> ConversionResult:
    """The conversion `settings` describe (see `convert`); what `gqaify convert` runs."""
    start = time.perf_counter()
    raise_if_problems(type_problems(settings) + required_problems(CONVERT, settings))
    s = settings
    src, out, kv_heads, method, calibration = s.src, s.out, s.kv_heads, s.method, s.calibration()
    out_path = resolve_out(out) if out.strip() else Path()
    problems = _request_problems(s, calibration)
    if problems:  # report what config.json would add too, where reading it is free (a local folder)
        local = Path(src).expanduser()
        if local.is_dir() and (local / "config.json").is_file():
            problems += _config_problems(_read_config_or_problem(local), kv_heads, calibration)[0]
        raise_if_problems(problems)

    with open_source(src, s.revision) as source:
        problems, spec, geometry = _config_problems(source.config, kv_heads, calibration)
        problems += _overlap_problems(source, out_path)
        raise_if_problems(problems)
        model_name = (source.config.get("architectures") or [spec.model_type])[0]
        spec = spec.stored_as(source.tensors.metadata())
        with_queries = calibration is not None
        layouts = [LayerLayout(spec, geometry, layer, with_queries) for layer in range(geometry.num_layers)]
        plan = _plan(source, spec, geometry, layouts, kv_heads, torch_dtype(s.dtype))
        qk_norms = spec.shared_norms_in(source.config) or layouts[0].has_qk_norms(plan.layer_inputs[0])
        _check_method(METHODS[method], method, model_name, qk_norms)

        remove_leftovers(out_path)
        size = sum(meta.nbytes for meta in plan.tensors.values()) + _SPACE_MARGIN
        size += sum(path.stat().st_size for path in source.side_files())
        if calibration is not None:  # the fitted layers wait on disk, in float32, until the stream writes them
            size += sum(plan.tensors[name].nbytes // plan.tensors[name].dtype.itemsize * 4
                        for names in plan.layer_outputs for name in names)  # fmt: skip
        raise_if_problems([p for p in [space_problem(out_path, size)] if p])

        ctx = MethodContext(torch.Generator().manual_seed(s.seed), source.config.get("initializer_range", 0.02))
        with _SourceHasher() as hasher, staged(out_path, s.force, size) as staging:
            calibrated = None
            if calibration is not None:
                ctx = replace(ctx, rotary_dim=rotary_dim(spec.model_type, source.config, geometry.head_dim))
                calibrated = calibrate(source, spec, geometry, calibration, METHODS[method], kv_heads, s.grouping, ctx,
                                       not qk_norms, staging / _FITS, s.progress)  # fmt: skip
            converter = _LayerConverter(METHODS[method], kv_heads, ctx, calibrated)
            with ShardWriter(staging, plan.tensors, parse_size(s.max_shard_size)) as writer:
                _stream(source, plan, writer, converter, hasher, s.allow_nonfinite, s.progress)
                writer.close()
            write_config_and_side_files(source, spec, staging, kv_heads, s.dtype)
            record = provenance(source, spec, geometry, kv_heads, method, s.dtype, s.seed,
                                hasher.results(source.tensors.files))  # fmt: skip
            record.update(grouping=s.grouping, calibration=None, settings=resolved_record(s, source, out_path))
            if calibrated is not None:
                shutil.rmtree(calibrated.folder)
                record.update(
                    calibration={**calibration.record(calibrated.tokens), "device": calibrated.device,
                                 "seconds": calibrated.seconds},  # fmt: skip
                    rotary_dim=ctx.rotary_dim,
                    permutations=calibrated.orders,
                    fit_error=calibrated.errors,
                )
            model_card(record).save(staging / "README.md")
            write_provenance(staging, record)

    if s.push_to_hub is not None:
        message = f"{attention_kind(kv_heads)} of {source.name} by gqaify {__version__} (--method {method})"
        push_folder(out_path, s.push_to_hub, message)
    kv_dtype = plan.tensors[plan.layer_outputs[0][0]].dtype
    converted = sum(len(names) for names in plan.layer_outputs)
    LOG.info("wrote %s", out_path)
    return ConversionResult(
        out=out_path,
        model_type=spec.model_type,
        method=method,
        num_heads=geometry.num_heads,
        source_kv_heads=geometry.num_kv_heads,
        kv_heads=kv_heads,
        groups=kv_groups(geometry.num_kv_heads, kv_heads),
        kv_bytes_per_token_before=kv_cache_bytes_per_token(geometry, kv_dtype),
        kv_bytes_per_token_after=kv_cache_bytes_per_token(geometry.with_kv_heads(kv_heads), kv_dtype),
        tensors_converted=converted,
        tensors_copied=len(plan.tensors) - converted,
        num_shards=writer.num_shards,
        bytes_written=writer.bytes_written,
        seconds=time.perf_counter() - start,
        grouping=s.grouping,
        permutations=calibrated.orders if calibrated else None,
        fit_errors=calibrated.errors if calibrated else None,
        calibration_seconds=calibrated.seconds if calibrated else None,
    )


# -- checks -------------------------------------------------------------------------------------------------


def _request_problems(s: ConvertSettings, calibration: Calibration | None) -> list[str]:
    """Everything wrong with the request that needs no model: the options, OUT, and whether SRC can exist."""
    problems = []
    if s.kv_heads is None or s.kv_heads < 1:
        problems.append(f"--kv-heads {s.kv_heads} must be a whole number of at least 1 (1 is MQA)")
    problems += method_problems(s.method, s.grouping, calibrated=calibration is not None)
    if calibration is not None:
        problems += calibration.problems()
    if parse_size(s.max_shard_size) is None:
        problems.append(f"--max-shard-size {s.max_shard_size!r} is not a size; write it like 5GB, 500MB or 2GiB")
    if s.push_to_hub is not None and (problem := repo_id_problem(s.push_to_hub)):
        problems.append(problem)
    problems += destination_problems(s.out, s.force)
    try:
        locate(s.src, "SRC")
    except UserError as exc:
        problems.append(str(exc))
    return problems


def resolved_record(s: ConvertSettings, source: Source, out: Path) -> dict:
    """The settings as gqaify.json records them: paths absolute, a hub source pinned to the commit read, so that
    `gqaify convert --config OUT/gqaify.json` reruns the conversion from anywhere (what went how, not what was
    made, is left out: `NOT_RECORDED`)."""
    calib_data = s.calib_data
    if calib_data is not None and Path(calib_data).expanduser().exists():
        calib_data = str(Path(calib_data).expanduser().resolve())
    src = source.name if source.kind == "hub" else str(Path(source.name).expanduser().resolve())
    resolved = replace(s, src=src, out=str(out), revision=source.revision, calib_data=calib_data)
    return recorded(resolved, NOT_RECORDED)


def _read_config_or_problem(directory: Path) -> dict:
    try:
        return read_config(directory)
    except UserError:
        return {}  # reported when the source is opened


def _config_problems(config: dict, kv_heads, calibration: Calibration | None):
    """(problems, spec, geometry) of converting a model with `config`: architecture, value types, G, calibration."""
    model_type = config.get("model_type")
    if (quantized := _quantization_problem(config)) is not None:
        return [quantized], None, None
    if model_type not in ARCHITECTURES:
        try:
            arch_for(model_type, config.get("architectures"))
        except UserError as exc:
            return [str(exc)], None, None
    spec = ARCHITECTURES[model_type]
    problems = Geometry.problems(spec, config)
    if spec.refused_when and config.get(spec.refused_when[0]):
        problems.append(f"gqaify does not convert {model_type} with {spec.refused_when[0]}: {spec.refused_when[1]}")
    if problems:
        return problems, spec, None
    geometry = Geometry.from_config(spec, config)
    model_name = (config.get("architectures") or [spec.model_type])[0]
    if isinstance(kv_heads, int) and kv_heads >= 1:
        problems += _kv_heads_problems(spec, geometry, kv_heads, model_name)
    if calibration is not None and spec.no_calibration:
        problems.append(f"{model_name} cannot be calibrated: {spec.no_calibration}; convert it with --method mean "
                        "or norm-mean, without --calib-data")  # fmt: skip
    elif calibration is not None and isinstance(calibration.tokens, int):
        problems += [p for p in [calibration.size_problem(calibration.tokens, geometry.hidden_size)] if p]
    return problems, spec, geometry


def _quantization_problem(config: dict) -> str | None:
    """A quantized checkpoint (GPTQ, AWQ, FP8, bitsandbytes, ...): its K/V weights are not plain matrices to pool.

    A GGUF source is dequantized when it is read, so its exported config carries no `quantization_config`.
    """
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "unknown method") if isinstance(quantization, dict) else "unknown method"
    return (
        f"SRC is quantized (quantization_config: {method}); gqaify pools full-precision weights: convert the "
        "unquantized checkpoint, or dequantize it first"
    )


def _kv_heads_problems(spec: ArchSpec, g: Geometry, kv_heads: int, model_name: str) -> list[str]:
    divisors = ", ".join(str(n) for n in range(1, g.num_kv_heads + 1) if g.num_kv_heads % n == 0)
    model = f"the {g.num_kv_heads} K/V heads of {model_name}"
    multiple, why = spec.kv_heads_multiple
    if g.num_heads % g.num_kv_heads:
        return [f"config.json has {g.num_heads} query heads, not a multiple of its {g.num_kv_heads} K/V heads"]
    if kv_heads > g.num_kv_heads:
        return [f"--kv-heads {kv_heads} exceeds {model}; gqaify only removes heads: choose one of {divisors}"]
    if g.num_kv_heads % kv_heads:
        return [f"--kv-heads {kv_heads} does not divide {model}; choose one of {divisors}"]
    if kv_heads % multiple:
        return [f"--kv-heads {kv_heads} is not a multiple of {multiple}, which {model_name} needs: {why}"]
    return []


def _overlap_problems(source: Source, out: Path) -> list[str]:
    if source.kind == "gguf":  # its folder is a temporary export
        return []
    src, dst = source.directory.resolve(), out.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        return [f"OUT {out} overlaps the source folder {src}; write the conversion somewhere else"]
    return []


def _check_method(method: Method, name: str, model_name: str, qk_norms: bool) -> None:
    if method.folds and qk_norms:
        raise UserError(
            f"--method {name} folds rotations into q_proj rows, which the Q/K norms of {model_name} do not let "
            "through unchanged; use mean or norm-mean (with --grouping similarity if you like)"
        )


# -- plan and stream ----------------------------------------------------------------------------------------


@dataclass
class _Plan:
    tensors: dict[str, TensorMeta]  # every output tensor, in the order the stream produces them
    layouts: list[LayerLayout]
    layer_of: dict[str, int]  # input tensor name -> the layer whose K/V it holds
    layer_inputs: list[list[str]]
    layer_outputs: list[list[str]]


def _plan(source: Source, spec: ArchSpec, geometry: Geometry, layouts: list[LayerLayout], kv_heads: int,
          cast: torch.dtype | None) -> _Plan:  # fmt: skip
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
    return _Plan(tensors, layouts, layer_of, layer_inputs, layer_outputs)


def _stream(source, plan: _Plan, writer: ShardWriter, converter: _LayerConverter, hasher, allow_nonfinite: bool,
            progress: bool) -> None:  # fmt: skip
    """Write every planned tensor: copied through as bytes where it can be, converted layer by layer.

    Raises:
        UserError: a head-indexed input holds NaN or Inf (unless `allow_nonfinite`).
    """
    pending_layers: dict[int, dict[str, torch.Tensor]] = {}
    total = sum(meta.nbytes for meta in plan.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress or None) as bar:
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
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            if allow_nonfinite:
                LOG.warning("%s holds NaN or Inf values; converted anyway (--allow-nonfinite)", name)
                return False
            bad = int((~torch.isfinite(t)).sum())
            raise UserError(
                f"tensor {name!r} holds {bad:,} NaN or Inf values: the checkpoint is damaged (re-download it), "
                "or pass --allow-nonfinite to convert it anyway"
            )
    return True


def _check_converted_finite(tensors: dict[str, torch.Tensor], method: Method) -> None:
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise RuntimeError(f"{name}: the method produced NaN or Inf from finite weights ({method.info.summary})")


class _LayerConverter:
    """One layer's conversion: the fitted tensors calibration wrote, or else the method applied to the layer."""

    def __init__(self, method: Method, kv_heads: int, ctx: MethodContext, calibrated: CalibratedLayers | None):
        self.method, self.kv_heads, self.ctx, self.calibrated = method, kv_heads, ctx, calibrated

    def __call__(self, layer: int, layout: LayerLayout, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.calibrated is not None:
            return self.calibrated.load(layer)
        return layout.join(self.method.fn(layout.split(inputs), self.kv_heads, self.ctx), self.kv_heads)


class _SourceHasher:
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

    def __enter__(self) -> _SourceHasher:
        return self

    def __exit__(self, *exc_info) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

