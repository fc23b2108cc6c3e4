"""Every plot gqaify draws, read as drawn: plain tick labels on log axes (no "3×10⁰4×10⁰6×10⁰"), none over another,
the start of a run on its curve, the per-text panel in the units its axis names, one colour per model across a
report's plots, whole layers."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from matplotlib.colors import to_rgba

from gqaify.eval.plots import plot_diagnostics, plot_panel, plot_perplexity_vs_kv, plot_tasks_vs_kv
from gqaify.eval.results import TaskScore
from gqaify.figures import plain_number, round_ticks
from gqaify.uptrain.curve import CurvePoint, forecast, plot_curve

PLAIN = re.compile(r"^-?\d+(\.\d+)?[kMBT]?$")  # 3, 1.25, 1.5k: no mathtext, no "×10"


@pytest.fixture
def drawn(monkeypatch):
    """Each figure the plot functions draw, kept open as saved (pyplot.close deferred to the test's end)."""
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    yield figures
    for fig in figures:
        close(fig)


def tick_labels(ax, axis: str) -> list[tuple[str, object]]:
    """The labelled major ticks of `ax`'s `axis` as last drawn: (text, box in pixels), in order along the axis."""
    renderer = ax.figure.canvas.get_renderer()
    which = ax.xaxis if axis == "x" else ax.yaxis
    low, high = sorted(which.get_view_interval())
    labels = [
        (tick.label1.get_text(), tick.label1.get_window_extent(renderer))
        for tick, at in zip(which.get_major_ticks(), which.get_majorticklocs(), strict=False)
        if tick.label1.get_text() and low <= at <= high
    ]
    return sorted(labels, key=lambda found: found[1].x0 if axis == "x" else found[1].y0)


def assert_plain_and_apart(ax, axis: str) -> list[str]:
    """The tick labels of a log axis: plain numbers, at least two, none overlapping its neighbour; their texts."""
    labels = tick_labels(ax, axis)
    texts = [text for text, _ in labels]
    assert len(texts) >= 2 and all(PLAIN.match(t) for t in texts), (axis, texts)
    clashes = [(a, b) for (a, box_a), (b, box_b) in zip(labels, labels[1:], strict=False) if box_a.overlaps(box_b)]
    assert not clashes, (axis, clashes)
    return texts


def run_points(names: list[str], tokens_per_step: int = 64, kl=(0.35, 0.2)) -> list[CurvePoint]:
    """A run's evaluations: the start and six more, the KL falling over less than a decade (the case whose labels
    overprinted), each text's perplexity falling too."""
    steps = [0, 2, 3, 4, 7, 12, 20]
    return [
        CurvePoint(
            s * tokens_per_step,
            s * 1.7,
            kl[0] + (kl[1] - kl[0]) * s / 20,
            1.3 - 0.01 * s,
            {n: (10.0 + i) * (1.3 - 0.01 * s + 0.02 * i) for i, n in enumerate(names)},
        )
        for s in steps
    ]


def draw_curve(drawn, tmp_path, names, parents, **run) -> tuple:
    plot_curve(forecast(run_points(names, **run), 0.15), parents, tmp_path / "recovery.png", "a run")
    assert (tmp_path / "recovery.png").is_file()
    return tuple(drawn[-1].axes[:3])


@pytest.mark.parametrize(("tokens_per_step", "kl"), [(64, (0.35, 0.2)), (4096, (0.25, 0.2)), (500_000, (2.0, 0.05))])
def test_the_recovery_plots_log_axes_carry_plain_labels_apart(drawn, tmp_path, tokens_per_step, kl):
    """They read "3×10⁰4×10⁰6×10⁰" (minor ticks labelled over each other) and "1.25×10⁰"."""
    by_tokens, by_seconds, texts = draw_curve(
        drawn, tmp_path, ["wiki", "stories"], {"wiki": 10.0, "stories": 11.0}, tokens_per_step=tokens_per_step, kl=kl
    )
    for ax in (by_tokens, by_seconds, texts):
        assert_plain_and_apart(ax, "x")
        assert_plain_and_apart(ax, "y")


def test_the_recovery_plot_draws_the_start_at_0_tokens_and_0_seconds(drawn, tmp_path):
    by_tokens, by_seconds, texts = draw_curve(drawn, tmp_path, ["wiki", "stories"], {"wiki": 10.0, "stories": 11.0})
    for ax, axis_start in ((by_tokens, "0"), (by_seconds, "0"), (texts, "0")):
        assert any(0 in line.get_xdata() for line in ax.get_lines()), "the start is not drawn"
        assert tick_labels(ax, "x")[0][0] == axis_start
    kl_line = by_tokens.get_lines()[0]
    assert list(kl_line.get_xdata()) == [p.tokens for p in run_points(["wiki"])]


def test_one_eval_text_is_drawn_as_its_ratio_to_the_parent_under_its_name(drawn, tmp_path):
    """A run of one text logs it as "eval"; the parent's perplexity is keyed by the text's name: the panel drew the
    raw perplexity (13) on an axis labelled "× the parent's", with a "worst" line over the same points."""
    texts = draw_curve(drawn, tmp_path, ["eval"], {"wiki": 10.0})[2]
    assert texts.get_ylabel() == "perplexity × the parent's"
    (line,) = texts.get_lines()
    assert line.get_label() == "wiki" and line.get_ydata()[0] == pytest.approx(1.3)


def test_one_eval_text_without_the_parents_perplexity_is_drawn_as_measured(drawn, tmp_path):
    texts = draw_curve(drawn, tmp_path, ["eval"], None)[2]
    assert texts.get_ylabel() == "eval perplexity"
    assert texts.get_lines()[0].get_ydata()[0] == pytest.approx(13.0)


def test_no_texts_line_hides_under_the_worst(drawn, tmp_path):
    """The worst ratio was drawn last, thick and black, over the worst text's own line."""
    names = [f"text{i}" for i in range(5)]
    texts = draw_curve(drawn, tmp_path, names, {n: 10.0 + i for i, n in enumerate(names)})[2]
    lines = {line.get_label(): line for line in texts.get_lines()}
    worst = lines.pop("worst")
    assert sorted(lines) == names
    assert all(line.get_zorder() > worst.get_zorder() for line in lines.values())
    assert worst.get_alpha() is not None and worst.get_alpha() < 1
    colours = {to_rgba(line.get_color()) for line in lines.values()}
    assert len(colours) == len(names)


def test_a_run_without_a_teacher_says_why_its_kl_panels_are_empty(drawn, tmp_path):
    """Its KL axes were drawn empty, on default limits, ticked at 0.1, 0.3 and 1 "training seconds"."""
    points = [CurvePoint(t, t / 1000, None, r, {"eval": 600 * r}) for t, r in ((0, 0.9), (320, 0.3), (640, 0.2))]
    plot_curve(forecast(points, 0.15), {"eval": 683.0}, tmp_path / "recovery.png", "a run")
    for ax in drawn[-1].axes[:2]:
        assert not ax.get_xticks().size and not ax.get_yticks().size and not ax.get_lines()
        assert [t.get_text() for t in ax.texts] == ["no mean KL: it needs a teacher\n(distill_from or parent)"]
    assert drawn[-1].axes[2].get_lines()[0].get_ydata()[0] == pytest.approx(600 * 0.9 / 683)


def eval_report(models: int, texts: int = 2, layers: int = 6) -> SimpleNamespace:
    """What the eval plots read of a report: the parent then `models - 1` converted models (G 4, 2, 1, 4, ...) on
    `texts` texts, with diagnostics of `layers` layers and two tasks' scores."""
    names = [f"text{i}" for i in range(texts)]
    entries = []
    for i in range(models):
        g = 8 if i == 0 else (4, 2, 1)[(i - 1) % 3]
        ratio = None if i == 0 else 1 + 0.1 * 8 / g + 0.01 * i
        entries.append(
            SimpleNamespace(
                model=f"runs/m{i}",
                num_key_value_heads=g,
                attention=f"G={g}",
                perplexity=12.3 * (ratio or 1),
                kv_cache_bytes_per_token=1536 * g / 8,
                panel=None if i == 0 else object(),
                texts=[SimpleNamespace(ratio_to_parent=ratio) for _ in names],
                diagnostics=None
                if i == 0
                else SimpleNamespace(
                    tokens=512,
                    attention_relative_error=[0.1 * j + 0.05 * i for j in range(layers)],
                    kl_nats_per_token=0.1,
                ),
                tasks=[TaskScore(f"task{t}", "acc", "none", 0.6 - 0.02 * 8 / g, 0.02, 100) for t in range(2)],
            )
        )
    return SimpleNamespace(
        models=entries, data=[SimpleNamespace(name=n) for n in names], labels=[Path(m.model).name for m in entries]
    )


@pytest.mark.parametrize("models", [2, 5, 12])
def test_perplexity_vs_kv_names_its_text_and_labels_its_axes_plainly_apart(drawn, tmp_path, models):
    """Its x labels (KV bytes under a decade apart) overprinted in scientific notation, and its y axis did not say
    which text's perplexity it is."""
    plot_perplexity_vs_kv(eval_report(models), tmp_path / "kv.png")
    ax = drawn[-1].axes[0]
    assert_plain_and_apart(ax, "x")
    assert_plain_and_apart(ax, "y")
    assert ax.get_ylabel() == "perplexity on text0"


def model_colours(ax) -> dict[str, tuple]:
    """Each model's colour in `ax`, by its name (the legend's label up to " ("): a scatter's, a bar's, a line's."""
    found = {}
    for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
        if label.startswith("task"):
            continue
        if hasattr(handle, "patches"):  # bars
            colour = handle.patches[0].get_facecolor()
        elif hasattr(handle, "get_facecolor"):  # a scatter's points
            colour = handle.get_facecolor()[0]
        else:
            colour = handle.get_color()
        found[label.split(" (")[0]] = to_rgba(colour)
    return found


@pytest.mark.parametrize("models", [2, 5, 12])
def test_a_model_keeps_one_colour_in_every_plot_of_a_report(drawn, tmp_path, models):
    """The panel and the diagnostics coloured the first converted model as perplexity_vs_kv coloured the parent,
    and the task plot coloured each task, not each model."""
    report = eval_report(models)
    for plot in (plot_perplexity_vs_kv, plot_panel, plot_diagnostics, plot_tasks_vs_kv):
        plot(report, tmp_path / f"{plot.__name__}.png")
    kv, panel, diagnostics, tasks = (model_colours(fig.axes[0]) for fig in drawn)
    names = [f"m{i}" for i in range(models)]
    assert list(kv) == names and list(tasks) == names and list(panel) == list(diagnostics) == names[1:]
    assert all(panel[n] == diagnostics[n] == kv[n] == tasks[n] for n in names[1:]) and kv["m0"] == tasks["m0"]
    assert len(set(kv.values())) == models  # no two models alike


@pytest.mark.parametrize("models", [2, 5, 12])
def test_the_panel_and_task_plots_log_axes_are_plain_and_apart(drawn, tmp_path, models):
    report = eval_report(models, texts=3)
    plot_panel(report, tmp_path / "panel.png")
    plot_tasks_vs_kv(report, tmp_path / "tasks.png")
    assert_plain_and_apart(drawn[0].axes[0], "y")
    assert_plain_and_apart(drawn[1].axes[0], "x")


@pytest.mark.parametrize("layers", [1, 2, 3, 30])
def test_diagnostics_tick_whole_layers_only(drawn, tmp_path, layers):
    plot_diagnostics(eval_report(3, layers=layers), tmp_path / "diagnostics.png")
    ax = drawn[-1].axes[0]
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert all(float(text).is_integer() for text, _ in tick_labels(ax, "x"))


def test_diagnostics_say_what_their_kl_is_on(drawn, tmp_path):
    """The legend's KL and the drift are measured on the first tokens of the panel's first text alone, which the
    plot did not say: a reader took its KL for the panel's."""
    plot_diagnostics(eval_report(3), tmp_path / "diagnostics.png")
    assert drawn[-1].axes[0].get_title() == "Per-layer drift from the parent\non the first 512 tokens of text0"
    plot_diagnostics(eval_report(1), tmp_path / "alone.png")  # the parent alone: nothing was measured
    assert drawn[-1].axes[0].get_title() == "Per-layer drift from the parent"


def test_plain_numbers_and_round_ticks():
    assert [plain_number(v) for v in (0, 0.05, 0.30000000000000004, 1.25, 384, 1500, 20_000, 1.5e6, 3e9)] == [
        "0",
        "0.05",
        "0.3",
        "1.25",
        "384",
        "1.5k",
        "20k",
        "1.5M",
        "3B",
    ]
    room = 9

    def fits(ticks):
        return len(ticks) <= room

    assert round_ticks(150, 1300, fits) == [200, 500, 1000]
    assert round_ticks(1e4, 1e8, fits) == [1e4, 1e5, 1e6, 1e7, 1e8]
    assert round_ticks(1.09, 1.52, fits) == pytest.approx([1.1, 1.2, 1.3, 1.4, 1.5])
    room = 3
    assert round_ticks(1, 1e12, fits) == [1, 1e5, 1e10]  # every fifth decade, where each would not fit


def test_the_panel_of_the_parent_alone_says_so(drawn, tmp_path):
    """With the parent alone the panel said "no converted model shares the parent's tokenizer"."""
    plot_panel(eval_report(1), tmp_path / "panel.png")
    assert [t.get_text() for t in drawn[-1].axes[0].texts] == ["the parent alone: no model beside it"]


def test_a_model_drawn_where_another_is_shows_around_it_and_says_so(drawn, tmp_path):
    """An exact MLA rewrite evaluated beside the GQA model it rewrites lies on that model's point and line: drawn
    alike over it, one of them was hidden while the legend named both. The later one is a ring around the point
    (wider than the point) and a dotted line of hollow markers over the line, and its legend entry says whose."""
    report = eval_report(4)
    twin = report.models[3]
    twin.model, twin.attention = "runs/mla", "MLA 96"
    first = report.models[1]
    twin.perplexity, twin.kv_cache_bytes_per_token = first.perplexity, first.kv_cache_bytes_per_token
    twin.diagnostics = SimpleNamespace(**vars(first.diagnostics))
    plot_perplexity_vs_kv(report, tmp_path / "kv.png")
    plot_diagnostics(report, tmp_path / "diagnostics.png")
    kv, diagnostics = (fig.axes[0] for fig in drawn)
    handles, labels = kv.get_legend_handles_labels()
    assert labels[3] == "mla (MLA 96), at m1's point" and labels[2] == "m2 (G=2)"  # m2 elsewhere: drawn as before
    ring, dot = handles[3], handles[1]
    assert len(ring.get_facecolor()) == 0 and ring.get_sizes()[0] > 2 * dot.get_sizes()[0]
    assert list(ring.get_offsets()[0]) == list(dot.get_offsets()[0])
    lines = {line.get_label(): line for line in diagnostics.get_lines()}
    over, under = lines["mla (KL 0.100), the same as m1"], lines["m1 (KL 0.100)"]
    assert list(over.get_ydata()) == list(under.get_ydata()) and over.get_linestyle() == ":"
    assert over.get_markerfacecolor() == "none" and over.get_markersize() > under.get_markersize()
    assert lines["m2 (KL 0.100)"].get_linestyle() == "-"


def test_the_recovery_plot_draws_the_forecast_as_the_range_its_sentence_gives(drawn, tmp_path):
    """The text gave a range ("about N more tokens (range L to H)") and the plot one dashed line: the band is the
    line's SPREAD standard errors either side, drawn on to the range's far end."""
    import math

    from gqaify.uptrain.curve import SPREAD

    wobble = [1.0, 1.08, 0.93, 1.05, 0.96, 1.04, 0.97]  # a power law, measured with some noise
    tokens = [0, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000]
    points = [
        CurvePoint(t, t / 100, 2.0 * max(t, 1_000) ** -0.3 * w, 1.5, {"wiki": 12.0})
        for t, w in zip(tokens, wobble, strict=True)
    ]
    found = forecast(points, 0.04)
    assert found.status == "on track" and found.tokens_to_target_low < found.tokens_to_target_high
    plot_curve(found, {"wiki": 10.0}, tmp_path / "recovery.png", "a run")
    by_tokens = drawn[-1].axes[0]
    [band] = [c for c in by_tokens.collections if c.get_label() == "forecast range"]
    xs = [x for x, _ in band.get_paths()[0].vertices]
    law = found.law
    for x, y in band.get_paths()[0].vertices[1:-1]:  # the edges: the line times e^(± SPREAD s.e.) at each x
        edges = [law.at(x) * math.exp(side * SPREAD * law.log_kl_se(x)) for side in (-1, 1)]
        assert min(abs(y - e) / e for e in edges) < 1e-9
    assert max(xs) >= found.tokens_seen + found.tokens_to_target_high  # on to where the range ends
    assert "forecast range" in by_tokens.get_legend_handles_labels()[1]
