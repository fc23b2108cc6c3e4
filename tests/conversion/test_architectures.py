"""Every supported architecture: identity at G = KV, the duplicated-heads oracle, and a G-head KV cache."""

import json

import pytest
import torch

import gqaify
from gqaify.conversion import coverage
from gqaify.model.archs import ARCHITECTURES, REFUSED, arch_for
from gqaify.model.geometry import Geometry
from gqaify.model.kvcache import kv_cache_bytes_per_token, measured_kv_cache_bytes
from gqaify.testing import ARCH_CONFIGS, CORPUS, QK_NORMS, build_model, duplicate_kv_heads, save, save_with_tokenizer
from helpers import REPO, load, logits, rotated_twin, run_cli, sample_ids

QK_NORMS_OFF = {"stablelm": {"qk_layernorm": False}, "cohere": {"use_qk_norm": False}}  # optional norms, off
# Calibrated methods rotate heads: every architecture calibration runs on, without Q/K norms in the way.
ROTATABLE = sorted(t for t in ARCH_CONFIGS if t not in QK_NORMS and ARCHITECTURES[t].no_calibration is None)


def test_every_architecture_has_a_test_case():
    assert set(ARCH_CONFIGS) == set(ARCHITECTURES)


def test_every_decoder_with_kv_heads_in_transformers_is_converted_or_refused_with_a_reason():
    """The audit: each causal-LM model type of the installed transformers whose config counts K/V heads."""
    types = coverage.kv_head_types()
    assert len(types) > 100 and {"llama", "mixtral", "deepseek_v3", "jamba"} <= set(types)  # the probe finds them
    assert [t for t in types if t not in ARCHITECTURES and t not in REFUSED] == []
    assert not set(ARCHITECTURES) & set(REFUSED)
    assert all(reason.strip() for reason in REFUSED.values())


@pytest.mark.parametrize("model_type", ["deepseek_v3", "jamba", "bitnet", "falcon"])
def test_a_refused_model_type_gets_its_reason(model_type, capsys, tmp_path):
    (tmp_path / "src").mkdir()
    config = {"model_type": model_type, "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 8}
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    code, err = run_cli(capsys, "convert", tmp_path / "src", tmp_path / "out", "--kv-heads", "1")
    assert code == 2 and err.count("\n") == 1, err
    assert f"gqaify does not convert {model_type!r}: {REFUSED[model_type]}" in err
    assert not (tmp_path / "out").exists()


def test_falcon_is_refused_because_transformers_caches_every_query_heads_kv():
    """The premise of falcon's refusal: with 2 K/V heads of 4 (new_decoder_architecture), transformers' cache
    still holds 4 heads per layer. When transformers caches the K/V heads themselves, this fails: convert it."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
    )
    cache = FalconForCausalLM(config).eval()(sample_ids(96), use_cache=True).past_key_values
    assert cache.layers[0].keys.shape[1] == 4


def test_a_variant_the_table_does_not_describe_is_refused(capsys, tmp_path):
    """Command-R+ (cohere with use_qk_norm): its (heads, head_dim) norms would be copied with the wrong shape."""
    src = save(build_model("cohere", num_kv_heads=2, use_qk_norm=True), tmp_path / "src")
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "1")
    assert code == 2 and err.count("\n") == 1, err
    assert "gqaify does not convert cohere with use_qk_norm: its per-head Q/K LayerNorms" in err
    assert not (tmp_path / "out").exists()


def test_optional_shared_qk_norms_follow_the_config_flag(capsys, tmp_path):
    """phi with qk_layernorm: its LayerNorms over head_dim are copied through (the duplicated-head twin pools back
    exactly with them), and the rotating methods refuse it; without the flag (Phi-1, 1.5, 2) lsq runs."""
    gqa = build_model("phi", num_kv_heads=2, vocab_size=320, qk_layernorm=True)
    ids = sample_ids(320)
    save_with_tokenizer(duplicate_kv_heads(gqa), tmp_path / "mha")
    gqaify.convert(tmp_path / "mha", tmp_path / "mean", kv_heads=2, progress=False)
    torch.testing.assert_close(logits(load(tmp_path / "mean"), ids), logits(gqa, ids))
    (tmp_path / "calib.txt").write_text(CORPUS * 4)
    args = ("--kv-heads", "1", "--method", "lsq", "--calib-data", str(tmp_path / "calib.txt"), "--calib-seq-len", "48")
    code, err = run_cli(capsys, "convert", tmp_path / "mha", tmp_path / "lsq", *args)
    assert code == 2 and "norm" in err and "mean" in err and not (tmp_path / "lsq").exists()
    save_with_tokenizer(build_model("phi", num_kv_heads=2, vocab_size=320), tmp_path / "plain")
    code, err = run_cli(capsys, "convert", tmp_path / "plain", tmp_path / "lsq", *args, "--calib-tokens", "2048")
    assert code == 0, err


def test_the_docs_architecture_table_is_the_generated_one(tmp_path):
    page = REPO / "docs" / "architectures.md"
    (tmp_path / "page.md").write_text(page.read_text())
    coverage.write_into(tmp_path / "page.md")
    assert (tmp_path / "page.md").read_text() == page.read_text(), (
        "regenerate it: python -m gqaify.conversion.coverage --write docs/architectures.md"
    )
    assert coverage.markdown() in page.read_text()


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


@pytest.mark.parametrize("model_type", ROTATABLE)
def test_lsq_pools_rotated_twins_back_exactly(model_type, tmp_path):
    """Each query/key head of the MHA twin turned by its own RoPE-commuting rotation: lsq must find the rotations,
    which it can only do with the table's RoPE pairing right (the twin itself checks that pairing against
    transformers: with the other pairing it computes something else)."""
    pairs = ARCHITECTURES[model_type].rope
    gqa = build_model(model_type, num_kv_heads=2, vocab_size=320, **QK_NORMS_OFF.get(model_type, {}))
    ids = sample_ids(320)
    expected = logits(gqa, ids)
    # float32 rounds the turned rows differently: 1e-4 still tells the pairings apart, which differ by ~1
    torch.testing.assert_close(logits(rotated_twin(gqa, pairs), ids), expected, atol=1e-4, rtol=1e-4)
    other = {"half": "interleaved", "interleaved": "half"}[pairs]
    assert not torch.allclose(logits(rotated_twin(gqa, other), ids), expected, atol=1e-3)

    twin = save_with_tokenizer(rotated_twin(gqa, pairs), tmp_path / "mha")
    (tmp_path / "calib.txt").write_text(CORPUS * 4)
    calibration = dict(calib_data=str(tmp_path / "calib.txt"), calib_tokens=512, calib_seq_len=48)
    gqaify.convert(twin, tmp_path / "out", kv_heads=2, method="lsq", **calibration, progress=False)
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", sorted(ARCH_CONFIGS))
def test_mqa_output_loads_and_caches_one_head(model_type, tmp_path, capsys):
    model = build_model(model_type, num_kv_heads=2)
    save(model, tmp_path / "src")
    multiple, why = ARCHITECTURES[model_type].kv_heads_multiple
    if multiple > 1:  # refused up front, in one line, nothing written
        code, err = run_cli(capsys, "convert", tmp_path / "src", tmp_path / "out", "--kv-heads", "1")
        assert code == 2 and f"not a multiple of {multiple}" in err and why in err, err
        assert not (tmp_path / "out").exists()
        return
    gqaify.convert(tmp_path / "src", tmp_path / "out", kv_heads=1, progress=False)
    converted = load(tmp_path / "out")
    assert type(converted).__name__ == type(model).__name__  # gpt2, gpt_neox, opt: from the shipped file
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
