"""Layer-by-layer calibration: the walk computes what the model computes, one layer at a time; a conversion that
changes nothing reproduces the parent through it; repair and refinement bring a converted layer closer to its
parent; what it records; its bad input."""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import gqaify
from gqaify.conversion import layer_by_layer
from gqaify.conversion.source import open_source
from gqaify.errors import UserError
from gqaify.model.archs import ARCHITECTURES
from gqaify.testing import ARCH_CONFIGS, CORPUS, QK_NORMS, build_model, duplicate_kv_heads, save_with_tokenizer
from helpers import MODELS, load, logits, needs_assets, run_cli, sample_ids, tree_hashes

TEXT = MODELS.parent / "text"
SLIDING = {"mistral": {"sliding_window": 8}, "gemma2": {"sliding_window": 8}}  # windows of 48 tokens slide


@pytest.fixture
def calibration(tmp_path) -> dict:
    (tmp_path / "calib.txt").write_text(CORPUS * 4)
    return dict(calib_data=str(tmp_path / "calib.txt"), calib_tokens=384, calib_seq_len=48)


def _tiny(model_type: str, directory, num_kv_heads: int = 2, **overrides):
    stablelm = {"qk_layernorm": False} if model_type == "stablelm" else {}
    overrides = {**stablelm, **SLIDING.get(model_type, {}), **overrides}
    model = build_model(model_type, num_kv_heads=num_kv_heads, vocab_size=320, **overrides)
    return model, save_with_tokenizer(model, directory)


CALIBRATED = sorted(t for t in ARCH_CONFIGS if ARCHITECTURES[t].no_calibration is None)


@pytest.mark.parametrize("model_type", CALIBRATED)
def test_the_walk_computes_the_models_hidden_states(model_type, tmp_path):
    """Layer by layer, with the inputs captured from the model (masks of each attention type, position
    embeddings), each layer's output is the hidden state transformers' own forward gives after that layer."""
    _, src = _tiny(model_type, tmp_path / "src", num_hidden_layers=3)
    model = AutoModelForCausalLM.from_pretrained(src).eval()  # the attention implementation transformers picks
    ids = sample_ids(320, length=40, batch=1)[0]
    with torch.no_grad():
        expected = model(ids[None], output_hidden_states=True).hidden_states  # embeddings, then each layer
    spec = ARCHITECTURES[model_type]
    config = json.loads((src / "config.json").read_text())
    state = model.state_dict()
    skeleton = layer_by_layer.skeleton(config)
    outside = {n: t for n, t in state.items() if spec.layer_of(n) is None}
    (hidden,), inputs = layer_by_layer.capture(skeleton, spec, outside, [ids], torch.device("cpu"))
    torch.testing.assert_close(hidden, expected[0])
    for layer in range(2):  # the last entry of hidden_states has the final norm applied
        prefix = spec.decoder_layer.format(layer=layer) + "."
        local = {n.removeprefix(prefix): t for n, t in state.items() if n.startswith(prefix)}
        with layer_by_layer.loaded(skeleton.get_submodule(prefix[:-1]), local, torch.device("cpu"), "layer") as block:
            hidden = layer_by_layer.run(block, hidden, inputs[layer][0], torch.device("cpu"))
        torch.testing.assert_close(hidden, expected[layer + 1])


@pytest.mark.parametrize("model_type", CALIBRATED)
def test_sequential_calibration_that_changes_nothing_reproduces_the_parent(model_type, calibration, tmp_path):
    """G = KV through the whole walk, repair and refinement included: the same logits."""
    model, src = _tiny(model_type, tmp_path / "src")
    method = "mean" if model_type in QK_NORMS else "lsq"
    result = gqaify.convert(
        src, tmp_path / "out", kv_heads=2, method=method, progress=False, **calibration, refine_steps=3
    )
    ids = sample_ids(320)
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), logits(model, ids))
    assert all(fit.out < 1e-5 and not fit.repaired for fit in result.fits)


PER_EXPERT = sorted(t for t in ARCH_CONFIGS if ARCHITECTURES[t].no_calibration and not ARCHITECTURES[t].shipped_class)


@pytest.mark.parametrize("model_type", PER_EXPERT)
def test_calibration_is_refused_where_the_walk_cannot_load_layers(model_type, capsys, calibration, tmp_path):
    """Per-expert checkpoints of MoE models: refused before anything is written, mean offered instead."""
    _, src = _tiny(model_type, tmp_path / "src")
    args = ("--kv-heads", "1", "--method", "mean", "--calib-data", calibration["calib_data"])
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", *args)
    assert code == 2 and err.count("\n") == 1, err
    assert f"cannot be calibrated: {ARCHITECTURES[model_type].no_calibration}" in err
    assert not (tmp_path / "out").exists()
    # and the walk would indeed fail: transformers' layer does not take the tensors as stored
    with pytest.raises(UserError, match="do not match"):
        _load_every_layer(src, ARCHITECTURES[model_type])


def _load_every_layer(src, spec):
    """Load each decoder layer's stored tensors into the walk's skeleton, as calibration does."""
    with open_source(src) as source:
        skeleton = layer_by_layer.skeleton(source.config)
        names = list(source.tensors.metadata())
        for layer in range(source.config["num_hidden_layers"]):
            prefix = spec.decoder_layer.format(layer=layer) + "."
            state = source.tensors.load([n for n in names if spec.layer_of(n) == layer])
            local = {n.removeprefix(prefix): t for n, t in state.items()}
            with layer_by_layer.loaded(
                skeleton.get_submodule(prefix[:-1]), local, torch.device("cpu"), f"layer {layer}"
            ):
                pass


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3", "gemma2", "stablelm"])
def test_duplicated_heads_pool_back_exactly_through_the_walk(model_type, calibration, tmp_path):
    gqa, _ = _tiny(model_type, tmp_path / "gqa")
    twin = save_with_tokenizer(duplicate_kv_heads(gqa), tmp_path / "mha")
    gqaify.convert(twin, tmp_path / "out", kv_heads=2, method="lsq", **calibration, progress=False)
    ids = sample_ids(320)
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), logits(gqa, ids))


@needs_assets
def test_stories260k_twin_pools_back_through_the_walk(tmp_path):
    calibration = dict(
        calib_data=str(TEXT / "tinystories-train-sample.txt"), calib_tokens=4096, calib_seq_len=256, refine_steps=2
    )
    gqaify.convert(
        MODELS / "stories260K-mha", tmp_path / "out", kv_heads=4, method="lsq", **calibration, progress=False
    )
    ids = sample_ids(512, length=64)
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), logits(load(MODELS / "stories260K"), ids))


def test_the_walk_holds_one_decoder_layer_at_a_time(calibration, tmp_path, monkeypatch):
    """Every time a layer's weights are loaded, no other layer of either model (parent or converted) holds any."""
    _, src = _tiny("llama", tmp_path / "src", num_kv_heads=4, num_hidden_layers=4)
    skeletons, seen = [], []
    make, load_layer = layer_by_layer.skeleton, layer_by_layer.loaded

    def tracked_skeleton(*args, **kwargs):
        skeletons.append(make(*args, **kwargs))
        return skeletons[-1]

    @contextmanager
    def tracked_loaded(layer, *args, **kwargs):
        with load_layer(layer, *args, **kwargs) as block:
            real = [name for model in skeletons for name, p in model.named_parameters() if not p.is_meta]
            layers = {ARCHITECTURES["llama"].layer_of(name) for name in real}
            seen.append((len(real), sum(1 for _ in block.parameters()), layers))
            yield block

    monkeypatch.setattr(layer_by_layer, "skeleton", tracked_skeleton)
    monkeypatch.setattr(layer_by_layer, "loaded", tracked_loaded)
    gqaify.convert(src, tmp_path / "out", kv_heads=1, method="lsq", **calibration, refine_steps=2, progress=False)
    assert len(skeletons) == 2 and len(seen) == 2 * 4  # the parent's and the converted layer, for each layer
    for real, in_layer, layers in seen:
        assert real == in_layer and len(layers) == 1 and None not in layers  # only the layer just loaded


def test_sequential_layers_are_repaired_and_refinement_lowers_the_output_error(calibration, tmp_path):
    _, src = _tiny("llama", tmp_path / "src", num_kv_heads=4)
    calibration = {**calibration, "calib_tokens": 1024}  # held-out windows enough to judge the refinement on
    plain = gqaify.convert(
        src, tmp_path / "parallel", kv_heads=1, method="lsq", **calibration, calib_mode="parallel", progress=False
    )
    assert all(fit.out is None for fit in plain.fits)
    repaired = gqaify.convert(src, tmp_path / "repaired", kv_heads=1, method="lsq", **calibration, progress=False)
    refined = gqaify.convert(
        src, tmp_path / "refined", kv_heads=1, method="lsq", progress=False, **calibration, refine_steps=40
    )
    assert all(fit.repaired for fit in repaired.fits)
    assert all(fit.refine_loss[1] < fit.refine_loss[0] for fit in refined.fits)
    assert refined.fits[-1].out < repaired.fits[-1].out
    record = json.loads((tmp_path / "refined" / "gqaify.json").read_text())
    assert record["calibration"]["mode"] == "sequential" and record["calibration"]["refine_steps"] == 40
    assert set(record["calibration"]["seconds"]) == {"capture", "fit", "repair", "refine", "run", "total"}
    assert [e["out"] for e in record["fit_error"]] == [fit.out for fit in refined.fits]
    assert ".gqaify-fits" not in record["files"]
    assert sorted(p.name for p in (tmp_path / "refined").iterdir() if p.name.startswith(".")) == []


def test_a_sliding_window_model_converts_to_fewer_heads(calibration, tmp_path):
    model, src = _tiny("gemma2", tmp_path / "src", num_kv_heads=2)
    gqaify.convert(src, tmp_path / "out", kv_heads=1, method="lsq", **calibration, refine_steps=5, progress=False)
    converted = load(tmp_path / "out")
    assert converted.config.num_key_value_heads == 1 and converted.config.sliding_window == 8
    assert torch.isfinite(logits(converted, sample_ids(320))).all()


def test_inputs_the_layers_share_are_moved_once():
    """The capture keeps every layer's keyword inputs on the CPU; from a GPU, the position embeddings and masks
    that all layers receive are copied once per window, not once per layer."""
    shared, own = torch.ones(4), torch.zeros(2)
    moved = {}
    first = layer_by_layer.to_device({"position_embeddings": (shared, shared), "mask": own}, "meta", moved)
    second = layer_by_layer.to_device({"position_embeddings": (shared,)}, "meta", moved)
    assert first["position_embeddings"][0].is_meta and first["mask"].is_meta
    assert first["position_embeddings"][0] is first["position_embeddings"][1] is second["position_embeddings"][0]
    assert first["mask"] is not first["position_embeddings"][0]
    copied = layer_by_layer.to_device(shared, "meta")  # without the memo: a new copy
    assert copied is not first["position_embeddings"][0]


def test_converted_config_drives_the_converted_skeleton(tmp_path):
    model, src = _tiny("qwen2", tmp_path / "src", num_kv_heads=2)
    config = json.loads((src / "config.json").read_text())
    converted = layer_by_layer.skeleton(config, num_kv_heads=1)
    assert converted.config.num_key_value_heads == 1
    assert converted.model.layers[0].self_attn.k_proj.weight.shape == (16, 64)
    parent = AutoConfig.for_model("qwen2", **{k: v for k, v in config.items() if k != "model_type"})
    assert parent.num_key_value_heads == 2


@pytest.fixture
def no_source_opened(monkeypatch):
    """Fails the command if the conversion opens its source: a refusal comes before any work."""
    from gqaify.conversion import core

    def opened(*args, **kwargs):
        raise AssertionError("the source was opened before the refusal")

    monkeypatch.setattr(core, "open_source", opened)


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--calib-mode", "parallel", "--refine-steps", "5"], "use --calib-mode sequential"),
        (["--refine-steps", "-1"], "--refine-steps -1 must be a whole number, 0 or more"),
        (["--refine-lr", "0"], "--refine-lr 0.0 must be a positive number"),
        (["--refine-steps", "1000000000"], "--refine-steps 1000000000 is more than the 1,000,000 allowed"),
        (["--refine-lr", "nan"], "--refine-lr nan is not a finite number; give a positive one"),
        (["--refine-lr", "inf"], "--refine-lr inf is not a finite number; give a positive one"),
        (["--refine-lr=-inf"], "--refine-lr -inf is not a finite number; give a positive one"),
        (["--calib-sha256", "abc"], "--calib-sha256 'abc' is not a SHA-256 (64 hex digits)"),
        (["--calib-mode", "backwards"], "argument --calib-mode/--calib_mode: invalid choice"),
    ],
)
def test_bad_calibration_options(capsys, calibration, tmp_path, no_source_opened, args, expect):
    _, src = _tiny("llama", tmp_path / "src")
    code, err = run_cli(
        capsys,
        "convert",
        src,
        tmp_path / "out",
        "--kv-heads",
        "1",
        "--method",
        "lsq",
        "--calib-data",
        calibration["calib_data"],
        *args,
    )
    assert code == 2 and expect in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_a_refine_lr_that_is_not_finite_is_refused_from_a_config_file(
    capsys, calibration, tmp_path, value, no_source_opened
):
    """--refine-lr nan ended in a traceback after 16 s of calibration; inf ran and undid every refinement. Both
    are refused before the source is opened."""
    _, src = _tiny("llama", tmp_path / "src")
    (tmp_path / "c.yaml").write_text(f"refine_lr: {value}\nrefine_steps: 5\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = run_cli(
        capsys,
        "convert",
        src,
        tmp_path / "out",
        "--kv-heads",
        "1",
        "--method",
        "lsq",
        "--calib-data",
        calibration["calib_data"],
        "--config",
        tmp_path / "c.yaml",
    )
    assert code == 2 and err.count("\n") == 1 and "is not a finite number; give a positive one" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_rerun_refuses_calibration_text_that_changed_unless_told_to_accept_it(capsys, calibration, tmp_path):
    """gqaify.json records the SHA-256 of the calibration text read (a text file's own); a rerun from it after a
    line was added to the file used to write other weights without a word."""
    _, src = _tiny("llama", tmp_path / "src")
    calib = tmp_path / "calib.txt"
    args = (
        "--kv-heads",
        "1",
        "--method",
        "lsq",
        "--calib-data",
        calib,
        "--calib-tokens",
        "1024",
        "--calib-seq-len",
        "48",
        "-q",
    )
    assert run_cli(capsys, "convert", src, tmp_path / "first", *args)[0] == 0
    record = json.loads((tmp_path / "first" / "gqaify.json").read_text())
    digest = hashlib.sha256(calib.read_bytes()).hexdigest()
    assert record["settings"]["calib_sha256"] == record["calibration"]["sha256"] == digest

    calib.write_text(calib.read_text() + "One more line.\n")
    before = tree_hashes(tmp_path)
    code, err = run_cli(
        capsys, "convert", "--config", tmp_path / "first" / "gqaify.json", "--out", tmp_path / "second", "-q"
    )
    assert code == 2 and err.count("\n") == 1, err
    assert f"--calib-data {calib}: the text changed since the recorded conversion" in err
    assert "pass --calib-sha256 '' to convert with the text as it is now" in err
    assert tree_hashes(tmp_path) == before and not (tmp_path / "second").exists()
    code, err = run_cli(
        capsys, "convert", "--config", tmp_path / "first" / "gqaify.json", "--out", tmp_path / "first", "-q", "--force"
    )
    assert code == 2 and "the text changed" in err, err  # --force replaces OUT; it does not accept other text

    code, err = run_cli(
        capsys,
        "convert",
        "--config",
        tmp_path / "first" / "gqaify.json",
        "--out",
        tmp_path / "second",
        "-q",
        "--calib-sha256",
        "",
    )
    assert code == 0, err
    again = json.loads((tmp_path / "second" / "gqaify.json").read_text())
    assert again["settings"]["calib_sha256"] == hashlib.sha256(calib.read_bytes()).hexdigest() != digest


@pytest.mark.parametrize(
    ("tokens", "weights", "expected"),
    [
        (1000, [2, 1, 1], [500, 250, 250]),
        (10, None, [4, 3, 3]),
        (7, [1, 1e-9], [7, 0]),
        (16384, [1, 1, 1], [5462, 5461, 5461]),
    ],
)
def test_a_mixture_shares_the_tokens_exactly(tokens, weights, expected):
    from gqaify.conversion.settings import Calibration

    calibration = Calibration(
        ["a", "b", "c"][: len(expected)], tokens, "train", "text", 48, "sequential", 0, 1e-3, True, weights=weights
    )
    assert calibration.shares() == expected and sum(expected) == tokens


def test_a_mixtures_windows_interleave_each_source_in_its_order():
    from gqaify.conversion.calibrate import CalibrationText

    parts = [torch.arange(0, 100), torch.arange(1000, 1030)]  # 10 windows of 10 and 3
    windows = CalibrationText(parts, [], 0.0).windows(10)
    assert torch.equal(torch.cat([w for w in windows if w[0] < 1000]), parts[0])
    assert torch.equal(torch.cat([w for w in windows if w[0] >= 1000]), parts[1])
    # window k of a source of n sits (k + 1/2) / n of the way: the three short source's windows spread evenly
    assert [i for i, w in enumerate(windows) if w[0] >= 1000] == [2, 6, 10]
    one = CalibrationText(parts[:1], [], 0.0).windows(16)
    assert [len(w) for w in one] == [16] * 6 + [4]  # one source: its windows in order, as before mixtures


def test_a_mixture_reads_each_sources_share_and_a_rerun_refuses_a_changed_source(capsys, tmp_path):
    """Each source's tokens are its share exactly, counted by the tokenizer on its own text, and recorded; the
    mixture's SHA-256 pins every source: one source changed fails a rerun from gqaify.json."""
    from transformers import AutoTokenizer

    _, src = _tiny("llama", tmp_path / "src")
    prose, verse = tmp_path / "prose.txt", tmp_path / "verse.txt"
    prose.write_text(CORPUS * 4)
    verse.write_text(" ".join(reversed((CORPUS * 4).split())))
    args = (
        "--kv-heads",
        "1",
        "--method",
        "lsq",
        "--calib-data",
        f"p={prose}",
        verse,
        "--calib-weights",
        "3",
        "1",
        "--calib-tokens",
        "1000",
        "--calib-seq-len",
        "48",
        "-q",
    )
    assert run_cli(capsys, "convert", src, tmp_path / "first", *args)[0] == 0
    record = json.loads((tmp_path / "first" / "gqaify.json").read_text())
    sources = record["calibration"]["sources"]
    tokenizer = AutoTokenizer.from_pretrained(src)
    assert [(s["name"], s["tokens_requested"], s["tokens"]) for s in sources] == [("p", 750, 750), ("verse", 250, 250)]
    assert len(tokenizer(verse.read_text())["input_ids"]) > 250 and record["calibration"]["tokens"] == 1000
    assert record["settings"]["calib_data"] == [f"p={prose}", str(verse)]
    assert record["settings"]["calib_weights"] == [3.0, 1.0]
    assert "`" + str(prose) + "` (750) and `" + str(verse) + "` (250)" in (tmp_path / "first" / "README.md").read_text()

    verse.write_text(verse.read_text() + " more")
    before = tree_hashes(tmp_path)
    code, err = run_cli(
        capsys, "convert", "--config", tmp_path / "first" / "gqaify.json", "--out", tmp_path / "second", "-q"
    )
    assert code == 2 and err.count("\n") == 1 and "the text changed since the recorded conversion" in err, err
    assert tree_hashes(tmp_path) == before and not (tmp_path / "second").exists()


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        (["--calib-weights", "1"], "--calib-weights gives 1 weights for 2 calib_data sources; give one per source"),
        (["--calib-weights", "1", "-1"], "must be positive numbers"),
        (["--calib-weights", "1000", "0.01"], "gets 0 of --calib-tokens 32,768 by --calib-weights 1000 0.01; a source"),
    ],
)
def test_bad_mixture_weights_are_refused_in_one_line(capsys, tmp_path, extra, expect):
    _, src = _tiny("llama", tmp_path / "src")
    (tmp_path / "a.txt").write_text(CORPUS)
    args = ("--kv-heads", "1", "--method", "lsq", "--calib-data", tmp_path / "a.txt", f"b={tmp_path / 'a.txt'}")
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", *args, *extra)
    assert code == 2 and err.count("\n") == 1 and expect in err, err
    assert not (tmp_path / "out").exists()
