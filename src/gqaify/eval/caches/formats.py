"""The KV cache formats `gqaify eval --kv-cache` evaluates a model under, as data: each format's name, the engine
that serves it, and the bits one cached value costs in it, scales counted (light: `--help` reads the names).

    f16          the cache whole, at 16 bits a value (both engines; transformers holds the model's own dtype)
    q8_0 ...     llama.cpp's cache types, K and V alike (q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl), or K/V apart:
                 q8_0/q4_0 holds keys in q8_0 and values in q4_0 (llama.cpp's --cache-type-k/-v)
    quanto4 ...  transformers' `QuantizedCache`: optimum-quanto's 4- and 2-bit integers (quanto4, quanto2) in groups
                 of 64 values (a scale and a zero point each, 16 bits apiece), the last `RESIDUAL_TOKENS` tokens kept
                 whole (KIVI's residual window); fp8, transformers' per-tensor float8 cache (no package needed)

A cached value's cost is what the engine stores for it: a llama.cpp block type's bytes over its values (q8_0: 34
bytes for 32 values, 8.5 bits), read from the gguf package's table of them; a group-wise integer's bits plus its
group's scale and zero point shared by its `GROUP` values.
"""

from __future__ import annotations

from dataclasses import dataclass

LLAMA_CPP = "llama.cpp"
TRANSFORMERS = "transformers"
ENGINES = (TRANSFORMERS, LLAMA_CPP)

FULL = "f16"  # the cache whole: the reference every other format of a model is measured against
LLAMA_CPP_TYPES = ("f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")  # those its flash attention reads
GROUP = 64  # values per scale and zero point in transformers' group-wise caches (its default q_group_size)
RESIDUAL_TOKENS = 128  # the newest tokens transformers' group-wise caches keep whole (its default residual_length)


@dataclass(frozen=True)
class QuantizedCacheKind:
    """One of transformers' `QuantizedCache` settings: its backend, bits and the package the backend needs."""

    backend: str  # QuantizedCache's backend: "quanto", "hqq" or "fp8"
    nbits: int | None  # None: fp8, which takes no group-wise settings
    package: str | None  # the module the backend imports (None: transformers alone)
    install: str  # what installs it


QUANTIZED_CACHES = {
    "quanto4": QuantizedCacheKind("quanto", 4, "optimum.quanto", "pip install 'gqaify[cache]'"),
    "quanto2": QuantizedCacheKind("quanto", 2, "optimum.quanto", "pip install 'gqaify[cache]'"),
    "fp8": QuantizedCacheKind("fp8", None, None, "nothing: transformers has it"),
}


@dataclass(frozen=True)
class CacheFormat:
    """A format a KV cache is held in: its name as `--kv-cache` takes it, the engine that serves it, and the bits of a
    key and of a value in it, scales counted."""

    name: str
    engine: str  # TRANSFORMERS, LLAMA_CPP, or "" for f16, which both serve
    key_bits: float
    value_bits: float
    key_type: str = FULL  # llama.cpp's type name for the keys, and for the values (f16 elsewhere)
    value_type: str = FULL

    @property
    def whole(self) -> bool:
        """The cache unquantized: the format every other one of a model is compared with."""
        return self.name == FULL

    def served_by(self, engine: str) -> bool:
        return self.whole or self.engine == engine

    def bytes_per_token(self, key_values: int, value_values: int) -> float:
        """The bytes one token's cache takes: `key_values` keys and `value_values` values over every layer."""
        return (key_values * self.key_bits + value_values * self.value_bits) / 8

    @property
    def quantized(self) -> QuantizedCacheKind | None:
        """The transformers `QuantizedCache` this format is, or None (f16, llama.cpp's types)."""
        return QUANTIZED_CACHES.get(self.name)


def ggml_bits(type_name: str) -> float:
    """The bits one value costs in llama.cpp's type `type_name` (q8_0: 8.5), its block's scales counted, from the
    gguf package's table of block sizes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    return 8 * block_bytes / values


def _group_bits(kind: QuantizedCacheKind) -> float:
    return 8.0 if kind.nbits is None else kind.nbits + 2 * 16 / GROUP  # fp8's one scale per tensor: nothing a token


def cache_format(name: str) -> CacheFormat:
    """The format `name` (`--kv-cache`'s spelling).

    Raises:
        ValueError: not a format (`format_problem` says so in one line).
    """
    if name in QUANTIZED_CACHES:
        bits = _group_bits(QUANTIZED_CACHES[name])
        return CacheFormat(name, TRANSFORMERS, bits, bits)
    key, _, value = name.partition("/")
    value = value or key
    if key in LLAMA_CPP_TYPES and value in LLAMA_CPP_TYPES and name.count("/") <= 1:
        engine = "" if name == FULL else LLAMA_CPP
        return CacheFormat(name, engine, ggml_bits(key), ggml_bits(value), key, value)
    raise ValueError(name)


def format_names() -> list[str]:
    """Every name `--kv-cache` takes, K/V pairs aside (any two of `LLAMA_CPP_TYPES` as K/V)."""
    return list(LLAMA_CPP_TYPES) + list(QUANTIZED_CACHES)


def format_problem(names: list[str], field: str) -> str | None:
    """What is wrong with the formats `names` (`--kv-cache`), in one line naming those that exist; None: nothing."""
    unknown = [n for n in names if not _known(n)]
    if unknown:
        return (
            f"{field} {', '.join(map(repr, unknown))}: not a cache format; give {', '.join(format_names())}, or two "
            f"of llama.cpp's as K/V (q8_0/q4_0)"
        )
    if len(set(names)) < len(names):
        return f"{field} names a format twice; give each once"
    engines = {cache_format(n).engine for n in names} - {""}
    if len(engines) > 1:
        return (
            f"{field} mixes llama.cpp's formats ({', '.join(n for n in names if cache_format(n).engine == LLAMA_CPP)}) "
            f"with transformers' ({', '.join(n for n in names if cache_format(n).engine == TRANSFORMERS)}); a "
            f".gguf model is evaluated in llama.cpp, a folder in transformers: give one engine's formats"
        )
    return None


def _known(name: str) -> bool:
    try:
        cache_format(name)
    except (ValueError, KeyError):
        return False
    return True


def engine_of(names: list[str]) -> str | None:
    """The engine the formats `names` need (None: f16 alone, which today's evaluation already measures)."""
    return next((e for n in names if (e := cache_format(n).engine)), None)
