"""What a record says is read with care and reruns what wrote it: a corpus record's counts are bounded by the disk
before anything is made of them; generate's and eval's records name local paths absolutely, links resolved, with
the SHA-256 of their texts, which a rerun checks; a corpus of another parent, or corpora nested in one folder, are
refused; and every record reruns its own stage with --config, or is refused naming the command that does."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from gqaify.entry.cli import main
from gqaify.errors import UserError
from gqaify.settings import parse
from gqaify.settings.registry import every_stage
from gqaify.testing import build_model, save_with_tokenizer
from helpers import one_line_refusal, tree_hashes
from helpers import uptrain_args as args

K = 4


@pytest.fixture(scope="module")
def corpus(tiny) -> Path:
    """A corpus of the tiny parent's samples with its top-4: 4 shards of 4 samples."""
    out = tiny["root"] / "corpus"
    argv = ["--tokens", "160", "--length", "12", "--batch-size", "4", "--top-logprobs", str(K), "-q"]
    assert main(["generate", str(tiny["parent"]), str(out), *argv]) == 0
    return out


@pytest.fixture(scope="module")
def run(tiny) -> Path:
    """The output_dir of a finished uptraining of the tiny converted model (2 steps): run.json and final/."""
    out = tiny["root"] / "run"
    assert main(["uptrain", *args(tiny, out, "--max_tokens", "128")]) == 0
    return out


def copy_with_record(corpus: Path, folder: Path, **changes) -> Path:
    """A copy of `corpus` in `folder`, its record's top-level values changed."""
    copy = shutil.copytree(corpus, folder)
    record = json.loads((copy / "gqaify.json").read_text())
    record.update(changes)
    (copy / "gqaify.json").write_text(json.dumps(record, indent=2) + "\n")
    return copy


# -- a corpus record's counts -----------------------------------------------------------------------------------


def test_a_damaged_count_is_one_line_naming_the_record_and_the_fix(corpus, tiny, tmp_path, capsys):
    folder = copy_with_record(corpus, tmp_path / "corpus", shards=-1)
    before = tree_hashes(folder)
    report = tmp_path / "report"
    err = one_line_refusal(
        capsys, "eval", tiny["parent"], "--data", folder, "--split", "train", "--seq-len", "16", "--out", report
    )
    assert f"its record {folder / 'gqaify.json'} says shards -1, which is no count" in err and "damaged" in err
    assert "write the corpus again into an empty OUT (gqaify generate --config" in err
    assert not report.exists() and tree_hashes(folder) == before


# -- paths absolute, texts pinned -------------------------------------------------------------------------------


def two_folders(tmp_path: Path, tiny) -> tuple[Path, Path]:
    """here/ and there/, each with an st.txt of other text; here/p, a link to the tiny parent."""
    here, there = (tmp_path / "here").resolve(), (tmp_path / "there").resolve()
    here.mkdir(), there.mkdir()
    text = tiny["train"].read_text()
    (here / "st.txt").write_text(text)
    (there / "st.txt").write_text(text.replace("fox", "cat").replace("lazy", "idle"))
    (here / "p").symlink_to(tiny["parent"])
    return here, there


def test_generates_record_names_score_data_absolutely_and_a_rerun_checks_its_tokens(
    tiny, tmp_path, monkeypatch, capsys
):
    """`--config sc/gqaify.json` given in another folder scored that folder's st.txt."""
    here, there = two_folders(tmp_path, tiny)
    monkeypatch.chdir(here)
    argv = ["--score-data", "st.txt", "--tokens", "48", "--length", "12", "--batch-size", "2", "--top-logprobs", "4"]
    assert main(["generate", "p", "sc", *argv, "-q"]) == 0
    record = json.loads((here / "sc" / "gqaify.json").read_text())
    assert record["settings"]["score_data"] == [str(here / "st.txt")]
    assert record["settings"]["model"] == str(tiny["parent"].resolve())  # the link resolved
    assert record["settings"]["score_sha256"] == record["score_sha256"]
    monkeypatch.chdir(there)
    assert main(["generate", "--config", str(here / "sc" / "gqaify.json"), "--out", "again", "-q"]) == 0
    assert tree_hashes(there / "again" / "data") == tree_hashes(here / "sc" / "data")
    (here / "st.txt").write_text((there / "st.txt").read_text())
    err = one_line_refusal(capsys, "generate", "--config", here / "sc" / "gqaify.json", "--out", "third")
    assert f"--score-data {here / 'st.txt'}: the text changed since the recorded corpus" in err
    assert "pass --score-sha256 '' to score with the text as it is now" in err
    assert not (there / "third").exists()


def test_evals_report_names_its_paths_absolutely_and_a_rerun_checks_its_text(tiny, tmp_path, monkeypatch, capsys):
    """`gqaify eval --config r1b/report.json` from another folder evaluated other text under the same name."""
    here, there = two_folders(tmp_path, tiny)
    monkeypatch.chdir(here)
    assert main(["eval", "p", "--data", "st.txt", "--out", "r1b", "--seq-len", "16", "--no-speed", "-q"]) == 0
    first = json.loads((here / "r1b" / "report.json").read_text())
    settings = first["settings"]
    assert settings["models"] == [str(tiny["parent"].resolve())]
    assert settings["data"] == [str(here / "st.txt")] and settings["out"] == str(here / "r1b")
    assert settings["data_sha256"] == hashlib.sha256((here / "st.txt").read_bytes()).hexdigest()
    monkeypatch.chdir(there)
    assert main(["eval", "--config", str(here / "r1b" / "report.json"), "--out", "r2", "-q"]) == 0
    again = json.loads((there / "r2" / "report.json").read_text())
    assert again["models"][0]["perplexity"] == first["models"][0]["perplexity"]
    (here / "st.txt").write_text((there / "st.txt").read_text())
    err = one_line_refusal(capsys, "eval", "--config", here / "r1b" / "report.json", "--out", "r3")
    assert f"--data {here / 'st.txt'}: the text changed since the recorded evaluation" in err
    assert "pass --data-sha256 '' to evaluate with the text as it is now" in err
    assert not (there / "r3").exists()


# -- another parent's corpus ------------------------------------------------------------------------------------


def test_a_corpus_of_another_vocabulary_is_refused(corpus, tiny, tmp_path, capsys):
    """A model of 640 tokens trained on the stored ids of a 320-token parent: every id was below 640."""
    wide = save_with_tokenizer(build_model("llama", num_kv_heads=2, vocab_size=640), tmp_path / "wide")
    out = tmp_path / "run"
    argv = args(tiny, out, "--model", wide, "--data", corpus, "--distill_from_data", "--distill_weight", "1")
    err = one_line_refusal(capsys, "uptrain", *argv)
    assert f"data {corpus} was written by {tiny['parent'].resolve()}, whose vocabulary has 320 tokens" in err
    assert "has 640" in err and "generate the corpus from the model's parent" in err
    assert not out.exists()


def test_a_corpus_of_another_parent_than_the_runs_is_refused(corpus, tiny, tmp_path, capsys):
    from gqaify.uptrain.checks import check_inputs
    from gqaify.uptrain.settings import parse as parse_uptrain

    other = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320, seed=1), tmp_path / "other")
    out = tmp_path / "run"
    stored = ("--data", str(corpus), "--distill_from_data", "--distill_weight", "1")
    err = one_line_refusal(capsys, "uptrain", *args(tiny, out, *stored, "--parent", other))
    parent = tiny["parent"].resolve()
    assert f"was written by {parent}, and the run's parent is {other}" in err
    assert f"generate the corpus from {other}, or set parent {parent}" in err
    assert not out.exists()
    check_inputs(parse_uptrain(args(tiny, out, *stored, "--parent", str(tiny["parent"]))))  # its own parent: taken


def test_corpora_nested_in_one_folder_are_refused_by_every_reader(corpus, tiny, tmp_path, capsys):
    """Read as loose files, two corpora in one folder passed by the one-corpus, length and completeness checks."""
    nest = tmp_path / "nest"
    shutil.copytree(corpus, nest / "a")
    copy_with_record(corpus, nest / "b", complete=False)
    before = tree_hashes(nest)
    report = tmp_path / "report"
    data = ("--data", nest, "--split", "train", "--seq-len", "16")
    err = one_line_refusal(capsys, "eval", tiny["parent"], *data, "--out", report)
    assert f"--data {nest} holds 2 corpora ({nest / 'a'} first)" in err and "name the corpus folder" in err
    out = tmp_path / "run"
    argv = args(tiny, out, "--data", nest, "--distill_from_data", "--distill_weight", "1")
    err = one_line_refusal(capsys, "uptrain", *argv)
    assert f"data {nest} holds 2 corpora" in err
    assert not report.exists() and not out.exists() and tree_hashes(nest) == before


# -- every kind, read and rerun ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def records(tiny, run, corpus) -> dict[Path, str]:
    """Each kind of record this gqaify writes: the command that reruns it."""
    report = tiny["root"] / "report"
    argv = ["--data", str(tiny["eval"]), "--out", str(report), "--seq-len", "16", "--no-speed", "-q"]
    assert main(["eval", str(tiny["parent"]), *argv]) == 0
    return {
        tiny["converted"] / "gqaify.json": "convert",
        corpus / "gqaify.json": "generate",
        report / "gqaify.json": "eval",
        report / "report.json": "eval",
        run / "run.json": "uptrain",
        run / "final" / "gqaify.json": "uptrain",
    }


def test_every_record_is_read_by_its_own_stage_and_refused_by_the_others(records):
    """run.json failed with "unknown key 'processes'"; final/gqaify.json (kind uptrained) was called a conversion
    record and sent to gqaify convert."""
    for file, own in records.items():
        for stage in every_stage():
            if stage.command == own:
                parse(stage, ["--config", str(file)])
                continue
            with pytest.raises(UserError) as refused:
                parse(stage, ["--config", str(file)])
            assert f"not {stage.command}'s; use `gqaify {own} --config {file}`" in str(refused.value), file


@pytest.mark.parametrize("name", ["run.json", "final/gqaify.json"])
def test_an_uptrainings_records_rerun_it(run, name):
    """The finished run, rerun from either of its records, is found finished: nothing is trained again."""
    before = tree_hashes(run / "final")
    assert main(["uptrain", "--config", str(run / name), "--no_progress"]) == 0
    assert tree_hashes(run / "final") == before
