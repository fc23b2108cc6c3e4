"""Bad input and failures in a process of its own: the console script's exit statuses, a process whose peer
stopped says so once and exits 1, and a conversion killed mid-write leaves no output."""

import os
import signal
import subprocess
import sys
import time

import pytest

import test_errors
from gqaify.testing import build_model, save
from helpers import HOLD_MID_WRITE, tree_hashes
from test_errors import GLOO_PEER_GONE

# test_errors.py's fixture, shared: pytest finds a fixture by its name in this module
source = test_errors.source


def test_console_script_success_and_bad_input(source, tmp_path):
    exe = [sys.executable, "-m", "gqaify"]
    done = subprocess.run([*exe, "convert", source, tmp_path / "out", "--kv-heads", "1", "-q"], capture_output=True)
    assert done.returncode == 0, done.stderr
    assert b"K/V heads       4 -> 1" in done.stdout
    bad = subprocess.run([*exe, "convert", source, tmp_path / "o2", "--kv-heads", "5"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and not (tmp_path / "o2").exists()


@pytest.mark.parametrize(
    ("raised", "line"),
    [
        (
            "RuntimeError(GLOO)",
            "gqaify: error: another process of the launch stopped, and this one with it: that "
            "process's output says why",
        ),
        ("ResourceError('another process of the launch stopped; kept x')", None),
    ],
    ids=["raw", "said by the stage"],
)
def test_a_process_whose_peer_stopped_says_so_once_and_exits_1_through_the_launchers_sigterm(raised, line):
    """A launch's process whose peer stopped fails in gloo, and the launcher sends it SIGTERM soon after: while it
    unwinds, or after its line. Neither changes the one line nor the exit status 1 (a traceback and "internal
    error" before, or death by SIGTERM after the line)."""
    script = f"""
import os, signal, sys
from gqaify.command import run_command
from gqaify.errors import ResourceError
GLOO = {GLOO_PEER_GONE!r}

def collective():
    raise RuntimeError(GLOO)

def command():
    try:
        collective()
    except RuntimeError as exc:
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM, in the middle of the unwinding
        sum(range(1000))
        raise {raised} from exc

status = run_command(command, process_exit=True)  # as the entry of the process runs it
os.kill(os.getpid(), signal.SIGTERM)  # and once more after the line: it comes when the launcher looks
sum(range(1000))
sys.exit(status)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    expected = line or "gqaify: error: another process of the launch stopped; kept x"
    assert (done.returncode, done.stderr) == (1, expected + "\n")


def test_sigkill_mid_conversion_leaves_no_output(tmp_path):
    """Kill the converter once its first shard is on disk: OUT must not exist, only the hidden staging folder."""
    model = build_model(
        "llama",
        num_kv_heads=8,
        num_attention_heads=8,
        head_dim=32,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=16,
        vocab_size=4096,
    )
    src = save(model, tmp_path / "src", max_shard_size="2MB")
    before = tree_hashes(src)
    out = tmp_path / "out"
    code = f"import gqaify; gqaify.convert({str(src)!r}, {str(out)!r}, kv_heads=1, max_shard_size='200KB')"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_MID_WRITE + code])  # waits mid-write, until killed
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.gqaify-*/model-*.safetensors")):
        assert proc.poll() is None, "conversion ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not out.exists()
    assert tree_hashes(src) == before
