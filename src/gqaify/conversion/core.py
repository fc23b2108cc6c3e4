"""Convert a checkpoint's attention from KV to G key/value heads, streaming: the steps in order, each a function.

check   every problem with the request at once, before anything is read: the options, OUT (as its sink sees
        it: a folder, or a GGUF file), SRC (`checks.check_request`, the sink's `problems`)
plan    with the source open once: config.json (value types, G against the K/V heads, calibration size against
        the hidden size, and against the weights' shapes, read from their headers), what the sink and the method
        cannot take, the calibration text (enough tokens, the text calib_sha256 records); then every output
        tensor's name, shape, dtype and shard (`_plan`)
fit     with calibration text only: walk the parent layer by layer and fit each converted layer (`calibrate`)
stream  take tensors in source order: copy unchanged ones through as bytes; hold a layer's head-indexed
        inputs until all have arrived, check they are finite, convert them with the method, write them (`stream`)
commit  config.json, side files, the model card and the record go into the sink's folder, which the sink
        makes OUT only when everything is there (`sinks`: renamed into place, or written as one GGUF file)
warn    a method that read no calibration text and changed the heads it replaced: one line on what that costs a
        trained model, and the conversion that avoids it (`conversion.settings.uncalibrated_warning`)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from gqaify._version import __version__
from gqaify.conversion.budget import resolve_cut
from gqaify.conversion.calibrate import (
    CalibratedLayers,
    CalibrationText,
    FitRequest,
    LayerFit,
    calibrate,
    read_calibration,
    short_sources,
)
from gqaify.conversion.card import model_card, source_metadata
from gqaify.conversion.checkpoint import ShardWriter
from gqaify.conversion.checks import (
    Request,
    check_request,
    config_problems,
    method_problem,
    overlap_problems,
    text_problems,
    weight_problem,
)
from gqaify.conversion.layout import LayerLayout
from gqaify.conversion.methods import METHODS, MethodContext
from gqaify.conversion.record import ConversionRecord, SourceRecord, kv_groups, write_config_and_side_files
from gqaify.conversion.settings import (
    NOT_RECORDED,
    UNCALIBRATED_LOG,
    Calibration,
    ConvertSettings,
    uncalibrated_warning,
)
from gqaify.conversion.shapes import Rewritten, shape
from gqaify.conversion.sinks import FolderSink, GgufSink, Written, sink_for
from gqaify.conversion.source import Source, open_source
from gqaify.conversion.stream import LayerConverter, Plan, SourceHasher, plan_output, stream_tensors
from gqaify.errors import raise_if_problems
from gqaify.model.archs import ArchSpec
from gqaify.model.dtypes import torch_dtype
from gqaify.model.geometry import Geometry, rotary_dim
from gqaify.model.hub import push_folder
from gqaify.model.kvcache import kv_cache_bytes_per_token
from gqaify.model.loading import load_model
from gqaify.output.destination import space_problem
from gqaify.output.leftovers import remove_leftovers
from gqaify.progress import announce
from gqaify.settings import recorded
from gqaify.text.pins import located_all

LOG = logging.getLogger(__name__)

_SPACE_MARGIN = 1 << 20  # bytes beyond the planned tensors: shard headers, index, config, card, provenance
_FITS = ".gqaify-fits"  # the fitted layers, in the staging folder while the stream writes them


@dataclass(frozen=True)
class ConversionResult:
    """A conversion: its record (what gqaify.json says of it) and how the run went."""

    out: Path
    record: ConversionRecord = field(repr=False)  # printed whole, it is the model card, every hash, every layer's fit
    kv_bytes_per_token_before: int
    kv_bytes_per_token_after: int
    tensors_converted: int
    tensors_copied: int
    num_shards: int
    bytes_written: int
    seconds: float
    fits: list[LayerFit] | None = None  # per layer, what calibration measured

    # What the record says, under the names a result has always had.
    model_type = property(lambda self: self.record.model_type)
    method = property(lambda self: self.record.method)
    kv_heads = property(lambda self: self.record.kv_heads)
    attention = property(lambda self: self.record.attention)  # "GQA-2", "MQA", or a rewrite's (`ShapeRecord`)
    groups = property(lambda self: self.record.groups)  # the source K/V heads pooled into each new one
    grouping = property(lambda self: self.record.grouping)
    permutations = property(lambda self: self.record.permutations)  # per layer, the source K/V heads' new order
    num_heads = property(lambda self: self.record.source_geometry.num_heads)
    source_kv_heads = property(lambda self: self.record.source_geometry.num_kv_heads)

    @property
    def calibration_seconds(self) -> dict | None:
        """Time spent capturing, fitting, repairing and refining (None without calibration)."""
        return None if self.record.calibration is None else self.record.calibration.seconds


def convert(
    src: str | os.PathLike, out: str | os.PathLike, kv_heads: int | None = None, **settings
) -> ConversionResult:
    """Convert the checkpoint `src` to `kv_heads` key/value heads (or to the cache `kv_cut` says) and save it as a
    plain checkpoint at `out`.

    Args:
        src: a local model folder, a Hugging Face hub id, or a `.gguf` file. Never modified.
        out: the folder to create. Written beside, renamed into place when complete.
        kv_heads: G, the new number of K/V heads; must divide the source's. 1 is MQA. None: `kv_cut` says.
        settings: the other fields of `ConvertSettings` (method, calib_data, dtype, force, push_to_hub, ...),
            the same as the command line's options.

    Raises:
        UserError: bad input; nothing is written. Or the push failed; `out` is complete.
        ResourceError: the disk filled up while writing; nothing is left behind.
    """
    return convert_with(ConvertSettings(src=os.fspath(src), out=os.fspath(out), kv_heads=kv_heads, **settings))


def convert_with(settings: ConvertSettings) -> ConversionResult:
    """The conversion `settings` describe (see `convert`); what `gqaify convert` runs, in its steps."""
    start = time.perf_counter()
    s, sink = settings, sink_for(settings)
    request = check_request(sink.checked(s))  # every problem with the settings, OUT and SRC, before reading
    raise_if_problems(sink.said(request.problems), sink.problems(s))
    with open_source(request.source, s.revision) as source:
        s = _cut(s, source)
        plan = _plan(s, request, source, sink)
        remove_leftovers(sink.out)
        raise_if_problems(space_problem(sink.out, plan.size))
        ctx = _context(s, source, plan)  # one, for the fit and the stream: its random generator runs through both
        if note := shape(s.attention).cost_note(s, plan.geometry):
            announce(note, shown=s.progress)
        with SourceHasher() as hasher, sink.folder(plan.size) as folder:
            calibrated = _fit(s, source, plan, ctx, folder)
            converter = LayerConverter(METHODS[s.method], s.kv_heads, ctx, calibrated)
            writer = _stream(s, source, plan, converter, hasher, folder)
            rewritten = _rewrite(s, plan, folder, source)
            record = _record(sink.recorded(s), sink.out, source, plan, ctx, calibrated, hasher, rewritten)
            model_card(record).save(folder / "README.md")
            written = sink.finish(folder, record, rewritten or writer, source)
    if converter.changed_heads:  # said before a push, which may fail
        logging.getLogger(UNCALIBRATED_LOG).warning(uncalibrated_warning(s.method, s.src))
    if s.push_to_hub is not None:
        message = f"{record.attention} of {source.name} by gqaify {__version__} (--method {s.method})"
        push_folder(written.out, s.push_to_hub, message)
    LOG.info("wrote %s", written.out)
    return _result(record, plan, calibrated, written, time.perf_counter() - start)


def _cut(s: ConvertSettings, source: Source) -> ConvertSettings:
    """`s` with what `--kv-cut` decides of the opened source filled in (`budget.resolve_cut`); as it is without."""
    if s.kv_cut is None:
        return s
    checked = config_problems(source.config, None, None)
    if checked.geometry is None:
        return s  # `_plan` says what is wrong with config.json
    resolved, problems = resolve_cut(s, checked.geometry)
    raise_if_problems(problems)
    return resolved


@dataclass(frozen=True)
class _Plan:
    """What the plan step worked out from the opened source, for the steps after it."""

    spec: ArchSpec
    geometry: Geometry
    layouts: list[LayerLayout]
    output: Plan  # every output tensor, its shard and dtype
    shard_bytes: int | None  # the output's largest shard
    calibration: Calibration | None
    qk_norms: bool  # the model normalises Q and K per head (what a method may rewrite depends on it)
    text: CalibrationText | None  # the calibration text read, if any
    size: int  # the bytes the conversion writes, at most


def _converted_from(source: Source) -> str:
    """Where a source gqaify itself converted (a shape's rewrite, which no shape converts again) came from: "; it is
    gqaify's conversion of P: convert P instead", or "" for any other source."""
    try:
        record = ConversionRecord.read(source.directory) if source.kind == "local" else None
    except ValueError:  # a damaged record: the source is refused for its architecture all the same
        record = None
    return "" if record is None else f"; it is gqaify's conversion of {record.source.name}: convert that instead"


def _plan(s: ConvertSettings, request: Request, source: Source, sink: FolderSink | GgufSink) -> _Plan:
    """Every problem the opened source shows (config.json, overlap with OUT, what the sink and the method cannot
    take, the calibration text), raised at once; else the plan of the output."""
    checked = config_problems(source.config, s.kv_heads, request.calibration)
    if checked.spec is None:  # a model gqaify does not convert: nothing else is checked against it
        raise_if_problems([f"{checked.problems[0]}{_converted_from(source)}", *checked.problems[1:]])
    raise_if_problems(
        checked.problems,
        overlap_problems(source, request.out),
        shape(s.attention).problems(s, source.config, isinstance(sink, GgufSink)),
        sink.source_problems(source),
    )
    metas = source.tensors.metadata()
    spec, geometry = checked.spec.stored_as(metas), checked.geometry
    raise_if_problems(weight_problem(spec, geometry, source.config, {n: tuple(m.shape) for n, m in metas.items()}))
    calibration = request.calibration
    layouts = [LayerLayout(spec, geometry, layer, calibration is not None) for layer in range(geometry.num_layers)]
    output = plan_output(source, spec, geometry, layouts, s.kv_heads, torch_dtype(s.dtype))
    qk_norms = spec.shared_norms_in(source.config) or layouts[0].has_qk_norms(output.layer_inputs[0])
    model_name = (source.config.get("architectures") or [spec.model_type])[0]
    raise_if_problems(method_problem(METHODS[s.method], s.method, model_name, qk_norms))
    text = None
    if calibration is not None:  # read before anything is written: too short, or not the recorded text
        text = read_calibration(calibration, source.load_tokenizer())
        raise_if_problems(text_problems(calibration, text, geometry.hidden_size))
        for warning in short_sources(text):
            LOG.warning(warning)
    weights = max(
        sum(meta.nbytes for meta in output.tensors.values()), shape(s.attention).weight_bytes(s, source.config)
    )
    size = weights + _SPACE_MARGIN
    size += sum(path.stat().st_size for path in source.side_files())
    if calibration is not None:  # the fitted layers wait on disk, in float32, until the stream writes them
        size += sum(
            output.tensors[name].nbytes // output.tensors[name].dtype.itemsize * 4
            for names in output.layer_outputs
            for name in names
        )
    return _Plan(spec, geometry, layouts, output, request.shard_bytes, calibration, qk_norms, text, size)


def _context(s: ConvertSettings, source: Source, plan: _Plan) -> MethodContext:
    ctx = MethodContext(torch.Generator().manual_seed(s.seed), source.config.get("initializer_range", 0.02))
    if plan.text is None:
        return ctx
    return replace(ctx, rotary_dim=rotary_dim(plan.spec.model_type, source.config, plan.geometry.head_dim))


def _fit(s: ConvertSettings, source: Source, plan: _Plan, ctx: MethodContext, folder: Path) -> CalibratedLayers | None:
    """With calibration text: the parent walked layer by layer and each converted layer fitted (`calibrate`),
    kept on disk in `folder` until the stream writes it."""
    if plan.calibration is None:
        return None
    fitting = FitRequest(METHODS[s.method], s.kv_heads, s.grouping, ctx, keys_measurable=not plan.qk_norms)
    return calibrate(source, plan.spec, plan.geometry, plan.calibration, plan.text, fitting, folder / _FITS, s.progress)


def _stream(
    s: ConvertSettings, source: Source, plan: _Plan, converter: LayerConverter, hasher: SourceHasher, folder: Path
) -> ShardWriter:
    """Every tensor into `folder`'s shards (unchanged ones as bytes, the attention converted by `converter`), then
    config.json and the side files; the fitted layers' folder is removed."""
    calibrated = converter.calibrated
    with ShardWriter(folder, plan.output.tensors, plan.shard_bytes) as writer:
        stream_tensors(source, plan.output, writer, converter, hasher, s.allow_nonfinite, s.progress)
        writer.close()
    write_config_and_side_files(source, plan.spec, folder, s.kv_heads, s.dtype)
    if calibrated is not None:
        shutil.rmtree(calibrated.folder)
    return writer


def _rewrite(s: ConvertSettings, plan: _Plan, folder: Path, source: Source) -> Rewritten | None:
    """The G-head checkpoint in `folder` made the attention shape asked for (`conversion.shapes`), what it needs
    fitted on the calibration text against the source; None where the G-head conversion is the output."""
    parent = source.name if source.kind == "gguf" else str(source.directory)  # a hub source: the commit read

    def load_parent():
        return load_model(parent, dtype=torch.float32, option="SRC")[0]

    return shape(s.attention).rewrite(folder, s, plan.text, load_parent, plan.geometry)


def _record(
    s: ConvertSettings,
    out: Path,
    source: Source,
    plan: _Plan,
    ctx: MethodContext,
    calibrated: CalibratedLayers | None,
    hasher: SourceHasher,
    rewritten: Rewritten | None,
) -> ConversionRecord:
    """The conversion's record (gqaify.json; inside a GGUF, `to_gguf.RECORD_KEY`): enough to rerun it."""
    text, geometry = plan.text, plan.geometry
    calibration = None
    if calibrated is not None:
        calibration = plan.calibration.record(text.sources, text.sha256, calibrated.device, calibrated.seconds)
    return ConversionRecord(
        version=__version__,
        source=SourceRecord.of(source, hasher.results(source.tensors.files)),
        model_type=plan.spec.model_type,
        method=s.method,
        kv_heads=s.kv_heads,
        source_geometry=geometry,
        groups=kv_groups(geometry.num_kv_heads, s.kv_heads),
        dtype=s.dtype,
        shipped=plan.spec.shipped_class,
        card=source_metadata(source.directory, source.kind, source.name),
        seed=s.seed if s.method == "random" else None,
        grouping=s.grouping,
        calibration=calibration,
        settings=resolved_record(s, source, out, text.sha256 if text is not None else None),
        rotary_dim=ctx.rotary_dim,
        permutations=calibrated.orders if calibrated is not None else None,
        fit_error=[fit.record() for fit in calibrated.fits] if calibrated is not None else None,
        rewrite=rewritten.record.named(s.attention) if rewritten is not None else None,
    )


def _result(
    record: ConversionRecord, plan: _Plan, calibrated: CalibratedLayers | None, written: Written, seconds: float
) -> ConversionResult:
    output, geometry = plan.output, plan.geometry
    kv_dtype = output.tensors[output.layer_outputs[0][0]].dtype
    converted = sum(len(names) for names in output.layer_outputs)
    return ConversionResult(
        out=written.out,
        record=record,
        kv_bytes_per_token_before=kv_cache_bytes_per_token(geometry, kv_dtype),
        kv_bytes_per_token_after=kv_cache_bytes_per_token(record.output_geometry, kv_dtype),
        tensors_converted=converted,
        tensors_copied=len(output.tensors) - converted,
        num_shards=written.num_shards,
        bytes_written=written.bytes_written,
        seconds=seconds,
        fits=calibrated.fits if calibrated else None,
    )


def resolved_record(s: ConvertSettings, source: Source, out: Path, calib_sha256: str | None) -> dict:
    """The settings as gqaify.json records them: paths absolute, a hub source pinned to the commit read, the
    calibration text pinned to the SHA-256 of the text read, so that `gqaify convert --config OUT/gqaify.json`
    reruns the conversion from anywhere, or refuses text that changed (what went how, not what was made, is left
    out: `NOT_RECORDED`)."""
    resolved = replace(
        s,
        src=source.recorded_name,
        out=str(out),
        revision=source.revision,
        calib_data=located_all(s.calib_data),
        calib_sha256=calib_sha256,
    )
    return recorded(resolved, NOT_RECORDED)
