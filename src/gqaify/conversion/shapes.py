"""The attention shapes a conversion writes, found by name: each is one folder under conversion/ and one
`ATTENTION_INFO` entry naming its `Shape` ("module:NAME"), imported when first asked, so that a conversion to GQA
loads nothing of another shape's. Generic code asks a shape through this module; the shapes themselves know only
the contract (`conversion.shape_contract`).
"""

from __future__ import annotations

import functools
import importlib

from gqaify.conversion.settings import ATTENTION_INFO
from gqaify.conversion.shape_contract import CONTRACT, Rewritten, Shape, ShapeRecord, float16_problem

__all__ = [
    "Rewritten",
    "Shape",
    "ShapeRecord",
    "cached_per_token",
    "every_shape",
    "float16_problem",
    "held_parameters",
    "rewriting",
    "shape",
    "shape_of_model",
]


@functools.cache
def shape(name: str) -> Shape:
    """The shape `ATTENTION_INFO[name]` names, imported on first use.

    Raises:
        TypeError: an object that does not answer the whole contract (a new shape missing a part).
    """
    module, _, attribute = ATTENTION_INFO[name].shape.partition(":")
    found = getattr(importlib.import_module(module), attribute)
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


def held_parameters(model) -> list[str]:
    """The parameters of `model` uptraining keeps as converted (`Shape.held`)."""
    found = shape_of_model(model.config)
    return [] if found is None else found.held(model)
