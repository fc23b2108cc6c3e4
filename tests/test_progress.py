"""Long work in a log: a bar is a line a minute and its end; work done within a minute, or asked quiet, writes
nothing."""

from __future__ import annotations

import re
import sys


def _log_of(
    monkeypatch, seconds_per_step: float, steps: int, shown: bool = True, desc: str = "fitting MLA layers"
) -> list[str]:
    """The lines a bar of `steps` steps of `seconds_per_step` each (on tqdm's clock, made to advance by that much
    a step) writes where standard error is a log, not a terminal."""
    import io

    import tqdm.std

    from gqaify.progress import progress_bar

    clock = [1_000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    log = io.StringIO()  # no terminal
    monkeypatch.setattr(sys, "stderr", log)
    bar = progress_bar(range(steps), shown=shown, desc=desc, unit="layer")
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


def test_in_a_log_a_bar_says_its_end_once_and_its_description_whole(monkeypatch):
    """A bar whose last step came a minute or more after its previous line wrote its 100% line twice (tqdm's close
    writes the final line whatever the last one said); a long description (a model's path) is written whole."""
    lines = _log_of(monkeypatch, 65.0, 3)
    assert [line.split()[4] for line in lines] == ["1/3", "2/3", "3/3"], lines
    name = "perplexity of /models/" + "a-long-folder-name/" * 8 + "final · wikitext"
    lines = _log_of(monkeypatch, 25.0, 10, desc=name)
    assert lines[-1].startswith(f"{name}: 100% 10/10 ")


def test_on_a_terminal_a_long_description_is_cut_in_its_middle_and_the_figures_show(monkeypatch):
    """On a terminal, tqdm cuts a line too long for it at its right end: a long description (a model's path) left
    the bar no figures at all. It is cut in its middle, its start and its end (the model's name) kept."""
    import fcntl
    import os
    import struct
    import termios

    from gqaify.progress import progress_bar

    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # 24 rows, 80 columns
    name = "perplexity of /models/" + "a-long-folder-name/" * 8 + "final · wikitext"
    with os.fdopen(child, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        for _ in progress_bar(range(3), shown=True, desc=name, unit="layer"):
            pass
    drawn = b""
    while True:  # one read returns what the terminal has buffered so far, not always all of it
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # EIO: the writing end is closed and everything has been read
            break
        if not chunk:
            break
        drawn += chunk
    drawn = drawn.decode()
    os.close(main)
    last = [line for line in re.split("[\r\n]", drawn) if "100%" in line][-1].rstrip()
    assert len(last) <= 80 and re.search(r" 3/3 \[[^]]*layer[^]]*\]$", last), drawn  # the figures, whole
    assert last.startswith("perplexity of ") and "..." in last and "· wikitext: 100%" in last, drawn


def test_every_bar_says_what_it_counts():
    """The MLA fit's bar counted "it" where the others count layers, windows, tokens or bytes: every bar in gqaify
    names its unit."""
    import ast

    from helpers import REPO

    unnamed = []
    for path in sorted((REPO / "src" / "gqaify").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            bar = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "progress_bar"
            if bar and not any(k.arg == "unit" for k in node.keywords):
                unnamed.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert unnamed == []


def _said(capsys, argv: list) -> list[str]:
    """The lines `gqaify ARGV` wrote to standard error (a log here, not a terminal), its exit status checked."""
    from helpers import run_cli

    code, err = run_cli(capsys, *argv)
    assert code == 0, err
    return err.splitlines()


def _in_order(lines: list[str], expected: list[str]) -> bool:
    """Whether each of `expected` begins a line of `lines`, one after another."""
    at = 0
    for line in lines:
        if at < len(expected) and line.startswith(expected[at]):
            at += 1
    return at == len(expected)


def test_each_long_phase_says_what_it_does_before_it_begins(tiny, tmp_path, capsys):
    """Minutes passed in silence on SmolLM2 under load: convert's capture before its first bar (108 s), uptrain
    reading its texts, loading its models and evaluating the start (85 s and 112 s), eval between two models (121 s).
    Each now says what it does as it begins, in a log as on a terminal, and nothing where asked quiet."""
    from helpers import uptrain_args

    convert = ["convert", tiny["parent"], tmp_path / "c", "--kv-heads", "2", "--method", "lsq", "--calib-data",
               tiny["train"], "--calib-seq-len", "16"]  # fmt: skip
    said = _said(capsys, convert)
    assert _in_order(said, ["capturing every layer's inputs on"]), said  # its bar, in a log, after a minute

    run = [a for a in uptrain_args(tiny, tmp_path / "u") if a != "--no_progress"]
    run += ["--eval_data", tiny["eval"], "--eval_every", "10", "--eval_points", "0", "--parent", tiny["parent"],
            "--distill_from", tiny["parent"]]  # fmt: skip
    said = _said(capsys, ["uptrain", *run])
    expected = [
        "reading the training and evaluation texts",
        f"loading the model to train ({tiny['converted']}) and its teacher",
        "evaluating the start beside the parent, before the first step",
    ]
    assert _in_order(said, expected), said

    evaluate = ["eval", tiny["parent"], tiny["converted"], "--data", tiny["eval"], "--out", tmp_path / "r",
                "--seq-len", "32", "--no-speed"]  # fmt: skip
    said = _said(capsys, evaluate)
    parent, converted = "parent", "gqa2"  # the models' labels: their folders' names
    expected = [f"loading {parent}", f"loading {converted}", f"comparing {converted}'s attention with the parent's"]
    assert _in_order(said, expected), said

    quiet = [
        *_said(capsys, [*convert[:2], tmp_path / "c2", *convert[3:], "-q"]),
        *_said(capsys, ["uptrain", *uptrain_args(tiny, tmp_path / "u2")]),
        *_said(capsys, [*evaluate[:6], tmp_path / "r2", *evaluate[7:], "-q"]),
    ]
    assert not [line for line in quiet if line.startswith(("capturing", "reading", "loading", "evaluating"))], quiet
