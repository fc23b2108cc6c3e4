"""Convert a checkpoint's attention from KV to G key/value heads, streaming, into a new folder.

plan    read every tensor's name, shape and dtype; list the output tensors, their shards and headers
fit     with calibration text only: run the parent once over it and keep each layer's input statistics
stream  take tensors in source order: copy unchanged ones through as bytes; hold a layer's head-indexed
        inputs until all have arrived, regroup and convert them with the method, and write them
commit  config.json with the new num_key_value_heads, side files, gqaify.json and a model card go
        into a temporary folder beside OUT, which is renamed to OUT only when everything is there
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from accelerate.utils import convert_file_size_to_int
from tqdm.auto import tqdm

from gqaify import __version__
from gqaify.convert.archs import ArchSpec, Geometry, arch_for, rotary_dim
from gqaify.convert.calibrate import Calibration, calibration_ids, second_moments
from gqaify.convert.checkpoint import ShardWriter, TensorMeta, is_writable_location, sha256_file, weight_files
from gqaify.convert.grouping import GROUPINGS, permute, similar_order
from gqaify.convert.layout import Attention, LayerLayout
from gqaify.convert.methods import METHODS, Method, MethodContext, fit_error
from gqaify.convert.source import Source, open_source
from gqaify.errors import UserError, raise_if_problems
from gqaify.kvcache import kv_cache_bytes_per_token

LOG = logging.getLogger(__name__)

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROVENANCE_FILE = "gqaify.json"
# Written by gqaify; a source's own copies are not carried over.
_NOT_CARRIED = {"config.json", "README.md", PROVENANCE_FILE}


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
    fit_errors: list[dict] | None = None  # per layer, relative errors of what query heads read (calibrated)


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    kv_heads: int,
    *,
    method: str = "mean",
    dtype: str = "auto",
    max_shard_size: int | str = "5GB",
    force: bool = False,
    revision: str | None = None,
    seed: int = 0,
    calibration: Calibration | None = None,
    grouping: str = "contiguous",
    progress: bool = True,
) -> ConversionResult:
    """Convert the checkpoint `src` to `kv_heads` key/value heads and save it as a plain checkpoint at `out`.

    Args:
        src: a local model folder, a Hugging Face hub id, or a `.gguf` file. Never modified.
        out: the folder to create. Written beside, renamed into place when complete.
        kv_heads: G, the new number of K/V heads; must divide the source's. 1 is MQA.
        method: how each group of heads becomes one: see `gqaify.convert.methods.METHODS`.
        dtype: "auto" keeps each tensor's dtype; otherwise floating-point tensors are cast.
        max_shard_size: the largest output shard, in bytes or as "5GB" / "500MiB".
        force: replace an existing `out`.
        revision: the hub revision (branch, tag or commit) when `src` is a hub id.
        seed: seeds methods that draw random numbers.
        calibration: text on which the parent is run to fit `aligned` and `lsq`, to find `similarity` groups,
            and to measure every method's per-layer error (recorded in gqaify.json).
        grouping: "contiguous" pools neighbouring heads; "similarity" first reorders each layer's heads so
            that the heads that agree most share a K/V head.
        progress: show a progress bar.

    Raises:
        UserError: bad input; nothing is written.
    """
    start = time.perf_counter()
    out = Path(out).expanduser().absolute()
    shard_bytes = _check_options(out, kv_heads, method, dtype, max_shard_size, force, calibration, grouping)

    with open_source(src, revision) as source:
        _check_not_overlapping(source, out)
        config = _load_config(source.directory)
        spec = arch_for(config.get("model_type"), config.get("architectures"))
        geometry = Geometry.from_config(spec, config)
        model_name = (config.get("architectures") or [spec.model_type])[0]
        _check_kv_heads(geometry, kv_heads, model_name)
        with_queries = calibration is not None
        layouts = [LayerLayout(spec, geometry, layer, with_queries) for layer in range(geometry.num_layers)]
        plan = _plan(source, layouts, kv_heads, DTYPES[dtype])
        qk_norms = spec.shared_head_norms or layouts[0].has_qk_norms(plan.layer_inputs[0])
        _check_method(METHODS[method], method, model_name, qk_norms)
        ctx = MethodContext(torch.Generator().manual_seed(seed), config.get("initializer_range", 0.02))
        if calibration is not None:  # fits need to know which dimensions RoPE turns
            ctx = replace(ctx, rotary_dim=rotary_dim(spec.model_type, config, geometry.head_dim))
        moments = None
        if calibration is not None:
            moments, tokens_read = _calibrate(source, spec, geometry, calibration, progress)
        converter = _LayerConverter(METHODS[method], kv_heads, ctx, grouping, moments, keys_measurable=not qk_norms)

        with _SourceHasher() as hasher, _staging(out, force) as staging:
            with ShardWriter(staging, plan.tensors, shard_bytes) as writer:
                _stream(source, plan, writer, converter, hasher, progress)
                writer.close()
            _write_side_files(source, staging, config, kv_heads, dtype)
            hashes = hasher.results(source.tensors.files)
            record = _provenance(source, spec, geometry, kv_heads, method, dtype, seed, hashes)
            record.update(grouping=grouping, calibration=None)
            if calibration is not None:
                record.update(
                    calibration=calibration.record(tokens_read),
                    rotary_dim=ctx.rotary_dim,
                    permutations=converter.orders,
                    fit_error=converter.errors,
                )
            (staging / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
            (staging / "README.md").write_text(_model_card(record))

    kv_dtype = plan.tensors[plan.layer_outputs[0][0]].dtype
    converted = sum(len(names) for names in plan.layer_outputs)
    LOG.info("wrote %s", out)
    return ConversionResult(
        out=out,
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
        grouping=grouping,
        permutations=converter.orders,
        fit_errors=converter.errors,
    )


def kv_groups(source_kv_heads: int, kv_heads: int) -> list[list[int]]:
    """The source K/V heads that make up each of the `kv_heads` new heads (contiguous, as `repeat_kv`)."""
    size = source_kv_heads // kv_heads
    return [list(range(g * size, (g + 1) * size)) for g in range(kv_heads)]


# -- checks -------------------------------------------------------------------------------------------------


def _check_options(out: Path, kv_heads, method, dtype, max_shard_size, force, calibration, grouping) -> int:
    problems = []
    if not isinstance(kv_heads, int) or kv_heads < 1:
        problems.append(f"--kv-heads {kv_heads} must be a whole number of at least 1 (1 is MQA)")
    if method not in METHODS:
        problems.append(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    elif METHODS[method].calibrated and calibration is None:
        problems.append(
            f"--method {method} is fitted on calibration text; pass --calib-data DATA (text other than your eval text)"
        )
    if grouping not in GROUPINGS:
        problems.append(f"unknown --grouping {grouping!r}; choose one of {', '.join(GROUPINGS)}")
    elif grouping == "similarity" and calibration is None:
        problems.append("--grouping similarity compares heads on calibration text; pass --calib-data DATA")
    if calibration is not None:
        problems += calibration.problems()
    if dtype not in DTYPES:
        problems.append(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    shard_bytes = 0
    with contextlib.suppress(ValueError):
        shard_bytes = convert_file_size_to_int(max_shard_size)
    if shard_bytes <= 0:
        problems.append(f"--max-shard-size {max_shard_size!r} is not a size; write it like 5GB, 500MB or 2GiB")
    if out.exists() and not force:
        problems.append(f"{out} already exists; pass --force to replace it, or choose another OUT")
    elif out.exists() and not out.is_dir():
        problems.append(f"{out} exists and is not a folder; choose another OUT")
    if not is_writable_location(out):
        problems.append(f"cannot write {out}: its parent is not a writable folder; choose another OUT")
    raise_if_problems(problems)
    return shard_bytes


def _check_not_overlapping(source: Source, out: Path) -> None:
    src = source.directory.resolve()
    dst = out.resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise UserError(f"OUT {out} overlaps the source folder {src}; write the conversion somewhere else")


def _check_kv_heads(g: Geometry, kv_heads: int, model_name: str) -> None:
    divisors = [n for n in range(1, g.num_kv_heads + 1) if g.num_kv_heads % n == 0]
    model = f"the {g.num_kv_heads} K/V heads of {model_name}"
    if kv_heads > g.num_kv_heads:
        raise UserError(
            f"--kv-heads {kv_heads} exceeds {model}; gqaify only removes heads: "
            f"choose one of {', '.join(map(str, divisors))}"
        )
    if g.num_kv_heads % kv_heads:
        raise UserError(f"--kv-heads {kv_heads} does not divide {model}; choose one of {', '.join(map(str, divisors))}")
    if g.num_heads % g.num_kv_heads:
        raise UserError(f"config.json has {g.num_heads} query heads, not a multiple of its {g.num_kv_heads} K/V heads")


def _check_method(method: Method, name: str, model_name: str, qk_norms: bool) -> None:
    if method.folds and qk_norms:
        raise UserError(
            f"--method {name} folds rotations into q_proj rows, which the Q/K norms of {model_name} do not let "
            "through unchanged; use mean or norm-mean (with --grouping similarity if you like)"
        )


def _load_config(directory: Path) -> dict:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot read {directory / 'config.json'} ({exc}); check the file") from exc
    if not isinstance(config, dict):
        raise UserError(f"{directory / 'config.json'} is not a JSON object; check the file")
    return config


# -- plan and stream ----------------------------------------------------------------------------------------


@dataclass
class _Plan:
    tensors: dict[str, TensorMeta]  # every output tensor, in the order the stream produces them
    layouts: list[LayerLayout]
    layer_of: dict[str, int]  # input tensor name -> the layer whose K/V it holds
    layer_inputs: list[list[str]]
    layer_outputs: list[list[str]]


def _plan(source: Source, layouts: list[LayerLayout], kv_heads: int, cast: torch.dtype | None) -> _Plan:
    metas = source.tensors.metadata()

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


def _stream(source, plan: _Plan, writer: ShardWriter, converter: _LayerConverter, hasher, progress: bool):
    """Write every planned tensor: copied through as bytes where it can be, converted layer by layer."""
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
            layout = plan.layouts[layer]
            converted = layout.join(converter(layer, layout.split(pending_layers.pop(layer))), converter.kv_heads)
            for name in plan.layer_outputs[layer]:
                writer.write(name, converted[name].to(plan.tensors[name].dtype))
                bar.update(plan.tensors[name].nbytes)


class _LayerConverter:
    """One layer's conversion: regroup its heads, apply the method, measure the fit; records what it did."""

    def __init__(self, method: Method, kv_heads: int, ctx: MethodContext, grouping: str,
                 second_moments: list[torch.Tensor] | None, keys_measurable: bool):  # fmt: skip
        self.method, self.kv_heads, self.ctx, self.second_moments = method, kv_heads, ctx, second_moments
        self.keys_measurable = keys_measurable
        # what was done, per layer: the head orders (similarity grouping), the fit errors (calibrated)
        self.orders: list[list[int]] | None = [] if grouping == "similarity" else None
        self.errors: list[dict] | None = [] if second_moments is not None else None

    def __call__(self, layer: int, attn: Attention) -> Attention:
        ctx = self.ctx
        if self.second_moments is not None:
            ctx = replace(ctx, second_moment=self.second_moments[layer])
        if self.orders is not None:
            order = similar_order(attn, self.kv_heads, ctx.rotary_dim, ctx.second_moment)
            attn = permute(attn, order)
            self.orders.append(order)
        converted = self.method.fn(attn, self.kv_heads, ctx)
        if self.errors is not None:
            errors = fit_error(attn, converted, ctx, keys=self.keys_measurable)
            self.errors.append({key: None if e is None else round(e, 6) for key, e in errors.items()})
        return converted


def _calibrate(source: Source, spec, geometry, calibration: Calibration, progress: bool):
    """(each layer's input second moment, tokens read): one pass of the source model over the calibration text."""
    ids = calibration_ids(calibration, source.load_tokenizer())
    model = source.load_model("cuda" if torch.cuda.is_available() else "cpu")
    seq_len = min(calibration.seq_len, getattr(model.config, "max_position_embeddings", None) or calibration.seq_len)
    moments = second_moments(model, spec, geometry, ids, seq_len, progress)
    del model
    return moments, len(ids)


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


# -- output folder ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _staging(out: Path, force: bool):
    """A temporary folder beside `out`, renamed to `out` when the block completes, removed if it fails.

    An interrupted run leaves at most a hidden `.OUT.gqaify-*` folder, never a partial `out`. With `force`,
    an existing `out` is moved aside first and deleted only once the new one is in place.
    """
    created = []  # parent folders made here, removed again if the conversion fails
    for parent in reversed(out.parents):
        if not parent.exists():
            parent.mkdir()
            created.append(parent)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.gqaify-", dir=out.parent))
    except OSError as exc:
        _remove_created(created)
        raise UserError(f"cannot write beside {out} ({exc.strerror}); choose another OUT") from exc
    try:
        yield staging
        _apply_umask(staging)
        _swap_into_place(staging, out, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_created(created)
        raise


def _swap_into_place(staging: Path, out: Path, force: bool) -> None:
    """Rename `staging` to `out`; with `force`, the old `out` is set aside and restored if the rename fails."""
    if not (force and out.exists()):
        staging.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.gqaify-old-", dir=out.parent))
    out.rename(aside / out.name)
    try:
        staging.rename(out)
    except BaseException:
        (aside / out.name).rename(out)
        aside.rmdir()
        raise
    shutil.rmtree(aside)


def _apply_umask(folder: Path) -> None:
    """Give the output the permissions of a normally created folder (mkdtemp makes it private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _remove_created(created: list[Path]) -> None:
    for parent in reversed(created):
        with contextlib.suppress(OSError):
            parent.rmdir()


def _write_side_files(source: Source, staging: Path, config: dict, kv_heads: int, dtype: str) -> None:
    """config.json with the new num_key_value_heads (and dtype when cast); tokenizer and friends as they are."""
    config = {**config, "num_key_value_heads": kv_heads}
    if DTYPES[dtype] is not None:
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = dtype
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    skip = _NOT_CARRIED | weight_files(source.directory)
    for path in sorted(source.directory.iterdir()):
        if path.is_file() and not path.name.startswith(".") and path.name not in skip:
            shutil.copyfile(path, staging / path.name)


def _provenance(source, spec: ArchSpec, geometry: Geometry, kv_heads, method, dtype, seed, hashes) -> dict:
    record = {
        "tool": "gqaify",
        "version": __version__,
        "source": {
            "name": source.name,
            "kind": source.kind,
            "path": str(source.directory) if source.kind == "local" else None,
            "revision": source.revision,
            "sha256": hashes,
            **source.provenance,
        },
        "model_type": spec.model_type,
        "method": method,
        "kv_heads": kv_heads,
        "source_geometry": asdict(geometry),
        "groups": kv_groups(geometry.num_kv_heads, kv_heads),
        "dtype": dtype,
    }
    if method == "random":
        record["seed"] = seed
    return record


def _model_card(record: dict) -> str:
    src, g = record["source"], record["source_geometry"]
    kind = "MQA" if record["kv_heads"] == 1 else f"GQA-{record['kv_heads']}"
    base = f"base_model: {src['name']}\n" if src["kind"] == "hub" else ""
    rewritten = "K/V projections rewritten"
    if METHODS[record["method"]].folds or record.get("grouping") == "similarity":
        rewritten = "K/V projections, q_proj rows and o_proj columns rewritten"
    grouping = ""
    if record.get("grouping") == "similarity":
        grouping = ", heads reordered within each layer so that similar ones share a K/V head"
    if record.get("calibration"):
        grouping += f" (calibrated on {record['calibration']['tokens']} tokens of `{record['calibration']['data']}`)"
    return f"""---
{base}library_name: transformers
tags: [gqaify, {kind.lower()}]
---
# {Path(src["name"]).name} → {kind}

Converted by [gqaify](https://pypi.org/project/gqaify/) {record["version"]} from `{src["name"]}`
({src["kind"]}{", revision " + src["revision"] if src["revision"] else ""}).

- Attention: {g["num_heads"]} query heads; K/V heads {g["num_kv_heads"]} → {record["kv_heads"]} \
(KV cache {g["num_kv_heads"] // record["kv_heads"]}× smaller).
- Method: `{record["method"]}`{grouping}; query head i reads K/V head i // {g["num_heads"] // record["kv_heads"]} \
(contiguous groups, as transformers' `repeat_kv`).
- {rewritten}; everything else is copied from the source unchanged. `gqaify.json` records the groups, \
calibration, per-layer fit error and source hashes.

A converted model loses quality until it is uptrained briefly (GQA paper, Ainslie et al. 2023); \
compare it with its parent before use.
"""
