"""The checks of a run's inputs made before anything is loaded or written: every problem at once."""

from __future__ import annotations

from pathlib import Path

from gqaify._version import __version__
from gqaify.conversion.record import ConversionRecord
from gqaify.errors import UserError, problems_in, raise_if_problems
from gqaify.model.archs import ARCHITECTURES, attention_pattern
from gqaify.model.loading import check_weights, load_config, untrusted_problem
from gqaify.model.locations import exists
from gqaify.output.destination import name_problem, resolve_out, writable_problem
from gqaify.records import PROVENANCE_FILE, read_provenance
from gqaify.text.corpus_format import corpus_record
from gqaify.text.loading import named_texts
from gqaify.text.pins import local_path
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
            if value.startswith((".", "/", "~")) and not exists(value):
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
                check_weights(value, key)
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
    problems += _corpus_parent_problems(s, configs.get("model"))
    positions = getattr(configs.get("model"), "max_position_embeddings", None)
    for key, length in (("seq_len", s.seq_len), ("eval_seq_len", s.eval_seq_len)):
        if positions and length and length > positions:
            problems.append(f"{key} {length} exceeds the {positions} positions of {s.model}; lower {key}")
    hidden = getattr(configs.get("model"), "hidden_size", None)
    if s.trainable == "lora" and hidden and s.lora_rank > hidden:  # before adapters that large are made
        problems.append(
            f"lora_rank {s.lora_rank:,} is more than the hidden size {hidden:,} of {s.model}: an adapter of that "
            "rank is no low-rank one; lower lora_rank"
        )
    if s.kv_heads is None:  # a model converted in the run is gqaify's own: its record reads
        problems += problems_in(_record_problem(s.model))
    raise_if_problems(problems)


def _record_problem(model: str) -> str | None:
    """Why the record (gqaify.json) in the model's folder cannot be read, which the run's end reads to write
    final/'s (`run_folder.save_final`): of a later gqaify (a field this one does not know), or damaged."""
    if not exists(model):
        return None  # a hub id (its record is read as it loads), or a name refused already
    folder = Path(model)
    try:
        ConversionRecord.read(folder)
    except (OSError, ValueError) as exc:  # the file is named in `exc`
        header = read_provenance(folder)
        if header is None or header.version in (None, __version__):
            return (
                f"model {model}: {exc}; convert the model again with gqaify convert, or move its "
                f"{PROVENANCE_FILE} aside to train it as a model gqaify did not convert"
            )
        return (
            f"model {model}: {exc} (it was written by gqaify {header.version}, this is gqaify {__version__}); "
            "upgrade gqaify (pip install -U gqaify), or convert the model again with this one"
        )
    return None


def _corpus_parent_problems(s: UptrainSettings, config) -> list[str]:
    """With distill_from_data, what says the corpus's stored top-K is another parent's than the run's: a vocabulary
    of another size than the model's (`config`), or a parent other than the run's `parent` (the model itself where
    the run converts it). A corpus whose record cannot be read is left to the data's own check."""
    if not s.distill_from_data or len(s.data) != 1:
        return []
    folder = Path(named_texts(s.data)[0].source).expanduser()
    try:
        record = corpus_record(folder) if folder.is_dir() else None
    except UserError:
        return []
    if record is None:
        return []
    written = f"data {s.data[0]} was written by {record.parent}"
    problems = []
    vocab = getattr(config, "vocab_size", None)
    if record.vocab_size is not None and vocab is not None and record.vocab_size != vocab:
        problems.append(
            f"{written}, whose vocabulary has {record.vocab_size:,} tokens, and the model {s.model} has {vocab:,}: its "
            "stored ids are another tokenizer's; generate the corpus from the model's parent"
        )
    parent = s.parent or (s.model if s.kv_heads is not None else None)
    theirs = local_path(record.parent)
    gone = theirs.startswith("/") and not exists(theirs)  # the parent's folder moved since: not known
    if parent is not None and not gone and local_path(parent) != theirs:
        named = "parent" if s.parent else "model (converted here: the parent)"
        problems.append(
            f"{written}, and the run's {named} is {parent}: distill_from_data would train toward another parent than "
            f"the one it is measured against; generate the corpus from {parent}, or set parent {record.parent}"
        )
    return problems


def _output_dir_problem(output_dir: str) -> str | None:
    """Why output_dir cannot hold the run: a name the file system refuses, a file, a folder that cannot be written."""
    if problem := name_problem(output_dir, "output_dir", beside=False):  # nothing beside it: no room to leave
        return problem
    out = resolve_out(output_dir)
    if out.exists() and not out.is_dir():
        return f"output_dir {out} is a file; choose a folder"
    return writable_problem(out, "output_dir")
