"""matplotlib's warnings (a glyph its font lacks) in a command run in a process of its own: kept out of the
terminal, written to the log."""

from __future__ import annotations

import subprocess
import sys

from gqaify.eval.plots import plot_panel
from helpers import REPO
from test_figures import panel_report


def test_matplotlibs_warnings_stay_out_of_the_terminal_and_go_to_the_log(tmp_path, caplog):
    """A model named in a script the font lacks: matplotlib's 'Glyph ... missing from font(s)' escaped -q."""
    code = (
        "import sys; from pathlib import Path; sys.path[:0] = [sys.argv[1], str(Path(sys.argv[1]).parent)]; "
        "from test_figures import panel_report; "
        "from gqaify.eval.plots import plot_panel; plot_panel(panel_report(['wiki'], '模型'), Path(sys.argv[2]))"
    )
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", code, str(REPO / "tests" / "shared"), str(tmp_path / "panel.png")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done.stderr
    assert (tmp_path / "panel.png").is_file()
    with caplog.at_level("INFO", logger="gqaify.figures"):
        plot_panel(panel_report(["wiki"], "模型"), tmp_path / "again.png")
    said = [r.getMessage() for r in caplog.records if r.name == "gqaify.figures"]
    assert said and all("missing from font" in m and "again.png" in m for m in said), said
