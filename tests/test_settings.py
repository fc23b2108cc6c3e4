"""One way to configure every stage: the same fields from a --config file, options and keyword arguments;
gqaify.json and report.json rerun what made them; --help lists every field; bad settings exit 2 in one line."""

import dataclasses
import json
import os

import pytest
import yaml

import gqaify
from conftest import CORPUS, build_model, save, save_with_tokenizer
from gqaify.cli import main
from gqaify.conversion.options import CONVERT, NOT_RECORDED, ConvertSettings
from gqaify.eval.settings import EVAL
from gqaify.settings import parse
from gqaify.uptrain.settings import UPTRAIN
from test_errors import run_cli

STAGES = [CONVERT, EVAL, UPTRAIN]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A GQA-4 llama in several shards, with a tokenizer (calibration reads text)."""
    model = build_model("llama", num_kv_heads=4, num_attention_heads=8, head_dim=8, vocab_size=300)
    directory = save_with_tokenizer(model, tmp_path_factory.mktemp("src") / "model")
    save(model, directory, "30KB")
    return directory


def test_every_field_is_an_option_with_its_help(capsys):
    for stage in STAGES:
        capsys.readouterr()
        assert main([stage.command, "--help"]) == 0
        shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        for field in dataclasses.fields(stage.settings):
            assert f"--{field.name}" in shown, (stage.command, field.name)
            assert " ".join(field.metadata["help"].split()[:4]) in shown, (stage.command, field.name)


def test_a_file_options_and_keywords_give_the_same_settings(tmp_path):
    values = {"src": "org/model", "out": "o", "kv_heads": 2, "method": "lsq", "calib_data": "c.txt",
              "calib_tokens": 4096, "dtype": "bfloat16", "force": True, "progress": False}  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(values))
    options = ["org/model", "o", "--kv-heads", "2", "--method", "lsq", "--calib_data", "c.txt", "--calib-tokens",
               "4096", "--dtype", "bfloat16", "--force", "-q"]  # fmt: skip
    assert parse(CONVERT, ["--config", str(tmp_path / "c.yaml")]) == ConvertSettings(**values)
    assert parse(CONVERT, options) == ConvertSettings(**values)


def test_the_command_line_wins_over_the_file(tmp_path):
    (tmp_path / "c.yaml").write_text("src: a\nout: b\nkv_heads: 1\nmethod: first\nprogress: false\n")
    settings = parse(CONVERT, ["--config", str(tmp_path / "c.yaml"), "--kv-heads", "2", "--progress", "x", "y"])
    assert (settings.src, settings.out, settings.kv_heads, settings.method) == ("x", "y", 2, "first")
    assert settings.progress is True


def test_a_flag_before_the_positionals_takes_no_value():
    settings = parse(EVAL, ["--trust-remote-code", "--no-speed", "p", "c", "--data", "d", "--out", "r"])
    assert settings.models == ["p", "c"] and settings.trust_remote_code and not settings.speed


@pytest.mark.parametrize(
    ("stage", "text", "expect"),
    [
        (CONVERT, "src: a\nout: b\nkv_head: 2\n", "unknown key 'kv_head' (did you mean kv_heads?)"),
        (CONVERT, "src: a\nout: b\nkv_heads: two\n", "c.yaml: kv_heads 'two' is not a whole number or empty"),
        (CONVERT, "src: a\nout: b\nkv_heads: 2\nmethod: median\n", "method 'median' is not one of mean, first"),
        (CONVERT, "- a\n- b\n", "must be a mapping of setting: value"),
        (CONVERT, "src: [a\n", "is not valid YAML (line 2)"),
        (EVAL, "models: p\ndata: d\nout: r\n", "models 'p' is not a list of text"),
        (EVAL, "data: d\n", "MODEL is required"),
        (UPTRAIN, "learning_rate: 1.0e-4\n", "unknown key 'learning_rate' (did you mean lr?)"),
    ],
)
def test_bad_files_are_refused_in_one_line(capsys, tmp_path, stage, text, expect):
    (tmp_path / "c.yaml").write_text(text)
    code, err = run_cli(capsys, stage.command, "--config", tmp_path / "c.yaml")
    assert code == 2 and err.count("\n") == 1 and expect in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_a_positional_and_its_option_together_are_refused(capsys, tmp_path):
    code, err = run_cli(capsys, "convert", "a", "b", "--src", "c", "--kv-heads", "1")
    assert code == 2 and "SRC and --src both given" in err


def test_a_missing_config_file(capsys, tmp_path):
    code, err = run_cli(capsys, "eval", "--config", tmp_path / "nope.yaml")
    assert code == 2 and "--config" in err and "nope.yaml does not exist" in err


def test_gqaify_json_reruns_the_conversion(capsys, source, tmp_path, monkeypatch):
    """Converted from relative paths in one folder and rerun from another, the record alone reproduces every byte
    of the weights and config, fitted method and calibration text included."""
    (tmp_path / "calib.txt").write_text(CORPUS * 4)
    first = tmp_path / "first"
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(capsys, "convert", os.path.relpath(source), "first", "--kv-heads", "2", "--method", "lsq",
                        "--calib-data", "calib.txt", "--calib-tokens", "1024", "--calib-seq-len", "48",
                        "--dtype", "bfloat16", "--max-shard-size", "20KB", "-q")  # fmt: skip
    assert code == 0, err
    record = json.loads((first / "gqaify.json").read_text())
    assert record["settings"]["src"] == str(source.resolve()) and record["settings"]["out"] == str(first.resolve())
    assert record["settings"]["calib_data"] == str((tmp_path / "calib.txt").resolve())
    assert not NOT_RECORDED & set(record["settings"])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, err = run_cli(capsys, "convert", "--config", first / "gqaify.json", "--out", "second", "-q")
    assert code == 0, err
    second = elsewhere / "second"
    weights = sorted(p.name for p in first.iterdir() if p.suffix in (".safetensors", ".json"))
    weights.remove("gqaify.json")
    assert len(weights) > 3  # several shards, the index, config.json
    for name in weights:
        assert (second / name).read_bytes() == (first / name).read_bytes(), name
    again = json.loads((second / "gqaify.json").read_text())
    assert {**again["settings"], "out": None} == {**record["settings"], "out": None}
    assert again["fit_error"] == record["fit_error"]


def test_rerunning_into_the_same_folder_needs_force(capsys, source, tmp_path):
    out = tmp_path / "out"
    assert run_cli(capsys, "convert", source, out, "--kv-heads", "1", "-q")[0] == 0
    code, err = run_cli(capsys, "convert", "--config", out / "gqaify.json", "-q")
    assert code == 2 and "--force" in err
    before = (out / "model.safetensors").read_bytes()
    assert run_cli(capsys, "convert", "--config", out / "gqaify.json", "--force", "-q")[0] == 0
    assert (out / "model.safetensors").read_bytes() == before


def test_report_json_reruns_the_evaluation(capsys, tmp_path):
    parent = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=300), tmp_path / "parent")
    (tmp_path / "text.txt").write_text(CORPUS)
    code, err = run_cli(capsys, "eval", parent, "--data", tmp_path / "text.txt", "--out", tmp_path / "r",
                        "--seq-len", "32", "--no-speed", "-q")  # fmt: skip
    assert code == 0, err
    code, err = run_cli(capsys, "eval", "--config", tmp_path / "r" / "report.json", "--out", tmp_path / "again")
    assert code == 0, err
    first, again = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("r", "again"))
    assert again["settings"] == {**first["settings"], "out": str(tmp_path / "again")}
    assert again["models"][0]["perplexity"] == first["models"][0]["perplexity"]


def test_python_keywords_are_the_settings_fields(source, tmp_path):
    result = gqaify.convert(source, tmp_path / "out", 2, method="norm-mean", dtype="float16", progress=False)
    record = json.loads((tmp_path / "out" / "gqaify.json").read_text())
    assert result.kv_heads == 2 and record["settings"]["method"] == "norm-mean"
    assert record["settings"]["dtype"] == "float16"
    with pytest.raises(TypeError, match="calibration"):
        gqaify.convert(source, tmp_path / "other", 2, calibration="text.txt")
