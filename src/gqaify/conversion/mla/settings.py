"""The settings of its own the MLA shape adds to a conversion's (`ShapeInfo.settings`): the widths of its cache."""

from __future__ import annotations

from dataclasses import dataclass

from gqaify.settings import Needs, Range, Settings, setting


@dataclass(frozen=True)
class LatentSettings(Settings):
    """The widths of an MLA cache, neither given the exact rewrite (with --kv-cut, the split chosen on calib_data):"""

    kv_rank: int | None = setting(
        None,
        "mla: the latent's width, values per token and layer (default: everything the G heads cache, exact)",
        check=(
            Range(1, says="a whole number of at least 1"),
            Needs("attention", "is an MLA latent's width", value="mla"),
        ),
    )
    rope_dims: int | None = setting(
        None,
        "mla: the rotary key's width, one key every query head shares: 2 x the rotary pairs kept x G (default: all, "
        "exact); the cache per token and layer is kv_rank + rope_dims",
        check=(Range(2, says="a whole number of at least 2"), Needs("attention", "is an MLA key's width", value="mla")),
    )

    @property
    def widths_given(self) -> bool:
        """Whether a width or a cut other than 1 is given: a cache smaller than the G heads', fitted on text."""
        return any(w is not None for w in (self.kv_rank, self.rope_dims, None if self.kv_cut == 1 else self.kv_cut))
