"""The hub unreachable: a push, a hub dataset or a task's dataset is one line at once (exit 2), nothing lost.

Each test makes the hub unreachable itself (`hub_unreachable`: HF_ENDPOINT on a closed local port), so the
tests do not depend on whether the machine running them has a network.
"""

import httpx2
import pytest
import requests
from huggingface_hub.errors import LocalTokenNotFoundError, OfflineModeIsEnabled

from gqaify.model import hub
from gqaify.testing import build_model, save_with_tokenizer
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from helpers import load, one_line_refusal, tree_hashes
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
