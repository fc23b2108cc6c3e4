"""Long work shows a progress bar on a terminal: checked under a real pseudo-terminal, not captured pipes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gqaify.testing import CORPUS, build_model, save_with_tokenizer


def _on_a_terminal(argv: list[str], size: tuple[int, int] | None) -> str:
    """What `gqaify ARGV` writes to a pseudo-terminal (of `size` columns and rows; None: one nobody sized)."""
    import fcntl
    import struct
    import termios

    main, child = os.openpty()
    if size is not None:
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "gqaify.entry.cli", *argv], stdout=child, stderr=child)
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed its end (EIO on Linux)
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait()
    os.close(main)
    assert process.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.integration
@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
@pytest.mark.parametrize("size", [None, (100, 40)], ids=["unsized", "sized"])
def test_a_fit_shows_its_bars_on_a_terminal_sized_or_not(tmp_path, size):
    """On a pseudo-terminal nobody sized (script, ssh -T), tqdm took 0 rows as no room and drew nothing for the
    whole fit; it draws there as on a sized one."""
    src = save_with_tokenizer(
        build_model("llama", num_kv_heads=4, num_attention_heads=4, vocab_size=320), tmp_path / "src"
    )
    (tmp_path / "calib.txt").write_text(CORPUS * 8)
    argv = [str(src), str(tmp_path / "out"), "--kv-heads", "2", "--method", "lsq"]
    argv += ["--calib-data", str(tmp_path / "calib.txt"), "--calib-tokens", "512"]
    shown = _on_a_terminal(["convert", *argv], size)
    assert "calibrating: 100%" in shown and "converting: 100%" in shown, shown
    quiet = _on_a_terminal(["convert", *argv[:1], str(tmp_path / "q"), *argv[2:], "-q"], size)
    assert "calibrating" not in quiet and "converting" not in quiet


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
