"""Every supported architecture: identity at G = KV, the duplicated-heads oracle, and a G-head KV cache."""

import pytest
import torch

import gqaify
from conftest import ARCH_CONFIGS, build_model, duplicate_kv_heads, load, logits, sample_ids, save
from gqaify.archs import ARCHITECTURES, Geometry, arch_for
from gqaify.kvcache import kv_cache_bytes_per_token, measured_kv_cache_bytes


def test_every_architecture_has_a_test_case():
    assert set(ARCH_CONFIGS) == set(ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(ARCH_CONFIGS))
def test_same_number_of_heads_gives_identical_logits(model_type, tmp_path):
    model = build_model(model_type, num_kv_heads=2)
    src = save(model, tmp_path / "src")
    gqaify.convert(src, tmp_path / "out", kv_heads=2, progress=False)
    ids = sample_ids(model.config.vocab_size)
    assert torch.equal(logits(load(tmp_path / "out"), ids), logits(model, ids))


@pytest.mark.parametrize("model_type", sorted(ARCH_CONFIGS))
def test_mean_pooling_duplicated_heads_reproduces_the_gqa_model(model_type, tmp_path):
    gqa = build_model(model_type, num_kv_heads=2)
    twin = duplicate_kv_heads(gqa)
    ids = sample_ids(gqa.config.vocab_size)
    expected = logits(gqa, ids)
    torch.testing.assert_close(logits(twin, ids), expected)  # the oracle itself holds

    save(twin, tmp_path / "mha")
    result = gqaify.convert(tmp_path / "mha", tmp_path / "out", kv_heads=2, progress=False)
    assert result.groups == [[0, 1], [2, 3]]
    converted = load(tmp_path / "out")
    assert converted.config.num_key_value_heads == 2
    torch.testing.assert_close(logits(converted, ids), expected)


@pytest.mark.parametrize("model_type", sorted(ARCH_CONFIGS))
def test_mqa_output_loads_and_caches_one_head(model_type, tmp_path):
    model = build_model(model_type, num_kv_heads=2)
    save(model, tmp_path / "src")
    gqaify.convert(tmp_path / "src", tmp_path / "out", kv_heads=1, progress=False)
    converted = load(tmp_path / "out")
    assert type(converted) is type(model)
    with torch.inference_mode():
        cache = converted(sample_ids(model.config.vocab_size, length=12), use_cache=True).past_key_values
    assert len(cache.layers) == model.config.num_hidden_layers
    for layer in cache.layers:
        assert layer.keys.shape[1] == 1 and layer.values.shape[1] == 1


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_measured_cache_bytes_equal_the_analytic_count(kv_heads, tmp_path):
    """MHA (4), GQA-2 and MQA from the same MHA parent: the real cache shrinks exactly as counted."""
    mha = build_model("llama", num_kv_heads=4)
    save(mha, tmp_path / "mha")
    gqaify.convert(tmp_path / "mha", tmp_path / "out", kv_heads=kv_heads, progress=False)
    model = load(tmp_path / "out")
    tokens = 20
    with torch.inference_mode():
        cache = model(sample_ids(model.config.vocab_size, length=tokens, batch=1), use_cache=True).past_key_values
    geometry = Geometry.from_config(arch_for("llama"), model.config.to_dict())
    assert geometry.num_kv_heads == kv_heads
    per_token = kv_cache_bytes_per_token(geometry, torch.float32)
    assert per_token == 2 * 2 * kv_heads * 16 * 4
    assert measured_kv_cache_bytes(cache) == tokens * per_token
