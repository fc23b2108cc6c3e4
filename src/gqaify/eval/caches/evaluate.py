"""Where `gqaify eval` meets the frontier: what --kv-cache and --retrieval ask that the models cannot give (refused
before any model is loaded), and the frontier of an evaluation once its models have been scored.

The engine is the formats': llama.cpp's cache types run every model in llama.cpp (every model must then be a
.gguf, the parent's reference included: the numbers a llama.cpp user gets); transformers' formats run the models in
transformers, where f16 is eval's own forward pass. f16 alone (the default) asks for no frontier.
"""

from __future__ import annotations

from dataclasses import dataclass

from gqaify.errors import UserError
from gqaify.eval.caches.engine import ROOMS, room
from gqaify.eval.caches.formats import TRANSFORMERS, CacheFormat, cache_format, engine_of, format_problem
from gqaify.eval.caches.results import Frontier


@dataclass(frozen=True)
class CachePlan:
    """What the frontier will run: its engine and formats, and the longest context a model is opened for."""

    engine: str
    formats: list[CacheFormat]
    context: int


def engine(s) -> str | None:
    """The engine the settings `s` evaluate caches in: the formats' (llama.cpp's or transformers'), or llama.cpp where
    a model only it can run is given (its f16 cache, on the frontier); None: f16 alone, today's evaluation."""
    if format_problem(s.kv_cache, "--kv-cache"):
        return None  # what the settings' own check says
    return engine_of(s.kv_cache) or next((e for e in ROOMS if room(e).only_here(s.models[1:])), None)


def asked(s) -> bool:
    """Whether the settings `s` ask for a frontier: a format besides f16, a model only llama.cpp runs, or the
    retrieval check."""
    return engine(s) is not None or bool(s.retrieval)


def plan(s, seq_len: int) -> CachePlan:
    from gqaify.eval.caches.retrieval import ANSWER_TOKENS

    context = max([seq_len, *(n + ANSWER_TOKENS for n in s.retrieval)])
    return CachePlan(engine(s) or TRANSFORMERS, [cache_format(n) for n in s.kv_cache], context)


def served_only(s) -> set[str]:
    """The models of `s` that the frontier's engine alone runs (a GGUF whose architecture transformers cannot read,
    such as llama.cpp's deepseek2): they are evaluated on the frontier only."""
    return room(chosen).only_here(s.models[1:]) if (chosen := engine(s)) else set()


def cache_problems(s, configs: list) -> list[str]:
    """What the models cannot run of --kv-cache and --retrieval (`s`, with the models' `configs`), each in one line
    naming what can: a llama.cpp format for a model that is not a .gguf, or without llama-cpp-python; a transformers
    format whose package is missing, or for a model whose cache transformers holds otherwise than it is served; a
    retrieval prompt longer than a model's positions."""
    if format_problem(s.kv_cache, "--kv-cache") or not asked(s):
        return []  # what the settings' own check says
    problems = room(engine(s) or TRANSFORMERS).problems(s, configs)
    problems += _retrieval_problems(s)
    for name, config in zip(s.models, configs, strict=True):
        positions = getattr(config, "max_position_embeddings", None) if config is not None else None
        longest = max(s.retrieval, default=0)
        if positions and longest > positions - 8:
            problems.append(
                f"--retrieval {longest:,} leaves no room for an answer in the {positions:,} positions of {name}; give "
                f"at most {positions - 8:,}"
            )
            break
    return problems


def _retrieval_problems(s) -> list[str]:
    """--retrieval lengths too short for a prompt's instruction, key and question in the parent's tokens."""
    if not s.retrieval:
        return []
    from gqaify.eval.caches.retrieval import shortest
    from gqaify.model.loading import load_tokenizer

    try:
        least = shortest(load_tokenizer(s.models[0])) + 16  # room for some filler
    except UserError:
        return []  # the parent's own checks say why
    short = [n for n in s.retrieval if n < least]
    return (
        [f"--retrieval {short[0]:,} is too short: {s.models[0]}'s tokens of a prompt need {least:,} or more"]
        if short
        else []
    )


def run_frontier(s, report, texts, tokenizer, configs, labels, budget: int) -> Frontier:
    """The frontier of the evaluation `report` (its models scored, the parent first) on the parent's tokens of each
    text (`texts`: (name, ids)), with `tokenizer` for the retrieval prompts."""
    from gqaify.eval.caches import measure, retrieval

    p = plan(s, s.seq_len)
    here = room(p.engine)
    models = [
        measure.CacheModel(name, label, *here.values(name, config))
        for name, label, config in zip(s.models, labels, configs, strict=True)
    ]
    stride = s.seq_len if s.stride is None else s.stride
    prompts = retrieval.prompts(tokenizer, list(s.retrieval)) if s.retrieval else []
    panel = measure.Panel(texts, s.seq_len, stride, prompts, lambda ids: tokenizer.decode(ids))
    opener = lambda name: here.open(name, p.context, s)  # noqa: E731
    rows = measure.measure(p.engine, models, p.formats, panel, opener, s.progress)
    return measure.frontier(p.engine, rows, here.read_back, _memory(s, report, rows, budget))


def _memory(s, report, rows, budget: int) -> tuple[str, float] | None:
    """The user's --memory-budget as a verdict's budget: how many times smaller than the parent's f16 cache a cache
    must be for the parent's weights and its whole context of it to fit `budget` bytes (None: the weights alone do
    not fit)."""
    context = report.models[0].max_positions or s.seq_len
    free = budget - report.models[0].weights_bytes
    if free <= 0:
        return None
    whole = rows[0].bytes_per_token * rows[0].times_smaller  # the parent's f16 cache per token
    return f"{budget / 2**30:.1f} GiB at {context:,} tokens", whole * context / free  # whose: the report says
