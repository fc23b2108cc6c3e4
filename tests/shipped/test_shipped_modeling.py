"""GPT-2, GPT-NeoX (Pythia) and OPT: transformers has no K/V heads for them, so the output carries its own class.

The oracles are transformers' own MHA classes: G = H reproduces them, and the MHA twin of a GQA model pools
back to it. The converted folder loads only with trust_remote_code=True, through its config's auto_map.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import gqaify
from gqaify.model.archs import ARCHITECTURES
from gqaify.model.geometry import Geometry
from gqaify.model.kvcache import kv_cache_bytes_per_token, measured_kv_cache_bytes
from gqaify.testing import CORPUS, build_model, duplicate_kv_heads, save, save_with_tokenizer
from helpers import load, logits, run_cli, sample_ids

SHIPPED = [t for t, spec in ARCHITECTURES.items() if spec.shipped_class]


def mha_parent(model_type: str, **overrides) -> torch.nn.Module:
    """transformers' own MHA class with random weights (the twin of a random GQA model)."""
    parent = duplicate_kv_heads(build_model(model_type, num_kv_heads=2, **overrides))
    assert type(parent).__module__.startswith("transformers.models.")
    return parent


def test_the_shipped_types_are_exactly_those_transformers_gives_no_kv_heads():
    assert sorted(SHIPPED) == ["gpt2", "gpt_neox", "opt"]
    for model_type in SHIPPED:
        from transformers import AutoConfig

        assert not hasattr(AutoConfig.for_model(model_type), "num_key_value_heads")


@pytest.mark.parametrize("model_type", SHIPPED)
def test_same_number_of_heads_gives_the_original_class_logits(model_type, tmp_path):
    parent = mha_parent(model_type)
    save(parent, tmp_path / "mha")
    gqaify.convert(tmp_path / "mha", tmp_path / "out", kv_heads=4, progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    shipped = ARCHITECTURES[model_type].shipped_class
    assert config["auto_map"] == {"AutoModelForCausalLM": f"modeling_gqaify.{shipped}"}
    assert (tmp_path / "out" / "modeling_gqaify.py").is_file()
    converted = load(tmp_path / "out")
    assert type(converted).__name__ == shipped and type(converted).__module__.startswith("transformers_modules")
    ids = sample_ids(parent.config.vocab_size)
    # the same weights through another (equivalent) code path, whose tensors may be laid out differently in
    # memory: float64, so that the rounding of another CPU's kernels stays far below the tolerance
    torch.testing.assert_close(logits(converted.double(), ids), logits(parent.double(), ids), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model_type", SHIPPED)
def test_generate_with_the_g_head_cache_matches_the_uncached_forward(model_type, tmp_path):
    save(mha_parent(model_type), tmp_path / "mha")
    gqaify.convert(tmp_path / "mha", tmp_path / "out", kv_heads=1, progress=False)
    model = load(tmp_path / "out").double()  # float64: no near-tie of two tokens flips between the two paths
    prompt = sample_ids(model.config.vocab_size, length=8, batch=1)
    with torch.inference_mode():
        cached = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
        ids = prompt
        for _ in range(10):  # greedy, every step a whole forward pass without a cache
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(cached, ids)


@pytest.mark.parametrize("model_type", SHIPPED)
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_the_measured_cache_is_h_over_g_smaller(model_type, kv_heads, tmp_path):
    parent = mha_parent(model_type)
    save(parent, tmp_path / "mha")
    gqaify.convert(tmp_path / "mha", tmp_path / "out", kv_heads=kv_heads, progress=False)
    tokens, spec = 20, ARCHITECTURES[model_type]
    measured = {}
    for name, model in (("parent", parent), ("converted", load(tmp_path / "out"))):
        with torch.inference_mode():
            cache = model(sample_ids(model.config.vocab_size, length=tokens, batch=1), use_cache=True).past_key_values
        measured[name] = measured_kv_cache_bytes(cache)
        geometry = Geometry.from_config(spec, model.config.to_dict())
        assert measured[name] == tokens * kv_cache_bytes_per_token(geometry, torch.float32)
    assert measured["parent"] == measured["converted"] * 4 // kv_heads
    assert measured["converted"] == tokens * 2 * 2 * kv_heads * 16 * 4  # layers x (K, V) x heads x d x fp32


@pytest.mark.parametrize("model_type", SHIPPED)
def test_sdpa_reads_the_g_heads_as_eager_does(model_type, tmp_path):
    save(mha_parent(model_type), tmp_path / "mha")
    gqaify.convert(tmp_path / "mha", tmp_path / "out", kv_heads=2, progress=False)
    sdpa = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="sdpa", dtype=torch.float32, trust_remote_code=True
    ).eval()
    ids = sample_ids(sdpa.config.vocab_size)
    torch.testing.assert_close(logits(sdpa, ids), logits(load(tmp_path / "out"), ids), atol=1e-5, rtol=1e-5)


def test_a_checkpoint_saved_from_the_base_model_converts(tmp_path):
    """GPT-2's original weights have no `transformer.` in their names (they were saved from GPT2Model)."""
    gqa = build_model("gpt2", num_kv_heads=2, tie_word_embeddings=True)
    save(duplicate_kv_heads(gqa), tmp_path / "mha", max_shard_size="10GB")
    weights = tmp_path / "mha" / "model.safetensors"
    state = load_file(weights)
    assert "lm_head.weight" not in state  # tied to wte
    save_file({k.removeprefix("transformer."): v for k, v in state.items()}, weights, metadata={"format": "pt"})
    gqaify.convert(tmp_path / "mha", tmp_path / "out", kv_heads=2, progress=False)
    assert "h.0.attn.c_attn.weight" in load_file(tmp_path / "out" / "model.safetensors")
    ids = sample_ids(gqa.config.vocab_size)
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), logits(gqa, ids))


def test_eval_loads_the_shipped_class_only_when_trusted(tmp_path, capsys):
    save_with_tokenizer(mha_parent("gpt_neox", vocab_size=320), tmp_path / "mha")
    gqaify.convert(tmp_path / "mha", tmp_path / "mqa", kv_heads=1, progress=False)
    (tmp_path / "text.txt").write_text(CORPUS)
    args = (
        "eval",
        tmp_path / "mha",
        tmp_path / "mqa",
        "--data",
        tmp_path / "text.txt",
        "--seq-len",
        "32",
        "--no-speed",
        "-q",
    )
    code, err = run_cli(capsys, *args, "--out", tmp_path / "report")
    assert code == 2 and err.count("\n") == 1, err
    assert "modeling_gqaify.py" in err and "--trust-remote-code" in err
    assert not (tmp_path / "report").exists()

    code, err = run_cli(capsys, *args, "--out", tmp_path / "report", "--trust-remote-code")
    assert code == 0, err
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    parent, converted = report["models"]
    assert converted["num_key_value_heads"] == 1 and parent["num_key_value_heads"] == 4
    assert converted["kv_cache_bytes_measured"] * 4 == parent["kv_cache_bytes_measured"]
    assert converted["kv_cache_bytes_measured"] == converted["kv_cache_bytes_analytic"]


def test_calibrated_methods_are_refused_with_the_reason(tmp_path, capsys):
    save_with_tokenizer(mha_parent("opt", vocab_size=320), tmp_path / "mha")
    (tmp_path / "calib.txt").write_text(CORPUS * 4)
    code, err = run_cli(
        capsys,
        "convert",
        tmp_path / "mha",
        tmp_path / "out",
        "--kv-heads",
        "1",
        "--method",
        "lsq",
        "--calib-data",
        tmp_path / "calib.txt",
    )
    assert code == 2 and "cannot be calibrated" in err and "--method mean" in err, err
    assert not (tmp_path / "out").exists()
    # the premise: transformers' class, which calibration builds, ignores the K/V head count
    from gqaify.conversion import layer_by_layer

    config = json.loads((tmp_path / "mha" / "config.json").read_text())
    assert layer_by_layer.skeleton(config, num_kv_heads=1).model.decoder.layers[0].self_attn.k_proj.out_features == 64
