"""The frontier as users read it: report.md's section (the points, the verdict per budget, the KL by position and
the retrieval check), the verdict printed after `gqaify eval`'s table, and frontier.png."""

from __future__ import annotations

import math
from pathlib import Path

from gqaify.eval.caches.results import CacheRow, Frontier, Verdict

PLOT_FRONTIER = "frontier.png"


def _kl(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else (f"{value:.4f}" if value < 10 else f"{value:,.1f}")


def _verdict_cells(v: Verdict) -> list[str]:
    if v.closest_mean is None:
        return [v.budget, "nothing is that small", "—", "—", "—"]
    return [v.budget, v.closest_mean, _kl(v.closest_mean_kl), v.closest_worst, f"{v.closest_worst_ratio:.3f}×"]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *["| " + " | ".join(r) + " |" for r in rows]]


def verdict_text(frontier: Frontier) -> str:
    """The verdict per budget, as `gqaify eval` prints it after its table: plain columns a terminal shows."""
    rows = [["budget", "closest on the mean KL", "mean KL", "closest on the worst text", "worst ratio"]]
    rows += [_verdict_cells(v) for v in frontier.verdicts]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    head = (
        f"cache frontier in {frontier.engine}: at each budget (times smaller than the parent's f16 cache), the point "
        "closest to the parent (KL from its f16 cache)"
    )
    return "\n".join([head, *lines, f"on the front: {', '.join(frontier.front)}"])


def _point_cells(r: CacheRow, front: list[str]) -> list[str]:
    measured = "—" if r.bytes_per_token_measured is None else f"{r.bytes_per_token_measured:,.0f}"
    retrieval = "—" if r.retrieval_rate is None else f"{r.retrieval_rate:.0%}"
    texts = [f"{t.kl_to_parent:.4f} ({t.ratio_to_parent:.3f}×)" for t in r.texts]
    on = "●" if r.name in front else ""
    return [on, r.label, r.cache, f"{r.bytes_per_token:,.0f}", measured, f"{r.times_smaller:.2f}×", _kl(r.mean_kl),
            f"{r.worst_ratio:.3f}× ({r.worst_text})", *texts, retrieval]  # fmt: skip


def frontier_lines(frontier: Frontier | None) -> list[str]:
    """report.md's section on the cache frontier (none where no format but f16 was asked)."""
    if frontier is None:
        return []
    texts = [t.text for t in frontier.rows[0].texts]
    header = ["front", "model", "cache", "bytes/token (counted)", "measured", "smaller than parent f16",
              "mean KL", "worst ratio", *[f"KL {t} (ratio)" for t in texts], "retrieval"]  # fmt: skip
    lines = [
        "## The cache frontier",
        "",
        f"Every model under every cache format, in {frontier.engine}. KL (nats/token) and perplexity ratios are "
        f"from {frontier.reference}; the cache per token is counted for its format, scales included, over every "
        f"layer at 16 bits a value for f16 (measured: as the engine reported allocating it). How the cache was read "
        f"back: {frontier.method}. ● marks the lower-left front: no other point is as small and closer.",
        "",
        *_table(header, [_point_cells(r, frontier.front) for r in frontier.rows]),
        "",
        "At each budget (times smaller than the parent's f16 cache), the point closest to the parent on the panel's "
        "mean, and on its worst text:",
        "",
        *_table(
            ["budget", "closest on the mean", "mean KL", "closest on the worst text", "worst ratio"],
            [_verdict_cells(v) for v in frontier.verdicts],
        ),  # fmt: skip
        "",
        f"![the cache frontier]({PLOT_FRONTIER})",
        "",
    ]
    return lines + _position_lines(frontier) + _retrieval_lines(frontier)


def _position_lines(frontier: Frontier) -> list[str]:
    bins = [(p.begin, p.end) for p in frontier.rows[0].kl_by_position]
    if len(bins) < 2:
        return []
    header = ["model", "cache", *[f"{b:,}–{e:,}" for b, e in bins]]
    rows = [[r.label, r.cache, *[_kl(p.kl) for p in r.kl_by_position]] for r in frontier.rows]
    intro = "KL to the parent by the token's position in its window: a cache whose damage grows with distance shows it."
    return ["### KL by position", "", intro, "", *_table(header, rows), ""]


def _retrieval_lines(frontier: Frontier) -> list[str]:
    first = frontier.rows[0].retrieval
    if not first:
        return []
    cells = [(r.length, r.depth) for r in first]
    header = ["model", "cache", *[f"{n:,} @ {d:.0%}" for n, d in cells], "all"]
    rows = [
        [r.label, r.cache, *[f"{x.found}/{x.tried}" for x in r.retrieval], f"{r.retrieval_rate:.0%}"]
        for r in frontier.rows
    ]
    intro = (
        "Pass-key retrieval: a five-digit key planted at a depth of a prompt of filler text and asked for at its end; "
        "exact matches of the keys tried, by prompt length and depth."
    )
    return ["### Retrieval", "", intro, "", *_table(header, rows), ""]


def plot_frontier(frontier: Frontier, path: Path) -> None:
    """Each (model, format) point at its mean KL (left) and its worst perplexity ratio (right) against how many times
    smaller its cache is than the parent's f16 one; the front drawn, the budgets marked."""
    from gqaify.figures import distinct_colors, figure, log_scale

    models = list(dict.fromkeys(r.label for r in frontier.rows))
    formats = list(dict.fromkeys(r.cache for r in frontier.rows))
    colors = dict(zip(models, distinct_colors(len(models)), strict=True))
    markers = dict(zip(formats, "o^sDvP*Xh<>", strict=False))
    with figure(path, (11, 4.6), ncols=2) as (left, right):
        for ax, value, ylabel in ((left, "mean_kl", "mean KL to the parent (nats/token)"),
                                  (right, "worst_ratio", "worst perplexity ratio to the parent")):  # fmt: skip
            floor = _floor([getattr(r, value) - (1 if value == "worst_ratio" else 0) for r in frontier.rows])
            for r in frontier.rows:
                y = getattr(r, value) - (1 if value == "worst_ratio" else 0)
                if y <= 0:  # the reference itself: drawn at the axis' floor, and said
                    ax.annotate("the parent, f16 (the reference: 0)", (r.times_smaller, floor), fontsize=7,
                                xytext=(8, 4), textcoords="offset points")  # fmt: skip
                ax.scatter(r.times_smaller, max(y, floor), color=colors[r.label], marker=markers.get(r.cache, "o"),
                           s=70 if r.name in frontier.front else 35, zorder=3,
                           edgecolors="black" if r.name in frontier.front else "none")  # fmt: skip
            front = sorted((r for r in frontier.rows if r.name in frontier.front), key=lambda r: r.times_smaller)
            ys = [max(getattr(r, value) - (1 if value == "worst_ratio" else 0), floor) for r in front]
            ax.plot([r.times_smaller for r in front], ys, color="gray", lw=1, zorder=1, label="front (mean KL)")
            for v in frontier.verdicts[:5]:
                ax.axvline(v.times_smaller, color="gray", lw=0.5, ls=":")
            log_scale(ax, "x")
            log_scale(ax, "y")
            ax.set_xlabel("times smaller than the parent's f16 cache")
            ax.set_ylabel(ylabel + (" − 1" if value == "worst_ratio" else ""))
            ax.grid(True, which="both", alpha=0.3)
        for label, color in colors.items():
            left.scatter([], [], color=color, label=label)
        for name, marker in markers.items():
            left.scatter([], [], color="gray", marker=marker, label=name)
        left.legend(fontsize=7, ncols=2)
        left.set_title("Closeness to the parent vs cache size (ringed: on the front)", fontsize=9)
        right.set_title("Worst text vs cache size (budgets: dotted)", fontsize=9)


def _floor(values: list[float]) -> float:
    """Where a log axis draws a point of 0 (the parent's own): a tenth of the smallest positive value."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return min(positive) / 10 if positive else 1e-6
