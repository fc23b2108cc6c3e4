"""What `gqaify eval --kv-cache` found: a row per model and cache format, the front of them and the verdict per
budget (report.json's `frontier`, read back typed with the rest of the report). Light: no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BUDGETS = (2.0, 3.0, 4.0, 6.0, 10.0)  # times smaller than the parent's f16 cache, where the verdict is given
# token positions within a window where the KL to the parent is reported apart: distance is where a cache's damage
# grows, if it does
POSITION_EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class CacheText:
    """One model in one cache format on one text of the panel, against the parent's f16 cache in the same engine."""

    text: str
    tokens_scored: int
    perplexity: float
    ratio_to_parent: float
    kl_to_parent: float  # KL(parent || model), nats per scored token


@dataclass
class PositionKL:
    """The KL to the parent of the tokens at positions [begin, end) of their windows, over every text."""

    begin: int
    end: int
    tokens: int
    kl: float


@dataclass
class Retrieval:
    """A key planted in filler text at a depth and asked for at the end (`retrieval`): exact matches of `tried`."""

    length: int  # tokens of the prompt
    depth: float  # where the key stands in it, 0 (start) to 1 (end)
    tried: int
    found: int


@dataclass
class CacheRow:
    """A model served with its cache in one format: a point of the frontier."""

    model: str
    label: str  # how tables and plots name the model
    cache: str  # the format, as --kv-cache names it
    engine: str
    bytes_per_token: float  # the cache of one token, every layer, counted for its format, scales included
    bytes_per_token_measured: float | None  # as the engine reported allocating it (None: it reports none)
    times_smaller: float  # the parent's f16 cache per token / this one's
    mean_kl: float  # over the texts of the panel
    worst_ratio: float  # the largest of the texts' perplexity ratios to the parent's
    worst_text: str
    texts: list[CacheText]
    kl_by_position: list[PositionKL]
    retrieval: list[Retrieval] = field(default_factory=list)

    @classmethod
    def of(cls, texts: list[CacheText], **fields) -> CacheRow:
        """The row of the scores `texts`, its mean KL and worst ratio taken from them."""
        worst = max(texts, key=lambda t: t.ratio_to_parent)
        mean = sum(t.kl_to_parent for t in texts) / len(texts)
        return cls(mean_kl=mean, worst_ratio=worst.ratio_to_parent, worst_text=worst.text, texts=texts, **fields)

    @property
    def name(self) -> str:
        return f"{self.label} · {self.cache}"

    @property
    def retrieval_rate(self) -> float | None:
        tried = sum(r.tried for r in self.retrieval)
        return sum(r.found for r in self.retrieval) / tried if tried else None


@dataclass
class Verdict:
    """At a budget, the point closest to the parent on the panel's mean KL, and the one on its worst text (None:
    no point is that small)."""

    budget: str  # "3x", or the user's --memory-budget as it was given
    times_smaller: float  # the least a point must be smaller than the parent's f16 cache by
    closest_mean: str | None
    closest_mean_kl: float | None
    closest_worst: str | None
    closest_worst_ratio: float | None


@dataclass
class Frontier:
    """Every (model, cache format) point, which of them make the lower-left front, and the verdict per budget."""

    engine: str
    reference: str  # what every KL is measured from
    method: str  # how the cache was read back
    rows: list[CacheRow]
    front: list[str]  # the names of the rows no other row beats on both bytes and mean KL
    verdicts: list[Verdict]


def front_of(rows: list[CacheRow]) -> list[str]:
    """The rows on the lower-left front of (bytes per token, mean KL): none other is as small and closer, or smaller
    and as close. In the order of their bytes, largest first."""
    front = [
        r
        for r in rows
        if not any(
            o is not r
            and o.bytes_per_token <= r.bytes_per_token
            and o.mean_kl <= r.mean_kl
            and (o.bytes_per_token < r.bytes_per_token or o.mean_kl < r.mean_kl)
            for o in rows
        )
    ]
    return [r.name for r in sorted(front, key=lambda r: -r.bytes_per_token)]


def verdict(rows: list[CacheRow], budget: str, times_smaller: float) -> Verdict:
    """The closest points among `rows` at least `times_smaller` times smaller than the parent's f16 cache (a point
    0.5% short of it counts: 2.99x is the 3x budget's)."""
    fits = [r for r in rows if r.times_smaller >= times_smaller * 0.995 and math.isfinite(r.mean_kl)]
    if not fits:
        return Verdict(budget, times_smaller, None, None, None, None)
    by_mean = min(fits, key=lambda r: r.mean_kl)
    by_worst = min(fits, key=lambda r: r.worst_ratio)
    return Verdict(budget, times_smaller, by_mean.name, by_mean.mean_kl, by_worst.name, by_worst.worst_ratio)


def verdicts(rows: list[CacheRow], memory: tuple[str, float] | None = None) -> list[Verdict]:
    """The verdict at each of `BUDGETS`, and at `memory` ((the --memory-budget as given, the times smaller it asks
    for)) where given."""
    found = [verdict(rows, f"{b:g}x", b) for b in BUDGETS]
    return found + ([verdict(rows, *memory)] if memory else [])


def position_bins(length: int) -> list[tuple[int, int]]:
    """The position bins [begin, end) of `POSITION_EDGES` that windows of `length` tokens reach."""
    edges = [e for e in POSITION_EDGES if e < length] + [length]
    return list(zip(edges, edges[1:], strict=False))
