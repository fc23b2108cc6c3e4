"""No transformers progress bar between a command's lines, in a process of its own reading a GGUF and loading
models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gqaify.entry.cli import main
from helpers import MODELS, needs_assets

# -- transformers' progress bars -----------------------------------------------------------------------------------


TRANSFORMERS_BARS = ("Loading weights", "Converting and de-quantizing GGUF tensors")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> dict[str, Path]:
    """stories260K's MHA twin and its GQA-2 conversion as one GGUF file."""
    source = MODELS / "stories260K-mha"
    if not source.is_dir():
        pytest.skip(f"needs {source}")
    out = tmp_path_factory.mktemp("bars") / "gqa2.gguf"
    assert main(["convert", str(source), str(out), "--kv-heads", "2", "-q"]) == 0
    return {"parent": source, "gguf": out}


@needs_assets
@pytest.mark.parametrize("quiet", [[], ["-q"]], ids=["default", "-q"])
def test_no_transformers_progress_bar_cuts_into_a_command_reading_a_gguf_and_loading_models(tiny_gguf, tmp_path, quiet):
    """eval loads the parent ("Loading weights") and reads the GGUF ("Converting and de-quantizing GGUF tensors"):
    both of transformers' bars printed to stderr, -q or not."""
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little girl who liked to play in the park. " * 20)
    argv = [sys.executable, "-m", "gqaify", "eval", str(tiny_gguf["parent"]), str(tiny_gguf["gguf"])]
    argv += ["--data", str(text), "--out", str(tmp_path / "report"), "--no-speed", *quiet]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "report" / "report.md").is_file()
    shown = [bar for bar in TRANSFORMERS_BARS if bar in done.stderr]
    assert not shown, done.stderr[-2000:]
