"""Real checkpoints: ../shared/assets models (skipped without them), pooled back and converted."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import gqaify
from helpers import MODELS, load, logits, needs_assets, tree_hashes


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
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), expected)
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


@needs_assets
def test_norm_mean_starts_closer_to_the_parent_than_mean_on_ref_mha_6l(tmp_path):
    from gqaify.eval.perplexity import perplexity

    src = MODELS / "ref-mha-6L"
    text = (MODELS.parent / "text" / "wikitext-2-raw-test.txt").read_text()
    ids = AutoTokenizer.from_pretrained(src)(text[:20_000], return_tensors="pt").input_ids[0, :2048]
    found = {}
    for method in ("mean", "norm-mean"):
        gqaify.convert(src, tmp_path / method, kv_heads=2, method=method, progress=False)
        found[method] = perplexity(load(tmp_path / method), ids, 512, 512, progress=False).perplexity
    assert found["norm-mean"] < 0.8 * found["mean"]
