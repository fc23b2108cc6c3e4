"""The eval report: `report.json` (`Report.write`; `Report.read` reads it back typed), `report.md` (a table), PNG
plots and `gqaify.json` (what wrote them), written as one folder that appears whole (`output.destination.staged`), as a
conversion's OUT does."""

from __future__ import annotations

import math
from pathlib import Path

from gqaify._version import __version__
from gqaify.eval.results import REPORT_FILE, ModelReport, Report, TaskScore, model_labels
from gqaify.eval.settings import decode_context
from gqaify.eval.tasks import headline
from gqaify.figures import distinct_colors, figure, integer_ticks, log_scale, readable_xticks
from gqaify.output.destination import staged, write_provenance
from gqaify.records import REPORT, ReportRecord
from gqaify.summary import printable

PLOT_KV = "perplexity_vs_kv.png"
PLOT_DIAGNOSTICS = "diagnostics.png"
PLOT_TASKS = "tasks_vs_kv.png"
PLOT_PANEL = "perplexity_by_text.png"
PLOT_SIZE = (6.4, 4.4)  # inches, at figures.figure's 120 dpi
REPORT_BYTES = 1 << 20  # room the report needs, checked before the evaluation: its files are a few hundred KB

COLUMNS = ["model", "kv heads", "ppl ({text})", "Δppl", "KV bytes/token", "KV ratio", "max context (bound)"]


def columns(report: Report) -> list[str]:
    """The table's header: the perplexity column names its text (the panel's first), the decode column its context,
    where the cache's size shows in the speed only when it is long (README's 8,192-token figures: MQA 1.51× MHA's
    speed on a GPU)."""
    text = printable(report.data[0].name)
    return [*(c.format(text=text) for c in COLUMNS), f"decode tok/s @{_decode_context(report):,} ctx"]


def _decode_context(report: Report) -> int:
    """The decode context measured (--decode-context, shortened to fit the parent's positions: a note says so)."""
    s, positions = report.settings, report.models[0].max_positions if report.models else None
    return decode_context(s["decode_context"], s["decode_tokens"], positions)


def table_rows(report: Report) -> list[list[str]]:
    rows = []
    for m in report.models:
        rows.append(
            [
                printable(m.model),  # a path may hold a newline; a row is one line
                m.attention.removeprefix("G="),
                f"{m.perplexity:,.2f}",
                "—" if m.delta_perplexity is None else f"{m.delta_perplexity:+,.2f}",
                f"{m.kv_cache_bytes_per_token:,.0f}",
                f"{m.kv_ratio_to_parent:g}×",
                _context(m),
                decode_cell(m),
            ]
        )
    return rows


def panel_rows(report: Report) -> list[list[str]]:
    """The panel as rows: a header, then one row per text (its perplexity under each model, and beside each other
    model's its ratio to the parent's and its KL from the parent), then with several texts the mean and the worst
    over them (the KL's too)."""
    names = [printable(label) for label in _labels(report)]
    rows = [["text", "tokens", *names]]
    for i, info in enumerate(report.data):
        cells = [printable(info.name), f"{report.models[0].texts[i].tokens_scored:,}"]
        for m in report.models:
            t = m.texts[i]
            beside = "" if t.ratio_to_parent is None else f" ({t.ratio_to_parent:.2f}×, KL {_kl(t.kl_to_parent)})"
            cells.append(f"{t.perplexity:,.2f}{beside}")
        rows.append(cells)
    if len(report.data) > 1:
        summaries = [m.panel for m in report.models]
        rows.append(
            ["mean", "", *[_summary(p, p and p.mean_ratio_to_parent, p and p.mean_kl_to_parent, "") for p in summaries]]
        )
        rows.append(
            [
                "worst",
                "",
                *[
                    _summary(
                        p,
                        p and p.worst_ratio_to_parent,
                        p and p.worst_kl_to_parent,
                        p and f" ({printable(p.worst_text)})",
                    )
                    for p in summaries
                ],
            ]
        )
    return rows


def _labels(report: Report) -> list[str]:
    """How the tables name each model (`results.model_labels`): up1/final and up2/final, not final twice."""
    return model_labels([m.model for m in report.models])


def _summary(panel, ratio, kl, where) -> str:
    return "—" if panel is None else f"{ratio:.2f}×{where}, KL {_kl(kl)}"


def _kl(kl: float | None) -> str:
    """A KL from the parent in nats per token, or "—" where there is none (a score made without the parent)."""
    return "—" if kl is None else f"{kl:.3f}"


def decode_cell(m: ModelReport) -> str:
    """The decode column's cell: the median and the spread of the runs, "24.2 (23.1–25.0)"; where a model's runs
    and the parent's timed in turns with them overlap, the difference is not resolved, and the cell says so in place
    of a figure a reader would compare."""
    spread, parent = m.decode_spread, m.parent_decode_spread
    if spread is None:  # not measured (--no-speed), or a report written before the runs were kept
        return _num(m.decode_tokens_per_s)
    runs = f"{spread.low:,.1f}–{spread.high:,.1f}"
    if parent is not None and not spread.resolved_from(parent):
        return f"{NOT_RESOLVED} ({runs} vs parent {parent.low:,.1f}–{parent.high:,.1f})"
    return f"{spread.median:,.1f} ({runs})"


NOT_RESOLVED = "not resolved"


def _context(m) -> str:
    """The usable context at batch 1 and what binds it: "8,192 (positions)", "1,724 (memory)"."""
    if m.usable_context is None:
        return "unbounded"
    return f"{m.usable_context:,} ({m.context_bound_by})"


def format_table(report: Report) -> str:
    """The summary table and the panel's, as aligned plain text, for the terminal."""
    tasks = [
        f"{task} ({metric}): " + ", ".join(f"{name} {value}" for name, value in cells)
        for task, metric, cells in _headline_rows(report)
    ]
    return "\n".join(
        [
            *_aligned([columns(report), *table_rows(report)]),
            "",
            "perplexity by text (ratio to the parent, KL from it in nats/token):",
            *_aligned(panel_rows(report)),
            *tasks,
            *[f"note: {n}" for n in report.notes],
            *_decode_note(report),
        ]
    )


# What the decode column says of itself where models were timed in turns with the parent (`_decode_runs`): report.md's
# description, the terminal's note where a cell is not resolved
_DECODE_RUNS = (
    "the median (slowest–fastest) of each model's runs, timed in turns with the parent's (parent, model, ...)"
)
_NOT_RESOLVED_MEANS = (
    f"'{NOT_RESOLVED}': the model's runs and the parent's beside them overlap, so the difference is within what the "
    "runs varied (more --repeats, or a quieter machine, may resolve it)"
)


def _decode_runs(report: Report, repeats: int) -> str:
    """What the decode column's figures are, as they were timed: a model evaluated alone was timed alone (nothing to
    resolve it from); several, each in turns with the parent."""
    if len(report.models) == 1:
        return f"the median (slowest–fastest) of the model's {repeats} run{'' if repeats == 1 else 's'}, timed alone"
    return f"{_DECODE_RUNS}, {repeats} runs each; {_NOT_RESOLVED_MEANS}"


def _decode_note(report: Report) -> list[str]:
    """The terminal's note on the decode column, where a cell of it is not resolved."""
    if any(decode_cell(m).startswith(NOT_RESOLVED) for m in report.models):
        return [f"note: decode tok/s: {_DECODE_RUNS}; {_NOT_RESOLVED_MEANS}"]
    return []


def _aligned(rows: list[list[str]]) -> list[str]:
    """A header, a rule and the rows, in columns: the first left-aligned, the numbers right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    lines = [line(r) for r in rows]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def _scores(m: ModelReport) -> list[TaskScore]:
    return m.tasks or []


def _headlines(report: Report) -> list[dict[str, TaskScore]]:
    """Each model's headline score per task (`tasks.headline`), in the report's order of models."""
    return [headline(_scores(m)) for m in report.models]


def _headline_rows(report: Report) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(task, metric, [(model, value)]) for each task's headline metric, in the parent's order."""
    per_model = _headlines(report)
    rows = []
    for task, first in per_model[0].items():
        cells = [
            (printable(label), f"{found[task].value:.4f}" if task in found else "—")
            for label, found in zip(_labels(report), per_model, strict=True)
        ]
        rows.append((task, first.metric, cells))
    return rows


def task_lines(report: Report) -> list[str]:
    """The task table of report.md: every metric of every task, the parent beside each model's difference."""
    if not any(m.tasks for m in report.models):
        return []
    keys: dict[tuple[str, str, str], int | None] = {}  # (task, metric, filter) -> n, in the order first seen
    for m in report.models:
        for s in _scores(m):
            keys.setdefault((s.task, s.metric, s.filter), s.n)
    found = [{(s.task, s.metric, s.filter): s for s in _scores(m)} for m in report.models]
    parent = found[0]
    settings = report.settings
    shots = "each task's default" if settings.get("num_fewshot") is None else settings["num_fewshot"]
    limit = "" if settings.get("limit") is None else f", at most {settings['limit']:g} items per task"
    lines = [
        "## Tasks",
        "",
        f"lm-evaluation-harness, few-shot: {shots}{limit}. Each converted model's score with its difference "
        "from the parent's; ± is the harness's standard error.",
        "",
        "| task | metric | n | " + " | ".join(md_cell(label) for label in _labels(report)) + " |",
        "|---|---|---|" + "---|" * len(report.models),
    ]
    for key, n in keys.items():
        cells = []
        for i, scores in enumerate(found):
            s = scores.get(key)
            if s is None:
                cells.append("—")
            elif i == 0 or key not in parent:
                cells.append(f"{s.value:.4f}" + ("" if s.stderr is None else f" ± {s.stderr:.4f}"))
            else:
                cells.append(f"{s.value:.4f} ({s.value - parent[key].value:+.4f})")
        task, metric, filter_ = key
        shown = metric if filter_ == "none" else f"{metric} ({filter_})"
        lines.append(f"| {task} | {shown} | {'—' if n is None else f'{n:,}'} | " + " | ".join(cells) + " |")
    return [*lines, "", f"![task scores vs KV bytes per token]({PLOT_TASKS})", ""]


def generation_lines(report: Report) -> list[str]:
    """Each prompt with every model's greedy continuation beside the others."""
    if not any(m.generations for m in report.models):
        return []
    prompts = [g.prompt for g in report.models[0].generations or []]
    lines = ["## Generations", "", f"Greedy, at most {report.settings['generate_tokens']} new tokens.", ""]
    for i, prompt in enumerate(prompts):
        lines += [f"**{md_cell(prompt)}** …", "", "| model | continuation |", "|---|---|"]
        named = zip(_labels(report), report.models, strict=True)
        lines += [f"| {md_cell(label)} | {md_cell(m.generations[i].text)} |" for label, m in named]
        lines.append("")
    return lines


def md_cell(text: str) -> str:
    """Text for one Markdown table cell: pipes escaped, line breaks shown as ↵."""
    return " ↵ ".join(text.replace("|", "\\|").splitlines()) or " "


def panel_lines(report: Report) -> list[str]:
    """The panel's section of report.md: every text, and every model on each."""
    texts = "; ".join(
        f"**{md_cell(t.name)}** `{md_cell(t.source)}` ({md_cell(t.split)}, column `{md_cell(t.text_column)}`, "
        f"{t.rows:,} rows)"
        for t in report.data
    )
    header, *rows = panel_rows(report)
    return [
        "## Perplexity by text",
        "",
        f"Texts: {texts}. Each converted model's perplexity with its ratio to the parent's on the same tokens and "
        "its KL from the parent's next-token distribution (nats per token, over every token scored); with several "
        "texts, the mean and the worst over them.",
        "",
        "| " + " | ".join(md_cell(c) for c in header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
        *["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows],
        "",
        f"![perplexity ratio to the parent by text]({PLOT_PANEL})",
        "",
    ]


def markdown(report: Report) -> str:
    s, first = report.settings, report.data[0]
    parent = report.models[0]
    others = f" (and {len(report.data) - 1} more texts: see Perplexity by text)" if len(report.data) > 1 else ""
    lines = [
        "# gqaify eval",
        "",
        f"Data: `{first.source}` ({first.split}, column `{first.text_column}`, {first.rows:,} rows){others}. "
        f"Windows of {s['seq_len']} tokens, stride {s['stride']}; {parent.tokens_scored:,} tokens scored; "
        f"device {s['device']}. KV capacity: K/V cache and weights in {s['memory_budget']}, at batch 1 "
        f"(max context: what the cache would hold, capped at the model's positions, and which of the two binds; "
        f"report.json has both) and at {s['seq_len']} tokens (max batch {parent.max_batch_at_seq_len:,} for the "
        "parent). "
        f"Decode: greedy, batch 1, {s['decode_tokens']} tokens after a {_decode_context(report):,}-token prefill, "
        f"{_decode_runs(report, s['repeats'])}.",
        "",
        "| " + " | ".join(md_cell(c) for c in columns(report)) + " |",
        "|" + "---|" * len(columns(report)),
        *["| " + " | ".join(row) + " |" for row in table_rows(report)],
        "",
        *[f"Note: {n}" for n in report.notes],
        "",
        "| model | word ppl | bits/byte | KV bytes measured = analytic | prefill tok/s | decode tok/s "
        f"(batch {s['decode_batch']}) | mean attn rel. error | {_diagnostics_kl(report)} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in report.models:
        diag = m.diagnostics
        errors = diag.attention_relative_error if diag else []
        mean_error = f"{sum(errors) / len(errors):.3f}" if errors else "—"
        lines.append(
            f"| {m.model} | {m.word_perplexity:,.2f} | {m.bits_per_byte:.4f} | {m.kv_cache_bytes_measured:,} "
            f"{'=' if m.kv_cache_bytes_measured == m.kv_cache_bytes_analytic else '≠'} {m.kv_cache_bytes_analytic:,} "
            f"| {_num(m.prefill_tokens_per_s)} | {_num(m.decode_tokens_per_s_batched)} | {mean_error} "
            f"| {'—' if not diag else format(diag.kl_nats_per_token, '.4f')} |"
        )
    lines += ["", f"![perplexity vs KV bytes per token]({PLOT_KV})", ""]
    lines += [f"![per-layer diagnostics]({PLOT_DIAGNOSTICS})", ""]
    return "\n".join(lines + panel_lines(report) + task_lines(report) + generation_lines(report))


def _diagnostics_kl(report: Report) -> str:
    """The diagnostics' KL column: measured in one pass on the first text's first tokens, not the panel's KL."""
    n = next((m.diagnostics.tokens for m in report.models if m.diagnostics), None)
    scope = "" if n is None else f" on the first {n:,} tokens of {md_cell(report.data[0].name)} only"
    return f"KL to parent{scope} (nats/token)"


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


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
        names, colors = _labels(report), distinct_colors(len(report.models))
        for i, (m, color) in enumerate(zip(report.models, colors, strict=True)):
            if not math.isfinite(m.perplexity):
                continue
            label = f"{names[i]} ({m.attention})"
            x, y = m.kv_cache_bytes_per_token, m.perplexity
            ax.scatter(x, y, s=90 if i == 0 else 60, marker="*" if i == 0 else "o", color=color, label=label, zorder=3)
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
                label=f"{_labels(report)[k]} ({m.attention})",
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
        per_model, colors = _headlines(report), distinct_colors(len(report.models))
        for m, name, color in zip(report.models, _labels(report), colors, strict=True):
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
        for m, name, color in zip(report.models[1:], _labels(report)[1:], colors[1:], strict=True):
            if m.diagnostics:
                errors = m.diagnostics.attention_relative_error
                label = f"{name} (KL {m.diagnostics.kl_nats_per_token:.2f})"
                ax.plot(range(len(errors)), errors, marker="o", markersize=3, color=color, label=label)
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
        ax.set_title("Per-layer drift from the parent")
        ax.grid(True, alpha=0.3)


def write_report(report: Report, out: Path, force: bool = False) -> None:
    """Write the report as the folder `out`: created whole, or with `force` replacing a report gqaify wrote.

    Raises:
        UserError: `out` appeared meanwhile (without `force`), or changed so that it may not be replaced.
        ResourceError: the disk filled up; nothing was left behind.
    """
    writers = {
        REPORT_FILE: report.write,  # read back typed by `Report.read`
        "report.md": lambda p: p.write_text(markdown(report)),
        PLOT_KV: lambda p: plot_perplexity_vs_kv(report, p),
        PLOT_DIAGNOSTICS: lambda p: plot_diagnostics(report, p),
        PLOT_PANEL: lambda p: plot_panel(report, p),
    }
    if any(m.tasks for m in report.models):
        writers[PLOT_TASKS] = lambda p: plot_tasks_vs_kv(report, p)
    with staged(out, force, REPORT_BYTES, "--out", writes=REPORT) as staging:
        for name, write in writers.items():
            write(staging / name)
        write_provenance(staging, ReportRecord(version=__version__, settings=report.settings))
