"""`gqaify eval`: every model beside the first (the parent) on the same text, windows and device.

For each model: perplexity (token, word, bits per byte), the KV cache (analytic, measured after a prefill,
ratio to the parent, what fits in a memory budget), prefill and decode speed, against the parent per-layer
diagnostics, and when asked, lm-evaluation-harness task scores and greedy continuations of prompts, all on
the one loaded model. Everything is checked before the first model runs (--out and its free space, the positions
each model has for --seq-len and --generate, the tasks' datasets), every problem in one message. The report is
written at the end as one folder that appears whole (`output.destination.staged`), so bad input, a failure, a stop or
a full disk leaves no partial report; --force replaces only a folder gqaify wrote.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
from dataclasses import replace

import torch

from gqaify.auto import is_auto
from gqaify.conversion.shapes import cache_label, cached_per_token, float16_problem, shape_of_model
from gqaify.errors import UserError, problems_in, raise_if_problems
from gqaify.eval.caches.evaluate import asked, cache_problems, served_only
from gqaify.eval.continuations import DEFAULT_PROMPTS, continuations, length_problem
from gqaify.eval.diagnostics import compare
from gqaify.eval.perplexity import perplexity
from gqaify.eval.report import REPORT_BYTES, write_report
from gqaify.eval.results import (
    EvalText,
    Generation,
    ModelReport,
    PanelSummary,
    Report,
    TextInfo,
    TextScore,
    model_labels,
)
from gqaify.eval.settings import DATA_PIN, EvalSettings, decode_context, window_length
from gqaify.eval.speed import Speed, pooled, timed_in_turns
from gqaify.eval.tasks import Harness
from gqaify.model.archs import ARCHITECTURES, ArchSpec
from gqaify.model.geometry import Geometry, float16_asked
from gqaify.model.kvcache import capacity, kv_cache_bytes, measured_kv_cache_bytes, sliding_windows
from gqaify.model.loading import check_weights, device_problem, load_config, load_model, load_tokenizer, resolve_device
from gqaify.model.locations import exists
from gqaify.output.destination import destination_problems, overlap_problem, resolve_out, space_problem
from gqaify.output.leftovers import remove_leftovers
from gqaify.progress import announce, progress_bar
from gqaify.records import REPORT
from gqaify.settings import recorded
from gqaify.sizes import parse_size
from gqaify.text.loading import NamedText, TextData, load_text, named_texts, tokenize, tokens_sha256
from gqaify.text.pins import local_path, located_all, panel_sha256, text_sha256

LOG = logging.getLogger(__name__)


def evaluate(
    models: list[str], data: str | list[str], out: str | os.PathLike, settings: EvalSettings | None = None
) -> Report:
    """Evaluate `models` (the first is the parent) on `data`, one text or a panel of them, and write the report to
    `out` (`run` with these in the settings).

    Args:
        data: a text (file, folder or hub name[:config][@split]) or several, each `NAME=SOURCE` or SOURCE alone.
        settings: the other fields of `EvalSettings`; its models, data and out, if set, must be these.

    Raises:
        UserError: bad input (every problem found, in one message); nothing is written.
        ResourceError: the disk filled up while writing the report; nothing is left behind.
    """
    data = [data] if isinstance(data, (str, os.PathLike)) else data
    given = {"models": [os.fspath(m) for m in models], "data": [os.fspath(d) for d in data], "out": os.fspath(out)}
    s = settings or EvalSettings()
    clash = next((name for name, value in given.items() if getattr(s, name) not in ([], None, value)), None)
    if clash is not None:
        raise UserError(
            f"evaluate's {clash} and its settings' {clash} differ; give {clash} once (as the argument, "
            f"or in the settings with gqaify.eval.run(settings))"
        )
    return run(replace(s, **given))


def run(settings: EvalSettings) -> Report:
    """The evaluation `settings` describe (see `evaluate`); what `gqaify eval` runs."""
    s = settings
    request = s.task_request()
    if s.out and s.out.strip():
        remove_leftovers(resolve_out(s.out))  # what a killed run left beside --out, before --out is checked
    configs, budget, device = _check(s)
    # the .gguf models llama.cpp alone runs (on the frontier only): those whose config `_check` did not read
    served = {name for name, config in zip(s.models, configs, strict=True) if config is None}
    s = replace(s, seq_len=window_length(s.seq_len, configs))  # the models' positions where --seq-len is not set
    stride = s.seq_len if s.stride is None else s.stride
    harness = Harness(request) if request.names else None  # the tasks' datasets are read here, before any model
    prompts = None if s.generate is None else list(s.generate or DEFAULT_PROMPTS)
    panel = _Panel(s, [(t, load_text(t.source, s.split, s.text_column)) for t in named_texts(s.data)])
    sha256 = panel_sha256([(t.name, text_sha256(loaded.text)) for t, loaded in panel.texts])
    raise_if_problems(DATA_PIN.problem(f"--data {' '.join(s.data)}", s.data_sha256, sha256))
    report = _new_report(s, panel, sha256, stride, device, budget)
    parent = parent_texts = parent_tokenizer = None
    speeds = _Speeds(s, alone=len(s.models) == 1)
    for i, (name, label) in enumerate(zip(s.models, model_labels(s.models), strict=True)):
        if name in served:
            report.notes.append(
                f"{label} is evaluated in llama.cpp alone (transformers cannot read its GGUF): see the frontier"
            )
            continue
        announce(f"loading {label}", shown=s.progress)
        model, tokenizer = load_model(name, s.dtype, device, trust_remote_code=s.trust_remote_code)
        fingerprint, texts = panel.read(tokenizer, name)
        same_vocabulary = getattr(configs[i], "vocab_size", None) == getattr(configs[0], "vocab_size", None)
        reference = (
            parent if parent is not None and fingerprint == report.models[0].tokenizer and same_vocabulary else None
        )
        scores = panel.score(label, model, texts, stride, reference, report.models[0].texts if report.models else None)
        ids = texts[0].ids  # the KV cache, decode speed and diagnostics are measured on the first text's tokens
        LOG.info("measuring %s", name)
        entry = _model_report(name, model, configs[i], fingerprint, scores, ids, s, budget)
        if s.speed:
            speeds.time(entry, model, ids, label)
        if harness:
            LOG.info("scoring %s on %s", name, ", ".join(harness.names))
            entry.tasks = harness.score(model, tokenizer)
        if prompts:
            written = continuations(model, tokenizer, prompts, s.generate_tokens)
            entry.generations = [Generation(p, t) for p, t in zip(prompts, written, strict=True)]
        if parent is None:
            parent, parent_ids, parent_texts, parent_tokenizer = model, ids, texts, tokenizer
        else:
            entry.delta_perplexity = entry.perplexity - report.models[0].perplexity
            entry.kv_ratio_to_parent = report.models[0].kv_cache_bytes_per_token / entry.kv_cache_bytes_per_token
            if reference is not None:
                announce(f"comparing {label}'s attention with the parent's, layer by layer", shown=s.progress)
                found = compare(parent, model, parent_ids[: min(s.diag_tokens, s.seq_len)])
                entry.diagnostics = found
            del model
            gc.collect()
        report.models.append(entry)
    if asked(s):
        _frontier(s, report, panel, parent_texts, parent_tokenizer, configs, budget)
    report.notes += _notes(s, panel, configs)
    write_report(report, resolve_out(s.out), s.force)
    return report


def _new_report(s: EvalSettings, panel: _Panel, sha256: str, stride: int, device, budget: int) -> Report:
    """The report before any model is measured: its texts, its settings and the memory its tables fill."""
    said = f"{budget / 2**30:.1f} GiB, {device_memory(device)[1]}" if is_auto(s.memory_budget) else s.memory_budget
    return Report(
        data=[
            TextInfo(t.name, t.source, s.split, s.text_column, loaded.rows, len(loaded.text))
            for t, loaded in panel.texts
        ],
        settings={**_recorded(s, sha256), "stride": stride, "device": str(device)},
        memory_budget=said,
    )


def _notes(s: EvalSettings, panel: _Panel, configs) -> list[str]:
    """What the report says under its table about how to read it: the decode context the speeds were timed at, and
    that token perplexities do not compare across tokenizers."""
    notes = []
    if s.speed and (note := _decode_context_note(s, configs)):
        notes.append(note)
    if len(panel.tokenizers) > 1:
        notes.append(
            "the models have different tokenizers: token perplexities are not comparable; "
            "compare word perplexity and bits per byte"
        )
    return notes


def _frontier(s: EvalSettings, report: Report, panel: _Panel, texts, tokenizer, configs, budget: int) -> None:
    """Every model that reads text as the parent does, under every --kv-cache format: `report.frontier`."""
    from gqaify.eval.caches.evaluate import run_frontier

    by_name = {m.model: m for m in report.models}
    same = [
        i
        for i, name in enumerate(s.models)
        if name not in by_name or by_name[name].tokenizer == report.models[0].tokenizer
    ]
    if len(same) < len(s.models):
        report.notes.append("the frontier leaves out the models whose tokenizer is not the parent's")
    kept = replace(s, models=[s.models[i] for i in same])
    every = model_labels(s.models)
    labels = [every[i] for i in same]
    named = [(named.name, text.ids) for (named, _), text in zip(panel.texts, texts, strict=True)]
    found = run_frontier(kept, report, named, tokenizer, [configs[i] for i in same], labels, budget)
    report.frontier = found


def device_memory(device: torch.device) -> tuple[int, str]:
    """The memory of `device` in bytes, and what it is: a GPU's own, or this machine's (--memory-budget auto)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(
            device
        ).total_memory, f"the memory of {torch.cuda.get_device_name(device)}"
    import psutil

    return psutil.virtual_memory().total, "this machine's memory"


def _recorded(s: EvalSettings, sha256: str) -> dict:
    """The settings as report.json records them: local paths absolute, links resolved (hub ids as given), and the
    texts pinned by `sha256`, so that `gqaify eval --config report.json` evaluates the same texts from any folder, or
    says they changed (--force is how that run went, not what it measured)."""
    models = [local_path(m) for m in s.models]
    resolved = replace(s, models=models, data=located_all(s.data), out=str(resolve_out(s.out)), data_sha256=sha256)
    return recorded(resolved, frozenset({"force"}))


class _Panel:
    """The texts of the panel, and their tokens under each tokenizer met, by what it does (`_fingerprint`).

    The first tokenizer to read a text cuts it at --max-tokens; the others read the same characters, so that word
    perplexity and bits per byte compare every model on one span of each text. A tokenizer that reads every span as
    one met before (the same ids) gets that one's tokens, and is the same tokenizer to the report, whatever its files
    (a GGUF's vocabulary and the tokenizer.json it was written from).
    """

    def __init__(self, s: EvalSettings, texts: list[tuple[NamedText, TextData]]):
        self.s, self.texts = s, texts
        self.spans: dict[str, int | None] = {t.name: None for t, _ in texts}
        self.tokens: dict[tuple[str, str], EvalText] = {}  # (text, fingerprint) -> its tokens and their span
        self.tokenizers: set[str] = set()

    def read(self, tokenizer, model_name: str) -> tuple[str, list[EvalText]]:
        """`tokenizer`'s fingerprint, and the tokens of every text it scores with: those of the first tokenizer met
        that read every span alike."""
        found = [self._tokens(named, loaded, tokenizer, model_name) for named, loaded in self.texts]
        fingerprint = _fingerprint(tokenizer, [whole for _, whole in found])
        for (named, _), (text, _) in zip(self.texts, found, strict=True):
            self.tokens.setdefault((named.name, fingerprint), text)
        self.tokenizers.add(fingerprint)
        return fingerprint, [self.tokens[named.name, fingerprint] for named, _ in self.texts]

    def _tokens(self, named: NamedText, loaded: TextData, tokenizer, model_name: str) -> tuple[EvalText, torch.Tensor]:
        """The tokens of one text to score (the first tokenizer's cut at --max-tokens), and of its span read whole:
        what tokenizers are compared on (a cut at --max-tokens may end where reading the span alone would not)."""
        span = self.spans[named.name]
        what = f"--data {named.source} with the tokenizer of {model_name}"
        found = tokenize(tokenizer, loaded.text[:span], self.s.max_tokens if span is None else None, what)
        given = len(loaded.text[:span])
        self.spans[named.name] = found.chars
        whole = found.ids if found.chars == given else tokenize(tokenizer, loaded.text[: found.chars], None, what).ids
        return EvalText.of(found.ids, loaded.text[: found.chars]), whole

    def score(
        self, label: str, model, texts: list[EvalText], stride: int, parent, parent_scores: list[TextScore] | None
    ) -> list[TextScore]:
        """`model` on every text (`texts`, its tokens of each); with `parent` (same tokenizer), its KL from the
        parent and its ratio to `parent_scores`, the parent's own."""
        s, scores = self.s, []
        for i, ((named, _), text) in enumerate(zip(self.texts, texts, strict=True)):
            LOG.info("evaluating %s on %s (%d tokens)", label, named.name, len(text.ids))
            desc = f"{label} · {named.name}"  # progress_bar fits it to a terminal, whole in a log
            ppl = perplexity(model, text.ids, s.seq_len, stride, s.batch_size, s.progress, desc=desc, parent=parent)
            parent_perplexity = None if parent is None else parent_scores[i].perplexity
            scores.append(TextScore.of(named.name, ppl, text.words, text.text_bytes, parent_perplexity))
        return scores


def _decode_context_note(s: EvalSettings, configs: list) -> str | None:
    """What the report says where a model's positions shortened the decode context (`decode_context`)."""
    for name, config in zip(s.models, configs, strict=True):
        positions = getattr(config, "max_position_embeddings", None)
        if (measured := decode_context(s.decode_context, s.decode_tokens, positions)) < s.decode_context:
            return (
                f"decode speed measured after a {measured:,}-token prefill, not --decode-context {s.decode_context:,}: "
                f"with --decode-tokens {s.decode_tokens:,} it fills the {positions:,} positions of {name}"
            )
    return None


def _model_report(name, model, config, fingerprint, scores: list[TextScore], ids, s: EvalSettings, budget: int):
    """The report of one model: its scores on the panel (the first text's also at the top, as one-text reports
    have it), and its KV cache, what fits in `budget` and its speed, measured on `ids` (the first text's)."""
    spec = ARCHITECTURES.get(config.model_type) or ArchSpec(config.model_type)
    geometry = Geometry.from_config(spec, config.to_dict()).with_cached(cached_per_token(config))
    dtype = model.dtype
    windows = sliding_windows(config)
    kv_tokens = min(s.seq_len, len(ids))
    analytic = kv_cache_bytes(geometry, dtype, kv_tokens, windows)
    with torch.inference_mode():
        cache = model(ids[:kv_tokens].unsqueeze(0).to(model.device), use_cache=True, logits_to_keep=1)
        measured = measured_kv_cache_bytes(cache.past_key_values)
        del cache
    positions = getattr(config, "max_position_embeddings", None)
    fits = capacity(geometry, dtype, windows, model.get_memory_footprint(), budget, s.seq_len, positions)
    first = scores[0]
    entry = ModelReport(
        model=name,
        model_type=config.model_type,
        num_attention_heads=geometry.num_heads,
        num_key_value_heads=geometry.num_kv_heads,
        cached_values=geometry.cached,
        cache_label=cache_label(config),
        dtype=str(dtype).removeprefix("torch."),
        parameters=model.num_parameters(),
        tokenizer=fingerprint,
        tokens_scored=first.tokens_scored,
        nll=first.nll,
        perplexity=first.perplexity,
        word_perplexity=first.word_perplexity,
        bits_per_byte=first.bits_per_byte,
        delta_perplexity=None,
        kv_cache_bytes_per_token=analytic / kv_tokens,
        kv_cache_bytes_analytic=analytic,
        kv_cache_bytes_measured=measured,
        kv_cache_tokens=kv_tokens,
        kv_ratio_to_parent=1.0,
        weights_bytes=fits.weights_bytes,
        max_context_at_budget=fits.max_context,
        max_positions=positions,
        usable_context=fits.usable_context,
        context_bound_by=fits.bound_by,
        max_batch_at_seq_len=fits.max_batch,
        words=first.words,
        text_bytes=first.text_bytes,
        texts=scores,
        panel=PanelSummary.of(scores),
    )
    return entry


class _Speeds:
    """Prefill and decode speed, each model timed in turns with the parent (`speed.timed_in_turns`: parent, model,
    parent, model, ...); the parent's own figures pool its turns beside every model (timed alone if it is the only
    model). Each model's report keeps the parent's runs timed beside it, which its own are compared with."""

    def __init__(self, s: EvalSettings, alone: bool):
        self.s, self.alone = s, alone
        self.parent = None  # (the parent's model, its context) once met
        self.parent_entry: ModelReport | None = None
        self.parent_turns: list[tuple[Speed, Speed]] = []  # (batch 1, decode batch) beside each model

    def time(self, entry: ModelReport, model, ids, label: str) -> None:
        """Time `model` after a prefill of `ids`' first --decode-context tokens (fewer where its positions end
        first) and write its figures into `entry`; the first model met is the parent."""
        s = self.s
        context = ids[: min(decode_context(s.decode_context, s.decode_tokens, entry.max_positions), len(ids))]
        if self.parent is None:
            self.parent, self.parent_entry = (model, context), entry
            if not self.alone:
                return  # timed in turns with each other model
        runs = [(model, context)] if self.alone else [self.parent, (model, context)]
        total = 2 * len(runs) * (s.repeats + 1)  # warm-up and repeats, at batch 1 and at --decode-batch
        with progress_bar(total=total, unit="run", desc=f"timing {label}", shown=s.progress) as bar:
            single = timed_in_turns(runs, 1, s.decode_tokens, s.repeats, tick=bar.update)
            batched = timed_in_turns(runs, s.decode_batch, s.decode_tokens, s.repeats, tick=bar.update)
        _record_speed(entry, single[-1], batched[-1])
        if not self.alone:
            entry.parent_decode_spread = single[0].decode
            self.parent_turns.append((single[0], batched[0]))
            pooled_single, pooled_batched = (pooled(list(turns)) for turns in zip(*self.parent_turns, strict=True))
            _record_speed(self.parent_entry, pooled_single, pooled_batched)


def _record_speed(entry: ModelReport, single: Speed, batched: Speed) -> None:
    entry.prefill_tokens_per_s = single.prefill_tokens_per_s
    entry.decode_tokens_per_s = single.decode_tokens_per_s
    entry.decode_tokens_per_s_batched = batched.decode_tokens_per_s
    entry.decode_spread = single.decode
    entry.prefill_spread = single.prefill
    entry.batched_decode_spread = batched.decode


# -- input -------------------------------------------------------------------------------------------------


def _check(s: EvalSettings) -> tuple[list, int, torch.device]:
    """Every problem with the settings, --out, --memory-budget, --device and the models, raised as one `UserError`;
    else the models' configs (None for a model llama.cpp alone runs: `served_only`), the memory budget in bytes and
    the device."""
    problems = s.problems() + _out_problems(s)
    budget = None if is_auto(s.memory_budget) else parse_size(s.memory_budget)
    if budget is None and not is_auto(s.memory_budget):
        problems.append(f"--memory-budget {s.memory_budget!r} is not a size; write it like 80GB or 24GiB")
    problems += problems_in(device_problem(s.device))
    configs, served = [], served_only(s)
    for name in s.models:
        config = None
        try:
            config = None if name in served else load_config(name, trust_remote_code=s.trust_remote_code)
            check_weights(name)  # whole, before the first model is loaded (the parent is evaluated first)
        except UserError as exc:
            problems.append(str(exc))
        configs.append(config)
    problems += _position_problems(s, configs) + problems_in(_stride_problem(s, configs))
    problems += [p for name, config in zip(s.models, configs, strict=True) if (p := _float16_problem(s, name, config))]
    problems += cache_problems(s, configs)
    raise_if_problems(problems)
    device = resolve_device(s.device)
    return configs, budget or device_memory(device)[0], device


def _float16_problem(s: EvalSettings, name: str, config) -> str | None:
    """A model whose shape float16 cannot hold (`Shape.float16`) asked to load in float16, by --dtype or its config."""
    if config is None:
        return None
    said = float16_asked(s.dtype, config, "its config's")
    found = shape_of_model(config)
    problem = float16_problem(found and found.float16, said, "evaluate it with --dtype bfloat16 or float32")
    return problem and f"{name}: " + problem


def _out_problems(s: EvalSettings) -> list[str]:
    """--out: not what the evaluation reads (a model, a text, --include-path), a folder that can be created (or,
    with --force, replaced: a report gqaify wrote, `output.destination.replace_problem`), with room for the report."""
    out = s.out
    if not out or not out.strip():
        return []  # required: a problem already
    texts = named_texts([d for d in s.data if isinstance(d, str)])
    read = [(name, "the model") for name in s.models] + [(t.source, "the text") for t in texts]
    read += [(s.include_path, "--include-path")] if s.include_path else []
    for path, what in read:
        local = isinstance(path, str) and path.strip() and exists(path)  # else a hub name
        if local and (overlap := overlap_problem(out, path, what, "--out")):
            return [overlap]  # not "pass --force": the report would replace what it reports on
    return destination_problems(out, s.force, "--out", writes=REPORT) or problems_in(
        space_problem(resolve_out(out), REPORT_BYTES, "--out")
    )


def _position_problems(s: EvalSettings, configs: list) -> list[str]:
    """--seq-len, and --generate's prompts with --generate-tokens, against each model's positions (the first model
    they do not fit is named: the others are usually its conversions)."""
    problems, generation = [], s.generate is not None and s.generate_tokens >= 1
    for name, config in zip(s.models, configs, strict=True):
        positions = None if config is None else getattr(config, "max_position_embeddings", None)
        if not positions:
            continue
        if s.seq_len is not None and s.seq_len > positions:
            problems.append(f"--seq-len {s.seq_len} exceeds the {positions} positions of {name}; lower --seq-len")
        if s.speed and s.decode_tokens >= positions:
            problems.append(
                f"--decode-tokens {s.decode_tokens:,} leaves no room for a context in the {positions} positions of "
                f"{name}; lower --decode-tokens below {positions}"
            )
        found = _generation_problems(s, name, positions) if generation else []
        problems += found
        generation = generation and not found
    return problems


def _stride_problem(s: EvalSettings, configs: list) -> str | None:
    """--stride against the window the models' positions give where --seq-len is not set (`window_length`; against a
    --seq-len given, the settings check it)."""
    window = window_length(s.seq_len, configs)
    if s.seq_len is not None or s.stride is None or s.stride <= window:
        return None
    return f"--stride {s.stride} exceeds the {window}-token windows the models' positions give; lower --stride"


def _generation_problems(s: EvalSettings, name: str, positions: int) -> list[str]:
    """--generate's prompts, read with the tokenizer of `name` alone (no model yet), and --generate-tokens."""
    try:
        tokenizer = load_tokenizer(name)
    except UserError as exc:
        return [str(exc)]
    problem = length_problem(tokenizer, list(s.generate or DEFAULT_PROMPTS), s.generate_tokens, positions, name)
    return [problem] if problem else []


# A text every tokenizer also reads, beside the texts evaluated: words, numbers, code, accents, other scripts, emoji
PROBE = "The café's naïve résumé, 3.14 × 2,048 tokens!\n\tdef f(x):  return x ** 2  # 東京 Привет 😀 <s></s>"


def _fingerprint(tokenizer, texts: list[torch.Tensor]) -> str:
    """What `tokenizer` does, hashed: the size of its vocabulary, its special tokens, its ids of `PROBE` and its ids of
    the texts evaluated (`texts`). Tokenizers with equal fingerprints give the models the same ids, whatever their
    files hold: a GGUF's vocabulary, read by transformers, is serialized otherwise than the tokenizer.json it was
    written from, and reads text alike."""
    special = {name: [value, tokenizer.convert_tokens_to_ids(value)] for name, value in _special_tokens(tokenizer)}
    described = json.dumps([len(tokenizer), special, tokenizer(PROBE)["input_ids"], tokens_sha256(texts)])
    return hashlib.sha256(described.encode()).hexdigest()[:12]


def _special_tokens(tokenizer) -> list[tuple[str, str | list[str]]]:
    """The named special tokens (bos, eos, unk, pad, ...) of `tokenizer` that it has, by name."""
    return sorted((name, value) for name, value in tokenizer.special_tokens_map.items() if value is not None)
