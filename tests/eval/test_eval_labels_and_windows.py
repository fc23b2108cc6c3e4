"""gqaify eval: a GGUF shares its parent's tokenizer by what it does, models named by the shortest distinct ending of
their paths, the window length from the models' positions, and report.md naming the text of each figure."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

import gqaify
from gqaify.entry.cli import main
from gqaify.eval.results import model_labels
from gqaify.eval.settings import EvalSettings
from gqaify.testing import CORPUS, build_model, save
from helpers import one_line_refusal

QUICK = EvalSettings(seq_len=32, speed=False, progress=False)
FAST = ["--seq-len", "32", "--no-speed", "-q"]


def save_with_llama_vocabulary(directory: Path) -> Path:
    """A tiny random Llama (4 K/V heads) with a SentencePiece vocabulary trained here on CORPUS, as a Llama checkpoint
    holds one: tokenizer.model (what a GGUF's vocabulary is written from) and a tokenizer.json whose merges that make
    the same token are ordered as transformers 4 wrote them (the left part's id first), where transformers 5, reading
    the GGUF, orders them otherwise (the longer left part first): two files, one way of reading text."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    trained = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split(". ")),
        model_writer=trained,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    pieces = spm.SentencePieceProcessor(model_proto=trained.getvalue())
    vocab = {pieces.id_to_piece(i): i for i in range(pieces.get_piece_size())}
    merges = sorted(
        ((p[:k], p[k:]) for p in vocab for k in range(1, len(p)) if p[:k] in vocab and p[k:] in vocab),
        key=lambda merge: (vocab[merge[0] + merge[1]], vocab[merge[0]], vocab[merge[1]]),
    )
    save(build_model("llama", num_kv_heads=4, vocab_size=len(vocab)), directory)
    (directory / "tokenizer.model").write_bytes(trained.getvalue())
    LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_vocabulary(tmp_path_factory) -> dict[str, Path]:
    """The parent above, its GQA-2 conversion as safetensors and as an f32 GGUF, and a text."""
    root = tmp_path_factory.mktemp("gguf-eval")
    parent = save_with_llama_vocabulary(root / "parent")
    for out, extra in (("gqa2", []), ("gqa2.gguf", ["--gguf-type", "f32"])):
        assert main(["convert", str(parent), str(root / out), "--kv-heads", "2", "-q", *extra]) == 0
    (root / "eval.txt").write_text(CORPUS[:600])
    return {"parent": parent, "folder": root / "gqa2", "gguf": root / "gqa2.gguf", "data": root / "eval.txt"}


def test_a_gguf_is_compared_with_its_parent_as_the_safetensors_it_was_written_from(llama_vocabulary, tmp_path):
    """The GGUF's tokenizer, rebuilt by transformers from its vocabulary, is serialized otherwise than the parent's
    tokenizer.json, and reads every text alike: its ratio, KL and diagnostics are those of the safetensors (they were
    "—", the tokenizers compared by a hash of their files)."""
    from gqaify.model.loading import load_tokenizer

    v = llama_vocabulary
    files = [load_tokenizer(str(v[name])).backend_tokenizer.to_str() for name in ("parent", "gguf")]
    assert files[0] != files[1]  # the case: two files
    models = [str(v[name]) for name in ("parent", "folder", "gguf")]
    report = gqaify.evaluate(models, str(v["data"]), tmp_path / "r", QUICK)
    parent, folder, gguf = report.models
    assert parent.tokenizer == folder.tokenizer == gguf.tokenizer
    assert not any("different tokenizers" in note for note in report.notes)
    assert gguf.tokens_scored == folder.tokens_scored
    assert gguf.perplexity == pytest.approx(folder.perplexity, rel=1e-5)
    assert gguf.texts[0].ratio_to_parent == pytest.approx(folder.texts[0].ratio_to_parent, rel=1e-5)
    assert gguf.texts[0].kl_to_parent == pytest.approx(folder.texts[0].kl_to_parent, rel=1e-4)
    assert gguf.panel is not None and gguf.diagnostics is not None
    assert gguf.diagnostics.kl_nats_per_token == pytest.approx(folder.diagnostics.kl_nats_per_token, rel=1e-4)


def test_model_labels_are_the_shortest_distinct_endings_of_their_paths():
    assert model_labels(["runs/up1/final"]) == ["final"]
    assert model_labels(["base", "/x/runs/up1/final", "/x/runs/up2/final", "out.gguf"]) == [
        "base",
        "up1/final",
        "up2/final",
        "out.gguf",
    ]
    assert model_labels(["a/b/final", "c/b/final"]) == ["a/b/final", "c/b/final"]
    assert model_labels(["org/model", "model"]) == ["org/model", "model"]
    assert model_labels(["same/final", "same/final"]) == ["same/final", "same/final"]  # given twice: whole


@pytest.fixture(scope="module")
def two_runs(tiny, tmp_path_factory) -> dict:
    """`gqaify eval PARENT runs/up1/final runs/up2/final` on a panel of two texts, windows of 32 tokens, as the
    command line runs it (what it printed kept)."""
    root = tmp_path_factory.mktemp("two-runs")
    finals = [root / "runs" / run / "final" for run in ("up1", "up2")]
    for final in finals:
        shutil.copytree(tiny["converted"], final)
    (root / "verse.txt").write_text(" ".join(reversed(CORPUS.split()))[:600])
    out = root / "report"
    data = [f"prose={tiny['eval']}", f"verse={root / 'verse.txt'}"]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        code = main(["eval", str(tiny["parent"]), *map(str, finals), "--data", *data, "--out", str(out), *FAST])
    report = json.loads((out / "report.json").read_text()) if code == 0 else None
    return {"code": code, "out": out, "report": report, "printed": printed.getvalue()}


def test_models_of_one_folder_name_are_told_apart_in_every_table(two_runs):
    assert two_runs["code"] == 0
    md = (two_runs["out"] / "report.md").read_text()
    assert "| text | tokens | parent | up1/final | up2/final |" in md
    assert "| final |" not in md
    panel = two_runs["printed"].split("perplexity by text")[1].splitlines()[1]  # the terminal's panel header
    assert panel.split() == ["text", "tokens", "parent", "up1/final", "up2/final"]


def test_the_report_says_only_what_it_measured_and_names_models_as_the_panel_does(two_runs):
    """With --no-speed, report.md explained a decode measurement and kept empty speed columns; its tables named
    models by full path where the panel's names them by their shortest distinct ending; the KV bytes measured
    (a window's) stood beside bytes per token without saying of how many tokens; a .txt was described with a split
    and a column it does not have."""
    assert two_runs["code"] == 0
    md = (two_runs["out"] / "report.md").read_text()
    assert "decode" not in md.lower() and "prefill" not in md and "Speed was not measured (--no-speed)." in md
    rows = [line.split(" | ")[0] for line in md.splitlines() if line.startswith("| ") and "KV" not in line]
    assert rows[:3] == rows[3:6] == ["| parent", "| up1/final", "| up2/final"]  # the main table, then the second
    printed = [line.split()[0] for line in two_runs["printed"].splitlines()[2:5]]
    assert printed == ["parent", "up1/final", "up2/final"] and "decode" not in two_runs["printed"]
    assert "| KV bytes of a 32-token window, measured = analytic |" in md
    prose = two_runs["report"]["data"][0]
    assert f"(a text file of {prose['characters']:,} characters)" in md and "column `text`" not in md


def test_seq_len_defaults_to_the_models_positions(tiny, tmp_path):
    """The default used to be 2,048 whatever the models, refused for a model of fewer positions."""
    out = tmp_path / "r"
    models = [str(tiny["parent"]), str(tiny["converted"])]
    assert main(["eval", *models, "--data", str(tiny["eval"]), "--out", str(out), "--no-speed", "-q"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert (report["settings"]["seq_len"], report["settings"]["stride"]) == (64, 64)  # the models' positions
    assert "Windows of 64 tokens, stride 64" in (out / "report.md").read_text()
    assert report["models"][1]["diagnostics"]["tokens"] == 64  # --diag-tokens 512, at most one window


def test_report_names_the_text_of_its_perplexity_and_of_the_diagnostics_kl(two_runs):
    """The main table's perplexity is the first text's, and the diagnostics' KL is on its first 32 tokens (one
    window): each says so, beside the panel's KL over every token scored."""
    assert two_runs["code"] == 0
    md = (two_runs["out"] / "report.md").read_text()
    assert "| model | kv heads | ppl (prose) | Δppl |" in md
    assert two_runs["printed"].splitlines()[0].split()[:4] == ["model", "kv", "heads", "ppl"]
    assert "ppl (prose)" in two_runs["printed"].splitlines()[0]
    assert "| KL to parent on the first 32 tokens of prose only (nats/token) |" in md
    assert "over every token scored" in md
    diagnostics = [m["diagnostics"] for m in two_runs["report"]["models"][1:]]
    assert all(d is not None and d["tokens"] == 32 for d in diagnostics)


def _without_weights(tiny, folder: Path) -> Path:
    """The tiny conversion with every weights file replaced by bytes no loader reads: only its config is sound."""
    shutil.copytree(tiny["converted"], folder)
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"not weights")
    return folder


def test_a_seq_len_past_a_models_positions_is_refused_from_its_config_alone(tiny, tmp_path, capsys):
    broken = _without_weights(tiny, tmp_path / "broken")
    out = tmp_path / "r"
    common = ["eval", tiny["parent"], broken, "--data", tiny["eval"], "--out", out, "--no-speed"]
    err = one_line_refusal(capsys, *common, "--seq-len", "4096")
    assert "--seq-len 4096 exceeds the 64 positions" in err and "could not be loaded" not in err
    err = one_line_refusal(capsys, *common, "--stride", "100")
    assert "--stride 100 exceeds the 64-token windows" in err and "lower --stride" in err
    assert not out.exists()
