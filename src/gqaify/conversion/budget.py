"""`--kv-cut X`: the cache as users think of it, 1/X of the source's, whatever the attention shape.

Each shape says what a cut means for it (`Shape.resolve_cut`): GQA the K/V heads that cache 1/X of the source's
(`conversion.gqa`), a shape that makes any cut the values per token and layer it keeps.
`resolve_cut` turns the request into the settings a conversion runs with, once the source's config.json is read;
its problems are the request's, raised before anything is written. `planned_config` is the model a memory plan
counts.
"""

from __future__ import annotations

from gqaify.conversion.settings import ConvertSettings
from gqaify.conversion.shapes import shape
from gqaify.model.geometry import Geometry


def resolve_cut(s: ConvertSettings, geometry: Geometry) -> tuple[ConvertSettings, list[str]]:
    """`s` with what `--kv-cut` decides filled in (G, and what else the shape fixes), and the problems of the request
    against the source's `geometry`."""
    if s.kv_cut is None:
        return s, []
    return shape(s.attention).resolve_cut(s, geometry)


def planned_config(s: ConvertSettings, config):
    """The config (a transformers config, changed in place) of the model the conversion `s` writes from a source of
    `config`, for a memory plan: its K/V heads, then what its shape makes of them (`Shape.planned_config`).

    Raises:
        UserError: a cut the conversion refuses.
    """
    from gqaify.errors import raise_if_problems
    from gqaify.model.archs import ARCHITECTURES

    spec = ARCHITECTURES.get(config.model_type)
    if spec is None:  # the conversion's own checks refuse it before training
        return config
    geometry = Geometry.from_config(spec, config.to_dict())
    s, problems = resolve_cut(s, geometry)
    raise_if_problems(problems)
    if s.kv_heads is not None:
        setattr(config, spec.num_kv_heads_key, s.kv_heads)
    return shape(s.attention).planned_config(s, config, geometry)
