"""The report's figures: the panel plot's text labels readable however many texts, and matplotlib's warnings (a
glyph its font lacks) kept out of the user's terminal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gqaify.eval.plots import PLOT_SIZE, plot_panel


def panel_report(names: list[str], model: str = "gqa2") -> SimpleNamespace:
    """What plot_panel reads of a report: the texts, and the parent and two converted models' ratios on each."""
    texts = [SimpleNamespace(ratio_to_parent=1.5 + i / 10) for i in range(len(names))]
    models = [
        SimpleNamespace(model=f"runs/{name}", num_key_value_heads=g, attention=f"G={g}", panel=object(), texts=texts)
        for name, g in (("parent", 8), (model, 2), ("mqa", 1))
    ]
    return SimpleNamespace(models=models, data=[SimpleNamespace(name=n) for n in names])


@pytest.fixture
def drawn(monkeypatch):
    """Each figure the plot functions draw, measured as saved (just before pyplot.close): its size in inches, its
    box and its first axes' x tick labels (text, rotation, box), in pixels."""
    import matplotlib.pyplot as plt

    figures, close = [], plt.close

    def measured(fig):
        renderer = fig.canvas.get_renderer()
        labels = [label for label in fig.axes[0].get_xticklabels() if label.get_text()]
        figures.append(
            SimpleNamespace(
                size=tuple(fig.get_size_inches()),
                box=fig.bbox.frozen(),
                names=[label.get_text() for label in labels],
                rotations=[label.get_rotation() for label in labels],
                boxes=[label.get_window_extent(renderer) for label in labels],
            )
        )
        close(fig)

    monkeypatch.setattr(plt, "close", measured)
    return figures


@pytest.mark.parametrize(
    "names",
    [
        [f"text-{i}" for i in range(8)],
        [f"{'a-rather-long-name-for-a-text-of-the-panel'}-{i:02d}" for i in range(12)],
        ["x" * 64, *[f"t{i}" for i in range(9)]],
    ],
    ids=["8-short", "12-long", "10-one-of-64-chars"],
)
def test_the_panel_plots_labels_never_overprint(tmp_path, drawn, names):
    plot_panel(panel_report(names), tmp_path / "panel.png")
    assert (tmp_path / "panel.png").is_file()
    fig = drawn[-1]
    assert fig.names == names
    boxes = fig.boxes
    clashes = [
        (a, b) for i, a in enumerate(names) for j, b in enumerate(names) if i < j and boxes[i].overlaps(boxes[j])
    ]
    assert not clashes, clashes[:3]
    figure = fig.box
    assert all(figure.x0 <= b.x0 and b.x1 <= figure.x1 and figure.y0 <= b.y0 and b.y1 <= figure.y1 for b in boxes)


def test_a_panel_of_a_few_short_texts_is_drawn_as_before(tmp_path, drawn):
    plot_panel(panel_report(["wikitext", "tinystories", "shakespeare"]), tmp_path / "panel.png")
    assert drawn[-1].rotations == [20, 20, 20] and drawn[-1].size == PLOT_SIZE


def test_a_warning_of_the_callers_own_block_reaches_the_caller(tmp_path, caplog):
    """The whole `with figure()` block was under catch_warnings(record=True): any library's warning raised in it (a
    deprecation in the caller's data code, say) was demoted to a log line. Only gqaify's drawing calls are."""
    import warnings

    from gqaify.figures import figure

    with (
        caplog.at_level("INFO", logger="gqaify.figures"),
        pytest.warns(DeprecationWarning, match="^the caller's own$"),
        figure(tmp_path / "f.png", (3, 2)) as ax,
    ):
        ax.plot([0, 1], [1, 0])
        warnings.warn("the caller's own", DeprecationWarning, stacklevel=1)
    assert (tmp_path / "f.png").is_file()
    assert not [r for r in caplog.records if r.name == "gqaify.figures"]
