"""gqaify eval: perplexity against references, KV bytes measured against analytic, the report, bad input."""

import json
import math
import os
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageStat

import gqaify
from gqaify.entry.cli import main
from gqaify.eval.perplexity import perplexity, sliding_windows
from gqaify.eval.settings import EvalSettings
from gqaify.model.archs import ARCHITECTURES
from gqaify.model.geometry import Geometry
from gqaify.model.kvcache import capacity, kv_cache_bytes, measured_kv_cache_bytes
from gqaify.model.kvcache import sliding_windows as layer_windows
from gqaify.testing import CORPUS, build_model, save_with_tokenizer, transformers_doc_loop
from helpers import sample_ids

FAST = EvalSettings(seq_len=32, decode_context=16, decode_tokens=4, decode_batch=2, repeats=1, progress=False)


@pytest.mark.parametrize(("n", "seq_len", "stride"), [(10, 6, 3), (100, 16, 5), (100, 16, 16), (17, 16, 1), (5, 8, 8)])
def test_windows_score_every_token_at_most_once(n, seq_len, stride):
    windows = sliding_windows(n, seq_len, stride)
    scored = [t for w in windows for t in range(w.scored_from, w.end)]
    assert len(scored) == len(set(scored))
    assert all(w.length <= seq_len and w.begin < w.scored_from for w in windows)
    if stride < seq_len:  # overlapping windows: every token but the first has context and is scored
        assert sorted(scored) == list(range(1, n))
    else:  # non-overlapping chunks: the first token of each chunk is context only
        assert sorted(scored) == [t for t in range(n) if t % seq_len]


def brute_force_nll(model, ids, seq_len, stride):
    """Each scored token on its own: the model sees exactly its left context inside its window."""
    total = 0.0
    with torch.inference_mode():
        for w in sliding_windows(len(ids), seq_len, stride):
            for t in range(w.scored_from, w.end):
                logits = model(ids[w.begin : t].unsqueeze(0)).logits[0, -1]
                total -= F.log_softmax(logits.float(), dim=-1)[ids[t]].item()
    return total


@pytest.mark.parametrize(("seq_len", "stride"), [(12, 12), (12, 5), (12, 1)])
def test_perplexity_equals_brute_force_reference(seq_len, stride):
    model = build_model("qwen2")
    ids = sample_ids(model.config.vocab_size, length=41, batch=1)[0]
    expected = brute_force_nll(model, ids, seq_len, stride)
    for batch_size in (1, 3):
        got = perplexity(model, ids, seq_len, stride, batch_size=batch_size, progress=False)
        assert got.tokens_scored == sum(w.scored for w in sliding_windows(len(ids), seq_len, stride))
        assert got.nll_sum == pytest.approx(expected, rel=1e-5)
        assert got.perplexity == pytest.approx(math.exp(expected / got.tokens_scored), rel=1e-5)


@pytest.mark.parametrize(("seq_len", "stride"), [(16, 16), (16, 6)])
def test_perplexity_matches_the_transformers_guide(seq_len, stride):
    model = build_model("llama")
    ids = sample_ids(model.config.vocab_size, length=70, batch=1)[0]
    nll_sum, n_tokens = transformers_doc_loop(model, ids, seq_len, stride)
    got = perplexity(model, ids, seq_len, stride, batch_size=2, progress=False)
    assert got.tokens_scored == n_tokens
    assert got.nll_sum == pytest.approx(nll_sum, rel=1e-5)


@pytest.mark.parametrize("model_type", ["gemma2", "mistral"])  # gemma2 alternates sliding layers, mistral slides all
def test_sliding_window_cache_bytes_measured_equal_analytic(model_type):
    model = build_model(model_type, sliding_window=8)
    windows = layer_windows(model.config)
    assert any(w == 8 for w in windows)
    geometry = Geometry.from_config(ARCHITECTURES[model_type], model.config.to_dict())
    for tokens in (5, 7, 8, 20):
        with torch.inference_mode():
            cache = model(sample_ids(model.config.vocab_size, length=tokens, batch=1), use_cache=True).past_key_values
        assert measured_kv_cache_bytes(cache) == kv_cache_bytes(geometry, torch.float32, tokens, windows)


def test_capacity_fills_the_budget_exactly():
    g = Geometry(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32)
    per_token = 2 * 2 * 2 * 8 * 2  # bf16, two layers
    fits = capacity(g, torch.bfloat16, [], weights_bytes=1000, budget_bytes=1000 + 10 * per_token + 5, context=4)
    assert (fits.max_context, fits.max_batch) == (10, 2)
    sliding = capacity(g, torch.bfloat16, [4, 4], weights_bytes=0, budget_bytes=10**12, context=4)
    assert sliding.max_context is None  # every layer slides: the cache never outgrows the budget
    assert capacity(g, torch.bfloat16, [], weights_bytes=10, budget_bytes=5, context=4).max_batch == 0


def test_capacity_is_capped_at_the_models_positions():
    """SmolLM2's 80 GB figure used to be 1,724,434 tokens, past its 8,192 positions."""
    g = Geometry(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32)
    per_token = 2 * 2 * 2 * 8 * 2
    budget = 10 * per_token
    short = capacity(g, torch.bfloat16, [], weights_bytes=0, budget_bytes=budget, context=4, positions=8)
    assert (short.max_context, short.usable_context, short.bound_by) == (10, 8, "positions")
    long = capacity(g, torch.bfloat16, [], weights_bytes=0, budget_bytes=budget, context=4, positions=100)
    assert (long.max_context, long.usable_context, long.bound_by) == (10, 10, "memory")
    sliding = capacity(g, torch.bfloat16, [4, 4], weights_bytes=0, budget_bytes=10**12, context=4, positions=64)
    assert (sliding.max_context, sliding.usable_context, sliding.bound_by) == (None, 64, "positions")


@pytest.fixture(scope="module")
def lm_pair(tmp_path_factory):
    """An MHA llama with a real (trained here) tokenizer, and its GQA-2 conversion."""
    root = tmp_path_factory.mktemp("lm")
    model = build_model("llama", num_kv_heads=4, vocab_size=320, max_position_embeddings=128)
    parent = save_with_tokenizer(model, root / "parent")
    gqaify.convert(parent, root / "gqa2", kv_heads=2, progress=False)
    gqaify.convert(parent, root / "same", kv_heads=4, progress=False)
    data = root / "corpus.txt"
    data.write_text(CORPUS)
    return root, parent, data


def test_report_beside_the_parent(lm_pair, tmp_path):
    root, parent, data = lm_pair
    report = gqaify.evaluate([str(parent), str(root / "gqa2"), str(root / "same")], str(data), tmp_path / "r", FAST)
    files = {p.name: p for p in (tmp_path / "r").iterdir()}
    assert set(files) == {
        "report.json",
        "report.md",
        "perplexity_vs_kv.png",
        "diagnostics.png",
        "perplexity_by_text.png",
        "gqaify.json",
    }
    for png in ("perplexity_vs_kv.png", "diagnostics.png", "perplexity_by_text.png"):
        with Image.open(files[png]) as image:
            image.load()  # decodes every pixel: a truncated or corrupt file raises here
            assert (image.format, image.size) == ("PNG", (768, 528))  # 6.4 x 4.4 inches at 120 dpi
            assert ImageStat.Stat(image.convert("L")).stddev[0] > 10, f"{png} is blank"
    loaded = json.loads(files["report.json"].read_text())
    assert {"data", "settings", "models"} <= set(loaded)
    keys = {
        "model",
        "num_key_value_heads",
        "perplexity",
        "nll",
        "tokens_scored",
        "kv_cache_bytes_per_token",
        "kv_cache_bytes_measured",
        "decode_tokens_per_s",
    }
    assert all(keys <= set(m) for m in loaded["models"])

    parent_r, gqa2, same = report.models
    assert [m.num_key_value_heads for m in report.models] == [4, 2, 4]
    assert parent_r.tokens_scored == gqa2.tokens_scored == same.tokens_scored > 0
    assert same.perplexity == pytest.approx(parent_r.perplexity, rel=1e-6) and same.delta_perplexity == pytest.approx(0)
    assert gqa2.kv_ratio_to_parent == 2 and parent_r.kv_cache_bytes_per_token == 2 * 2 * 4 * 16 * 4
    assert all(m.kv_cache_bytes_measured == m.kv_cache_bytes_analytic for m in report.models)
    assert same.diagnostics.kl_nats_per_token == pytest.approx(0, abs=1e-6)
    assert max(same.diagnostics.attention_relative_error) < 1e-6
    assert gqa2.diagnostics.kl_nats_per_token > 1e-3 and len(gqa2.diagnostics.attention_relative_error) == 2
    assert all(m.decode_tokens_per_s > 0 and m.prefill_tokens_per_s > 0 for m in report.models)
    assert "| 2 |" in files["report.md"].read_text()
    assert f"| decode tok/s @{FAST.decode_context:,} ctx |" in files["report.md"].read_text()  # the context it is at
    # 80 GB holds far more than the 128 positions: the usable context is the positions, and says so
    assert all(m.max_context_at_budget > 10**6 and m.max_positions == 128 for m in report.models)
    assert all((m.usable_context, m.context_bound_by) == (128, "positions") for m in report.models)
    assert "128 (positions)" in files["report.md"].read_text()


def reference_kl(model, parent, ids, seq_len):
    """KL(parent || model) summed over the tokens non-overlapping windows score, from the full logits of each."""
    total = 0.0
    with torch.inference_mode():
        for begin in range(0, len(ids) - 1, seq_len):
            window = ids[begin : begin + seq_len].unsqueeze(0)
            log_q = F.log_softmax(model(window).logits[0, :-1].double(), dim=-1)
            log_p = F.log_softmax(parent(window).logits[0, :-1].double(), dim=-1)
            total += (log_p.exp() * (log_p - log_q)).sum().item()
    return total


def test_kl_to_the_parent_equals_a_full_logits_reference():
    parent, model = build_model("llama", num_kv_heads=4), build_model("llama", num_kv_heads=2)
    ids = sample_ids(parent.config.vocab_size, length=50, batch=1)[0]
    got = perplexity(model, ids, 16, 16, batch_size=2, progress=False, parent=parent)
    assert got.kl_sum == pytest.approx(reference_kl(model, parent, ids, 16), rel=1e-4)
    assert got.kl == pytest.approx(got.kl_sum / got.tokens_scored) and got.kl > 0
    assert perplexity(parent, ids, 16, 16, progress=False, parent=parent).kl == pytest.approx(0, abs=1e-6)


def test_a_panel_reports_each_text_as_one_text_at_a_time(lm_pair, tmp_path):
    root, parent, data = lm_pair
    verse = tmp_path / "verse.txt"
    verse.write_text(" ".join(reversed(CORPUS.split())))  # another text of the same words
    models = [str(parent), str(root / "gqa2")]
    panel = gqaify.evaluate(models, [f"prose={data}", str(verse)], tmp_path / "panel", FAST)
    alone = [gqaify.evaluate(models, text, tmp_path / f"alone-{i}", FAST) for i, text in enumerate([data, verse])]
    assert [t.name for t in panel.data] == ["prose", "verse"]
    for i, one in enumerate(alone):
        for in_panel, by_itself in zip(panel.models, one.models, strict=True):
            score = in_panel.texts[i]
            assert score.tokens_scored == by_itself.tokens_scored and score.words == by_itself.words
            assert score.perplexity == pytest.approx(by_itself.perplexity, rel=1e-6)
            assert score.bits_per_byte == pytest.approx(by_itself.bits_per_byte, rel=1e-6)
            expected = by_itself.texts[0].kl_to_parent  # None for the parent
            assert score.kl_to_parent == (None if expected is None else pytest.approx(expected, rel=1e-5))
    # the first text is also at the top, as a one-text report has it; the parent has no ratio, the conversion one
    parent_r, gqa2 = panel.models
    assert gqa2.perplexity == gqa2.texts[0].perplexity and parent_r.texts[1].ratio_to_parent is None
    ratios = [t.perplexity / p.perplexity for t, p in zip(gqa2.texts, parent_r.texts, strict=True)]
    assert [t.ratio_to_parent for t in gqa2.texts] == pytest.approx(ratios)
    assert gqa2.panel.mean_ratio_to_parent == pytest.approx(sum(ratios) / 2)
    assert gqa2.panel.worst_ratio_to_parent == max(ratios)
    assert gqa2.panel.worst_text == ["prose", "verse"][ratios.index(max(ratios))]
    assert gqa2.panel.worst_kl_to_parent == max(t.kl_to_parent for t in gqa2.texts) and parent_r.panel is None
    # the independent check of the KL: the parent's and the conversion's full logits on the first text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(parent)(CORPUS)["input_ids"]
    ids = torch.tensor(ids[: FAST.max_tokens] if FAST.max_tokens else ids)
    expected = reference_kl(
        AutoModelForCausalLM.from_pretrained(root / "gqa2"),
        AutoModelForCausalLM.from_pretrained(parent),
        ids,
        FAST.seq_len,
    )
    assert gqa2.texts[0].kl_to_parent == pytest.approx(expected / gqa2.texts[0].tokens_scored, rel=1e-4)
    stored = json.loads((tmp_path / "panel" / "report.json").read_text())
    assert [t["name"] for t in stored["data"]] == ["prose", "verse"]
    assert stored["models"][1]["panel"]["worst_text"] == gqa2.panel.worst_text
    md = (tmp_path / "panel" / "report.md").read_text()
    assert "## Perplexity by text" in md and "| worst |" in md and f"{ratios[1]:.2f}×" in md


def test_a_panel_from_the_command_line_and_a_rerun_from_its_report(lm_pair, tmp_path, capsys):
    root, parent, data = lm_pair
    args = [
        "eval",
        str(parent),
        str(root / "gqa2"),
        "--data",
        f"a={data}",
        f"b={data}",
        "--seq-len",
        "32",
        "--no-speed",
        "-q",
    ]
    assert main([*args, "--out", str(tmp_path / "r")]) == 0
    shown = capsys.readouterr().out
    assert "perplexity by text" in shown and "worst" in shown
    assert main(["eval", "--config", str(tmp_path / "r" / "report.json"), "--out", str(tmp_path / "again")]) == 0
    first, again = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("r", "again"))
    assert first["data"] == again["data"] and [t["name"] for t in again["data"]] == ["a", "b"]
    scores = [[t["perplexity"] for t in r["models"][1]["texts"]] for r in (first, again)]
    assert scores[0] == scores[1]


def test_two_texts_of_one_name_are_refused(lm_pair, tmp_path, capsys):
    root, parent, data = lm_pair
    code = main(["eval", str(parent), "--data", str(data), str(data), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "names two texts 'corpus'" in err and "NAME=SOURCE" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_report_files_follow_the_umask(lm_pair, tmp_path):
    root, parent, data = lm_pair
    previous = os.umask(0o022)
    try:
        gqaify.evaluate([str(parent)], str(data), tmp_path / "r", EvalSettings(seq_len=32, speed=False, progress=False))
    finally:
        os.umask(previous)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "r").iterdir()} == dict.fromkeys(
        [
            "report.json",
            "report.md",
            "perplexity_vs_kv.png",
            "diagnostics.png",
            "perplexity_by_text.png",
            "gqaify.json",
        ],
        0o644,
    )
    assert (tmp_path / "r").stat().st_mode & 0o777 == 0o755


def test_word_and_byte_normalisation(lm_pair, tmp_path):
    root, parent, data = lm_pair
    report = gqaify.evaluate(
        [str(parent)], str(data), tmp_path / "r", EvalSettings(seq_len=32, speed=False, progress=False, max_tokens=50)
    )
    m = report.models[0]
    assert m.tokens_scored == 49 - 1  # 50 tokens in chunks of 32: the first token of each chunk is not scored
    nll_sum = m.nll * m.tokens_scored
    from transformers import AutoTokenizer

    encoded = AutoTokenizer.from_pretrained(parent)(CORPUS, return_offsets_mapping=True)
    span = CORPUS[: encoded["offset_mapping"][49][1]]
    assert m.word_perplexity == pytest.approx(math.exp(nll_sum / len(span.split())))
    assert m.bits_per_byte == pytest.approx(nll_sum / len(span.encode()) / math.log(2))


def test_a_diverged_models_score_is_inf_not_an_overflow():
    """math.exp(nll_sum / words) raised OverflowError on text of few words per token: a diverged uptraining run
    stopped at its evaluation."""
    from gqaify.eval.perplexity import Perplexity
    from gqaify.eval.results import TextScore

    diverged = Perplexity(nll_sum=30_000.0, tokens_scored=100, kl_sum=5_000.0)  # 300 nats a token, 3,000 a word
    score = TextScore.of("t", diverged, words=10, text_bytes=400, parent_perplexity=20.0)
    assert score.word_perplexity == math.inf and score.ratio_to_parent == pytest.approx(math.exp(300) / 20)
    assert score.bits_per_byte == pytest.approx(30_000 / (400 * math.log(2))) and score.kl_to_parent == 50.0
    worse = TextScore.of("t", Perplexity(nll_sum=1e6, tokens_scored=100), words=10, text_bytes=400)
    assert worse.perplexity == math.inf and worse.word_perplexity == math.inf and worse.nll == 1e4
    assert TextScore.of("t", Perplexity(nll_sum=20.0, tokens_scored=10), 5, 40).word_perplexity == math.exp(4.0)


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--stride", "64", "--seq-len", "32"], "--stride 64 must be between 1 and --seq-len 32"),
        (["--stride", "0"], "--stride 0 must be between 1"),
        (["--seq-len", "4096"], "--seq-len 4096 exceeds the 128 positions"),
        (["--decode-tokens", "100000"], "--decode-tokens 100,000 leaves no room for a context in the 128 positions"),
        (["--decode-batch", "1000000000"], "--decode-batch 1000000000 is more than the 4,096 allowed"),
        (["--memory-budget", "lots"], "--memory-budget 'lots' is not a size"),
    ],
)
def test_bad_input(lm_pair, tmp_path, capsys, args, expect):
    root, parent, data = lm_pair
    capsys.readouterr()
    code = main(["eval", str(parent), "--data", str(data), "--out", str(tmp_path / "r"), "--seq-len", "32", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expect in err, err
    assert not (tmp_path / "r").exists()


@pytest.fixture
def no_model_loaded(monkeypatch):
    """Fails the command if eval loads a model: a refusal comes before any work."""
    from gqaify.eval import core

    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(core, "load_model", load_model)


def test_every_problem_is_reported_at_once(lm_pair, tmp_path, capsys, no_model_loaded):
    """eval used to report only its first problem when several settings were bad, unlike convert."""
    root, parent, data = lm_pair
    (tmp_path / "r").write_text("mine")
    bad = ["--seq-len", "4096", "--memory-budget", "lots", "--decode-tokens", "0", "--device", "tpu"]
    models = [str(parent), str(tmp_path / "missing")]
    code = main(["eval", *models, "--data", str(data), "--out", str(tmp_path / "r"), *bad])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    for expect in (
        "--seq-len 4096 exceeds the 128 positions",
        "--memory-budget 'lots' is not a size",
        "--decode-tokens 0 must be at least 1",
        "unknown --device 'tpu'",
        "MODEL not found: ",
        f"{tmp_path / 'r'} exists and is not a folder",
    ):
        assert expect in err, expect
    assert (tmp_path / "r").read_text() == "mine"


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--generate", "word " * 200], "--generate prompt 1 is "),
        (["--generate", "Hello", "word " * 10, "--generate-tokens", "100"], "lower --generate-tokens to "),
        (["--generate", "--generate-tokens", "1000000000"], "--generate-tokens 1,000,000,000 after the "),
    ],
)
def test_generation_must_fit_in_the_models_positions(lm_pair, tmp_path, capsys, no_model_loaded, args, expect):
    """A 50,000-token prompt for a 512-position model was accepted and ran for minutes (a stop took 18 s: the
    prompt is one forward pass, and Python acts on a signal only between torch's operations); --generate-tokens
    1000000000 generated past the positions. Both are refused from the tokenizer alone, before any model."""
    root, parent, data = lm_pair
    code = main(["eval", str(parent), "--data", str(data), "--out", str(tmp_path / "r"), "--seq-len", "32", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expect in err and "positions of " in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_requested_without_a_gpu(lm_pair, tmp_path, capsys):
    root, parent, data = lm_pair
    code = main(["eval", str(parent), "--data", str(data), "--out", str(tmp_path / "r"), "--device", "cuda"])
    assert code == 2 and "no CUDA GPU is available; use --device cpu" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_bad_models_and_data(lm_pair, tmp_path, capsys):
    root, parent, data = lm_pair
    (tmp_path / "empty.txt").write_text("  \n\n ")
    cases = [
        ([str(parent), str(tmp_path / "missing")], str(data), "MODEL not found: " + str(tmp_path / "missing")),
        ([str(parent)], str(tmp_path / "nothing.txt"), "no such file or folder"),
        ([str(parent)], str(tmp_path / "empty.txt"), "holds no text"),
    ]
    for models, data_arg, expect in cases:
        capsys.readouterr()
        code = main(["eval", *models, "--data", data_arg, "--out", str(tmp_path / "r"), "--seq-len", "32"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and expect in err, err
        assert not (tmp_path / "r").exists()


def test_models_with_different_tokenizers_are_flagged(lm_pair, tmp_path):
    root, parent, data = lm_pair
    other = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=300, seed=3), tmp_path / "other")
    report = gqaify.evaluate(
        [str(parent), str(other)], str(data), tmp_path / "r", EvalSettings(seq_len=32, speed=False, progress=False)
    )
    assert report.models[0].tokenizer != report.models[1].tokenizer
    assert report.models[1].diagnostics is None
    assert any("different tokenizers" in note for note in report.notes)


def test_max_tokens_cuts_the_text_once_when_tokenizers_differ(lm_pair, tmp_path):
    """The parent's first N tokens set the span; a model with another tokenizer reads the same characters, so
    its word perplexity and bits per byte are comparable (they used to cover different text)."""
    from transformers import AutoTokenizer

    root, parent, data = lm_pair
    other = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=260, seed=3), tmp_path / "other")
    settings = EvalSettings(seq_len=32, speed=False, progress=False, max_tokens=60)
    first, second = gqaify.evaluate([str(parent), str(other)], str(data), tmp_path / "r", settings).models
    span = CORPUS[: AutoTokenizer.from_pretrained(parent)(CORPUS, return_offsets_mapping=True)["offset_mapping"][59][1]]
    expected = (len(span.split()), len(span.encode()))
    assert (first.words, first.text_bytes) == (second.words, second.text_bytes) == expected
    other_ids = AutoTokenizer.from_pretrained(other)(span)["input_ids"]
    assert len(other_ids) != 60 and second.tokens_scored == len(other_ids) - math.ceil(len(other_ids) / 32)


def test_cli_prints_the_table(lm_pair, tmp_path, capsys):
    root, parent, data = lm_pair
    args = [
        "eval",
        str(parent),
        str(root / "gqa2"),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "r"),
        "--seq-len",
        "32",
        "--no-speed",
        "-q",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "kv heads" in out and "gqa2" in out and "report.md" in out


def test_save_with_tokenizer_round_trips(tmp_path):
    from transformers import AutoTokenizer

    directory = save_with_tokenizer(build_model("llama", vocab_size=320), tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.decode(tokenizer("The quick brown fox").input_ids) == "The quick brown fox"


def test_a_decode_context_past_the_positions_is_shortened_and_said(lm_pair, tmp_path):
    root, parent, data = lm_pair
    s = EvalSettings(seq_len=32, decode_context=100_000, decode_tokens=4, decode_batch=2, repeats=1, progress=False)
    report = gqaify.evaluate([str(parent)], str(data), tmp_path / "r", s)
    text = (tmp_path / "r" / "report.md").read_text()
    assert "| decode tok/s @124 ctx |" in text and "after a 124-token prefill" in text  # 124 + 4 = the 128 positions
    assert report.notes == [
        f"decode speed measured after a 124-token prefill, not --decode-context 100,000: with --decode-tokens 4 it "
        f"fills the 128 positions of {parent}"
    ]


class _Clocked(torch.nn.Module):
    """A stand-in model whose forward passes cost fake seconds on a shared clock and say who ran, in order."""

    def __init__(self, name: str, prefill_s: float, step_s: float, clock: list[float], log: list[str]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.name, self.prefill_s, self.step_s, self.clock, self.log = name, prefill_s, step_s, clock, log

    def forward(self, ids, past_key_values=None, use_cache=True, logits_to_keep=None):
        first = past_key_values is None
        if first:
            self.log.append(self.name)
        self.clock[0] += self.prefill_s if first else self.step_s
        return types.SimpleNamespace(logits=torch.zeros(ids.shape[0], 1, 8), past_key_values="cache")


def test_speed_times_the_models_in_turns_after_one_warm_up_each():
    """Parent and conversion alternate (each warmed up once first), so a load that comes and goes falls on both;
    every run is kept. Fake seconds: A prefills 6 tokens x batch 2 in 1 s and decodes a token in 0.5 s, B in 2 s
    and 0.25 s, so their rates are exact."""
    from gqaify.eval.speed import timed_in_turns

    clock, log = [0.0], []
    a, b = _Clocked("A", 1.0, 0.5, clock, log), _Clocked("B", 2.0, 0.25, clock, log)
    ids = torch.arange(6)
    speed_a, speed_b = timed_in_turns([(a, ids), (b, ids)], 2, 4, 3, clock=lambda: clock[0])
    assert log == ["A", "B", "A", "B", "A", "B", "A", "B"]
    assert speed_a.decode.runs == [4.0] * 3 and speed_b.decode.runs == [8.0] * 3  # 2 x 4 tokens / (4 x step)
    assert speed_a.prefill.runs == [12.0] * 3 and speed_b.prefill.runs == [6.0] * 3  # 2 x 6 tokens / prefill
    assert (speed_a.batch, speed_a.context, speed_a.new_tokens) == (2, 6, 4)


def test_speed_cell_says_not_resolved_where_the_spreads_overlap():
    from gqaify.eval.report import decode_cell
    from gqaify.eval.results import Spread

    def row(spread, parent=None):
        median = None if spread is None else spread.median
        return types.SimpleNamespace(decode_tokens_per_s=median, decode_spread=spread, parent_decode_spread=parent)

    parent = Spread.of([23.1, 25.0, 24.2, 24.0, 24.5])
    assert (parent.low, parent.median, parent.high) == (23.1, 24.2, 25.0)
    assert decode_cell(row(parent)) == "24.2 (23.1–25.0)"
    overlapping = Spread.of([22.0, 27.1, 24.8, 26.0, 23.0])
    assert decode_cell(row(overlapping, parent)) == "not resolved (22.0–27.1 vs parent 23.1–25.0)"
    apart = Spread.of([25.5, 26.8, 26.1, 26.3, 25.9])  # every run faster than every run of the parent
    assert decode_cell(row(apart, parent)) == "26.1 (25.5–26.8)"
    slower = Spread.of([5.4, 5.1, 5.6])
    assert decode_cell(row(slower, parent)) == "5.4 (5.1–5.6)"
    touching = Spread.of([25.0, 26.0])  # its slowest run equals the parent's fastest: not told apart
    assert decode_cell(row(touching, parent)).startswith("not resolved")
    before = types.SimpleNamespace(decode_tokens_per_s=24.25, decode_spread=None, parent_decode_spread=None)
    assert decode_cell(before) == "24.2" and decode_cell(row(None)) == "—"  # a report without runs; --no-speed


def test_speed_spreads_are_stored_and_read_back_and_older_reports_still_read(lm_pair, tmp_path, monkeypatch):
    """The parent is timed in turns beside each model; its row pools those turns. report.json keeps every run and
    reads back typed; a report written before the runs were kept reads back too, its cell the bare median.

    The clock is a counter that every reading advances by one second, so that each prefill and each decode lasts
    exactly one second: a run decodes batch x decode_tokens tokens per second, and prefills batch x context."""
    import functools
    import itertools

    import gqaify.eval.core as core
    from gqaify.eval.report import format_table, markdown
    from gqaify.eval.results import ModelReport, Report, Spread, TextInfo
    from gqaify.eval.speed import timed_in_turns
    from gqaify.records import from_json

    seconds = itertools.count()
    monkeypatch.setattr(core, "timed_in_turns", functools.partial(timed_in_turns, clock=lambda: float(next(seconds))))
    root, parent, data = lm_pair
    report = gqaify.evaluate(
        [str(parent), str(root / "gqa2"), str(root / "same")], str(data), tmp_path / "r", replace(FAST, repeats=3)
    )
    parent_r, gqa2, same = report.models
    one = 1 * FAST.decode_tokens / 1.0  # one sequence, 4 tokens in one second
    assert gqa2.decode_spread.runs == same.decode_spread.runs == [one] * 3  # repeats=3
    assert gqa2.parent_decode_spread.runs == same.parent_decode_spread.runs == [one] * 3  # the parent beside each
    assert parent_r.decode_spread.runs == [one] * 6 and parent_r.parent_decode_spread is None  # both turns, pooled
    assert [m.decode_tokens_per_s for m in report.models] == [4.0] * 3
    assert [m.decode_tokens_per_s_batched for m in report.models] == [FAST.decode_batch * 4.0] * 3
    assert [m.prefill_tokens_per_s for m in report.models] == [FAST.decode_context * 1.0] * 3

    loaded = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [from_json(ModelReport, m) for m in loaded["models"]] == report.models
    for m in loaded["models"]:
        del m["decode_spread"], m["parent_decode_spread"]
    older = [from_json(ModelReport, m) for m in loaded["models"]]
    assert [m.decode_spread for m in older] == [None] * 3
    older_report = Report([from_json(TextInfo, t) for t in loaded["data"]], loaded["settings"], older)
    assert "| 4.0 |" in markdown(older_report)

    gqa2.decode_spread = Spread.of([1e-3, 1e9])  # overlaps any parent's: said so, in the table and its note
    text = format_table(report)
    assert (
        "not resolved (0.0–1,000,000,000.0 vs parent 4.0–4.0)" in text
        and "note: decode tok/s: the median (slowest–fastest)" in text
    )
    assert "timed in turns with the parent's" in markdown(report)


def test_a_panel_without_kl_shows_a_dash_for_it():
    """PanelSummary holds None KL where a score has none; the panel's rows formatted it with :.3f (TypeError)."""
    from gqaify.eval.report import panel_rows
    from gqaify.eval.results import PanelSummary, TextScore

    def scores(perplexities, parents):
        return [
            TextScore(name, 10, 1.0, p, 2.0, 0.5, 5, 20, None if q is None else p / q, None)
            for name, p, q in zip(["a", "b"], perplexities, parents, strict=True)
        ]

    parent_scores, model_scores = scores([4.0, 5.0], [None, None]), scores([5.0, 8.0], [4.0, 5.0])
    models = [
        types.SimpleNamespace(model=f"x/{name}", texts=texts, panel=PanelSummary.of(texts))
        for name, texts in [("parent", parent_scores), ("gqa", model_scores)]
    ]
    assert models[1].panel.mean_kl_to_parent is None
    report = types.SimpleNamespace(
        data=[types.SimpleNamespace(name="a"), types.SimpleNamespace(name="b")], models=models
    )
    assert panel_rows(report) == [
        ["text", "tokens", "parent", "gqa"],
        ["a", "10", "4.00", "5.00 (1.25×, KL —)"],
        ["b", "10", "5.00", "8.00 (1.60×, KL —)"],
        ["mean", "", "—", "1.43×, KL —"],
        ["worst", "", "—", "1.60× (b), KL —"],
    ]


def test_a_model_timed_alone_is_described_as_timed_alone(lm_pair, tmp_path):
    """report.md said every decode figure was timed in turns with the parent's, even for one model timed alone."""
    from gqaify.eval.report import markdown

    root, parent, data = lm_pair
    report = gqaify.evaluate([str(parent)], str(data), tmp_path / "r", replace(FAST, repeats=2))
    text = markdown(report)
    assert "the median (slowest–fastest) of the model's 2 runs, timed alone." in text
    assert "in turns" not in text and "not resolved" not in text
    assert len(report.models[0].decode_spread.runs) == 2


def test_a_nan_score_is_null_in_report_json(lm_pair, tmp_path):
    """A diverged model's perplexity is NaN; report.json held a bare NaN, which is not JSON."""
    from gqaify.eval.report import write_report

    root, parent, data = lm_pair
    report = gqaify.evaluate([str(parent)], str(data), tmp_path / "r", replace(FAST, speed=False))
    report.models[0].perplexity = report.models[0].texts[0].perplexity = float("nan")
    report.models[0].nll = float("inf")
    write_report(report, tmp_path / "again")

    def no_constant(name):
        raise AssertionError(f"report.json holds {name}")

    loaded = json.loads((tmp_path / "again" / "report.json").read_text(), parse_constant=no_constant)
    assert loaded["models"][0]["perplexity"] is None and loaded["models"][0]["nll"] is None
    assert loaded["models"][0]["texts"][0]["perplexity"] is None
    assert "nan" in (tmp_path / "again" / "report.md").read_text()
