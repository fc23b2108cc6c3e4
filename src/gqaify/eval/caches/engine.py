"""What `gqaify eval --kv-cache` asks of an engine, whichever it is: a model opened in it gives its logits for every
position of a window, and its greedy continuation of a prompt, with its cache held in a given format. One room per
engine answers it (`transformers_engine`, `llama_cpp_engine`); the frontier (`frontier`) asks only this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from gqaify.eval.caches.formats import LLAMA_CPP, CacheFormat


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


def open_runner(engine: str, model: str, context: int, settings) -> CacheRunner:
    """`model` opened in `engine` for windows of at most `context` tokens, with eval's `settings` (dtype, device,
    trust_remote_code)."""
    if engine == LLAMA_CPP:
        from gqaify.eval.caches.llama_cpp_engine import LlamaCppRunner

        return LlamaCppRunner(model, context)
    from gqaify.eval.caches.transformers_engine import TransformersRunner

    return TransformersRunner.load(model, settings)
