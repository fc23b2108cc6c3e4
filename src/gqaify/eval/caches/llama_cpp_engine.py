"""The llama.cpp room of `--kv-cache`: a .gguf model run in llama.cpp itself (llama-cpp-python, the `serving`
extra), its cache types set as `llama-server --cache-type-k/-v` sets them, with flash attention on (llama.cpp needs
it to hold the values quantized, and a server asked for a quantized cache runs with it).

A window is evaluated in one `eval` of its tokens in batches of `BATCH`: llama.cpp writes each batch's keys and
values into its cache in the cache's type and attends from the cache, so every token, the batch's own included, is
read back as the cache holds it. The logits of every position come from `logits_all`. The bytes of the cache are
what llama.cpp reports allocating (its log, read from the process's standard error while the context is made).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from gqaify.conversion.shapes import cached_per_token
from gqaify.errors import UserError
from gqaify.eval.caches.formats import FULL, CacheFormat, cache_format
from gqaify.eval.caches.values import cached_values
from gqaify.model.archs import ARCHITECTURES, ArchSpec
from gqaify.model.geometry import Geometry
from gqaify.model.locations import locate

# GGUF architectures whose cache llama.cpp holds as keys alone, reading the values from them (deepseek2's absorbed
# attention, which gqaify writes for its own shape)
KEYS_ONLY = {"deepseek2"}
PROBE_SECONDS = 600  # for a child process to load a model and evaluate 8 tokens of it
BATCH = 512  # tokens per llama.cpp batch (llama-server's default n_batch is 2,048, its n_ubatch 512)
_ALLOCATED = re.compile(r"llama_kv_cache: +size = +([\d.]+) MiB \( *(\d+) cells")


def llama_cpp_problem() -> str | None:
    """Why llama.cpp cannot run here (llama-cpp-python is not installed), or None."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return (
            "llama.cpp's cache formats run in llama-cpp-python, which is not installed; pip install 'gqaify[serving]'"
        )
    return None


# Makes a context and evaluates a few tokens in a process of its own: llama.cpp aborts the process on some models and
# cache types (an assertion in C), which no exception in this one could catch.
_PROBE = """
import sys, llama_cpp
value = sys.argv[3]
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, n_ubatch=64, logits_all=True, verbose=False,
                      type_k=getattr(llama_cpp, "GGML_TYPE_" + sys.argv[2].upper()),
                      type_v=getattr(llama_cpp, "GGML_TYPE_" + value.upper()), flash_attn=value != "f16")
llm.eval(list(range(8)))
"""


def probe_problem(path: str, cache: CacheFormat) -> str | None:
    """Why llama.cpp cannot run the GGUF `path` with its cache as `cache`, found in a child process (None: it can): an
    assertion it fails (a cache type it cannot hold for that file), or a crash (a build that cannot run the file's
    weights on this CPU: some crash on quantized ones)."""
    import subprocess

    argv = [sys.executable, "-c", _PROBE, path, cache.key_type, cache.value_type]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_SECONDS)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not evaluate 8 tokens of {path} in {PROBE_SECONDS} s in a process of its own; check it"
    if done.returncode == 0:
        return None
    said = [line for line in done.stderr.splitlines() if "GGML_ASSERT" in line or "error" in line.lower()]
    if done.returncode < 0 and not said:  # killed by a signal, not by an assertion it states: a crash in C
        return (
            f"llama.cpp crashed (signal {-done.returncode}) running {path}, in a process of its own: this "
            "llama-cpp-python build cannot run that file here; write it with f16 weights (gqaify convert "
            f"{path} OUT.gguf --gguf-type f16, at its own --kv-heads) or rebuild llama-cpp-python for this machine"
        )
    reason = said[0].rsplit(": ", 1)[-1].strip() if said else f"exit status {done.returncode}"
    return f"llama.cpp cannot run {path} with a {cache.name} cache ({reason}); leave {cache.name} out of --kv-cache"


def gguf_architecture(path: str) -> str | None:
    """The `general.architecture` a GGUF file's header names (None: not a GGUF gqaify can read)."""
    from gqaify.model import gguf_header

    try:
        return gguf_header.read(path).fields.get("general.architecture")
    except (OSError, ValueError):
        return None


def served_values(path: str) -> tuple[int, int]:
    """The keys and the values one token caches over every layer in llama.cpp, from the GGUF's header: per layer a
    key of `key_length` and a value of `value_length` per K/V head, or the keys alone (`KEYS_ONLY`)."""
    from gqaify.model import gguf_header

    fields = gguf_header.read(path).fields
    arch = fields["general.architecture"]
    layers, heads = fields[f"{arch}.block_count"], fields[f"{arch}.attention.head_count"]
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    head = fields[f"{arch}.embedding_length"] // heads
    keys = layers * kv_heads * fields.get(f"{arch}.attention.key_length", head)
    values = 0 if arch in KEYS_ONLY else layers * kv_heads * fields.get(f"{arch}.attention.value_length", head)
    return keys, values


@contextmanager
def _stderr_to(path: str):
    """The process's standard error sent to `path` meanwhile: file descriptor 2, which llama.cpp's C code writes, and
    Python's `sys.stderr`, which llama-cpp-python's log callback writes (a capture, pytest's say, may hold it apart)."""
    saved, python = os.dup(2), sys.stderr
    python.flush()
    with open(path, "w") as sink:
        os.dup2(sink.fileno(), 2)
        sys.stderr = sink
        try:
            yield
        finally:
            sink.flush()
            sys.stderr = python
            os.dup2(saved, 2)
            os.close(saved)


@contextmanager
def _refused(path: str, cache: CacheFormat, log: str):
    """llama.cpp's refusal to make a context (a cache type whose blocks do not divide a head, say) as a `UserError`
    naming the reason its log gives."""
    try:
        yield
    except ValueError:
        lines = Path(log).read_text(errors="replace").splitlines()
        reason = next(
            (line.split(": ", 1)[-1] for line in lines if "does not divide" in line or "error" in line.lower()), ""
        )
        raise UserError(
            f"llama.cpp cannot hold the cache of {path} as {cache.name}"
            + (f" ({reason.strip()})" if reason else "")
            + "; leave that format out of --kv-cache"
        ) from None


class LlamaCppRunner:
    """A .gguf model in llama.cpp, one context per cache format (a context's cache types are fixed when it is made:
    `engine.CacheRunner`)."""

    def __init__(self, path: str, context: int):
        self.path, self.context = path, context
        self.threads = max(1, torch.get_num_threads())
        self._contexts: dict[str, object] = {}
        self._measured: dict[str, float] = {}

    def _llama(self, cache: CacheFormat):
        if cache.name not in self._contexts:
            import llama_cpp

            types = {n: getattr(llama_cpp, f"GGML_TYPE_{n.upper()}") for n in (cache.key_type, cache.value_type)}
            with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
                with _stderr_to(log.name), _refused(self.path, cache, log.name):
                    llm = llama_cpp.Llama(
                        model_path=self.path,
                        n_ctx=self.context,
                        n_batch=BATCH,
                        n_ubatch=BATCH,
                        n_threads=self.threads,
                        logits_all=True,
                        type_k=types[cache.key_type],
                        type_v=types[cache.value_type],
                        flash_attn=cache.value_type != FULL,  # what llama.cpp needs to hold values quantized
                        verbose=True,
                    )
                found = _ALLOCATED.search(Path(log.name).read_text(errors="replace"))
            if found:
                self._measured[cache.name] = float(found[1]) * 2**20 / int(found[2])
            self._contexts[cache.name] = llm
        return self._contexts[cache.name]

    def logits(self, ids: Sequence[int], cache: CacheFormat) -> torch.Tensor:
        llm = self._llama(cache)
        llm.reset()
        llm.eval(list(ids))
        return torch.from_numpy(llm.scores[: len(ids)].copy())

    def greedy(self, ids: Sequence[int], cache: CacheFormat, tokens: int) -> list[int]:
        llm = self._llama(cache)
        llm.reset()
        llm.eval(list(ids))
        out = []
        for _ in range(tokens):
            token = int(llm.scores[llm.n_tokens - 1].argmax())
            out.append(token)
            llm.eval([token])
        return out

    def measured_bytes_per_token(self, cache: CacheFormat) -> float | None:
        self._llama(cache)
        return self._measured.get(cache.name)

    def close(self) -> None:
        with _stderr_to(os.devnull):  # a context made verbose (for its allocation log) logs its freeing too
            for llm in self._contexts.values():
                llm.close()
        self._contexts.clear()


class _LlamaCpp:
    """The llama.cpp room, as eval asks it (`engine.CacheEngine`; its runner is a `engine.CacheRunner`)."""

    read_back = (
        f"llama.cpp: each window evaluated in one pass in batches of {BATCH}, every token's keys and values written to "
        "the cache in its type and read back from it (flash attention on)"
    )

    def problems(self, s, configs: list) -> list[str]:
        """llama-cpp-python not installed; a model that is not a .gguf (every model runs in llama.cpp, the parent's
        reference too); a head its quantized types' blocks do not divide; a file llama.cpp aborts or crashes on
        (tried in a process of its own)."""
        missing = llama_cpp_problem()
        problems = [missing] if missing else []
        quantized = ", ".join(n for n in s.kv_cache if n != FULL)
        problems += [
            f"--kv-cache {quantized}: llama.cpp's formats run .gguf files, and {name} is not one; give "
            f"every model as .gguf (gqaify convert {name} OUT.gguf writes one), or take transformers' formats "
            f"(quanto4, quanto2, fp8)"
            for name in s.models
            if _is_gguf(name) is False
        ][:1]
        return problems + _block_problems(s, configs) + ([] if missing else _probe_problems(s))

    def only_here(self, models: list[str]) -> set[str]:
        """The .gguf models of an architecture transformers cannot read (`KEYS_ONLY`: a cache of keys alone)."""
        return {name for name in models if _is_gguf(name) and gguf_architecture(name) in KEYS_ONLY}

    def values(self, model: str, config) -> tuple[int, int]:
        return cached_values(config) if config is not None else served_values(model)

    def open(self, model: str, context: int, settings) -> LlamaCppRunner:
        return LlamaCppRunner(model, context)


ENGINE = _LlamaCpp()


def _is_gguf(name: str) -> bool | None:
    """Whether the model `name` is a .gguf file (None: it cannot be found, which the model checks report)."""
    try:
        return locate(name).kind == "gguf"
    except UserError:
        return None


def _probe_problems(s) -> list[str]:
    """Each .gguf model run in llama.cpp in a child process, before any work could be lost: llama.cpp aborts the
    process (an assertion in C) or crashes on what it cannot run. The keys-only path (`KEYS_ONLY`) is tried with each
    format asked (llama.cpp 0.3.36 cannot hold most cache types there); any other file with the last one, as a build
    can crash on a file's quantized weights on a CPU it was not built for."""
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
