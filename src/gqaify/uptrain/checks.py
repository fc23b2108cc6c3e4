"""The checks of a run's inputs made before anything is loaded or written: every problem at once."""

from __future__ import annotations

from pathlib import Path

from gqaify.archs import ARCHITECTURES, attention_pattern
from gqaify.conversion.checkpoint import open_checkpoint
from gqaify.errors import UserError, problems_in, raise_if_problems
from gqaify.locations import locate
from gqaify.models import load_config, untrusted_problem
from gqaify.outputs import name_problem, resolve_out, writable_problem
from gqaify.uptrain.settings import UptrainSettings


def check_inputs(s: UptrainSettings) -> None:
    """Every problem at once: the settings' (`UptrainSettings.problems`); output_dir is a folder or absent; the models
    exist; the windows fit in the model's positions."""
    problems = s.problems()
    if s.output_dir:
        problems += problems_in(_output_dir_problem(s.output_dir))
    configs = {}
    for key in ("model", "distill_from", "parent"):
        if value := getattr(s, key):
            if value.startswith((".", "/", "~")) and not Path(value).expanduser().exists():
                # a recipe's path beside a checkout (ref-mha-6L-gqa2 by name from elsewhere): say what to pass
                problems.append(
                    f"{key} {value} does not exist here ({Path.cwd()}; a recipe's paths are read from the working "
                    f"directory); pass --{key} with a model folder, hub id or .gguf file"
                )
                continue
            try:
                # exists and is a model, whose weights are whole (their headers: a damaged one is found before
                # output_dir is touched, not by the load that follows the claim)
                configs[key] = load_config(value, option=key, trust_remote_code=s.trust_remote_code)
                _check_weights(value, key)
            except UserError as exc:
                problems.append(str(exc))
    model_type = getattr(configs.get("model"), "model_type", None)
    spec = ARCHITECTURES.get(model_type)
    if s.trainable != "all" and model_type is not None:  # before the model is loaded
        try:
            attention_pattern(model_type, f"trainable {s.trainable}")
        except UserError as exc:
            problems.append(str(exc))
    if s.kv_heads is not None and spec is not None and spec.shipped_class and not s.trust_remote_code:
        problems.append(untrusted_problem(f"model {s.model} converted to {s.kv_heads} K/V heads is a class that"))
    positions = getattr(configs.get("model"), "max_position_embeddings", None)
    for key, length in (("seq_len", s.seq_len), ("eval_seq_len", s.eval_seq_len)):
        if positions and length and length > positions:
            problems.append(f"{key} {length} exceeds the {positions} positions of {s.model}; lower {key}")
    raise_if_problems(problems)


def _check_weights(name: str, option: str) -> None:
    """Read the headers of a local folder's weights (a hub model's are fetched, and checked, as it loads; a .gguf
    file's header was read by `locate`).

    Raises:
        UserError: a shard is missing, cut short or damaged.
    """
    where = locate(name, option)
    if where.kind != "local":
        return
    try:
        open_checkpoint(where.path)
    except UserError as exc:
        raise UserError(f"{option} {name}: {exc}") from None


def _output_dir_problem(output_dir: str) -> str | None:
    """Why output_dir cannot hold the run: a name the file system refuses, a file, a folder that cannot be written."""
    if problem := name_problem(output_dir, "output_dir", beside=False):  # nothing beside it: no room to leave
        return problem
    out = resolve_out(output_dir)
    if out.exists() and not out.is_dir():
        return f"output_dir {out} is a file; choose a folder"
    return writable_problem(out, "output_dir")
