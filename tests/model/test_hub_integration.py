"""The hub unreachable, in a fresh process as a user runs it: a command that needs it is one line on the real
stderr, at once, and so is a hub model that is not in the cache.

Each test makes the hub unreachable itself (HF_ENDPOINT on a local port that hangs up on every connection, and
counts them), so the tests do not depend on whether the machine running them has a network: the hub is asked once,
where huggingface_hub's own requests retried five times, 23 lines of "Retrying in 1s" over 25 s.
"""

import importlib.util
import os
import socket
import subprocess
import sys
import threading

import pytest

import test_hub
from gqaify.testing import CORPUS
from helpers import NOT_CACHED

# test_hub.py's fixture, shared: pytest finds a fixture by its name in this module
source = test_hub.source


@pytest.fixture
def silent_hub():
    """(an HF_ENDPOINT that accepts each connection and hangs up at once, the connections it was asked so far)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    asked, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            asked.append(1)
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", asked
    stop.set()
    thread.join()
    server.close()


def run_without_the_hub(endpoint: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`gqaify ARGV` in a fresh process, as a user runs it, with the hub at `endpoint` and offline mode off."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}
    return subprocess.run([sys.executable, "-m", "gqaify", *argv], capture_output=True, text=True, env=env)


EVAL = ["eval", "{src}", "--out", "{tmp}/report", "--no-speed", "--seq-len", "32"]
needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval: gqaify[tasks]")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([*EVAL, "--data", NOT_CACHED], "--data gqaify-tests/"),
        (
            ["convert", "{src}", "{tmp}/out", "--kv-heads", "2", "--method", "lsq", "--calib-data", NOT_CACHED],
            "--calib-data gqaify-tests/",
        ),
        pytest.param(
            [*EVAL, "--data", "{tmp}/text.txt", "--tasks", "hellaswag"],
            "task hellaswag needs Rowan/hellaswag",
            marks=needs_lm_eval,
        ),
    ],
    ids=["eval-data", "convert-calib-data", "eval-tasks"],
)
def test_the_hub_unreachable_is_one_line_on_the_real_stderr(tmp_path, source, silent_hub, argv, said):
    """In a fresh process, as a user runs it: stderr holds the one line and nothing else (the 22 lines of retry
    warnings, each printed twice, went to handlers the libraries bound to stderr, which an in-process capture may
    not see), the hub asked once; nothing is written."""
    (tmp_path / "text.txt").write_text(CORPUS)
    endpoint, asked = silent_hub
    done = run_without_the_hub(endpoint, [a.format(src=source, tmp=tmp_path) for a in argv])
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("gqaify: error: "), (
        done.stderr
    )
    assert said in done.stderr and "could not be reached" in done.stderr
    assert len(asked) == 1  # asked once, then the libraries offline: no retries
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "text.txt"]


HUB_MODEL = "gqaify-tests/not-cached-model"  # a hub model no machine has in its cache


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["eval", HUB_MODEL, "--data", "{tmp}/text.txt", "--out", "{tmp}/report"], f"MODEL {HUB_MODEL}"),
        (["eval", "{src}", HUB_MODEL, "--data", "{tmp}/text.txt", "--out", "{tmp}/report"], HUB_MODEL),
        (["generate", HUB_MODEL, "{tmp}/corpus", "--tokens", "100"], f"MODEL {HUB_MODEL}"),
        (["uptrain", "--model", HUB_MODEL, "--output_dir", "{tmp}/run", "--data", "{tmp}/text.txt"], "model"),
        (
            ["uptrain", "--model", "{src}", "--distill_from", HUB_MODEL, "--output_dir", "{tmp}/run"]
            + ["--data", "{tmp}/text.txt", "--seq_len", "16", "--micro_batch_size", "1"],
            f"distill_from {HUB_MODEL}",
        ),
    ],
    ids=["eval", "eval-second-model", "generate", "uptrain", "uptrain-teacher"],
)
def test_a_hub_model_without_the_hub_is_one_line_at_once(tmp_path, source, silent_hub, argv, said):
    """The hub asked once before a model is loaded (as convert and hub datasets do): transformers' own requests
    retried five times, 23 lines of "Retrying in 1s" over 25 s, before the error."""
    (tmp_path / "text.txt").write_text(CORPUS)
    endpoint, asked = silent_hub
    argv = [a.format(src=source, tmp=tmp_path) for a in argv]
    argv += ["--max_tokens", "1024"] if argv[0] == "uptrain" else []
    done = run_without_the_hub(endpoint, argv)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Retrying" not in done.stderr, done.stderr
    assert said in done.stderr and "is not a local path and the Hugging Face hub could not be reached" in done.stderr
    assert len(asked) == 1  # asked once, then the libraries offline: no retries
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "text.txt"]
