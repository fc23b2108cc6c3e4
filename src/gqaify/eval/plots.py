"""The eval report's plots (`report.write_report` writes them beside report.md): each model in one colour in every
plot, the parent first. Two models drawn at one place (an exact rewrite into another shape and the GQA model it
rewrites) are both seen: the later one as a ring around the earlier's point, or a dotted line over its line, its
legend entry saying which model it coincides with."""

from __future__ import annotations

import math
from pathlib import Path

from gqaify.eval.results import Report, labels_of
from gqaify.eval.tasks import headlines
from gqaify.figures import distinct_colors, figure, integer_ticks, log_scale, readable_xticks

PLOT_KV = "perplexity_vs_kv.png"
PLOT_DIAGNOSTICS = "diagnostics.png"
PLOT_TASKS = "tasks_vs_kv.png"
PLOT_PANEL = "perplexity_by_text.png"
PLOT_SIZE = (6.4, 4.4)  # inches, at figures.figure's 120 dpi
SAME = 1e-6  # two models whose drawn values agree to this relative difference are drawn at one place


def coinciding(drawn: list[tuple[float, ...] | None]) -> list[int | None]:
    """For each model's `drawn` values (None: not drawn), the first earlier model drawn at the same place (None:
    none), so that a plot can show the later one around it rather than hide it."""
    found: list[int | None] = []
    for i, values in enumerate(drawn):
        same = (
            j
            for j in range(i)
            if values is not None
            and drawn[j] is not None
            and len(drawn[j]) == len(values)
            and all(math.isclose(a, b, rel_tol=SAME) for a, b in zip(drawn[j], values, strict=True))
        )
        found.append(next(same, None))
    return found


def _against_kv(ax, ylabel: str, title: str) -> None:
    """Label axes that plot each model against its KV cache bytes per token (log scale, plain round numbers), and
    name each model, in its colour, in their legend."""
    log_scale(ax, "x")
    ax.set_xlabel("KV cache bytes per token")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.margins(x=0.1, y=0.15)
    if ax.get_legend_handles_labels()[0]:  # none where every model diverged
        ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)


def plot_perplexity_vs_kv(report: Report, path: Path) -> None:
    """Each model's perplexity on the first text (log scale) against its KV bytes per token, in its colour; a model
    whose perplexity is not finite (a diverged one) has no point."""
    with figure(path, PLOT_SIZE) as ax:
        names, colors = labels_of(report), distinct_colors(len(report.models))
        points = [
            (m.kv_cache_bytes_per_token, m.perplexity) if math.isfinite(m.perplexity) else None for m in report.models
        ]
        at = coinciding(points)
        for i, (m, color, point) in enumerate(zip(report.models, colors, points, strict=True)):
            if point is None:
                continue
            label = f"{names[i]} ({m.attention})"
            if at[i] is not None:  # a ring around the point it shares, wider for each model already there
                ring = 160 + 120 * at[:i].count(at[i])
                label += f", at {names[at[i]]}'s point"
                ax.scatter(*point, s=ring, facecolors="none", edgecolors=color, linewidths=2, label=label, zorder=2)
                continue
            marker, size = ("*", 90) if i == 0 else ("o", 60)
            ax.scatter(*point, s=size, marker=marker, color=color, label=label, zorder=3)
        if any(math.isfinite(m.perplexity) for m in report.models):
            log_scale(ax, "y")
        _against_kv(ax, f"perplexity on {report.data[0].name}", "Perplexity vs KV cache (★ parent)")


def plot_panel(report: Report, path: Path) -> None:
    """Each converted model's perplexity ratio to the parent on each text, side by side (log scale, 1 = the
    parent's)."""
    with figure(path, PLOT_SIZE) as ax:
        colors = distinct_colors(len(report.models))  # a model's colour in every plot of the report
        others = [
            (k, m) for k, m in enumerate(report.models) if k and (m.panel or any(t.ratio_to_parent for t in m.texts))
        ]
        width = 0.8 / max(len(others), 1)
        for j, (k, m) in enumerate(others):
            ratios = [t.ratio_to_parent or float("nan") for t in m.texts]
            ax.bar(
                [i + (j - (len(others) - 1) / 2) * width for i in range(len(ratios))],
                ratios,
                width,
                color=colors[k],
                label=f"{labels_of(report)[k]} ({m.attention})",
            )
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
        ax.set_xticks(range(len(report.data)), [t.name for t in report.data], rotation=20, ha="right", fontsize=8)
        readable_xticks(ax)  # upright, the figure widened, where 8 texts or long names would overprint
        log_scale(ax, "y")
        ax.set_ylabel("perplexity / parent's")
        ax.set_title("Perplexity ratio to the parent, by text (--- parent)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        if others:
            ax.legend(fontsize=8)
        else:
            ax.text(
                0.5,
                0.65,  # above the parent's line at 1
                "the parent alone: no model beside it"
                if len(report.models) == 1
                else "no converted model shares the parent's tokenizer",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )


def plot_tasks_vs_kv(report: Report, path: Path) -> None:
    """Each task's headline score for each model against its KV bytes per token: a model in its colour (the same in
    every plot of the report), a task by its marker; the legend names both."""
    with figure(path, PLOT_SIZE) as ax:
        per_model, colors = headlines(report.models), distinct_colors(len(report.models))
        for m, name, color in zip(report.models, labels_of(report), colors, strict=True):
            ax.plot([], [], "o", color=color, label=f"{name} ({m.attention})")
        for t, (task, first) in enumerate(per_model[0].items()):
            marker = "os^Dvp<>hX"[t % 10]
            ax.plot([], [], marker, color="grey", label=f"{task} ({first.metric})")
            for i, (m, found, color) in enumerate(zip(report.models, per_model, colors, strict=True)):
                if task in found:  # the parent's larger: a model of its KV and score (G = H) lies on it
                    score, kv, size = found[task], m.kv_cache_bytes_per_token, 11 if i == 0 else 6
                    ax.errorbar(
                        [kv], [score.value], [score.stderr or 0.0], None, marker, ms=size, color=color, capsize=3
                    )
        _against_kv(ax, "score", "Task scores vs KV cache")


def plot_diagnostics(report: Report, path: Path) -> None:
    with figure(path, PLOT_SIZE) as ax:
        drawn, colors = False, distinct_colors(len(report.models))  # a model's colour in every plot of the report
        names = labels_of(report)
        lines = [tuple(m.diagnostics.attention_relative_error) if m.diagnostics else None for m in report.models]
        for i, (m, same) in enumerate(zip(report.models, coinciding(lines), strict=True)):
            if i == 0 or m.diagnostics is None:
                continue
            errors = m.diagnostics.attention_relative_error
            label = f"{names[i]} (KL {m.diagnostics.kl_nats_per_token:.3f})"
            style = {"marker": "o", "markersize": 3}
            if same is not None:  # dotted over the line it shares, its markers rings around that line's
                label += f", the same as {names[same]}"
                style = {"marker": "o", "markersize": 8, "markerfacecolor": "none", "linestyle": ":", "linewidth": 2}
            ax.plot(range(len(errors)), errors, color=colors[i], label=label, **style)
            drawn = True
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(
                0.5,
                0.5,
                "no converted model shares the parent's tokenizer and layers",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        ax.set_xlabel("layer")
        integer_ticks(ax, "x")  # layer 2, never 2.5
        ax.set_ylabel("attention output relative error vs parent")
        ax.set_ylim(bottom=0)
        ax.set_title("Per-layer drift from the parent" + _diagnosed_on(report))
        ax.grid(True, alpha=0.3)


def _diagnosed_on(report: Report) -> str:
    """What the drift and its KL were measured on: the first tokens of the panel's first text (all models alike)."""
    measured = [m.diagnostics.tokens for m in report.models if m.diagnostics]
    return f"\non the first {max(measured):,} tokens of {report.data[0].name}" if measured else ""


# The plots every report draws, by file name (the task plot only where tasks were scored: `PLOT_TASKS`)
PLOTS = {PLOT_KV: plot_perplexity_vs_kv, PLOT_DIAGNOSTICS: plot_diagnostics, PLOT_PANEL: plot_panel}
