"""The transformers room of `--kv-cache`: a model with its cache held in one of transformers' own cache classes.

f16 is a plain forward pass (the whole window at once, no cache read back): today's evaluation. A quantized format
is a `QuantizedCache` the window is prefilled through in chunks of `CHUNK` tokens, so that every chunk after the
first reads the earlier tokens back from the cache as it holds them (quantized, but for the newest
`RESIDUAL_TOKENS`, which the cache keeps whole until they are `RESIDUAL_TOKENS` and then quantizes with the rest):
a single forward pass would attend to its own keys and values in full precision and never read the cache. The first
chunk's tokens attend to each other whole, as a prefill of that length would.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from gqaify.conversion.shapes import cached_per_token
from gqaify.eval.caches.formats import GROUP, RESIDUAL_TOKENS, CacheFormat, QuantizedCacheKind, cache_format
from gqaify.eval.caches.values import cached_values
from gqaify.model.loading import load_model, resolve_device

CHUNK = 32  # tokens a chunked prefill feeds at a time: each reads the cache of the tokens before it


def backend_problem(kind: QuantizedCacheKind, name: str) -> str | None:
    """Why transformers cannot hold a cache as `kind` (`name`, as --kv-cache gives it) here: its package is not
    installed (None: it can)."""
    if kind.package is None or importlib.util.find_spec(kind.package.split(".")[0]) is not None:
        return None
    return f"--kv-cache {name} needs {kind.package.split('.')[0]}, which is not installed; {kind.install}"


def quantized_cache(kind: QuantizedCacheKind, config):
    """A fresh transformers `QuantizedCache` of `kind` for a model of `config`."""
    from transformers import QuantizedCache

    if kind.nbits is None:
        return QuantizedCache(kind.backend, config)
    return QuantizedCache(kind.backend, config, nbits=kind.nbits, q_group_size=GROUP, residual_length=RESIDUAL_TOKENS)


class TransformersRunner:
    """A model loaded in transformers, run with its cache in each format asked (`engine.CacheRunner`)."""

    def __init__(self, model):
        self.model = model

    @classmethod
    def load(cls, name: str, settings) -> TransformersRunner:
        device = resolve_device(settings.device)
        model, _ = load_model(name, settings.dtype, device, trust_remote_code=settings.trust_remote_code)
        return cls(model)

    def _cache(self, cache: CacheFormat):
        return None if cache.whole else quantized_cache(cache.quantized, self.model.config)

    @torch.no_grad()
    def logits(self, ids: Sequence[int], cache: CacheFormat) -> torch.Tensor:
        inputs = torch.as_tensor(list(ids), device=self.model.device).unsqueeze(0)
        if cache.whole:
            return self.model(inputs, use_cache=False).logits[0].float()
        past, rows = self._cache(cache), []
        for begin in range(0, inputs.shape[1], CHUNK):
            out = self.model(inputs[:, begin : begin + CHUNK], past_key_values=past, use_cache=True)
            rows.append(out.logits[0].float())
        return torch.cat(rows)

    @torch.no_grad()
    def greedy(self, ids: Sequence[int], cache: CacheFormat, tokens: int) -> list[int]:
        inputs = torch.as_tensor(list(ids), device=self.model.device).unsqueeze(0)
        past = self._cache(cache)
        kwargs = {} if past is None else {"past_key_values": past}
        out = self.model.generate(
            inputs, max_new_tokens=tokens, do_sample=False, attention_mask=torch.ones_like(inputs), **kwargs
        )
        return out[0, inputs.shape[1] :].tolist()

    def measured_bytes_per_token(self, cache: CacheFormat) -> float | None:
        return None  # transformers reports no allocation; the count is the cache's format times its values

    def close(self) -> None:
        del self.model


class _Transformers:
    """The transformers room, as eval asks it (`engine.CacheEngine`; its runner is a `engine.CacheRunner`)."""

    read_back = (
        f"transformers: f16 is a plain forward pass; a quantized cache is prefilled in chunks of {CHUNK} tokens "
        f"through transformers' QuantizedCache, each chunk reading the earlier tokens back from it (the newest "
        f"{RESIDUAL_TOKENS} kept whole, KIVI's residual window)"
    )

    def problems(self, s, configs: list) -> list[str]:
        """A quantized format whose package is not installed; a model whose cache transformers holds otherwise than
        it is served (a shape of its own, expanded into heads here)."""
        formats = [cache_format(n) for n in s.kv_cache]
        missing = (backend_problem(f.quantized, f.name) for f in formats if f.quantized)
        problems = list(dict.fromkeys(p for p in missing if p))
        if any(f.quantized for f in formats):
            problems += [
                f"{name} caches values of its own shape, which transformers holds expanded into heads: its quantized "
                f"cache would not be the one served; evaluate it as .gguf in llama.cpp"
                for name, config in zip(s.models, configs, strict=True)
                if config is not None and cached_per_token(config) is not None
            ]
        return problems

    def only_here(self, models: list[str]) -> set[str]:
        return set()  # every model transformers reads, another engine may serve

    def values(self, model: str, config) -> tuple[int, int]:
        return cached_values(config)

    def open(self, model: str, context: int, settings) -> TransformersRunner:
        return TransformersRunner.load(model, settings)


ENGINE = _Transformers()
