"""Calibrated methods (aligned, lsq), similarity grouping, and the fitting math under them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import gqaify
from gqaify.conversion import fit
from gqaify.conversion.grouping import balanced_groups, permute, similar_order
from gqaify.conversion.layout import LayerLayout
from gqaify.model.archs import ARCHITECTURES
from gqaify.model.geometry import Geometry
from gqaify.testing import CORPUS, QK_NORMS, build_model, duplicate_kv_heads, save_with_tokenizer
from helpers import MODELS, load, logits, needs_assets, run_cli, sample_ids, tree_hashes

TEXT = MODELS.parent / "text"
EXACT = ["mean", "first", "norm-mean", "aligned", "lsq"]  # `random` discards the heads by design
# separate projections, K/V/Q biases, fused QKV, partial rotary
FOLDABLE = {"llama": {}, "qwen2": {}, "phi3": {}, "stablelm": {"qk_layernorm": False}}


@pytest.fixture
def calibration(tmp_path) -> dict:
    (tmp_path / "calib.txt").write_text(CORPUS * 4)
    return dict(calib_data=str(tmp_path / "calib.txt"), calib_tokens=512, calib_seq_len=48)


def _tiny(model_type: str, directory, num_kv_heads: int = 2, **overrides):
    model = build_model(model_type, num_kv_heads=num_kv_heads, vocab_size=320, **{**FOLDABLE[model_type], **overrides})
    return model, save_with_tokenizer(model, directory)


@pytest.mark.parametrize("model_type", list(FOLDABLE))
@pytest.mark.parametrize("method", EXACT)
def test_every_method_with_nothing_pooled_reproduces_the_parent(model_type, method, calibration, tmp_path):
    model, src = _tiny(model_type, tmp_path / "src")
    result = gqaify.convert(src, tmp_path / "out", kv_heads=2, method=method, **calibration, progress=False)
    ids = sample_ids(320)
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), logits(model, ids))
    assert all(fit.v < 1e-6 and fit.k < 1e-6 for fit in result.fits)


@pytest.mark.parametrize("model_type", list(FOLDABLE))
@pytest.mark.parametrize("method", ["aligned", "lsq"])
def test_fitted_methods_pool_duplicated_heads_back_exactly(model_type, method, calibration, tmp_path):
    gqa, _ = _tiny(model_type, tmp_path / "gqa")
    twin = save_with_tokenizer(duplicate_kv_heads(gqa), tmp_path / "mha")
    gqaify.convert(twin, tmp_path / "out", kv_heads=2, method=method, **calibration, progress=False)
    ids = sample_ids(320)
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), logits(gqa, ids))


@needs_assets
@pytest.mark.parametrize("method", ["aligned", "lsq"])
def test_stories260k_twin_pools_back_to_the_real_model(method, tmp_path):
    calibration = dict(calib_data=str(TEXT / "tinystories-train-sample.txt"), calib_tokens=4096, calib_seq_len=256)
    out = tmp_path / "out"
    gqaify.convert(MODELS / "stories260K-mha", out, kv_heads=4, method=method, **calibration, progress=False)
    ids = sample_ids(512, length=64)
    expected = logits(load(MODELS / "stories260K"), ids)
    torch.testing.assert_close(logits(load(out), ids), expected)


@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial RoPE, head_dim 16
def test_key_rotation_commutes_with_rope(rotary_dim):
    torch.manual_seed(0)
    head_dim, hidden, positions = 16, 32, 256
    keys = torch.randn(2, head_dim, hidden, dtype=torch.float64)  # two key heads
    query = torch.randn(1, head_dim, hidden, dtype=torch.float64)  # a query head that reads the second
    c = torch.cov(torch.randn(hidden, 500, dtype=torch.float64)) + 0.1 * torch.eye(hidden, dtype=torch.float64)
    blocks = fit.key_blocks(keys, rotary_dim)
    fitted = [fit.align(block, c)[1][:, 1:] for block in blocks]  # T of head 1: rotations, not identity
    assert any((t - torch.eye(t.shape[-1])).abs().max() > 0.1 for t in fitted)
    rotated_k = fit.from_key_blocks([t @ b[:, 1:] for t, b in zip(fitted, blocks, strict=True)], rotary_dim)
    rotated_q = fit.from_key_blocks(
        [t @ b for t, b in zip(fitted, fit.key_blocks(query, rotary_dim), strict=True)], rotary_dim
    )

    config = build_model("llama").config
    config.head_dim, config.max_position_embeddings = rotary_dim, positions
    x = torch.randn(1, positions, hidden, dtype=torch.float64)
    cos, sin = LlamaRotaryEmbedding(config)(x.float(), torch.arange(positions)[None])

    def scores(q_rows, k_rows):  # (positions, positions) RoPE attention scores, RoPE on the first rotary_dim
        q, k = (x @ rows[0].T for rows in (q_rows, k_rows))  # (1, positions, head_dim)
        rope_q, rope_k = apply_rotary_pos_emb(
            q[None, ..., :rotary_dim], k[None, ..., :rotary_dim], cos.double(), sin.double()
        )
        q = torch.cat([rope_q, q[None, ..., rotary_dim:]], -1)
        k = torch.cat([rope_k, k[None, ..., rotary_dim:]], -1)
        return (q @ k.transpose(-1, -2))[0, 0]

    expected = scores(query, keys[1:])
    torch.testing.assert_close(scores(rotated_q, rotated_k), expected, rtol=1e-9, atol=1e-9)
    assert (rotated_k - keys[1:]).abs().max() > 0.1  # the rotation did change the key rows


def test_shared_factor_is_exact_for_heads_that_span_one_head():
    torch.manual_seed(0)
    base = torch.randn(1, 1, 4, 12, dtype=torch.float64)
    mix = torch.randn(1, 3, 4, 4, dtype=torch.float64)  # three heads, each an invertible mix of one head
    heads = mix @ base
    c = torch.eye(12, dtype=torch.float64)
    readers = torch.eye(4, dtype=torch.float64).expand(1, 3, 4, 4)
    merged, transforms = fit.shared_factor(heads, c, readers)
    torch.testing.assert_close(transforms @ merged.unsqueeze(1), heads)
    # duplicates of an ordinary head: the shared head is that head, in its own coordinates
    rows = torch.linalg.qr(torch.randn(12, 4, dtype=torch.float64))[0].T * torch.tensor([[1.0], [1.5], [2.0], [0.8]])
    merged, transforms = fit.shared_factor(rows.expand(1, 2, 4, 12), c, readers[:, :2])
    torch.testing.assert_close(merged[0], rows)
    torch.testing.assert_close(transforms, torch.eye(4, dtype=torch.float64).expand(1, 2, 4, 4))


def test_balanced_groups_finds_planted_pairs():
    sim = torch.full((6, 6), 0.1)
    for a, b in ((0, 4), (1, 3), (2, 5)):
        sim[a, b] = sim[b, a] = 0.9
    assert balanced_groups(sim, 3) == [0, 4, 1, 3, 2, 5]
    assert balanced_groups(sim, 1) == list(range(6))  # one group: nothing to choose


@needs_assets
def test_similarity_permutation_alone_preserves_the_function_exactly():
    """Reordering heads changes only the order of attention's sum over heads: compared in float64, where that
    order costs ~1e-14, not in float32, where it costs ~1e-6 on a logit of 10 (a tolerance on the edge)."""
    src = MODELS / "ref-mha-6L"
    model = load(src).double()
    config = model.config.to_dict()
    spec = ARCHITECTURES["llama"]
    geometry = Geometry.from_config(spec, config)
    state = model.state_dict()
    moments = _moments(src, spec, geometry)
    orders = []
    for layer in range(geometry.num_layers):
        layout = LayerLayout(spec, geometry, layer, with_queries=True)
        attn = layout.split({n: state[n] for n in layout.inputs(state)})
        order = similar_order(attn, 2, geometry.head_dim, moments[layer])
        state.update({n: t.double() for n, t in layout.join(permute(attn, order), geometry.num_kv_heads).items()})
        orders.append(order)
    assert any(order != sorted(order) for order in orders)  # real heads do get regrouped
    permuted = load(src).double()
    permuted.load_state_dict(state)
    ids = sample_ids(4096, length=128)
    torch.testing.assert_close(logits(permuted, ids), logits(model, ids), rtol=0, atol=1e-9)


def _moments(src, spec, geometry):
    """Each layer's E[[x; 1][x; 1]ᵀ] of the attention input, from hooks on the whole model (independent of gqaify)."""
    from gqaify.conversion.calibrate import read_calibration
    from gqaify.conversion.settings import ConvertSettings

    calibration = ConvertSettings(calib_data=str(TEXT / "tinyshakespeare.txt"), calib_tokens=2048).calibration()
    ids = read_calibration(calibration, AutoTokenizer.from_pretrained(src)).parts[0]
    model = load(src)
    sums = [
        torch.zeros(geometry.hidden_size + 1, geometry.hidden_size + 1, dtype=torch.float64)
        for _ in range(geometry.num_layers)
    ]

    def hook(layer):
        def add(module, args):
            x = torch.cat([args[0][0].double(), torch.ones(args[0].shape[1], 1, dtype=torch.float64)], dim=1)
            sums[layer] += x.T @ x

        return add

    handles = [
        model.model.layers[i].self_attn.k_proj.register_forward_pre_hook(hook(i)) for i in range(geometry.num_layers)
    ]
    with torch.no_grad():
        for window in ids.split(512):
            model(window[None])
    for handle in handles:
        handle.remove()
    return [s / len(ids) for s in sums]


def test_provenance_records_calibration_grouping_and_fit(calibration, tmp_path):
    _, src = _tiny("llama", tmp_path / "src", num_kv_heads=4)
    out = tmp_path / "out"
    gqaify.convert(src, out, 2, method="lsq", **calibration, grouping="similarity", progress=False)
    record = json.loads((out / "gqaify.json").read_text())
    assert record["method"] == "lsq" and record["grouping"] == "similarity" and record["rotary_dim"] == 16
    assert record["calibration"]["data"] == [calibration["calib_data"]]
    assert 0 < record["calibration"]["tokens"] <= calibration["calib_tokens"]
    assert len(record["permutations"]) == 2 and all(sorted(p) == [0, 1, 2, 3] for p in record["permutations"])
    # a relative error: 1 is what writing zeros would score
    assert len(record["fit_error"]) == 2 and all(0 <= e["k"] < 1 and 0 <= e["v"] < 1 for e in record["fit_error"])
    assert "q_proj rows and o_proj columns rewritten" in (out / "README.md").read_text()


def test_the_recorded_permutation_is_the_grouping_the_output_has(calibration, tmp_path):
    """Mean-pooling after the similarity order: each new K head is the mean of the source heads the record lists
    for its group, in that order (2 groups of 2 of 4 heads)."""
    _, src = _tiny("llama", tmp_path / "src", num_kv_heads=4)
    out = tmp_path / "out"
    gqaify.convert(src, out, 2, method="mean", **calibration, grouping="similarity", progress=False)
    record = json.loads((out / "gqaify.json").read_text())
    source, converted = (
        {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()} for folder in (src, out)
    )
    for layer, order in enumerate(record["permutations"]):
        name = f"model.layers.{layer}.self_attn.k_proj.weight"
        heads = source[name].view(4, -1, source[name].shape[-1])[order]  # (head, head_dim, hidden), reordered
        pooled = heads.view(2, 2, *heads.shape[1:]).mean(1)
        torch.testing.assert_close(converted[name].view(pooled.shape), pooled)


def test_calibrated_methods_refuse_bad_input(capsys, calibration, tmp_path):
    _, src = _tiny("llama", tmp_path / "src")
    before = tree_hashes(tmp_path)
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "1", "--method", "lsq")
    assert code == 2 and "--calib-data" in err and len(err.strip().splitlines()) == 1
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "1", "--grouping", "similarity")
    assert code == 2 and "--calib-data" in err
    args = ("--kv-heads", "1", "--method", "aligned", "--calib-data", str(tmp_path / "missing.txt"))
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", *args)
    assert code == 2 and "missing.txt" in err and len(err.strip().splitlines()) == 1
    assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("model_type", sorted(QK_NORMS))
def test_rotating_methods_refuse_models_with_qk_norms(model_type, capsys, calibration, tmp_path):
    from gqaify.testing import save

    src = save(build_model(model_type), tmp_path / "src")
    args = ("--kv-heads", "1", "--method", "lsq", "--calib-data", calibration["calib_data"])
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", *args)
    assert code == 2 and "norm" in err and "mean" in err and not (tmp_path / "out").exists()


def test_every_declared_method_is_registered_and_every_registered_one_declared():
    """A method is one entry of options.METHOD_INFO naming its function in conversion/methods.py: every entry's
    function is there and is what METHODS runs, and every public function there of a method's signature is listed
    (one left out could not be asked for)."""
    import inspect

    import gqaify.conversion.methods as methods
    from gqaify.conversion.registry import METHOD_INFO

    assert sorted(methods.METHODS) == sorted(METHOD_INFO)
    assert all(
        m.info is METHOD_INFO[n] and m.fn is getattr(methods, m.info.function) for n, m in methods.METHODS.items()
    )
    shaped = {
        name
        for name, fn in inspect.getmembers(methods, inspect.isfunction)
        if fn.__module__ == methods.__name__
        and not name.startswith("_")
        and list(inspect.signature(fn).parameters) == ["attn", "num_groups", "ctx"]
    }
    assert shaped == {info.function for info in METHOD_INFO.values()}
