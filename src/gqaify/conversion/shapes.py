"""The attention shapes a conversion writes, found by name: each is one folder under conversion/ and one
`ATTENTION_INFO` entry (`conversion.registry`) naming its `Shape` ("module:NAME"), imported when first asked, so that
a conversion to GQA loads nothing of another shape's. Generic code asks a shape through this module; the shapes
themselves know only the contract (`conversion.shape_contract`).
"""

from __future__ import annotations

import functools
import importlib

from gqaify.conversion.registry import ATTENTION_INFO
from gqaify.conversion.shape_contract import CONTRACT, Rewritten, Shape, ShapeRecord, float16_problem
from gqaify.errors import UserError
from gqaify.model.archs import ARCHITECTURES, TrainedAttention

__all__ = [
    "Rewritten",
    "Shape",
    "ShapeRecord",
    "cache_label",
    "cached_per_token",
    "every_shape",
    "float16_problem",
    "held_parameters",
    "rewriting",
    "shape",
    "shape_of_model",
    "trained_attention",
]


@functools.cache
def shape(name: str) -> Shape:
    """The shape `ATTENTION_INFO[name]` names, imported on first use.

    Raises:
        TypeError: an object that does not answer the whole contract (a new shape missing a part).
    """
    found = _named(ATTENTION_INFO[name].shape)
    if not isinstance(found, Shape):
        missing = [part for part in CONTRACT if not hasattr(found, part)]
        raise TypeError(f"{ATTENTION_INFO[name].shape} is not a Shape: it lacks {', '.join(missing)}")
    return found


def every_shape() -> list[Shape]:
    """Every shape, in `ATTENTION_INFO`'s order."""
    return [shape(name) for name in ATTENTION_INFO]


def rewriting() -> list[str]:
    """The names of the shapes that rewrite the G-head model (those with a record of it), in `ATTENTION_INFO`'s
    order."""
    return [name for name, info in ATTENTION_INFO.items() if info.record is not None]


def shape_of_model(config) -> Shape | None:
    """The shape whose rewrite wrote the model of `config` (None: no rewrite did; whole K/V heads)."""
    return next((shape(name) for name in rewriting() if shape(name).wrote(config)), None)


def cached_per_token(config) -> int | None:
    """The values one token caches per layer in a model of `config`, where a shape caches other than whole K/V heads
    (`Shape.cached`; None: whole K/V heads)."""
    return next((values for found in every_shape() if (values := found.cached(config)) is not None), None)


def cache_label(config) -> str | None:
    """What a report calls the cache of a model of `config` where its shape caches other than whole K/V heads, before
    the values it holds (`ShapeInfo.label`); None: whole K/V heads."""
    return next((info.label for name, info in ATTENTION_INFO.items() if shape(name).cached(config) is not None), None)


def held_parameters(model) -> list[str]:
    """The parameters of `model` uptraining keeps as converted (`Shape.held`)."""
    found = shape_of_model(model.config)
    return [] if found is None else found.held(model)


def trained_attention(model_type: str, wanted: str) -> TrainedAttention:
    """Where `model_type`'s attention trains (uptrain's `trainable` lora, kv-only and attention): from the
    architecture table, or for a class a shape writes and gqaify converts from none, from its entry
    (`ShapeInfo.writes`).

    Raises:
        UserError: neither knows the architecture; `wanted` (e.g. "trainable lora") says what needed it.
    """
    if model_type in ARCHITECTURES:
        return TrainedAttention.of(ARCHITECTURES[model_type])
    for info in ATTENTION_INFO.values():
        if info.writes and model_type in (written := _named(info.writes)):
            return written[model_type]
    raise UserError(f"{wanted}: gqaify does not know where attention lives in {model_type}; use trainable all")


def _named(name: str):
    """What "module:NAME" names, its module imported."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)
