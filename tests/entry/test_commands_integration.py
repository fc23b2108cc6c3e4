"""A `gqaify` command in a process of its own whose standard output is no ordinary one: its reader went away
(`gqaify recipes | head`), it is on a full disk (`> /dev/full`), or it is closed (`>&-`). No internal error."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from gqaify.packaged import RECIPES
from helpers import one_line


def test_a_reader_that_went_away_is_no_internal_error(tmp_path):
    """`gqaify recipes | head` printed "internal error ... please report it" with a BrokenPipeError traceback. The
    pipe's reading end is closed before the command starts, so its first write fails on every machine."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gqaify", "recipes"], stdout=write, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == ""


def _gqaify(argv: list[str], redirect: str) -> subprocess.CompletedProcess:
    """`gqaify ARGV` in a process of its own, its standard output redirected by the shell as `redirect` says
    (`> /dev/full`, `>&-`); its stderr captured."""
    command = shlex.join([sys.executable, "-m", "gqaify", *argv])
    return subprocess.run(["bash", "-c", f"{command} {redirect}"], stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full is Linux's full disk")
def test_a_full_disk_under_standard_output_is_one_line_and_a_copy_written_whole_says_so(tmp_path):
    """`gqaify --constraints > /dev/full` and `gqaify recipes > /dev/full` ended in an ENOSPC traceback,
    `gqaify --help > /dev/full` said nothing and exited 0 (argparse swallows the error), and a `recipes cp` whose copy
    was written whole reported an internal error. Each is one line, exit 1 (the machine ran out of room)."""
    said = "gqaify: error: standard output cannot be written (No space left on device)"
    for argv in (["--constraints"], ["recipes"], ["--help"], ["convert", "--help"]):
        done = _gqaify(argv, "> /dev/full")
        assert done.returncode == 1 and one_line(done.stderr).startswith(said), (argv, done.stderr)
    copy = tmp_path / "cpu.yaml"
    done = _gqaify(["recipes", "cp", "accelerate/cpu", str(copy)], "> /dev/full")
    assert done.returncode == 1 and one_line(done.stderr).startswith(said), done.stderr
    assert done.stderr.strip().endswith(f"; the copy {copy} is whole all the same")
    assert copy.read_bytes() == (RECIPES / "accelerate" / "cpu.yaml").read_bytes()


def test_a_closed_standard_output_is_refused_before_anything_runs(tmp_path):
    """With `>&-`, `gqaify recipes` and `--constraints` ended in "'NoneType' object has no attribute 'flush'" (an
    internal error), and `gqaify convert` converted, then failed so. Every command is refused at once, exit 2, and
    writes nothing: the conversion is refused before its SRC is even looked at."""
    said = "gqaify: error: standard output is closed (>&-), so nothing gqaify prints could be read"
    runs = (
        ["--constraints"],
        ["recipes"],
        ["recipes", "cp", "accelerate/cpu", str(tmp_path / "cpu.yaml")],
        ["convert", str(tmp_path / "no-such-model"), str(tmp_path / "out"), "--kv-heads", "1"],
    )
    for argv in runs:
        done = _gqaify(argv, ">&-")
        assert done.returncode == 2 and one_line(done.stderr).startswith(said), (argv, done.stderr)
    done = subprocess.run(
        ["bash", "-c", f"{shlex.quote(sys.executable)} -m gqaify.uptrain --help >&-"], stderr=subprocess.PIPE, text=True
    )
    assert done.returncode == 2 and one_line(done.stderr).startswith(said), done.stderr
    assert list(tmp_path.iterdir()) == []
