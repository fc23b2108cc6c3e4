"""What a user meets in the first hour: the default conversion says what it costs a trained model, and a wheel user
can reach the tested versions and is told exactly which package a GGUF's vocabulary lacks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import gqaify
from gqaify.conversion.core import convert
from gqaify.entry.cli import main
from gqaify.testing import CORPUS, build_model, duplicate_kv_heads, save, save_with_tokenizer
from helpers import REPO, one_line, run_cli

ADVICE = "--method lsq --calib-data TEXT"


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("gqaify")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny MHA Llama (4 K/V heads, each its own) with a tokenizer, and calibration text."""
    root = tmp_path_factory.mktemp("first-hour")
    src = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), root / "parent")
    (root / "calib.txt").write_text(CORPUS * 4)
    return {"root": root, "src": src, "calib": root / "calib.txt"}


@pytest.mark.parametrize("method", ["first", "random", "norm-mean"])
def test_every_uncalibrated_method_warns_and_the_same_method_calibrated_does_not(trained, tmp_path, caplog, method):
    """Every method that reads no calibration text warns; given --calib-data (the layer-by-layer repair), none."""
    with caplog.at_level(logging.WARNING):
        convert(trained["src"], tmp_path / "plain", 2, method=method, progress=False)
    said = warnings_of(caplog)
    assert len(said) == 1 and f"--method {method} read no calibration text" in said[0] and ADVICE in said[0], said
    caplog.clear()
    calibration = {"calib_data": str(trained["calib"]), "calib_tokens": 1024, "calib_seq_len": 48}
    with caplog.at_level(logging.WARNING):
        convert(trained["src"], tmp_path / "calibrated", 2, method=method, progress=False, **calibration)
    assert not [w for w in warnings_of(caplog) if ADVICE in w], warnings_of(caplog)


def test_a_calibrated_method_says_nothing_where_mean_would_warn(trained, tmp_path, capsys, caplog):
    with caplog.at_level(logging.WARNING):
        code, err = run_cli(capsys, "convert", trained["src"], tmp_path / "mean", "--kv-heads", "2", "-q")
    assert code == 0 and len([w for w in warnings_of(caplog) if ADVICE in w]) == 1, err
    caplog.clear()
    calib = ("--calib-data", trained["calib"], "--calib-tokens", "1024", "--calib-seq-len", "48")
    with caplog.at_level(logging.WARNING):
        code, err = run_cli(
            capsys, "convert", trained["src"], tmp_path / "lsq", "--kv-heads", "2", "--method", "lsq", *calib, "-q"
        )
    assert code == 0 and not [w for w in warnings_of(caplog) if ADVICE in w], (err, warnings_of(caplog))


def test_a_conversion_that_loses_nothing_says_nothing_and_one_that_loses_warns(tmp_path, caplog):
    """Pooling a duplicated-head twin back, or keeping every head (G = KV), changes no head: no warning there."""
    gqa = build_model("llama", num_kv_heads=2)
    save(duplicate_kv_heads(gqa), tmp_path / "twin")
    with caplog.at_level(logging.WARNING):
        convert(tmp_path / "twin", tmp_path / "back", 2, progress=False)
        convert(tmp_path / "twin", tmp_path / "same", 4, progress=False)
    assert warnings_of(caplog) == []
    with caplog.at_level(logging.WARNING):
        convert(tmp_path / "twin", tmp_path / "mqa", 1, progress=False)  # the two groups' heads differ
    said = warnings_of(caplog)
    assert len(said) == 1 and ADVICE in said[0], said


def test_a_run_of_the_ref_mha_recipe_says_nothing_against_its_mean_pooling_which_it_measures(trained, tmp_path, caplog):
    """The ref-mha-6L recipe converts by mean-pooling on purpose (it shows uptraining recover the GQA paper's start),
    and its every run warned that a trained model loses most of its quality. A run that evaluates measures that start
    against the parent and says nothing against it; one that measures nothing keeps the warning."""
    (tmp_path / "eval.txt").write_text(CORPUS[:800])
    src, text = str(trained["src"]), str(trained["calib"])
    small = ["--seq_len", "16", "--micro_batch_size", "2", "--grad_accum", "1", "--max_tokens", "64"]
    small += ["--eval_tokens", "64", "--eval_seq_len", "32", "--save_every", "0", "--no_progress"]
    recipe = ["uptrain", "--recipe", "ref-mha-6L-gqa2", "--model", src, "--distill_from", src, "--data", text, *small]
    for eval_data, warned in ((str(tmp_path / "eval.txt"), 0), ("", 1)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert main([*recipe, "--eval_data", eval_data, "--output_dir", str(tmp_path / f"run{warned}")]) == 0
        assert len([w for w in warnings_of(caplog) if ADVICE in w]) == warned, warnings_of(caplog)
    assert gqaify.uptrain.parse(["--recipe", "ref-mha-6L-gqa2"]).method == "mean"


def test_a_sentencepiece_vocabulary_without_sentencepiece_names_that_package_alone(tmp_path, capsys, monkeypatch):
    """GGUF writing said pip install 'gqaify[serving]' (which builds llama.cpp, minutes) where sentencepiece alone
    (seconds) was missing."""
    import gguf.vocab

    src = tmp_path / "spm"
    save(build_model("llama", num_kv_heads=4, vocab_size=320), src)
    (src / "tokenizer.model").write_bytes(b"")  # refused before it is read: the package is what is missing
    monkeypatch.setattr(gguf.vocab, "SentencePieceProcessor", None)  # what gguf holds when the import failed
    code, err = run_cli(capsys, "convert", src, tmp_path / "out.gguf", "--kv-heads", "2")
    line = one_line(err)
    assert code == 2 and line.endswith("needs the sentencepiece package to write: pip install sentencepiece"), line
    assert "serving" not in line and not (tmp_path / "out.gguf").exists()


def test_gqaify_prints_the_path_of_its_packaged_constraints_which_are_the_repositorys(capsys):
    assert main(["--constraints"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == Path(gqaify.__file__).resolve().parent and path.name == "constraints.txt"
    assert path.read_bytes() == (REPO / "constraints.txt").read_bytes()
    assert "torch==2.13.0" in path.read_text().splitlines()
