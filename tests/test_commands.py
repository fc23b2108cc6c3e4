"""What every `gqaify` command takes: `--help` for each, `--config FILE` for exactly the commands README says."""

from __future__ import annotations

import argparse
import re

from conftest import REPO
from gqaify.cli import build_parser, main


def commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_the_commands_that_take_a_config_file_are_those_readme_names(capsys, tmp_path):
    """README said "every command" takes --config; recipes and demo take none (they have no settings to keep)."""
    readme = " ".join((REPO / "README.md").read_text().split())
    named = re.search(r"the four that run a stage \(([^)]*)\) take a `--config FILE`", readme)
    assert named, "README's sentence on --config moved"
    named = set(re.findall(r"`(\w+)`", named.group(1)))
    assert len(named) == 4 and named < set(commands()) and {"recipes", "demo"} <= set(commands()) - named
    (tmp_path / "x.yaml").write_text("{}\n")
    for command in commands():
        assert main([command, "--help"]) == 0, command
        assert ("--config" in capsys.readouterr().out) == (command in named), command
        if command not in named:
            assert main([command, "--config", str(tmp_path / "x.yaml")]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"gqaify {command} takes no --config (it has no settings to keep)" in err, (
                err
            )


def test_a_reader_that_went_away_is_no_internal_error(tmp_path):
    """`gqaify recipes | head` printed "internal error ... please report it" with a BrokenPipeError traceback. The pipe's
    reading end is closed before the command starts, so its first write fails on every machine."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "gqaify", "recipes"], stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == ""
