"""`gqaify eval --kv-cache` in llama.cpp on a tiny model, offline: a random Llama of two layers whose heads hold 32
values (llama.cpp's quantized types store blocks of 32), with stories260K's tokenizer so that gqaify writes it as
GGUF. Its own quantized caches drift from it as their bits fall, llama.cpp allocates the bytes gqaify counts, its f16
row agrees with transformers' figure for the same file, and nothing of llama.cpp's log reaches the terminal."""

import shutil
import subprocess
import sys

import pytest

from gqaify.entry.cli import main
from gqaify.eval.results import Report
from gqaify.testing import build_model, save
from helpers import ASSETS, MODELS, needs_assets, needs_llama_cpp

pytestmark = [needs_assets, needs_llama_cpp]
LAYERS, HEADS, HEAD = 2, 4, 32


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny parent and its MQA conversion as GGUF files, evaluated under f16, q8_0 and q4_0 caches in a process of
    its own, as a user runs it: (its report, its rows by (label, cache), what it printed)."""
    root = tmp_path_factory.mktemp("tiny-served")
    model = build_model("llama", num_kv_heads=HEADS, num_attention_heads=HEADS, hidden_size=HEADS * HEAD,
                        head_dim=HEAD, num_hidden_layers=LAYERS, vocab_size=512, bos_token_id=1, eos_token_id=2,
                        max_position_embeddings=512)  # fmt: skip
    save(model, root / "parent")
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(MODELS / "stories260K" / name, root / "parent" / name)
    for kv in (HEADS, 1):
        assert main(["convert", str(root / "parent"), str(root / f"kv{kv}.gguf"), "--kv-heads", str(kv), "-q"]) == 0
    (root / "text.txt").write_text((ASSETS / "text" / "tinystories-valid-head.txt").read_text()[:3000])
    argv = [sys.executable, "-m", "gqaify", "eval", root / f"kv{HEADS}.gguf", root / "kv1.gguf", "--data",
            root / "text.txt", "--out", root / "r", "--seq-len", "128", "--max-tokens", "384", "--no-speed",
            "--kv-cache", "f16", "q8_0", "q4_0", "-q"]  # fmt: skip
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = Report.read(root / "r")
    return report, {(r.label, r.cache): r for r in report.frontier.rows}, done.stdout + done.stderr


def test_the_tiny_parents_quantized_caches_drift_as_their_bits_fall(served):
    _, rows, _ = served
    parent = f"kv{HEADS}.gguf"
    assert rows[parent, "f16"].mean_kl == 0.0
    assert 0 < rows[parent, "q8_0"].mean_kl < rows[parent, "q4_0"].mean_kl
    assert rows["kv1.gguf", "q8_0"].mean_kl > 0 and rows["kv1.gguf", "f16"].mean_kl > 0


def test_llama_cpp_allocates_the_bytes_gqaify_counts_for_the_tiny_model(served):
    _, rows, _ = served
    for (label, cache), row in rows.items():
        kv_heads = HEADS if label == f"kv{HEADS}.gguf" else 1
        bits = {"f16": 16, "q8_0": 8.5, "q4_0": 4.5}[cache]
        assert row.bytes_per_token == LAYERS * kv_heads * HEAD * 2 * bits / 8
        step = 0.01 * 2**20 / 512  # the log states MiB to 2 decimals, over a context of the model's 512 positions
        assert row.bytes_per_token_measured == pytest.approx(row.bytes_per_token, abs=step)


def test_llama_cpps_f16_row_agrees_with_transformers_for_the_tiny_file(served):
    report, rows, _ = served
    for model, label in zip(report.models, [f"kv{HEADS}.gguf", "kv1.gguf"], strict=True):
        llama = rows[label, "f16"].texts[0].perplexity
        assert llama == pytest.approx(model.texts[0].perplexity, rel=0.01), (llama, model.texts[0].perplexity)


def test_nothing_of_llama_cpps_log_reaches_the_terminal(served):
    """Each context is made verbose, for the allocation its log states; freeing it printed four lines of
    '~llama_context: CPU compute buffer size ...' between eval's own."""
    _, _, printed = served
    assert not [line for line in printed.splitlines() if "llama_" in line or "ggml" in line], printed
