"""Everything that can be wrong with a conversion request, found before anything is written.

The settings, OUT and where SRC is need no model (`check_request`, which keeps what it worked out: where SRC is,
the shard size in bytes); config.json adds the architecture, the value types, G against the K/V heads,
calibration against the hidden size; the opened source adds overlap with OUT, config.json against the weights'
shapes (`weight_problem`) and what the method may rewrite.
Each function returns its problems (`gqaify.errors.Found`), so that the conversion reports them at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gqaify.conversion.methods import Method
from gqaify.conversion.settings import Calibration, ConvertSettings
from gqaify.conversion.source import Source, read_config
from gqaify.errors import UserError, problems_in
from gqaify.model.archs import ARCHITECTURES, ArchSpec, arch_for
from gqaify.model.geometry import Geometry
from gqaify.model.locations import Location, locate
from gqaify.output.destination import destination_problems, overlap_problem, resolve_out
from gqaify.records import CONVERSION
from gqaify.sizes import parse_size


@dataclass(frozen=True)
class Request:
    """A conversion request as checked before anything is read: every problem found, and what the checks worked
    out on the way, kept for the conversion rather than worked out again (the rest holds only without problems)."""

    problems: list[str]
    source: Location | None  # where SRC is
    out: Path  # OUT, absolute
    shard_bytes: int | None  # max_shard_size in bytes
    calibration: Calibration | None


def check_request(s: ConvertSettings) -> Request:
    """Everything wrong with the request that needs no model, at once: the settings (`ConvertSettings.problems`),
    max_shard_size, OUT, and whether SRC can exist; and, if anything is wrong, what SRC's config.json would add,
    where reading it is free (a local folder)."""
    problems = s.problems()
    shard_bytes = parse_size(s.max_shard_size)
    if shard_bytes is None:
        problems.append(f"--max-shard-size {s.max_shard_size!r} is not a size; write it like 5GB, 500MB or 2GiB")
    source = None
    if _given(s.src):  # else a problem already
        try:
            source = locate(s.src, "SRC")
        except UserError as exc:
            problems.append(str(exc))
    out = resolve_out(s.out) if _given(s.out) else Path()
    if _given(s.out):
        overlap = _overlap(source.path, Path(s.out).expanduser()) if source and source.kind == "local" else None
        # OUT would be refused as existing; the real reason is that it is (or holds, or is held by) the source
        problems += [overlap] if overlap else destination_problems(s.out, s.force, writes=CONVERSION)
    calibration = s.calibration()
    if problems and source is not None and source.kind == "local" and (source.path / "config.json").is_file():
        with contextlib.suppress(UserError):  # an unreadable config.json: reported when the source is opened
            problems += config_problems(read_config(source.path), s.kv_heads, calibration).problems
    return Request(problems, source, out, shard_bytes, calibration)


def _given(text: str | None) -> bool:
    return text is not None and bool(text.strip())


@dataclass(frozen=True)
class ConfigCheck:
    """What a source's config.json says of converting it: its problems, and, as far as the checks got, its
    architecture and geometry (both set when there are no problems)."""

    problems: list[str]
    spec: ArchSpec | None = None
    geometry: Geometry | None = None


def config_problems(config: dict, kv_heads, calibration: Calibration | None) -> ConfigCheck:
    """The problems of converting a model with `config`: architecture, value types, G, calibration size."""
    model_type = config.get("model_type")
    if (quantized := _quantization_problem(config)) is not None:
        return ConfigCheck([quantized])
    if model_type not in ARCHITECTURES:
        try:
            arch_for(model_type, config.get("architectures"))
        except UserError as exc:
            return ConfigCheck([str(exc)])
    spec = ARCHITECTURES[model_type]
    problems = Geometry.problems(spec, config)
    if spec.refused_when and config.get(spec.refused_when[0]):
        problems.append(f"gqaify does not convert {model_type} with {spec.refused_when[0]}: {spec.refused_when[1]}")
    if problems:
        return ConfigCheck(problems, spec)
    geometry = Geometry.from_config(spec, config)
    model_name = (config.get("architectures") or [spec.model_type])[0]
    if isinstance(kv_heads, int) and kv_heads >= 1:
        problems += _kv_heads_problems(spec, geometry, kv_heads, model_name)
    if calibration is not None and spec.no_calibration:
        problems.append(
            f"{model_name} cannot be calibrated: {spec.no_calibration}; convert it with --method mean "
            "or norm-mean, without --calib-data"
        )
    elif calibration is not None:
        problems += problems_in(calibration.size_problem(calibration.tokens, geometry.hidden_size))
    return ConfigCheck(problems, spec, geometry)


def text_problems(calibration: Calibration, text, hidden_size: int) -> list[str]:
    """Problems with the calibration text read (a `calibrate.CalibrationText`): too few tokens for the model, or
    not the text that calib_sha256 records. --calib-tokens itself was checked before the text was read
    (`request_problems`), so text too short for the fit is the text's problem."""
    return problems_in(calibration.text_size_problem(text, hidden_size), calibration.text_problem(text.sha256))


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


def overlap_problems(source: Source, out: Path) -> list[str]:
    if source.kind == "gguf":  # its folder is a temporary export
        return []
    problem = _overlap(source.directory, out)
    return [problem] if problem else []


def _overlap(source_dir: Path, out: Path) -> str | None:
    """Why OUT may not be written where it is: it is the source folder, inside it, or holds it; else None."""
    return overlap_problem(out, source_dir, "the source folder")


def method_problem(method: Method, name: str, model_name: str, qk_norms: bool) -> str | None:
    """Why `method` cannot rewrite this model's attention (its Q/K norms stop a rotation folded into q_proj)."""
    if method.folds and qk_norms:
        return (
            f"--method {name} folds rotations into q_proj rows, which the Q/K norms of {model_name} do not let "
            "through unchanged; use mean or norm-mean (with --grouping similarity if you like)"
        )
    return None


def weight_problem(
    spec: ArchSpec, geometry: Geometry, config: dict, shapes: Mapping[str, tuple[int, ...]]
) -> str | None:
    """Where config.json disagrees with the weights' shapes (`shapes`, from the safetensors headers: no data read):
    the token embedding against (vocab_size, hidden_size), every attention projection against what the head
    counts, head_dim and hidden_size imply. A tensor absent here is left to the plan (`LayerLayout.inputs`)."""
    expected = _expected_shapes(spec, geometry, config)
    wrong = [
        (name, shape, keys) for name, (shape, keys) in expected.items() if name in shapes and shapes[name] != shape
    ]
    if not wrong:
        return None
    name, shape, keys = wrong[0]
    more = f" (and {len(wrong) - 1} more tensors)" if len(wrong) > 1 else ""
    return (
        f"the checkpoint's config.json does not match its weights: config.json's {keys} imply {name!r} of shape "
        f"{list(shape)}, but its shape is {list(shapes[name])}{more}; use the config.json that came with these weights"
    )


def _expected_shapes(spec: ArchSpec, g: Geometry, config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (the shape config.json implies, the config.json values that imply it, as the message names
    them), for the embedding and each layer's attention projections."""
    hidden = f"{spec.hidden_size_key} = {g.hidden_size}"
    head_dim = f"{spec.head_dim_key or 'head_dim'} = {g.head_dim}"
    heads = f"{spec.num_heads_key} = {g.num_heads}"
    kv_heads = f"{spec.num_kv_heads_key} = {g.num_kv_heads}"
    expected = {}
    vocab, width_key = config.get(spec.vocab_size_key), spec.embed_width_key or spec.hidden_size_key
    width = config.get(width_key, g.hidden_size)  # OPT's word_embed_proj_dim defaults to hidden_size
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (vocab, width)):
        keys = f"{spec.vocab_size_key} = {vocab} and {width_key} = {width}"
        expected[f"{spec.embed_tokens}.weight"] = ((vocab, width), keys)
    q_rows, kv_rows = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    if spec.qkv_proj:
        projections = [(spec.qkv_proj, q_rows + 2 * kv_rows, f"{heads}, {kv_heads}, {head_dim} and {hidden}")]
    else:
        projections = [
            (spec.q_proj, q_rows, f"{heads}, {head_dim} and {hidden}"),
            (spec.k_proj, kv_rows, f"{kv_heads}, {head_dim} and {hidden}"),
            (spec.v_proj, kv_rows, f"{kv_heads}, {head_dim} and {hidden}"),
        ]
    # (module, rows, columns of the (out, in) weight, the values that imply them)
    matrices = [(name, rows, g.hidden_size, keys) for name, rows, keys in projections]
    matrices.append((spec.o_proj, g.hidden_size, q_rows, f"{hidden}, {heads} and {head_dim}"))
    for layer in range(g.num_layers):
        for module, rows, columns, keys in matrices:
            path = spec.module(layer, module)
            weight = (columns, rows) if spec.transposed else (rows, columns)  # stored (in, out): GPT-2's Conv1D
            expected[f"{path}.weight"] = (weight, keys)
            expected[f"{path}.bias"] = ((rows,), keys)
    return expected
