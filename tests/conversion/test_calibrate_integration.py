"""Layer-by-layer calibration stopped in a process of its own: SIGTERM mid-refinement answered at once in
bounded memory, and what a SIGKILL mid-refinement leaves removed by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import test_calibrate
from test_calibrate import _tiny

# test_calibrate.py's fixture, shared: pytest finds a fixture by its name in this module
calibration = test_calibrate.calibration


# The command line under a cap of 3 GiB of address space beyond what the libraries it loads take (Linux).
_CAPPED = """
import resource, sys
import datasets, torch, transformers
from gqaify.entry.cli import main
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmPeak")) << 10
resource.setrlimit(resource.RLIMIT_AS, (peak + (3 << 30), peak + (3 << 30)))
sys.exit(main(sys.argv[1:]))
"""


def _refining(calibration, tmp_path) -> tuple[subprocess.Popen, list, threading.Thread]:
    """A capped conversion of the most refinement steps allowed, once it is in its steps: the process, its
    stderr lines as (when, line), and the thread that reads them as they come."""
    from gqaify.conversion.settings import REFINE_STEPS_MAX

    _, src = _tiny("llama", tmp_path / "src")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # on the CPU: a CUDA context reserves address space
    argv = [
        sys.executable,
        "-c",
        _CAPPED,
        "-v",
        "convert",
        src,
        tmp_path / "out",
        "--kv-heads",
        "1",
        "--method",
        "lsq",
        "--calib-data",
        calibration["calib_data"],
        "--calib-tokens",
        "1024",
        "--calib-seq-len",
        "48",
        "--refine-steps",
        str(REFINE_STEPS_MAX),
        "-q",
    ]
    process = subprocess.Popen([str(a) for a in argv], stderr=subprocess.PIPE, text=True, env=env)
    lines = []  # (when, line) of stderr
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in process.stderr))
    reader.start()
    deadline = time.monotonic() + 120
    while not any("layer 0: refining" in line for _, line in lines):
        assert process.poll() is None and time.monotonic() < deadline, lines
        time.sleep(0.01)
    time.sleep(1)  # in the steps
    assert process.poll() is None, lines  # still refining: the cap held
    return process, lines, reader


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_sigterm_during_refinement_is_answered_at_once_in_bounded_memory(calibration, tmp_path):
    """--refine-steps 1000000000 drew an 8.3 GB permutation for over a minute, deaf to SIGTERM, before the first
    step. Now the most steps allowed run within 3 GiB more address space than the libraries take, and SIGTERM
    mid-refinement is answered between two steps, before the layer's refinement ends, with nothing left behind."""
    process, lines, reader = _refining(calibration, tmp_path)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143
    reader.join()
    _, line = lines[-1]
    assert "stopped by SIGTERM; nothing was written" in line, line
    assert not any("layer 1" in said for _, said in lines), lines  # stopped inside layer 0's refinement
    assert [line for _, line in lines if line.startswith("gqaify")] == [line]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "src"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_sigkill_during_refinement_leaves_only_a_staging_folder_the_next_run_removes(calibration, tmp_path):
    """A SIGKILL mid-refinement left `.gqaify-fits` beside OUT. The fitted layers wait inside the staging folder,
    whose name records its owner: the kill leaves that one folder, and the next run to OUT removes it and says so."""
    process, _, reader = _refining(calibration, tmp_path)
    process.kill()
    process.wait()
    reader.join()
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("calib.txt", "src"))
    assert len(left) == 1 and left[0].startswith(".out.gqaify-"), left
    assert (tmp_path / left[0] / ".gqaify-fits").is_dir()  # the fits of the layers done, inside it
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gqaify",
            "convert",
            str(tmp_path / "src"),
            str(tmp_path / "out"),
            "--kv-heads",
            "1",
            "-q",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"removed {tmp_path / left[0]}" in done.stderr and "left by a run that was killed" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "out", "src"]
