"""What `gqaify eval --kv-cache` asks of an engine, whichever it is. Before any model loads, what the models cannot run
in it (`CacheEngine.problems`); then, a model opened in it (`CacheRunner`) gives its logits for every position of a
window, and its greedy continuation of a prompt, with its cache held in a given format. One room per engine answers
it (`transformers_engine`, `llama_cpp_engine`, each with its `ENGINE`, registered in `ROOMS`); eval asks only this.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from gqaify.eval.caches.formats import LLAMA_CPP, TRANSFORMERS, CacheFormat

# engine -> the module of its room, which holds its `ENGINE` (imported when asked: llama.cpp's only then); a room
# imports nothing of this module, which only names it
ROOMS = {TRANSFORMERS: "gqaify.eval.caches.transformers_engine", LLAMA_CPP: "gqaify.eval.caches.llama_cpp_engine"}


@runtime_checkable
class CacheRunner(Protocol):
    """One model opened in one engine."""

    def logits(self, ids: Sequence[int], cache: CacheFormat) -> torch.Tensor:
        """The logits (len(ids), vocab) in float32 for the window `ids` run from an empty cache held in `cache`,
        the cache read back in that format: row i is the distribution of the token after ids[i]."""
        ...

    def greedy(self, ids: Sequence[int], cache: CacheFormat, tokens: int) -> list[int]:
        """The `tokens` tokens greedy decoding gives after the prompt `ids`, the cache held in `cache`."""
        ...

    def measured_bytes_per_token(self, cache: CacheFormat) -> float | None:
        """The cache's bytes per token as the engine reports allocating it (None: it reports none)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class CacheEngine(Protocol):
    """One engine's room, as eval asks it."""

    read_back: str  # how a window's cache is written and read back in this engine, for the report

    def problems(self, s, configs: list) -> list[str]:
        """What the models of the eval settings `s` (their `configs`, None for one this engine alone reads) cannot
        run under `s.kv_cache` here, each in one line naming what can; before any model loads."""
        ...

    def only_here(self, models: list[str]) -> set[str]:
        """The `models` this engine alone runs (whose file no other engine reads): evaluated on the frontier only."""
        ...

    def values(self, model: str, config) -> tuple[int, int]:
        """The keys and the values one token of `model` caches over every layer, as this engine holds them."""
        ...

    def open(self, model: str, context: int, settings) -> CacheRunner:
        """`model` opened for windows of at most `context` tokens, with eval's `settings` (dtype, device,
        trust_remote_code)."""
        ...


def room(engine: str) -> CacheEngine:
    """The room of `engine` (one of `ROOMS`)."""
    return importlib.import_module(ROOMS[engine]).ENGINE
