"""The eval report: `report.json` (`Report.write`; `Report.read` reads it back typed), `report.md` (a table), PNG
plots and `gqaify.json` (what wrote them), written as one folder that appears whole (`output.destination.staged`), as a
conversion's OUT does."""

from __future__ import annotations

import functools
from pathlib import Path

from gqaify._version import __version__
from gqaify.eval.caches.report import PLOT_FRONTIER, frontier_lines, plot_frontier
from gqaify.eval.plots import PLOT_DIAGNOSTICS, PLOT_KV, PLOT_PANEL, PLOT_TASKS, PLOTS, plot_tasks_vs_kv
from gqaify.eval.results import REPORT_FILE, ModelReport, Report, labels_of
from gqaify.eval.settings import decode_context
from gqaify.eval.tasks import headlines
from gqaify.output.destination import staged, write_provenance
from gqaify.records import REPORT, ReportRecord
from gqaify.summary import printable

REPORT_BYTES = 1 << 20  # room the report needs, checked before the evaluation: its files are a few hundred KB

COLUMNS = ["model", "kv heads", "ppl ({text})", "Δppl", "KV bytes/token", "KV ratio", "max context (bound)"]


def columns(report: Report) -> list[str]:
    """The table's header: the perplexity column names its text (the panel's first), the decode column its context,
    where the cache's size shows in the speed only when it is long (README's 8,192-token figures: MQA 1.51× MHA's
    speed on a GPU); no decode column where speed was not measured (--no-speed)."""
    text = printable(report.data[0].name)
    decode = [f"decode tok/s @{_decode_context(report):,} ctx"] if _timed(report) else []
    return [*(c.format(text=text) for c in COLUMNS), *decode]


def _timed(report: Report) -> bool:
    """Whether speed was measured (not --no-speed; a report of an earlier gqaify that did not record it: yes)."""
    return report.settings.get("speed", True) is not False


def _decode_context(report: Report) -> int:
    """The decode context measured (--decode-context, shortened to fit the parent's positions: a note says so)."""
    s, positions = report.settings, report.models[0].max_positions if report.models else None
    return decode_context(s["decode_context"], s["decode_tokens"], positions)


def table_rows(report: Report) -> list[list[str]]:
    rows = []
    for m, label in zip(report.models, labels_of(report), strict=True):
        rows.append(
            [
                printable(label),  # a path may hold a newline; a row is one line
                _kv_heads(m),
                f"{m.perplexity:,.2f}",
                "—" if m.delta_perplexity is None else f"{m.delta_perplexity:+,.2f}",
                f"{m.kv_cache_bytes_per_token:,.0f}",
                f"{m.kv_ratio_to_parent:g}×",
                _context(m),
                *([decode_cell(m)] if _timed(report) else []),
            ]
        )
    return rows


def _kv_heads(m: ModelReport) -> str:
    """The kv heads column's cell: the K/V heads, or for a shape that has none, what it caches."""
    return (
        f"{m.num_key_value_heads}" if m.cached_values is None else f"none ({m.cache_label}: {m.cached_values} values)"
    )


def panel_rows(report: Report) -> list[list[str]]:
    """The panel as rows: a header, then one row per text (its perplexity under each model, and beside each other
    model's its ratio to the parent's and its KL from the parent), then with several texts the mean and the worst
    over them (the KL's too)."""
    names = [printable(label) for label in labels_of(report)]
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


def _headline_rows(report: Report) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(task, metric, [(model, value)]) for each task's headline metric, in the parent's order."""
    per_model = headlines(report.models)
    rows = []
    for task, first in per_model[0].items():
        cells = [
            (printable(label), f"{found[task].value:.4f}" if task in found else "—")
            for label, found in zip(labels_of(report), per_model, strict=True)
        ]
        rows.append((task, first.metric, cells))
    return rows


def task_lines(report: Report) -> list[str]:
    """The task table of report.md: every metric of every task, the parent beside each model's difference."""
    if not any(m.tasks for m in report.models):
        return []
    keys: dict[tuple[str, str, str], int | None] = {}  # (task, metric, filter) -> n, in the order first seen
    for m in report.models:
        for s in m.tasks or []:
            keys.setdefault((s.task, s.metric, s.filter), s.n)
    found = [{(s.task, s.metric, s.filter): s for s in (m.tasks or [])} for m in report.models]
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
        "| task | metric | n | " + " | ".join(md_cell(label) for label in labels_of(report)) + " |",
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
        named = zip(labels_of(report), report.models, strict=True)
        lines += [f"| {md_cell(label)} | {md_cell(m.generations[i].text)} |" for label, m in named]
        lines.append("")
    return lines


def md_cell(text: str) -> str:
    """Text for one Markdown table cell: pipes escaped, line breaks shown as ↵."""
    return " ↵ ".join(text.replace("|", "\\|").splitlines()) or " "


def panel_lines(report: Report) -> list[str]:
    """The panel's section of report.md: every text, and every model on each."""
    texts = "; ".join(f"**{md_cell(t.name)}** `{md_cell(t.source)}` ({md_cell(t.described)})" for t in report.data)
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
        f"Data: `{md_cell(first.source)}` ({md_cell(first.described)}){others}. "
        f"Windows of {s['seq_len']} tokens, stride {s['stride']}; {parent.tokens_scored:,} tokens scored; "
        f"device {s['device']}. KV capacity: K/V cache and weights in "
        f"{report.memory_budget or s['memory_budget']}, at batch 1 "
        f"(max context: what the cache would hold, capped at the model's positions, and which of the two binds; "
        f"report.json has both) and at {s['seq_len']} tokens (max batch {parent.max_batch_at_seq_len:,} for the "
        "parent). "
        + (
            f"Decode: greedy, batch 1, {s['decode_tokens']} tokens after a {_decode_context(report):,}-token "
            f"prefill, {_decode_runs(report, s['repeats'])}."
            if _timed(report)
            else "Speed was not measured (--no-speed)."
        ),
        "",
        "| " + " | ".join(md_cell(c) for c in columns(report)) + " |",
        "|" + "---|" * len(columns(report)),
        *["| " + " | ".join(row) + " |" for row in table_rows(report)],
        "",
        *[f"Note: {n}" for n in report.notes],
        "",
        *_detail_lines(report),
    ]
    lines += ["", f"![perplexity vs KV bytes per token]({PLOT_KV})", ""]
    lines += [f"![per-layer diagnostics]({PLOT_DIAGNOSTICS})", ""]
    lines += panel_lines(report) + frontier_lines(report.frontier)
    return "\n".join(lines + task_lines(report) + generation_lines(report))


def _detail_lines(report: Report) -> list[str]:
    """report.md's second table: word perplexity, bits per byte, the KV cache of one window measured in
    transformers' cache beside the config's count, the speeds (where measured) and the per-layer diagnostics."""
    s, timed = report.settings, _timed(report)
    speeds = ["prefill tok/s (runs' range)", f"decode tok/s, batch {s['decode_batch']} (runs' range)"] if timed else []
    header = [
        "model",
        "word ppl",
        "bits/byte",
        f"KV bytes of a {report.models[0].kv_cache_tokens:,}-token window, measured = analytic",
        *speeds,
        "mean attn rel. error",
        _diagnostics_kl(report),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for m, label in zip(report.models, labels_of(report), strict=True):
        diag = m.diagnostics
        errors = diag.attention_relative_error if diag else []
        same = "=" if m.kv_cache_bytes_measured == m.kv_cache_bytes_analytic else "≠"
        cells = [
            printable(label),  # as the main table names it
            f"{m.word_perplexity:,.2f}",
            f"{m.bits_per_byte:.4f}",
            f"{m.kv_cache_bytes_measured:,} {same} {m.kv_cache_bytes_analytic:,}",
            *(
                [
                    _spread(m.prefill_tokens_per_s, m.prefill_spread),
                    _spread(m.decode_tokens_per_s_batched, m.batched_decode_spread),
                ]
                if timed
                else []
            ),  # fmt: skip
            f"{sum(errors) / len(errors):.3f}" if errors else "—",
            "—" if not diag else _kl(diag.kl_nats_per_token),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _diagnostics_kl(report: Report) -> str:
    """The diagnostics' KL column: measured in one pass on the first text's first tokens, not the panel's KL."""
    n = next((m.diagnostics.tokens for m in report.models if m.diagnostics), None)
    scope = "" if n is None else f" on the first {n:,} tokens of {md_cell(report.data[0].name)} only"
    return f"KL to parent{scope} (nats/token)"


def _spread(value: float | None, spread) -> str:
    """A throughput with the range of its runs, "378.6 (350.1–390.2)" (a report written before the runs were kept:
    the figure alone)."""
    return _num(value) if spread is None else f"{spread.median:,.1f} ({spread.low:,.1f}–{spread.high:,.1f})"


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def write_report(report: Report, out: Path, force: bool = False) -> None:
    """Write the report as the folder `out`: created whole, or with `force` replacing a report gqaify wrote.

    Raises:
        UserError: `out` appeared meanwhile (without `force`), or changed so that it may not be replaced.
        ResourceError: the disk filled up; nothing was left behind.
    """
    writers = {
        REPORT_FILE: report.write,  # read back typed by `Report.read`
        "report.md": lambda p: p.write_text(markdown(report)),
        **{name: functools.partial(plot, report) for name, plot in PLOTS.items()},
    }
    if report.frontier is not None:
        writers[PLOT_FRONTIER] = functools.partial(plot_frontier, report.frontier)
    if any(m.tasks for m in report.models):
        writers[PLOT_TASKS] = functools.partial(plot_tasks_vs_kv, report)
    with staged(out, force, REPORT_BYTES, "--out", writes=REPORT) as staging:
        for name, write in writers.items():
            write(staging / name)
        write_provenance(staging, ReportRecord(version=__version__, settings=report.settings))
