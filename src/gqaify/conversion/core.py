"""Convert a checkpoint's attention from KV to G key/value heads, streaming, into a new folder: the steps in order.

check   every problem with the request at once, before anything is read: the options, OUT, SRC, and
        config.json (value types, G against the K/V heads, calibration size against the hidden size); then
        the calibration text: enough tokens, and the text calib_sha256 records, if any (`checks`)
plan    read every tensor's name, shape and dtype; list the output tensors, their shards and headers (`stream`)
fit     with calibration text only: walk the parent layer by layer and fit each converted layer (`calibrate`)
stream  take tensors in source order: copy unchanged ones through as bytes; hold a layer's head-indexed
        inputs until all have arrived, check they are finite, convert them with the method, write them (`stream`)
commit  config.json, side files, the model card and gqaify.json go into the staging folder beside OUT,
        which is renamed to OUT only when everything is there (`record`, `card`, `gqaify.outputs`)
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gqaify._version import __version__
from gqaify.archs import attention_kind, rotary_dim
from gqaify.conversion import to_gguf
from gqaify.conversion.calibrate import FitRequest, LayerFit, calibrate, read_calibration
from gqaify.conversion.card import model_card
from gqaify.conversion.checkpoint import ShardWriter
from gqaify.conversion.checks import check_method, check_request, config_problems, overlap_problems, text_problems
from gqaify.conversion.layout import LayerLayout
from gqaify.conversion.methods import METHODS, MethodContext
from gqaify.conversion.options import CONVERT, NOT_RECORDED, ConvertSettings
from gqaify.conversion.record import kv_groups, provenance, write_config_and_side_files
from gqaify.conversion.source import Source, open_source
from gqaify.conversion.stream import LayerConverter, SourceHasher, plan_output, stream_tensors
from gqaify.data import NamedText
from gqaify.dtypes import torch_dtype
from gqaify.errors import ResourceError, UserError, raise_if_problems
from gqaify.hub import push_folder
from gqaify.kvcache import kv_cache_bytes_per_token
from gqaify.outputs import (
    PROVENANCE_FILE,
    current_umask,
    file_into_place,
    remove_leftovers,
    resolve_out,
    space_problem,
    staged,
    work_folder,
    write_provenance,
)
from gqaify.settings import recorded, required_problems

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
    fits: list[LayerFit] | None = None  # per layer, what calibration measured
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
    if to_gguf.is_gguf_out(settings.out):
        return _convert_to_gguf(settings)
    if settings.gguf_type is not None:
        raise UserError(f"--gguf-type {settings.gguf_type} is the type of a GGUF file's matrices; name OUT with "
                        ".gguf to write one, or drop --gguf-type")  # fmt: skip
    start = time.perf_counter()
    s = settings
    request = check_request(s)  # every problem with the settings, OUT and SRC, before anything is read
    raise_if_problems(request.problems)
    kv_heads, method, calibration, out_path = s.kv_heads, s.method, request.calibration, request.out

    with open_source(request.source, s.revision) as source:
        problems, spec, geometry = config_problems(source.config, kv_heads, calibration)
        problems += overlap_problems(source, out_path)
        raise_if_problems(problems)
        model_name = (source.config.get("architectures") or [spec.model_type])[0]
        spec = spec.stored_as(source.tensors.metadata())
        with_queries = calibration is not None
        layouts = [LayerLayout(spec, geometry, layer, with_queries) for layer in range(geometry.num_layers)]
        plan = plan_output(source, spec, geometry, layouts, kv_heads, torch_dtype(s.dtype))
        qk_norms = spec.shared_norms_in(source.config) or layouts[0].has_qk_norms(plan.layer_inputs[0])
        check_method(METHODS[method], method, model_name, qk_norms)
        text = None
        if calibration is not None:  # read before anything is written: too short, or not the recorded text
            text = read_calibration(calibration, source.load_tokenizer())
            raise_if_problems(text_problems(calibration, text, geometry.hidden_size))

        remove_leftovers(out_path)
        size = sum(meta.nbytes for meta in plan.tensors.values()) + _SPACE_MARGIN
        size += sum(path.stat().st_size for path in source.side_files())
        if calibration is not None:  # the fitted layers wait on disk, in float32, until the stream writes them
            size += sum(plan.tensors[name].nbytes // plan.tensors[name].dtype.itemsize * 4
                        for names in plan.layer_outputs for name in names)  # fmt: skip
        raise_if_problems([p for p in [space_problem(out_path, size)] if p])

        ctx = MethodContext(torch.Generator().manual_seed(s.seed), source.config.get("initializer_range", 0.02))
        with SourceHasher() as hasher, staged(out_path, s.force, size) as staging:
            calibrated = None
            if calibration is not None:
                ctx = replace(ctx, rotary_dim=rotary_dim(spec.model_type, source.config, geometry.head_dim))
                fitting = FitRequest(METHODS[method], kv_heads, s.grouping, ctx, keys_measurable=not qk_norms)
                calibrated = calibrate(source, spec, geometry, calibration, text, fitting, staging / _FITS, s.progress)
            converter = LayerConverter(METHODS[method], kv_heads, ctx, calibrated)
            with ShardWriter(staging, plan.tensors, request.shard_bytes) as writer:
                stream_tensors(source, plan, writer, converter, hasher, s.allow_nonfinite, s.progress)
                writer.close()
            write_config_and_side_files(source, spec, staging, kv_heads, s.dtype)
            record = provenance(source, spec, geometry, kv_heads, method, s.dtype, s.seed,
                                hasher.results(source.tensors.files))  # fmt: skip
            settings = resolved_record(s, source, out_path, text.sha256 if text is not None else None)
            record.update(grouping=s.grouping, calibration=None, settings=settings)
            if calibrated is not None:
                shutil.rmtree(calibrated.folder)
                record.update(
                    calibration={**calibration.record(text.sources, text.sha256), "device": calibrated.device,
                                 "seconds": calibrated.seconds},  # fmt: skip
                    rotary_dim=ctx.rotary_dim,
                    permutations=calibrated.orders,
                    fit_error=[fit.record() for fit in calibrated.fits],
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
        fits=calibrated.fits if calibrated else None,
        calibration_seconds=calibrated.seconds if calibrated else None,
    )


def _convert_to_gguf(settings: ConvertSettings) -> ConversionResult:
    """The conversion `settings` describe, written as the GGUF file `settings.out`: converted as usual into a
    work folder beside OUT, written from there as GGUF, renamed into place whole; the work folder is removed
    (after a kill, by the next run's clean-up of leftovers).

    Raises:
        UserError: bad input (see `convert`), an architecture or vocabulary llama.cpp's format cannot carry here,
            or OUT exists and is not a GGUF gqaify wrote (with --force) or --force is not given.
        ResourceError: the disk filled up; nothing is left behind.
    """
    s = settings
    raise_if_problems(required_problems(CONVERT, s))  # SRC and OUT, read below
    out = resolve_out(s.out)
    # the folder checks read the work folder's place beside OUT: inside the source, unwritable, ...
    problems = check_request(replace(s, out=str(out.with_name(f".{out.name}.gqaify-work")))).problems
    if _same_file(Path(s.src).expanduser(), out):  # not "pass --force": it would be refused
        problems.append(f"OUT {out} is the source; name another file to write")
    else:
        problems += [p for p in [to_gguf.destination_problem(out, s.force)] if p]
    problems += [p for p in [to_gguf.type_problem(s.gguf_type)] if p]
    if s.push_to_hub is not None:
        problems.append("--push-to-hub uploads a converted folder; upload a .gguf file with "
                        f"`huggingface-cli upload {s.push_to_hub} {out}`")  # fmt: skip
    raise_if_problems(problems)
    with open_source(s.src, s.revision) as source:  # refused before any work: what GGUF cannot carry here
        tokenizer_gguf = Path(source.name).expanduser() if source.kind == "gguf" else None
        vocabulary = None if tokenizer_gguf else to_gguf.vocabulary_problem(source.directory)
        raise_if_problems([p for p in (to_gguf.gguf_problem(source.config), vocabulary) if p])
    remove_leftovers(out)
    with work_folder(out) as work:  # this run's own: a rival run, or a file of the user's, is never written over
        result = convert_with(replace(s, out=str(work / "model"), force=False, push_to_hub=None, gguf_type=None))
        record = _gguf_record(json.loads((result.out / PROVENANCE_FILE).read_text()), out, s.gguf_type or "f16")
        partial = work / out.name
        try:
            to_gguf.write_gguf(result.out, partial, s.gguf_type or "f16", tokenizer_gguf, record)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ResourceError(f"no space left while writing {out}; nothing was left behind") from exc
            raise
        partial.chmod(0o666 & ~current_umask())
        file_into_place(partial, out, (lambda: to_gguf.destination_problem(out, True)) if s.force else None)
    return replace(result, out=out, num_shards=1, bytes_written=out.stat().st_size)


def _gguf_record(record: dict, out: Path, gguf_type: str) -> str:
    """The record a GGUF file carries: the work folder's gqaify.json with the GGUF's own OUT and type in its
    settings (so that `gqaify convert --config` with it reruns this GGUF conversion), and without the folder's
    file list (the file is one, and the record is inside it)."""
    settings = {**record["settings"], "out": str(out), "gguf_type": gguf_type}
    return json.dumps({**{k: v for k, v in record.items() if k != "files"}, "settings": settings}, indent=2)


def _same_file(src: Path, out: Path) -> bool:
    """Whether writing `out` would replace the file `src`: one path, or one file through a symbolic link (of the
    file or of a folder above it) or a hard link."""
    if not src.exists():
        return False
    return src.resolve() == out.resolve() or (out.exists() and os.path.samefile(src, out))


def resolved_record(s: ConvertSettings, source: Source, out: Path, calib_sha256: str | None) -> dict:
    """The settings as gqaify.json records them: paths absolute, a hub source pinned to the commit read, the
    calibration text pinned to the SHA-256 of the text read, so that `gqaify convert --config OUT/gqaify.json`
    reruns the conversion from anywhere, or refuses text that changed (what went how, not what was made, is left
    out: `NOT_RECORDED`)."""
    calib_data = None if s.calib_data is None else [_resolved_text(value) for value in s.calib_data]
    src = source.name if source.kind == "hub" else str(Path(source.name).expanduser().resolve())
    resolved = replace(s, src=src, out=str(out), revision=source.revision, calib_data=calib_data,
                       calib_sha256=calib_sha256)  # fmt: skip
    return recorded(resolved, NOT_RECORDED)


def _resolved_text(value: str) -> str:
    """A calibration source as a rerun from anywhere finds it: a local path absolute, its NAME= kept."""
    named = NamedText.parse(value)
    path = Path(named.source).expanduser()
    if not path.exists():
        return value
    return str(path.resolve()) if named.source == value else f"{named.name}={path.resolve()}"
