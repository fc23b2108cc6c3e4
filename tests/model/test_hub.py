"""The hub unreachable: a push, a hub dataset or a task's dataset is one line at once (exit 2), nothing lost.

Each test makes the hub unreachable itself (`hub_unreachable`: HF_ENDPOINT on a closed local port), so the
tests do not depend on whether the machine running them has a network.
"""

import importlib.util
import os
import subprocess
import sys
import time

import httpx2
import pytest
import requests
from huggingface_hub.errors import LocalTokenNotFoundError, OfflineModeIsEnabled

from gqaify.model import hub
from gqaify.testing import CORPUS, build_model, save_with_tokenizer
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from helpers import CLOSED, NOT_CACHED, QUICK, load, one_line_refusal, tree_hashes
from helpers import uptrain_args as args


@pytest.fixture
def source(tmp_path):
    return save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=300), tmp_path / "src")


def test_push_without_network_keeps_the_folder_and_says_how_to_push_it(capsys, tmp_path, source, hub_unreachable):
    out = tmp_path / "out"
    err = one_line_refusal(capsys, "convert", source, out, "--kv-heads", "2", "--push-to-hub", "you/x", "-q")
    assert "the push to you/x failed (ConnectError" in err and f"hf upload you/x {out.resolve()}" in err
    assert load(out).config.num_key_value_heads == 2  # complete, loadable
    assert not list(tmp_path.glob(".out.gqaify-*"))


EVAL = ["eval", "{src}", "--out", "{tmp}/report", "--no-speed", "--seq-len", "32"]
needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval: gqaify[tasks]")


@pytest.mark.integration
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
def test_the_hub_unreachable_is_one_line_on_the_real_stderr(tmp_path, source, argv, said):
    """In a fresh process, as a user runs it: stderr holds the one line and nothing else (the 22 lines of retry
    warnings, each printed twice, went to handlers the libraries bound to stderr, which an in-process capture may
    not see), soon after the libraries are imported; nothing is written."""
    (tmp_path / "text.txt").write_text(CORPUS)
    env = {**os.environ, "HF_ENDPOINT": CLOSED, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}
    argv = [a.format(src=source, tmp=tmp_path) for a in argv]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gqaify", *argv], capture_output=True, text=True, env=env)
    elapsed = time.monotonic() - start
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("gqaify: error: "), (
        done.stderr
    )
    assert said in done.stderr and "could not be reached" in done.stderr
    assert elapsed < 3 * QUICK, f"{elapsed:.1f} s"  # imports and the harness's task index included
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "text.txt"]


HUB_MODEL = "gqaify-tests/not-cached-model"  # a hub model no machine has in its cache


@pytest.mark.integration
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
def test_a_hub_model_without_the_hub_is_one_line_at_once(tmp_path, source, argv, said):
    """The hub asked once before a model is loaded (as convert and hub datasets do): transformers' own requests
    retried five times, 23 lines of "Retrying in 1s" over 25 s, before the error."""
    (tmp_path / "text.txt").write_text(CORPUS)
    env = {**os.environ, "HF_ENDPOINT": CLOSED, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}
    argv = [a.format(src=source, tmp=tmp_path) for a in argv]
    argv += ["--max_tokens", "1024"] if argv[0] == "uptrain" else []
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gqaify", *argv], capture_output=True, text=True, env=env)
    elapsed = time.monotonic() - start
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Retrying" not in done.stderr, done.stderr
    assert said in done.stderr and "is not a local path and the Hugging Face hub could not be reached" in done.stderr
    assert elapsed < QUICK, f"{elapsed:.1f} s"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "text.txt"]


def raising(exc: Exception):
    class Failing:
        def create_repo(self, repo_id, **kwargs):
            raise exc

    return Failing


PUSH_FAILURES = {
    "connect": httpx2.ConnectError("[Errno -2] Name or service not known"),
    "timeout": httpx2.ReadTimeout("The read operation timed out"),
    "offline": OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled."),
    "requests": requests.ConnectionError("Max retries exceeded"),
    "no token": LocalTokenNotFoundError("Token is required, but no token found."),
    "os timeout": TimeoutError("timed out"),
}


@pytest.mark.parametrize("exc", PUSH_FAILURES.values(), ids=PUSH_FAILURES.keys())
def test_any_failure_to_reach_the_hub_is_one_line(capsys, tmp_path, source, monkeypatch, exc):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", raising(exc))
    out = tmp_path / "out"
    err = one_line_refusal(capsys, "convert", source, out, "--kv-heads", "2", "--push-to-hub", "you/x", "-q")
    assert f"({type(exc).__name__}: " in err and "hf upload you/x" in err
    assert load(out).config.num_key_value_heads == 2


def test_a_bug_in_the_push_is_still_a_bug(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", raising(KeyError("repo")))
    with pytest.raises(KeyError):
        hub.push_folder(tmp_path, "you/x", "message")


def test_uptrain_push_without_network_keeps_the_finished_run(capsys, tmp_path, tiny, hub_unreachable):
    out = tmp_path / "run"
    uptrain(parse(args(tiny, out)))
    before = tree_hashes(out)
    err = one_line_refusal(capsys, "uptrain", *args(tiny, out, "--push_to_hub", "you/x"))
    assert "the push to you/x failed (ConnectError" in err and f"hf upload you/x {out / 'final'}" in err
    assert tree_hashes(out) == before


def test_the_probe_is_asked_once_and_offline_mode_is_undone(hub_unreachable, monkeypatch):
    import datasets.config
    from huggingface_hub import constants

    with hub.offline_unless_reachable() as why:
        assert "ConnectError" in why and constants.is_offline_mode() and datasets.config.HF_HUB_OFFLINE
    assert not constants.is_offline_mode() and not datasets.config.HF_HUB_OFFLINE
    monkeypatch.setattr(httpx2.Client, "head", lambda *a, **k: pytest.fail("asked twice"))
    assert hub.unreachable() == why  # remembered
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE" in hub.unreachable()
