"""Everything that can be wrong with a conversion request, found before anything is written.

The options and OUT need no model; config.json adds the architecture, the value types, G against the K/V heads,
calibration against the hidden size; the opened source adds overlap with OUT and what the method may rewrite.
Each function returns its problems (or raises one `UserError`), so that `convert_with` reports them at once.
"""

from __future__ import annotations

from pathlib import Path

from gqaify.archs import ARCHITECTURES, ArchSpec, Geometry, arch_for
from gqaify.conversion.methods import Method
from gqaify.conversion.options import Calibration, ConvertSettings, method_problems
from gqaify.conversion.source import Source, read_config
from gqaify.errors import UserError
from gqaify.hub import repo_id_problem
from gqaify.locations import locate
from gqaify.outputs import destination_problems
from gqaify.sizes import parse_size


def request_problems(s: ConvertSettings, calibration: Calibration | None) -> list[str]:
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
    source_dir = Path(s.src or "").expanduser()
    if s.src and s.out and source_dir.is_dir() and _overlap(source_dir, Path(s.out).expanduser()):
        # OUT would be refused as existing; the real reason is that it is (or holds, or is held by) the source
        problems.append(_overlap(source_dir, Path(s.out).expanduser()))
    else:
        problems += destination_problems(s.out, s.force)
    try:
        locate(s.src, "SRC")
    except UserError as exc:
        problems.append(str(exc))
    return problems


def read_config_or_empty(directory: Path) -> dict:
    try:
        return read_config(directory)
    except UserError:
        return {}  # reported when the source is opened


def config_problems(config: dict, kv_heads, calibration: Calibration | None):
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
    elif calibration is not None:
        problems += [p for p in [calibration.size_problem(calibration.tokens, geometry.hidden_size)] if p]
    return problems, spec, geometry


def text_problems(calibration: Calibration, text, hidden_size: int) -> list[str]:
    """Problems with the calibration text read (a `calibrate.CalibrationText`): too few tokens for the model, or
    not the text that calib_sha256 records."""
    problems = [calibration.size_problem(len(text.ids), hidden_size), calibration.text_problem(text.sha256)]
    return [p for p in problems if p]


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
    src, dst = source_dir.resolve(), out.resolve()
    if dst == src:
        return f"OUT {out} is the source folder itself; the source is never modified: write the conversion elsewhere"
    if src in dst.parents or dst in src.parents:
        return f"OUT {out} overlaps the source folder {src}; write the conversion somewhere else"
    return None


def check_method(method: Method, name: str, model_name: str, qk_norms: bool) -> None:
    if method.folds and qk_norms:
        raise UserError(
            f"--method {name} folds rotations into q_proj rows, which the Q/K norms of {model_name} do not let "
            "through unchanged; use mean or norm-mean (with --grouping similarity if you like)"
        )
