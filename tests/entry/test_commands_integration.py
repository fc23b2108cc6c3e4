"""A `gqaify` command in a process of its own whose reader went away (`gqaify recipes | head`): no internal
error."""

from __future__ import annotations


def test_a_reader_that_went_away_is_no_internal_error(tmp_path):
    """`gqaify recipes | head` printed "internal error ... please report it" with a BrokenPipeError traceback. The
    pipe's reading end is closed before the command starts, so its first write fails on every machine."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gqaify", "recipes"], stdout=write, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == ""
