"""The checks of a run's inputs, made before anything is written: every problem at once, and what the checks read,
for the run to use rather than read again (`Inputs`). They read first (`_read`), then judge what they read."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqaify._version import __version__
from gqaify.auto import AUTO
from gqaify.conversion.record import ConversionRecord
from gqaify.conversion.shapes import float16_problem, shape, shape_of_model, trained_attention
from gqaify.errors import UserError, raise_if_problems
from gqaify.eval.tasks import Harness
from gqaify.model.archs import ARCHITECTURES
from gqaify.model.geometry import float16_asked
from gqaify.model.loading import check_weights, load_config, load_tokenizer, untrusted_problem
from gqaify.model.locations import exists
from gqaify.output.destination import name_problem, resolve_out, writable_problem
from gqaify.packaged import PLACEHOLDERS
from gqaify.records import PROVENANCE_FILE, CorpusRecord, read_provenance
from gqaify.text.corpus_format import corpus_record, count_problem
from gqaify.text.loading import NamedText, named_texts, named_texts_problem, unavailable
from gqaify.text.pins import local_path
from gqaify.uptrain.settings import UptrainSettings
from gqaify.uptrain.sharding import fsdp_problem

MODELS = ("model", "distill_from", "parent")  # the settings that name a model


@dataclass(frozen=True)
class Inputs:
    """What the checks read of a run's inputs, for the run to use rather than read again: the config of each model the
    settings name (by its setting, one of `MODELS`), the model's tokenizer, the tasks' harness (None without
    eval_tasks), and with distill_from_data the record of the corpus (None: none, or one that cannot be read, which
    the data's own reading says)."""

    configs: dict[str, Any]
    tokenizer: Any
    harness: Harness | None
    corpus: CorpusRecord | None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: every stored id of a corpus it trains on falls in it."""
        return self.configs["model"].vocab_size


def check_inputs(s: UptrainSettings) -> Inputs:
    """Every problem at once, before anything is written: the settings' (`UptrainSettings.problems`) and the launch's
    (a tracker in log_to that is not installed, FSDP1 without GPUs); output_dir is a folder or absent; the models
    exist, whole, the model with its tokenizer (`_read`); every text the run reads can be read (`_text_problems`);
    what trains is known in its architecture; the windows fit in its positions; a corpus of stored log-probabilities
    is its parent's.

    Returns:
        what was read (`Inputs`).

    Raises:
        UserError: every problem found, in one message.
    """
    problems = s.problems() + _launch_problems(s)
    found, unread = _read(s)
    model = found.configs.get("model")
    raise_if_problems(
        problems,
        _output_dir_problem(s.output_dir) if s.output_dir else None,
        _inside_a_model_problem(s) if s.output_dir else None,
        unread,
        _text_problems(s),
        _trainable_problem(s, model),
        _untrusted_problem(s, model),
        _vocab_problem(s, found.corpus, model),
        _parent_problem(s, found.corpus),
        s.window_problems(getattr(model, "max_position_embeddings", None)),
        _lora_rank_problem(s, model),
        None if s.converts else _record_problem(s.model),  # a model converted in the run is gqaify's own
        _float16_problem(s, model),
    )
    return found


def _float16_problem(s: UptrainSettings, model) -> str | None:
    """float16 for a model whose shape float16 cannot hold (`Shape.float16`), or a run that converts to one: fp16
    mixed precision (asked here or by the launch), or a model whose config stores float16, the dtype final/ would be
    saved in (as eval refuses to load it so)."""
    precision = s.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    written = [shape(s.attention)] if s.converts else []
    written += [found] if model is not None and (found := shape_of_model(model)) else []
    why = next((x.float16 for x in written if x.float16 is not None), None)
    if precision == "fp16":
        said = "mixed_precision fp16" + ("" if s.mixed_precision else " (the launch's)")
        return float16_problem(why, said, "train with mixed_precision bf16 or no")
    if s.converts or why is None or not float16_asked(AUTO, model, "its config's"):
        return None
    return f"model {s.model}: " + float16_problem(
        why,
        "its config's float16 (final/ is saved in the dtype the config names)",
        f'set "dtype" to "float32" or "bfloat16" in {s.model}/config.json',
    )


def _launch_problems(s: UptrainSettings) -> list[str]:
    """What the launch cannot run: a tracker in log_to whose package is not installed (accelerate would drop it
    without a word), or FSDP1 on a machine without an accelerator (`sharding.fsdp_problem`)."""
    from accelerate.tracking import get_available_trackers

    available = {str(t) for t in get_available_trackers()} | {"csv"}
    missing = [t for t in s.log_to if t not in available]
    problems = [f"log_to {missing[0]} needs its package; pip install {missing[0]}"] if missing else []
    return problems + [p for p in [fsdp_problem()] if p]


def _read(s: UptrainSettings) -> tuple[Inputs, list[str]]:
    """(what the checks read (`Inputs`), why each of the rest cannot be read): the tasks' harness (where the request
    itself is sound), the corpus's record, each model's config where it exists and is a model whose weights are
    whole (their headers: a damaged one is found before output_dir is touched, not by the load that follows the
    claim), and the model's tokenizer."""
    unread = []
    request = s.task_request()
    harness = None
    if request.names and not request.problems():
        try:
            harness = Harness(request)  # reads the tasks' datasets
        except UserError as exc:
            unread.append(str(exc))
    corpus = None
    if s.distill_from_data and len(s.data) == 1:
        folder = Path(named_texts(s.data)[0].source).expanduser()
        with contextlib.suppress(UserError):  # a corpus whose record cannot be read: refused by the data's reading
            corpus = corpus_record(folder) if folder.is_dir() else None
    configs = {}
    for key in (k for k in MODELS if getattr(s, k)):
        value = getattr(s, key)
        if value in PLACEHOLDERS and not exists(value):  # a printed command pasted as it is: never asked of the hub
            unread.append(f"{key} {value} is a printed command's placeholder; replace it with {PLACEHOLDERS[value]}")
            continue
        if value.startswith((".", "/", "~")) and not exists(value):
            # a recipe's path beside a checkout (ref-mha-6L-gqa2 by name from elsewhere): say what to pass
            unread.append(
                f"{key} {value} does not exist here ({Path.cwd()}; a recipe's paths are read from the working "
                f"directory); pass --{key} with a model folder, hub id or .gguf file"
            )
            continue
        try:
            configs[key] = load_config(value, option=key, trust_remote_code=s.trust_remote_code)
            check_weights(value, key)
        except UserError as exc:
            unread.append(str(exc))
    tokenizer = None
    if "model" in configs:
        try:
            tokenizer = load_tokenizer(s.model, option="model")
        except UserError as exc:
            unread.append(str(exc))
    return Inputs(configs, tokenizer, harness, corpus), unread


def _text_problems(s: UptrainSettings) -> list[str]:
    """Each text the run would fail to read, named at once (`text.loading.unavailable`): a local path that is not
    there, and where the hub does not answer, a hub dataset datasets' cache cannot give. The run reads the calibration
    text (a calibrated conversion's: the training text unless calib_data is given) first, then the training text,
    then eval_data, and each used to stop it in turn. A source named twice is said once; a field whose values the
    settings refuse is left to that refusal."""
    calibration = s.calibrated_on_data() if s.converts else s
    reads = [
        ("calib_data", calibration.calib_data if s.converts else None, s.calib_split or s.split, True),
        ("data", s.data, s.split, s.streaming),
        ("eval_data", s.eval_data, s.eval_split, False),
    ]
    problems, failed = [], set()
    for option, values, split, streaming in reads:
        if not values or named_texts_problem(values, option):
            continue
        for source in [t.source for t in named_texts(values) if t.source not in failed]:
            if problem := unavailable(source, split, option, streaming):
                problems.append(problem)
                failed.add(source)
    return problems


def _trainable_problem(s: UptrainSettings, config) -> str | None:
    """Why what trains cannot be found in the model's architecture (said before the model is loaded)."""
    model_type = getattr(config, "model_type", None)
    if s.trainable == "all" or model_type is None:
        return None
    try:
        trained_attention(model_type, f"trainable {s.trainable}")
    except UserError as exc:
        return str(exc)
    return None


def _untrusted_problem(s: UptrainSettings, config) -> str | None:
    """A conversion to a class only gqaify's shipped modeling code implements, without trust_remote_code."""
    spec = ARCHITECTURES.get(getattr(config, "model_type", None))
    if not s.converts or spec is None or not spec.shipped_class or s.trust_remote_code:
        return None
    heads = f"{s.kv_heads} K/V heads" if s.kv_heads is not None else f"1/{s.kv_cut:g} of its cache"
    return untrusted_problem(f"model {s.model} converted to {heads} is a class that")


def _lora_rank_problem(s: UptrainSettings, config) -> str | None:
    """An adapter rank above the model's hidden size (said before adapters that large are made)."""
    hidden = getattr(config, "hidden_size", None)
    if s.trainable != "lora" or not hidden or s.lora_rank <= hidden:
        return None
    return (
        f"lora_rank {s.lora_rank:,} is more than the hidden size {hidden:,} of {s.model}: an adapter of that rank is "
        "no low-rank one; lower lora_rank"
    )


def _vocab_problem(s: UptrainSettings, corpus: CorpusRecord | None, config) -> str | None:
    """A corpus of stored top-K (its record `corpus`) in a vocabulary of another size than the model's: its stored ids
    are another tokenizer's."""
    vocab = getattr(config, "vocab_size", None)
    if corpus is None or corpus.vocab_size is None or vocab is None or corpus.vocab_size == vocab:
        return None
    folder = Path(NamedText.parse(s.data[0]).source)
    if damaged := count_problem(corpus, f"data {folder}: its record {folder / PROVENANCE_FILE}"):
        return f"{damaged}; write the corpus again (gqaify generate)"  # a vocabulary of -1 is no other tokenizer's
    return (
        f"data {s.data[0]} was written by {corpus.parent}, whose vocabulary has {corpus.vocab_size:,} tokens, and the "
        f"model {s.model} has {vocab:,}: its stored ids are another tokenizer's; generate the corpus from the model's "
        "parent"
    )


def _parent_problem(s: UptrainSettings, corpus: CorpusRecord | None) -> str | None:
    """A corpus of stored top-K (its record `corpus`) written by another parent than the run's `parent` (the model
    itself where the run converts it): the run would train toward one parent and be measured against another."""
    parent = s.parent or (s.model if s.converts else None)
    if corpus is None or parent is None:
        return None
    theirs = local_path(corpus.parent)
    if theirs.startswith("/") and not exists(theirs) or local_path(parent) == theirs:  # moved since: not known
        return None
    named = "parent" if s.parent else "model (converted here: the parent)"
    return (
        f"data {s.data[0]} was written by {corpus.parent}, and the run's {named} is {parent}: distill_from_data would "
        f"train toward another parent than the one it is measured against; generate the corpus from {parent}, or set "
        f"parent {corpus.parent}"
    )


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


def _inside_a_model_problem(s: UptrainSettings) -> str | None:
    """output_dir at or inside a model folder the run reads (its model, teacher or parent), at any depth: the run would
    write its checkpoints and final/ into the user's model, as convert refuses to. (A model inside output_dir, the
    run's own converted/, is the other way round, and allowed.)"""
    out = resolve_out(s.output_dir).resolve()
    for option in ("model", "distill_from", "parent"):
        value = getattr(s, option)
        folder = Path(value).expanduser() if value else None
        if folder is None or not os.path.isdir(folder):  # os.path: no error on a name the file system refuses
            continue
        folder = folder.resolve()
        if out == folder or folder in out.parents:
            return (
                f"output_dir {s.output_dir} is inside {option} {value}, which the run reads and never writes; choose "
                "an output_dir outside it"
            )
    return None


def _output_dir_problem(output_dir: str) -> str | None:
    """Why output_dir cannot hold the run: a name the file system refuses, a file, a folder that cannot be written."""
    if problem := name_problem(output_dir, "output_dir", beside=False):  # nothing beside it: no room to leave
        return problem
    out = resolve_out(output_dir)
    if out.exists() and not out.is_dir():
        return f"output_dir {out} is a file; choose a folder"
    return writable_problem(out, "output_dir")
