"""Latent attention: a GQA, MQA or MHA Llama rewritten as DeepSeek-V3's dense MLA layer, checked against the source
itself (the exact rewrite) and against an independent attention written here (fewer rotary pairs)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import gqaify
from gqaify.conversion.mla.latent import latent_from_covariance
from gqaify.conversion.mla.layer import MlaShape, build_mla, plan_mla, rewrite_as_mla
from gqaify.entry.cli import main
from gqaify.errors import UserError
from gqaify.eval.settings import EvalSettings
from gqaify.testing import CORPUS, build_model, save_with_tokenizer
from helpers import MODELS, calibrated_on, losses, needs_assets, one_line, run_cli, tree_hashes


def logits_scale(logits: torch.Tensor) -> float:
    return logits.abs().max().item()


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_the_exact_rewrite_gives_the_sources_logits(kv_heads):
    """MQA, GQA-2 and MHA: the same logits to float precision, and a cache of the source's size holding the latent."""
    source = build_model("llama", num_kv_heads=kv_heads)
    mla = rewrite_as_mla(source)
    ids = torch.randint(0, source.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = source(ids).logits, mla(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4 * logits_scale(expected)
    config, d = mla.config, source.config.head_dim
    assert config.kv_lora_rank + config.qk_rope_head_dim == 2 * kv_heads * d  # the source's cache, in values
    with torch.no_grad():
        cache = mla(ids[:1], use_cache=True).past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert held == 48 * config.num_hidden_layers * 2 * kv_heads * d * 4  # float32, per token and layer


def test_a_mistral_without_a_sliding_window_is_rewritten_exactly_and_with_one_is_refused():
    source = build_model("mistral", num_kv_heads=2, sliding_window=None)
    ids = torch.randint(0, source.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected, got = source(ids).logits, rewrite_as_mla(source)(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4 * logits_scale(expected)
    with pytest.raises(UserError, match="sliding_window is set"):
        rewrite_as_mla(build_model("mistral", num_kv_heads=2, sliding_window=16))


def test_the_rewrite_generates_the_sources_greedy_tokens_with_its_cache():
    source = build_model("llama", num_kv_heads=2)
    mla = rewrite_as_mla(source)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35]])
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(mla.generate(prompt, **kwargs), source.generate(prompt, **kwargs))


def test_the_latent_norm_stays_linear_for_any_input_the_layer_norm_allows():
    """The latent is scaled below RMSNorm's epsilon for the largest input the layer's own norm can give: hidden
    states a thousand times larger change nothing."""
    source = build_model("llama", num_kv_heads=2)
    mla = rewrite_as_mla(source)
    with torch.no_grad():
        embeds = 1000 * torch.randn(1, 16, source.config.hidden_size, generator=torch.Generator().manual_seed(2))
        expected, got = source(inputs_embeds=embeds).logits, mla(inputs_embeds=embeds).logits
    assert (got - expected).abs().max().item() <= 1e-4 * logits_scale(expected)


def reference_partial_rope(model, ids: torch.Tensor, kept: list[list[list[int]]]) -> torch.Tensor:
    """The source's logits where, in layer l, RoPE turns only the pairs `kept[l][g]` of K/V head g and its query
    heads (the others unrotated), written here from the weights: the partial-RoPE model an MLA layer with those
    pairs and a full latent must equal."""
    config = model.config
    H, G, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    half, rep = d // 2, H // G
    base = config.rope_parameters["rope_theta"]
    T = ids.shape[1]

    def rotations(layer_kept):
        cos, sin = [], []
        for pairs in layer_kept:
            freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
            freq[[j for j in range(half) if j not in pairs]] = 0.0  # angle 0: not rotated
            angle = torch.arange(T, dtype=torch.float64)[:, None] * freq[None, :]
            cos.append(torch.cat([angle.cos()] * 2, -1).float())
            sin.append(torch.cat([angle.sin()] * 2, -1).float())
        return torch.stack(cos), torch.stack(sin)  # (G, T, d)

    def rotate(x, group_of_head, cos, sin):
        c, s = cos[group_of_head], sin[group_of_head]
        return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s

    h = model.model.embed_tokens(ids)[0]
    for layer, layer_kept in zip(model.model.layers, kept, strict=True):
        a = layer.self_attn
        cos, sin = rotations(layer_kept)
        x = layer.input_layernorm(h)
        q = rotate((x @ a.q_proj.weight.T).view(T, H, d).transpose(0, 1), torch.arange(H) // rep, cos, sin)
        k = rotate((x @ a.k_proj.weight.T).view(T, G, d).transpose(0, 1), torch.arange(G), cos, sin)
        k = k.repeat_interleave(rep, 0)
        v = (x @ a.v_proj.weight.T).view(T, G, d).transpose(0, 1).repeat_interleave(rep, 0)
        scores = q @ k.transpose(1, 2) / math.sqrt(d) + torch.full((T, T), -math.inf).triu(1)
        h = h + (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, H * d) @ a.o_proj.weight.T
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))


def test_fewer_rotary_pairs_with_a_full_latent_equal_partial_rope():
    """Keeping 6 (K/V head, pair) choices of 16, the latent holding every dropped key dimension and every value: the
    model is the source with RoPE off on the pairs not kept (checked against an attention written here). The
    class's one list of frequencies is the pairs listed; which head keeps which changes from layer to layer, and a
    head may keep more than another."""
    source = build_model("llama", num_kv_heads=2)
    G, d = 2, source.config.head_dim
    full = 2 * G * d - 2 * 6
    calibration = torch.randint(0, source.config.vocab_size, (600,), generator=torch.Generator().manual_seed(3))
    plan = plan_mla(source, kv_rank=full, rope_dim=2 * 3 * G, ids=calibration, across=False)
    mla = build_mla(source, plan)
    kept = plan.layout.per_layer(G)
    assert [sum(len(pairs) for pairs in layer) for layer in kept] == [6, 6]
    assert kept[0] != kept[1] and len(kept[0][0]) != len(kept[0][1])  # chosen per layer, unequally: this seed
    base = source.config.rope_parameters["rope_theta"]
    ladder = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    frequencies = mla.model.rotary_emb.inv_freq.double()
    assert torch.allclose(frequencies, ladder[plan.layout.pairs], rtol=1e-5)
    for layer in kept:  # each listed frequency is kept by as many heads as it is listed, in every layer
        listed = sorted(plan.layout.pairs.tolist())
        assert sorted(pair for pairs in layer for pair in pairs) == listed
    ids = torch.randint(0, source.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected, got = reference_partial_rope(source, ids, kept), mla(ids).logits[0]
    assert (got - expected).abs().max().item() <= 1e-4 * logits_scale(expected)


def test_turning_each_frequency_across_heads_keeps_what_a_head_by_head_choice_loses():
    """Two K/V heads whose pairs of each frequency are multiples of one another (rank one across the heads, a
    different multiple for each pair): one rotary slot per frequency, turned across the heads, holds both heads'
    rotation whole, so the rewrite is exact; choosing heads instead, each frequency keeps one head's rotation and
    loses the other's."""
    source = build_model("llama", num_kv_heads=2)
    G, d = 2, source.config.head_dim
    half = d // 2
    multiples = torch.linspace(-1.5, 2.0, half).repeat(2)[:, None]  # one per pair, both of its dimensions
    with torch.no_grad():
        for layer in source.model.layers:
            k = layer.self_attn.k_proj.weight.view(G, d, -1)
            k[1] = multiples * k[0]
    rope_dim = d  # = 2 x (d/2 / G) pairs x G heads: as many slots as frequencies
    full = MlaShape(source.config.num_attention_heads, G, d, half // G, 1).full_rank  # the widest latent allowed
    calibration = torch.randint(0, source.config.vocab_size, (600,), generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, source.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = source(ids).logits
    for across, exact in ((True, True), (False, False)):
        plan = plan_mla(source, kv_rank=full, rope_dim=rope_dim, ids=calibration, across=across)
        if across:  # one slot per frequency: the leading component holds all of it
            assert sorted(plan.layout.pairs.tolist()) == list(range(half))
        with torch.no_grad():
            error = (build_mla(source, plan)(ids).logits - expected).abs().max().item()
        assert (error <= 1e-4 * logits_scale(expected)) == exact, (across, error)


def test_the_listed_frequencies_are_the_best_of_every_list_a_brute_force_tries():
    """The layout keeps the (head, pair) choices whose scores sum highest under one list of frequencies for every
    layer (each listed frequency given, in each layer, to the heads that score most on it): checked against every
    list of 4 frequencies of 5, none listed more often than there are heads."""
    import itertools

    from gqaify.conversion.mla.rotary import choose_layout

    scores = torch.rand(3, 2, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)  # (layers, G, d/2)
    layers, G, half = scores.shape

    def total(listed) -> float:
        counts = torch.bincount(torch.tensor(listed), minlength=half)
        return sum(float(scores[i, :, f].topk(int(counts[f])).values.sum()) for i in range(layers) for f in set(listed))

    lists = [c for c in itertools.combinations_with_replacement(range(half), 4) if max(map(c.count, c)) <= G]
    layout = choose_layout(scores, G, 2 * half, pairs=2, layers=layers)
    kept = sum(float(scores[i, layout.heads[i, j], layout.pairs[j]]) for i in range(layers) for j in range(4))
    assert kept == pytest.approx(max(map(total, lists))) == pytest.approx(total(layout.pairs.tolist()))


def test_a_narrower_latent_is_the_leading_components_of_the_balanced_targets():
    """At rank R the latent reconstructs the balanced targets as well as their R leading principal components do:
    the error left is the sum of the other eigenvalues."""
    generator = torch.Generator().manual_seed(5)
    shape = MlaShape(num_heads=4, kv_groups=2, head_dim=8, pairs=2, kv_rank=10)
    targets = torch.randn(shape.full_rank, 12, generator=generator, dtype=torch.float64)
    x = torch.randn(500, 12, generator=generator, dtype=torch.float64)
    covariance = x.T @ x / len(x)
    latent = latent_from_covariance(targets, covariance, shape.kv_rank, shape.kv_groups * shape.nope_dim)
    y = x @ targets.T  # (tokens, targets)
    keys = shape.kv_groups * shape.nope_dim
    balance = torch.ones(shape.full_rank, dtype=torch.float64)
    balance[:keys] = (y[:, keys:].pow(2).sum() / y[:, :keys].pow(2).sum()).sqrt()
    error = ((y - y @ latent.down.T @ latent.up.T) * balance).pow(2).sum() / len(x)
    eigenvalues = torch.linalg.eigvalsh((y * balance).T @ (y * balance) / len(x))
    assert error.item() == pytest.approx(eigenvalues[: shape.full_rank - shape.kv_rank].sum().item(), rel=1e-6)


def test_a_latent_in_a_metric_is_the_leading_components_in_that_metric():
    """With a metric M (the scores' and the output's), the latent's error |M (t' - t)|, keys and values balanced
    in M, is the sum of the eigenvalues the rank leaves out; and it is smaller there than the plain latent's."""
    generator = torch.Generator().manual_seed(6)
    shape = MlaShape(num_heads=4, kv_groups=2, head_dim=8, pairs=2, kv_rank=10)
    keys = shape.kv_groups * shape.nope_dim
    targets = torch.randn(shape.full_rank, 12, generator=generator, dtype=torch.float64)
    x = torch.randn(500, 12, generator=generator, dtype=torch.float64)
    covariance = x.T @ x / len(x)
    a = torch.randn(shape.full_rank, shape.full_rank, generator=generator, dtype=torch.float64)
    metric = a @ a.T / shape.full_rank + torch.eye(shape.full_rank, dtype=torch.float64)
    y = x @ targets.T @ metric.T  # (tokens, targets) as the metric sees them
    balance = torch.ones(shape.full_rank, dtype=torch.float64)
    balance[:keys] = (y[:, keys:].pow(2).sum() / y[:, :keys].pow(2).sum()).sqrt()

    def error(latent) -> float:
        reconstructed = x @ (latent.up @ latent.down @ targets).T @ metric.T
        return (((reconstructed - y) * balance).pow(2).sum() / len(x)).item()

    latent = latent_from_covariance(targets, covariance, shape.kv_rank, keys, metric)
    eigenvalues = torch.linalg.eigvalsh((y * balance).T @ (y * balance) / len(x))
    assert error(latent) == pytest.approx(eigenvalues[: shape.full_rank - shape.kv_rank].sum().item(), rel=1e-6)
    assert error(latent) < error(latent_from_covariance(targets, covariance, shape.kv_rank, keys))


@pytest.mark.parametrize(
    ("model_type", "overrides", "says"),
    [
        ("qwen2", {}, "an MLA rewrite is described for llama, mistral, not 'qwen2'"),
        ("llama", {"attention_bias": True}, "attention_bias is set"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "dynamic"),
    ],
)
def test_what_the_rewrite_cannot_take_is_refused_with_its_reason(model_type, overrides, says):
    source = build_model(model_type, num_kv_heads=2, **overrides)
    with pytest.raises(UserError, match=says):
        rewrite_as_mla(source)


def test_a_smaller_cache_needs_calibration_text_and_whole_rotary_pairs():
    source = build_model("llama", num_kv_heads=2)
    with pytest.raises(UserError, match="fitted on calibration text"):
        rewrite_as_mla(source, kv_rank=8, rope_dim=8)
    with pytest.raises(UserError, match="multiple of 4"):
        rewrite_as_mla(source, kv_rank=8, rope_dim=6)


# -- gqaify convert --attention mla --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """A tiny MHA Llama (4 K/V heads) with a tokenizer, and calibration and evaluation text."""
    root = tmp_path_factory.mktemp("mla")
    src = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), root / "parent")
    (root / "calib.txt").write_text(CORPUS * 8)
    return src


def load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_convert_writes_a_plain_deepseek_v3_checkpoint_with_the_gqa_conversions_function(parent, tmp_path, capsys):
    """The MLA conversion is the GQA-2 conversion of the same settings, rewritten: the same logits, a class of
    transformers' own (no remote code), the record saying what was cached, and the summary counting it."""
    gqa, mla = tmp_path / "gqa", tmp_path / "mla"
    assert main(["convert", str(parent), str(gqa), "--kv-heads", "2", "-q"]) == 0
    assert main(["convert", str(parent), str(mla), "--kv-heads", "2", "--attention", "mla", "-q"]) == 0
    said = capsys.readouterr().out
    assert "to MLA (latent 32 + rotary key 32, from GQA-2)" in said and "KV cache/token  1,024 -> 512 bytes" in said
    model = load(mla)
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and not (mla / "modeling_gqaify.py").exists()
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected, got = load(gqa)(ids).logits, model(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4 * logits_scale(expected)
    record = json.loads((mla / "gqaify.json").read_text())
    assert record["mla"] == {
        "kv_rank": 32,
        "rope_dims": 32,
        "nope_dims": 0,
        "rotary_pairs": [[list(range(8))] * 2] * 2,  # per layer, per K/V head
        "rope_type": "longrope",
        "exact": True,
    }
    assert record["settings"]["attention"] == "mla" and "mla" in (mla / "README.md").read_text()
    assert "The latent layer is DeepSeek-V2's (DeepSeek-AI, DeepSeek-V2:" in (mla / "README.md").read_text()


def test_a_smaller_cache_is_fitted_and_eval_counts_and_measures_it(parent, tmp_path):
    """--kv-rank 16 --rope-dims 16 from GQA-2: a quarter of the parent's cache, which eval counts from the config and
    measures in transformers' cache alike."""
    out = tmp_path / "small"
    calib = parent.parent / "calib.txt"
    argv = ["--attention", "mla", "--kv-rank", "16", "--rope-dims", "16", *calibrated_on(calib)]
    assert main(["convert", str(parent), str(out), "--kv-heads", "2", *argv, "-q"]) == 0
    record = json.loads((out / "gqaify.json").read_text())["mla"]
    fewest = min(len(pairs) for layer in record["rotary_pairs"] for pairs in layer)
    assert (record["kv_rank"], record["rope_dims"], record["nope_dims"], record["exact"]) == (
        16,
        16,
        16 - 2 * fewest,
        False,
    )
    assert [sum(len(pairs) for pairs in layer) for layer in record["rotary_pairs"]] == [8, 8]
    settings = EvalSettings(seq_len=32, speed=False, progress=False)
    report = gqaify.evaluate([str(out)], str(calib), tmp_path / "report", settings)
    entry = report.models[0]
    layers = 2
    assert entry.kv_cache_bytes_per_token == (16 + 16) * layers * 4 and entry.cached_values == 32
    assert entry.kv_cache_bytes_analytic == entry.kv_cache_bytes_measured == 32 * (16 + 16) * layers * 4
    assert entry.attention == "MLA 32"
    # the kv heads column held "MLA 32", a count of values: latent attention has no K/V heads, and says what it caches
    assert f"| {out.name} | none (MLA: 32 values) |" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--kv-rank", "16"], "--kv-rank 16 is an MLA latent's width; use --attention mla"),
        (["--attention", "mla", "--rope-dims", "16"], "fit a smaller MLA cache on calibration text; add --calib-data"),
        (["--attention", "mla", "--dtype", "float16"], "float16 cannot hold; use --dtype bfloat16 or float32"),
        (["--attention", "mla", "--rope-dims", "6", "--calib-data", "x.txt"], "--rope-dims must be a multiple of 4"),
        (["--attention", "mla", "--kv-rank", "999", "--calib-data", "x.txt"], "--kv-rank 999 is wider than all"),
    ],
)
def test_what_an_mla_conversion_cannot_be_is_one_line_and_writes_nothing(parent, tmp_path, capsys, argv, says):
    """Refused before anything is read or written (the shape, the dtype): not after the G-head conversion."""
    argv = [str(parent.parent / "calib.txt") if a == "x.txt" else a for a in argv]
    before = tree_hashes(parent)
    code, err = run_cli(capsys, "convert", parent, tmp_path / "out", "--kv-heads", "2", *argv)
    assert code == 2 and one_line(err) and says in err
    assert sorted(tmp_path.iterdir()) == [] and tree_hashes(parent) == before


@pytest.mark.parametrize("argv", [["--kv-heads", "1"], ["--kv-heads", "1", "--attention", "mla", "--kv-cut", "2"]])
def test_an_mla_output_converted_again_is_refused_for_what_it_is_and_names_its_parent(parent, tmp_path, capsys, argv):
    """Converting an MLA output again blamed the rope_type (longrope) gqaify itself wrote, a missing --calib-data and
    the architecture at once; the one reason is that no shape converts latent attention: convert its parent."""
    mla = tmp_path / "mla"
    assert main(["convert", str(parent), str(mla), "--kv-heads", "2", "--attention", "mla", "-q"]) == 0
    code, err = run_cli(capsys, "convert", mla, tmp_path / "again", *argv)
    assert code == 2 and one_line(err)
    assert "gqaify does not convert 'deepseek_v3'" in err and f"conversion of {parent}: convert that instead" in err
    assert "longrope" not in err and "--calib-data" not in err and not (tmp_path / "again").exists()


def test_a_float16_source_is_refused_unless_another_dtype_is_named(tmp_path, capsys):
    """float16 cannot hold the latent (about 1e-8): a source stored in it would have made a model of zeros."""
    src = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320).half(), tmp_path / "half")
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2", "--attention", "mla")
    assert code == 2 and "the source's float16 (--dtype auto) cannot hold" in one_line(err)
    assert main(["convert", str(src), str(tmp_path / "out"), "--kv-heads", "2", "--attention", "mla", "--dtype",
                 "bfloat16", "-q"]) == 0  # fmt: skip
    assert load(tmp_path / "out").config.kv_lora_rank == 32


def test_an_mla_gguf_and_an_architecture_without_the_rewrite_are_refused(tmp_path, capsys):
    src = save_with_tokenizer(build_model("qwen2", num_kv_heads=4, vocab_size=320), tmp_path / "qwen2")
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2", "--attention", "mla")
    assert code == 2 and "not 'qwen2'" in one_line(err) and not (tmp_path / "out").exists()
    llama = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), tmp_path / "llama")
    code, err = run_cli(capsys, "convert", llama, tmp_path / "out.gguf", "--kv-heads", "2", "--attention", "mla")
    assert code == 2 and "convert with --kv-heads 1" in one_line(err) and not (tmp_path / "out.gguf").exists()


def test_an_mla_model_uptrains_with_its_latent_down_projection_held(parent, tmp_path):
    """AdamW moves every weight by about its learning rate: the latent rows (below the norm's epsilon) would leave
    the range where the norm is linear at the first step. Uptraining holds them and trains the rest: the loss falls,
    the down-projection is bit for bit as converted, and the final model is the class transformers loads."""
    from safetensors.torch import load_file

    from gqaify.uptrain import parse
    from gqaify.uptrain import run as uptrain

    mla = tmp_path / "mla"
    assert main(["convert", str(parent), str(mla), "--kv-heads", "2", "--attention", "mla", "-q"]) == 0
    (tmp_path / "train.txt").write_text(CORPUS * 4)
    out = tmp_path / "run"
    argv = ["--model", mla, "--output_dir", out, "--data", tmp_path / "train.txt", "--seq_len", "16"]
    uptrain(parse([*map(str, argv), "--micro_batch_size", "2", "--max_tokens", "1280", "--lr", "1e-3"]))
    curve = losses(out)
    assert len(curve) == 40 and all(math.isfinite(x) for x in curve)
    assert sum(curve[-5:]) < sum(curve[:5])
    before, after = load_file(mla / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    held = [name for name in before if "kv_a_proj_with_mqa" in name]
    assert held and all(torch.equal(before[name], after[name]) for name in held)
    assert any(not torch.equal(before[name], after[name]) for name in before if "kv_b_proj" in name)
    assert type(load(out / "final")).__name__ == "DeepseekV3ForCausalLM"


@pytest.mark.parametrize(
    ("trainable", "changed"),
    [
        (["--trainable", "lora", "--lora_rank", "4"], {"q_proj", "kv_b_proj", "o_proj"}),
        (["--trainable", "kv-only"], {"kv_b_proj"}),
        (["--trainable", "attention"], {"q_proj", "kv_b_proj", "o_proj", "kv_a_layernorm"}),
    ],
    ids=["lora", "kv-only", "attention"],
)
def test_an_mla_models_attention_trains_alone(parent, tmp_path, trainable, changed):
    """trainable lora, kv-only and attention find DeepSeek-V3's attention as gqaify writes it: exactly the
    projections each names change (LoRA's merged into a plain checkpoint), the latent's down-projection and
    everything outside attention stay as converted."""
    from safetensors.torch import load_file

    from gqaify.uptrain import parse
    from gqaify.uptrain import run as uptrain

    mla = tmp_path / "mla"
    assert main(["convert", str(parent), str(mla), "--kv-heads", "2", "--attention", "mla", "-q"]) == 0
    (tmp_path / "train.txt").write_text(CORPUS * 4)
    out = tmp_path / "run"
    argv = ["--model", mla, "--output_dir", out, "--data", tmp_path / "train.txt", "--seq_len", "16"]
    argv += ["--micro_batch_size", "2", "--max_tokens", "320", "--lr", "1e-2", "--no-progress", *trainable]
    uptrain(parse(list(map(str, argv))))
    before, after = load_file(mla / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert before.keys() == after.keys()
    moved = {name.split(".")[-2] for name in before if not torch.equal(before[name], after[name])}
    assert moved == changed
    assert type(load(out / "final")).__name__ == "DeepseekV3ForCausalLM"


def test_the_memory_plan_of_a_run_that_converts_to_mla_counts_the_mla_models_tensors(parent, tmp_path):
    """`gqaify uptrain --plan` of a run that converts to MLA itself plans the MLA model it will train (its wider
    query, its latent's projections), not the GQA model it is made from: the weights are the converted checkpoint's,
    the gradients all but the latent's down-projection, which stays as converted."""
    from gqaify.uptrain.plan import Launch, plan
    from gqaify.uptrain.settings import parse

    mla = tmp_path / "mla"
    assert main(["convert", str(parent), str(mla), "--kv-heads", "2", "--attention", "mla", "-q"]) == 0
    (tmp_path / "train.txt").write_text(CORPUS)
    argv = ["--model", parent, "--kv_heads", "2", "--attention", "mla", "--output_dir", tmp_path / "run"]
    argv += ["--data", tmp_path / "train.txt", "--seq_len", "16", "--max_tokens", "320"]
    found = plan(parse(list(map(str, argv))), Launch(1, False, "no"))
    weights = dict(load(mla).named_parameters())
    assert found.student == 4 * sum(p.numel() for p in weights.values())
    assert found.gradients == 4 * sum(p.numel() for n, p in weights.items() if "kv_a_proj_with_mqa" not in n)


def test_uptrain_converts_to_a_smaller_mla_cache_itself_calibrated_on_its_data(parent, tmp_path):
    """uptrain's conversion takes the shape settings a conversion does: MLA at 16 + 16 values from GQA-2, fitted on
    the training data (calib_data defaults to it, as for a calibrated method), then trained."""
    from gqaify.uptrain import parse
    from gqaify.uptrain import run as uptrain

    (tmp_path / "train.txt").write_text(CORPUS * 4)
    out = tmp_path / "run"
    argv = ["--model", parent, "--kv_heads", "2", "--attention", "mla", "--kv_rank", "16", "--rope_dims", "16"]
    argv += ["--output_dir", out, "--data", tmp_path / "train.txt", "--seq_len", "16", "--calib_seq_len", "64"]
    uptrain(parse([*map(str, argv), "--micro_batch_size", "2", "--max_tokens", "320", "--no-progress"]))
    record = json.loads((out / "converted" / "gqaify.json").read_text())
    assert (record["mla"]["kv_rank"], record["mla"]["rope_dims"], record["mla"]["exact"]) == (16, 16, False)
    assert record["settings"]["calib_data"] == [str(tmp_path / "train.txt")]
    config = load(out / "final").config
    assert (config.kv_lora_rank, config.qk_rope_head_dim) == (16, 16) and len(losses(out)) == 10


def test_a_fit_that_takes_the_model_further_from_its_parent_is_undone(monkeypatch):
    """Each layer's fit is judged on that layer's output, which does not always add up over the layers: the whole
    fit is kept only if the model's next-token KL to the parent falls on the held-out windows. A step that wrecks
    o_proj is undone to the last bit; the same fit without it is kept."""
    from gqaify.conversion.mla import fit as mla_fit

    source = build_model("llama", num_kv_heads=2)
    ids = torch.randint(0, source.config.vocab_size, (1200,), generator=torch.Generator().manual_seed(7))
    windows = list(ids[:1024].view(-1, 64))
    mla = rewrite_as_mla(source, kv_rank=24, rope_dim=8, ids=ids)
    before = {name: t.clone() for name, t in mla.state_dict().items()}
    kl = mla_fit.held_out_kl(source, mla, windows[7::8])

    def wrecked(layer, *args):
        with torch.no_grad():
            layer.self_attn.o_proj.weight.mul_(-50.0)

    with monkeypatch.context() as patch:
        patch.setattr(mla_fit, "_refit_o_proj", wrecked)
        assert mla_fit.fit_mla(mla, source, windows, steps=0, progress=False) is False
    assert all(torch.equal(before[name], t) for name, t in mla.state_dict().items())
    assert mla_fit.fit_mla(mla, source, windows, steps=0, progress=False) is True
    assert mla_fit.held_out_kl(source, mla, windows[7::8]) < kl


def test_the_held_out_kl_is_per_token_as_torchs_kl_div_counts_it():
    """What the fit, the split and the two starts are judged by (and the record says): the mean over every token of
    the windows of KL(parent || model), here against torch's own kl_div over the windows' tokens, unequal windows
    included."""
    from gqaify.conversion.mla import fit as mla_fit

    source = build_model("llama", num_kv_heads=2)
    ids = torch.randint(0, source.config.vocab_size, (700,), generator=torch.Generator().manual_seed(3))
    mla = rewrite_as_mla(source, kv_rank=24, rope_dim=8, ids=ids)
    windows = [ids[:64], ids[64:96], ids[96:200]]
    with torch.no_grad():
        logits = [(source(w[None]).logits[0], mla(w[None]).logits[0]) for w in windows]
    p, q = (torch.cat([pair[i] for pair in logits]).double().log_softmax(-1) for i in (0, 1))
    expected = torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum").item() / 200
    assert mla_fit.held_out_kl(source, mla, windows) == pytest.approx(expected, rel=1e-6)
    # two models judged in one pass (the parent's distribution once a window): each exactly as judged alone
    other = rewrite_as_mla(source, kv_rank=8, rope_dim=8, ids=ids)
    alone = [mla_fit.held_out_kl(source, model, windows) for model in (mla, other)]
    assert mla_fit.held_out_kls(source, [mla, other], windows) == alone and alone[0] != alone[1]


def test_every_attention_shape_is_one_entry_whose_object_answers_the_whole_contract(capsys):
    """An attention shape is one entry of ATTENTION_INFO naming its `Shape`: each answers the whole contract, the
    command line offers exactly their names, and GQA, the stream's output, rewrites nothing."""
    from gqaify.conversion.registry import ATTENTION_INFO
    from gqaify.conversion.shapes import Shape, every_shape, shape

    assert list(ATTENTION_INFO) == ["gqa", "mla"]
    assert all(isinstance(found, Shape) for found in every_shape())
    assert ATTENTION_INFO["gqa"].record is None and shape("gqa").rewrite(None, None, None, None, None) is None
    assert main(["convert", "--help"]) == 0
    offered = re.search(r"--attention \{([^}]*)\}", capsys.readouterr().out).group(1)
    assert offered.split(",") == list(ATTENTION_INFO)


@needs_assets
def test_a_real_models_mla_conversion_is_its_gqa_conversion_to_float_precision(tmp_path):
    """ref-mha-6L (a real MHA Llama, 8 heads of 32): the MLA rewrite of its GQA-2 conversion gives that conversion's
    logits on real text, and caches what it caches."""
    source = MODELS / "ref-mha-6L"
    gqa = gqaify.convert(source, tmp_path / "gqa", 2, progress=False)
    mla = gqaify.convert(source, tmp_path / "mla", 2, attention="mla", progress=False)
    assert mla.kv_bytes_per_token_after == gqa.kv_bytes_per_token_after
    ids = torch.tensor([list(range(1, 200, 3))])
    with torch.no_grad():
        expected, got = load(tmp_path / "gqa")(ids).logits, load(tmp_path / "mla")(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4 * logits_scale(expected)


def test_float16_is_refused_where_an_mla_model_is_evaluated_or_trained(parent, tmp_path, capsys, monkeypatch):
    """float16 rounds the latent's weights (held below the norm's epsilon, about 1e-8) to its few smallest steps,
    6e-8 apart: eval --dtype float16 of an MLA rewrite, and uptraining one, or converting to one, under fp16 mixed
    precision (asked, or the launch's) are refused in one line, writing nothing; bfloat16 keeps them."""
    mla = tmp_path / "mla"
    assert main(["convert", str(parent), str(mla), "--kv-heads", "2", "--attention", "mla", "-q"]) == 0
    attn = load(mla).model.layers[0].self_attn
    rows = attn.kv_a_proj_with_mqa.weight[: attn.kv_lora_rank].detach()

    def error(dtype) -> float:
        return ((rows.to(dtype).float() - rows).abs().max() / rows.abs().max()).item()

    assert error(torch.float16) > 0.1 and error(torch.bfloat16) < 0.01  # what the refusal is for
    calib = parent.parent / "calib.txt"
    code, err = run_cli(capsys, "eval", mla, "--data", calib, "--out", tmp_path / "r", "--dtype", "float16", "-q")
    assert code == 2 and one_line(err) and "--dtype float16 cannot hold; evaluate it with --dtype bfloat16" in err
    assert not (tmp_path / "r").exists()
    run = ["--data", calib, "--output_dir", tmp_path / "run", "--seq_len", "16", "--max_tokens", "64"]
    for model, extra in ([mla, []], [parent, ["--kv_heads", "2", "--attention", "mla"]]):
        code, err = run_cli(capsys, "uptrain", "--model", model, *run, *extra, "--mixed_precision", "fp16")
        assert code == 2 and one_line(err) and "mixed_precision fp16 cannot hold; train with" in err
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    code, err = run_cli(capsys, "uptrain", "--model", mla, *run)
    assert code == 2 and "mixed_precision fp16 (the launch's) cannot hold" in err
    assert not (tmp_path / "run").exists()


def test_an_mla_model_whose_config_stores_float16_is_refused_by_uptrain(parent, tmp_path, capsys):
    """An MLA rewrite whose config.json names float16 (its weights float32) was trained and its final/ saved in
    float16, the latent's rows erased (93-97% exactly 0) without a word. uptrain refuses it as eval does, in one
    line naming the file to change, writing nothing; with the config's dtype float32 it trains, and final/'s
    weights are in the dtype its config names."""
    from safetensors.torch import load_file

    mla = tmp_path / "mla"
    assert main(["convert", str(parent), str(mla), "--kv-heads", "2", "--attention", "mla", "-q"]) == 0
    config = json.loads((mla / "config.json").read_text())
    (mla / "config.json").write_text(json.dumps({**config, "dtype": "float16", "torch_dtype": "float16"}))
    calib = parent.parent / "calib.txt"
    run = ["--model", mla, "--data", calib, "--output_dir", tmp_path / "run", "--seq_len", "16", "--max_tokens", "64"]
    code, err = run_cli(capsys, "uptrain", *run, "--no-progress")
    assert code == 2 and one_line(err), err
    assert "its config's float16" in err and f'"dtype" to "float32" or "bfloat16" in {mla}/config.json' in err
    assert not (tmp_path / "run").exists()
    (mla / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    assert run_cli(capsys, "uptrain", *run, "--no-progress")[0] == 0
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(final / "model.safetensors")
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
    rows = load(mla).model.layers[0].self_attn.kv_lora_rank
    latent = weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][:rows]
    assert (latent == 0).float().mean() < 0.01  # bfloat16 holds the latent


def test_the_disk_plan_counts_the_wider_queries_of_the_mla_model(tmp_path, capsys, monkeypatch):
    """The exact rewrite of an MHA model keeps every rotary pair of each of its 8 K/V heads in the one shared
    rotary key, which each query head reads through its own query as wide: the query projection is 8 times the
    source's, 14 MB written from a 6 MB source, more than the plan's margin. The plan counts the MLA model, so too
    little room for it is refused up front."""
    import shutil

    from gqaify.output import destination

    wide = dict(num_attention_heads=8, hidden_size=256, head_dim=32, num_hidden_layers=4, vocab_size=320)
    src = save_with_tokenizer(build_model("llama", num_kv_heads=8, **wide), tmp_path / "src")
    out = tmp_path / "mla"
    assert main(["convert", str(src), str(out), "--kv-heads", "8", "--attention", "mla", "-q"]) == 0
    written = sum(path.stat().st_size for path in out.iterdir())
    assert written > 2 * sum(path.stat().st_size for path in src.glob("*.safetensors"))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(destination.shutil, "disk_usage", lambda path: usage._replace(free=written - 1))
    code, err = run_cli(capsys, "convert", src, tmp_path / "again", "--kv-heads", "8", "--attention", "mla")
    assert code == 2 and "not enough disk space" in one_line(err)
    assert int(re.search(r"needs ([\d,]+) bytes", err)[1].replace(",", "")) >= written
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("width", [["--kv-rank", "16"], ["--rope-dims", "16"]])
def test_one_width_given_converts_and_says_first_what_it_fits(parent, tmp_path, capsys, width):
    """The note said before a fit added the two widths, and one of them left unset was an internal error."""
    calib = ["--calib-data", str(parent.parent / "calib.txt"), "--calib-seq-len", "64", "--calib-tokens", "1024"]
    argv = ["convert", str(parent), str(tmp_path / "out"), "--kv-heads", "2", "--attention", "mla", *width, *calib]
    assert main(argv) == 0
    said = capsys.readouterr().err.splitlines()[0]
    assert said.startswith("MLA, after the G-head conversion: one layer-by-layer fit (2 layers, ")
