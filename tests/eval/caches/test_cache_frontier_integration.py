"""`gqaify eval --kv-cache` in llama.cpp itself, on SmolLM2-135M-Instruct (a real GQA-3 model; its heads of 64 values
take llama.cpp's 32-value blocks): the parent's own quantized caches drift from it as their bits fall, the bytes
llama.cpp reports allocating are the bytes gqaify counts, and llama.cpp's f16 row agrees with transformers' figure
for the same file."""

import pytest

import gqaify
from gqaify.entry.cli import main
from gqaify.eval.settings import EvalSettings
from gqaify.testing import CORPUS

pytestmark = pytest.mark.usefixtures("smollm2_read_once")


@pytest.fixture(scope="module")
def served(smollm2_gguf, tmp_path_factory):
    """The parent written by gqaify as an f16 GGUF (its Q4_1 weights dequantized), its MQA conversion, a text, and
    their evaluation under f16, q8_0 and q4_0 caches in llama.cpp."""
    root = tmp_path_factory.mktemp("served")
    parent, mqa = root / "parent.gguf", root / "mqa.gguf"
    assert main(["convert", str(smollm2_gguf), str(parent), "--kv-heads", "3", "-q"]) == 0
    assert main(["convert", str(smollm2_gguf), str(mqa), "--kv-heads", "1", "-q"]) == 0
    (root / "text.txt").write_text(CORPUS)
    settings = EvalSettings(seq_len=128, max_tokens=384, speed=False, progress=False, kv_cache=["f16", "q8_0", "q4_0"])
    report = gqaify.evaluate([str(parent), str(mqa)], str(root / "text.txt"), root / "r", settings)
    return report, {(r.label, r.cache): r for r in report.frontier.rows}


def test_the_parents_quantized_caches_drift_as_their_bits_fall(served):
    _, rows = served
    assert rows["parent.gguf", "f16"].mean_kl == 0.0
    assert 0 < rows["parent.gguf", "q8_0"].mean_kl < rows["parent.gguf", "q4_0"].mean_kl
    assert rows["mqa.gguf", "f16"].mean_kl > rows["parent.gguf", "q4_0"].mean_kl  # mean-pooled, untrained: far


def test_llama_cpp_allocates_the_bytes_gqaify_counts(served):
    _, rows = served
    layers, heads, head = 30, 3, 64
    for (label, cache), row in rows.items():
        kv_heads = heads if label == "parent.gguf" else 1
        bits = {"f16": 16, "q8_0": 8.5, "q4_0": 4.5}[cache]
        assert row.bytes_per_token == layers * kv_heads * head * 2 * bits / 8
        assert row.bytes_per_token_measured == pytest.approx(row.bytes_per_token, rel=0.01)  # MiB to 2 decimals


def test_llama_cpps_f16_row_agrees_with_transformers_for_the_same_file(served):
    """transformers reads the f16 GGUF's weights into float32 and runs in float32; llama.cpp multiplies in its own
    kernels with an f16 cache: the perplexities differ by rounding alone, well under 1%."""
    report, rows = served
    for model, label in zip(report.models, ["parent.gguf", "mqa.gguf"], strict=True):
        llama = rows[label, "f16"].texts[0].perplexity
        assert llama == pytest.approx(model.texts[0].perplexity, rel=0.01), (llama, model.texts[0].perplexity)
