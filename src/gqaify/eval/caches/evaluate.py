"""Where `gqaify eval` meets the frontier: what --kv-cache and --retrieval ask that the models cannot give (refused
before any model is loaded), and the frontier of an evaluation once its models have been scored.

The engine is the formats': llama.cpp's cache types run every model in llama.cpp (every model must then be a
.gguf, the parent's reference included: the numbers a llama.cpp user gets); transformers' formats run the models in
transformers, where f16 is eval's own forward pass. f16 alone (the default) asks for no frontier.
"""

from __future__ import annotations

from dataclasses import dataclass

from gqaify.conversion.shapes import cached_per_token
from gqaify.errors import UserError
from gqaify.eval.caches.formats import (
    FULL,
    LLAMA_CPP,
    TRANSFORMERS,
    CacheFormat,
    cache_format,
    engine_of,
    format_problem,
)
from gqaify.eval.caches.results import Frontier
from gqaify.model.archs import ARCHITECTURES, ArchSpec
from gqaify.model.geometry import Geometry
from gqaify.model.locations import locate

READ_BACK = {
    LLAMA_CPP: "llama.cpp: each window evaluated in one pass in batches of 512, every token's keys and values "
    "written to the cache in its type and read back from it (flash attention on)",
    TRANSFORMERS: "transformers: f16 is a plain forward pass; a quantized cache is prefilled in chunks of {chunk} "
    "tokens through transformers' QuantizedCache, each chunk reading the earlier tokens back from it (the newest "
    "{residual} kept whole, KIVI's residual window)",
}


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
    return engine_of(s.kv_cache) or (LLAMA_CPP if _llama_only(s) else None)


def asked(s) -> bool:
    """Whether the settings `s` ask for a frontier: a format besides f16, a model only llama.cpp runs, or the
    retrieval check."""
    return engine(s) is not None or bool(s.retrieval)


def plan(s, seq_len: int) -> CachePlan:
    from gqaify.eval.caches.retrieval import ANSWER_TOKENS

    context = max([seq_len, *(n + ANSWER_TOKENS for n in s.retrieval)])
    return CachePlan(engine(s) or TRANSFORMERS, [cache_format(n) for n in s.kv_cache], context)


def served_only(s) -> set[str]:
    """The models of `s` that llama.cpp alone runs (a GGUF whose architecture transformers cannot read, such as
    llama.cpp's deepseek2), where the frontier is llama.cpp's: they are evaluated on the frontier only."""
    return _llama_only(s) if engine(s) == LLAMA_CPP else set()


def _llama_only(s) -> set[str]:
    from gqaify.eval.caches.llama_cpp_engine import KEYS_ONLY, gguf_architecture

    return {name for name in s.models[1:] if _is_gguf(name) and gguf_architecture(name) in KEYS_ONLY}


def cache_problems(s, configs: list) -> list[str]:
    """What the models cannot run of --kv-cache and --retrieval (`s`, with the models' `configs`), each in one line
    naming what can: a llama.cpp format for a model that is not a .gguf, or without llama-cpp-python; a transformers
    format whose package is missing, or for a model whose cache transformers holds otherwise than it is served; a
    retrieval prompt longer than a model's positions."""
    if format_problem(s.kv_cache, "--kv-cache") or not asked(s):
        return []  # what the settings' own check says
    problems = []
    if engine(s) == LLAMA_CPP:
        from gqaify.eval.caches.llama_cpp_engine import llama_cpp_problem

        missing = llama_cpp_problem()
        problems += [missing] if missing else []
        quantized = ", ".join(n for n in s.kv_cache if n != FULL)
        problems += [
            f"--kv-cache {quantized}: llama.cpp's formats run .gguf files, and {name} is not one; give "
            f"every model as .gguf (gqaify convert {name} OUT.gguf writes one), or take transformers' formats "
            f"(quanto4, quanto2, fp8)"
            for name in s.models
            if _is_gguf(name) is False
        ][:1]
        problems += _block_problems(s, configs) + ([] if missing else _probe_problems(s))
    else:
        problems += _transformers_problems(s, configs)
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


def _probe_problems(s) -> list[str]:
    """Each .gguf model run in llama.cpp in a child process, before any work could be lost: llama.cpp aborts the
    process (an assertion in C) or crashes on what it cannot run. The keys-only path (`KEYS_ONLY`) is tried with each
    format asked (llama.cpp 0.3.36 cannot hold most cache types there); any other file with the last one, as a build
    can crash on a file's quantized weights on a CPU it was not built for."""
    from gqaify.eval.caches.llama_cpp_engine import KEYS_ONLY, gguf_architecture, probe_problem

    tried = [(name, s.kv_cache if gguf_architecture(name) in KEYS_ONLY else s.kv_cache[-1:])
             for name in s.models if _is_gguf(name)]  # fmt: skip
    found = (probe_problem(name, cache_format(n)) for name, formats in tried for n in formats)
    return [p for p in found if p][:1]


def _block_problems(s, configs: list) -> list[str]:
    """llama.cpp's quantized types store blocks of values (32 for q8_0), which must divide each head's keys and
    values: a model whose heads are narrower cannot hold them (llama.cpp refuses to make its context)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for f in (cache_format(n) for n in s.kv_cache):
        for name, config in zip(s.models, configs, strict=True):
            if config is None or cached_per_token(config) is not None:
                continue  # a shape caching otherwise: llama.cpp checks its width as it makes the context
            spec = ARCHITECTURES.get(config.model_type) or ArchSpec(config.model_type)
            head = Geometry.from_config(spec, config.to_dict()).head_dim
            block = max(GGML_QUANT_SIZES[GGMLQuantizationType[t.upper()]][0] for t in (f.key_type, f.value_type))
            if head % block:
                return [
                    f"--kv-cache {f.name} stores blocks of {block} values, which do not divide the {head}-value heads "
                    f"of {name}; leave {f.name} out (f16 holds any head)"
                ]
    return []


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


def _transformers_problems(s, configs: list) -> list[str]:
    from gqaify.eval.caches.transformers_engine import backend_problem

    formats = [cache_format(n) for n in s.kv_cache]
    problems = list(dict.fromkeys(p for f in formats if f.quantized and (p := backend_problem(f.quantized, f.name))))
    if any(f.quantized for f in formats):
        for name, config in zip(s.models, configs, strict=True):
            if config is not None and cached_per_token(config) is not None:
                problems.append(
                    f"{name} caches values of its own shape, which transformers holds expanded into heads: its "
                    f"quantized cache would not be the one served; evaluate it as .gguf in llama.cpp"
                )
    return problems


def _is_gguf(name: str) -> bool | None:
    """Whether the model `name` is a .gguf file (None: it cannot be found, which the model checks report)."""
    try:
        return locate(name).kind == "gguf"
    except UserError:
        return None


def cached_values(config) -> tuple[int, int]:
    """The keys and the values one token caches over every layer of a model of `config`: whole K/V heads a key and a
    value each; a shape that caches otherwise, its values counted as keys (llama.cpp holds them so)."""
    spec = ARCHITECTURES.get(config.model_type) or ArchSpec(config.model_type)
    geometry = Geometry.from_config(spec, config.to_dict()).with_cached(cached_per_token(config))
    if geometry.cached is not None:
        return geometry.num_layers * geometry.cached, 0
    per_layer = geometry.num_kv_heads * geometry.head_dim
    return geometry.num_layers * per_layer, geometry.num_layers * per_layer


def run_frontier(s, report, texts, tokenizer, configs, labels, budget: int) -> Frontier:
    """The frontier of the evaluation `report` (its models scored, the parent first) on the parent's tokens of each
    text (`texts`: (name, ids)), with `tokenizer` for the retrieval prompts."""
    from gqaify.eval.caches import measure, retrieval
    from gqaify.eval.caches.engine import open_runner
    from gqaify.eval.caches.formats import RESIDUAL_TOKENS
    from gqaify.eval.caches.transformers_engine import CHUNK

    p = plan(s, s.seq_len)
    from gqaify.eval.caches.llama_cpp_engine import served_values

    models = [
        measure.CacheModel(name, label, *(cached_values(config) if config is not None else served_values(name)))
        for name, label, config in zip(s.models, labels, configs, strict=True)
    ]
    stride = s.seq_len if s.stride is None else s.stride
    prompts = retrieval.prompts(tokenizer, list(s.retrieval)) if s.retrieval else []
    panel = measure.Panel(texts, s.seq_len, stride, prompts, lambda ids: tokenizer.decode(ids))
    opener = lambda name: open_runner(p.engine, name, p.context, s)  # noqa: E731
    rows = measure.measure(p.engine, models, p.formats, panel, opener, s.progress)
    method = READ_BACK[p.engine].format(chunk=CHUNK, residual=RESIDUAL_TOKENS)
    return measure.frontier(p.engine, rows, method, _memory(s, report, rows, budget))


def _memory(s, report, rows, budget: int) -> tuple[str, float] | None:
    """The user's --memory-budget as a verdict's budget: how many times smaller than the parent's f16 cache a cache
    must be for the parent's weights and its whole context of it to fit `budget` bytes (None: the weights alone do
    not fit)."""
    context = report.models[0].max_positions or s.seq_len
    room = budget - report.models[0].weights_bytes
    if room <= 0:
        return None
    whole = rows[0].bytes_per_token * rows[0].times_smaller  # the parent's f16 cache per token
    return f"{budget / 2**30:.1f} GiB at {context:,} tokens", whole * context / room  # whose: the report says
