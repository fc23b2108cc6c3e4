"""Long work in a log: a bar is a line a minute and its end; work done within a minute, or asked quiet, writes
nothing."""

from __future__ import annotations

import sys


def _log_of(monkeypatch, seconds_per_step: float, steps: int, shown: bool = True) -> list[str]:
    """The lines a bar of `steps` steps of `seconds_per_step` each (on tqdm's clock, made to advance by that much
    a step) writes where standard error is a log, not a terminal."""
    import io

    import tqdm.std

    from gqaify.progress import progress_bar

    clock = [1_000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    log = io.StringIO()  # no terminal
    monkeypatch.setattr(sys, "stderr", log)
    bar = progress_bar(range(steps), shown=shown, desc="fitting MLA layers", unit="layer")
    for step in bar:
        clock[0] += seconds_per_step
        bar.set_postfix(out=f"{step / 100:.3f}")  # redraws at once on a terminal; in a log, at the bar's pace
    return log.getvalue().splitlines(keepends=True)


def test_in_a_log_a_bar_is_a_line_a_minute_and_its_end(monkeypatch):
    """Where standard error was a log, a bar wrote nothing at all (tqdm disables itself off a terminal): a fit of
    many minutes said nothing until its summary. It writes its figures once a minute, each line whole, and the last."""
    from gqaify.progress import LOG_EVERY

    assert LOG_EVERY == 60
    lines = _log_of(monkeypatch, 25.0, 10)  # 250 s: lines past 60 s, then a minute apart, then the end
    assert [line.split()[4] for line in lines] == ["3/10", "6/10", "9/10", "10/10"], lines
    assert all(line.startswith("fitting MLA layers: ") and line.endswith("\n") and "\r" not in line for line in lines)
    assert lines[-1] == "fitting MLA layers: 100% 10/10 [04:10<00:00, 25.00s/layer, out=0.090]\n"


def test_in_a_log_work_done_within_a_minute_or_asked_quiet_writes_nothing(monkeypatch):
    assert _log_of(monkeypatch, 25.0, 2) == []  # 50 s
    assert _log_of(monkeypatch, 25.0, 10, shown=False) == []  # --no-progress, -q
