"""The default conversion of a trained model in a process of its own: one line on stderr naming what it costs and
the fix."""

from __future__ import annotations

import subprocess
import sys

import test_uncalibrated_warning_and_pins
from test_uncalibrated_warning_and_pins import ADVICE

# test_uncalibrated_warning_and_pins.py's fixture, shared: pytest finds a fixture by its name in this module
trained = test_uncalibrated_warning_and_pins.trained


DAMAGE = "SmolLM2-135M-Instruct made MQA scored a WikiText-2 perplexity of 28,407, its parent 23.09"


def test_the_default_conversion_warns_on_stderr_in_one_line_naming_the_damage_and_the_fix(trained, tmp_path):
    """`gqaify convert SRC OUT --kv-heads 1` (mean) wrecked SmolLM2 (WikiText-2 26.99 -> 35,580) and said nothing."""
    out = tmp_path / "mqa"
    argv = [sys.executable, "-m", "gqaify", "convert", str(trained["src"]), str(out), "--kv-heads", "1", "-q"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0 and (out / "model.safetensors").is_file(), done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert "--method mean read no calibration text: expect a trained model to lose most of its quality" in line
    assert DAMAGE in line
    assert ADVICE in line and f"gqaify generate {trained['src']} parent-text" in line
    assert done.stdout.startswith("converted llama to MQA with --method mean")  # the summary, on stdout
