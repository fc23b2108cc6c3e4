"""The text loader: local files of each kind, folders, hub names, and its errors."""

import json

import pytest

from gqaify.errors import UserError
from gqaify.testing import build_model, save_with_tokenizer
from gqaify.text.loading import NamedText, load_text, named_texts, named_texts_problem
from helpers import NOT_CACHED, one_line_refusal, run_cli


def test_text_file_is_read_verbatim(tmp_path):
    (tmp_path / "a.txt").write_text("line one\nline two\n\nline four")
    data = load_text(str(tmp_path / "a.txt"))
    assert data.text == "line one\nline two\n\nline four" and data.rows == 1


def test_folder_of_text_files_joins_documents(tmp_path):
    (tmp_path / "1.txt").write_text("first")
    (tmp_path / "2.txt").write_text("second")
    assert load_text(str(tmp_path)).text == "first\n\nsecond"


def test_jsonl_and_parquet_columns(tmp_path):
    rows = [{"id": i, "body": f"row {i}"} for i in range(3)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_text(str(tmp_path / "d.jsonl"), text_column="body").text == "row 0\n\nrow 1\n\nrow 2"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    data = load_text(str(tmp_path / "d.parquet"), split="validation", text_column="body")
    assert (data.text, data.split) == ("row 0\n\nrow 1\n\nrow 2", "validation")
    with pytest.raises(UserError, match=r"has no column 'text'; pass --text-column with one of \['id', 'body'\]"):
        load_text(str(tmp_path / "d.jsonl"))


def test_hub_name_and_config(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None, **kwargs):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"text": ["a", "", "b"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_text("Salesforce/wikitext:wikitext-2-raw-v1", split="test").text == "a\n\n\n\nb"
    load_text("someone/corpus", split="validation")
    load_text("Salesforce/wikitext:wikitext-2-raw-v1@validation", split="test")  # a source's own split wins
    load_text("someone/corpus@train", split="test")
    assert calls == [
        ("Salesforce/wikitext", "wikitext-2-raw-v1", "test"),
        ("someone/corpus", None, "validation"),
        ("Salesforce/wikitext", "wikitext-2-raw-v1", "validation"),
        ("someone/corpus", None, "train"),
    ]
    assert [t.name for t in named_texts(["Salesforce/wikitext:wikitext-2-raw-v1@validation", "a/b@train"])] == [
        "wikitext",
        "b",
    ]


def test_mixed_folder_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text('{"text": "y"}')
    with pytest.raises(UserError, match="use files of one kind"):
        load_text(str(tmp_path))


# -- the hub unreachable: one line at once, nothing written (the hub made unreachable by `hub_unreachable`) ---


@pytest.fixture
def model(tmp_path):
    return save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=300), tmp_path / "m")


def test_a_hub_dataset_without_the_hub_is_one_line_at_once(capsys, tmp_path, model, hub_unreachable):
    out = tmp_path / "report"
    err = one_line_refusal(capsys, "eval", model, "--data", NOT_CACHED, "--out", out, "--no-speed", "--seq-len", "32")
    assert f"--data {NOT_CACHED} is not a local path and the Hugging Face hub could not be reached (" in err
    assert not out.exists()


def test_calibration_data_without_the_hub_is_one_line_at_once(capsys, tmp_path, model, hub_unreachable):
    out = tmp_path / "out"
    err = one_line_refusal(
        capsys, "convert", model, out, "--kv-heads", "2", "--method", "lsq", "--calib-data", NOT_CACHED
    )
    assert f"--calib-data {NOT_CACHED} is not a local path and the Hugging Face hub could not be reached (" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing written beside the model


def test_a_cached_hub_dataset_is_read_offline_when_the_hub_does_not_answer(monkeypatch, hub_unreachable):
    import datasets

    def from_cache_only(name, config=None, split=None, **kwargs):
        assert datasets.config.HF_HUB_OFFLINE  # datasets reads its cache, with no request and no retry
        return datasets.Dataset.from_dict({"text": ["cached"]})

    monkeypatch.setattr(datasets, "load_dataset", from_cache_only)
    assert load_text("someone/corpus").text == "cached"
    assert not datasets.config.HF_HUB_OFFLINE  # and only for that call


def test_malformed_json_lines_is_one_line(capsys, tmp_path, model):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": oops\n')
    out = tmp_path / "report"
    err = one_line_refusal(capsys, "eval", model, "--data", bad, "--out", out, "--no-speed", "--seq-len", "32")
    assert f"--data {bad} is not valid JSON lines: " in err and err.rstrip().endswith("; fix the file")
    assert not out.exists()
    err = one_line_refusal(
        capsys, "convert", model, tmp_path / "o", "--kv-heads", "2", "--method", "lsq", "--calib-data", bad
    )
    assert f"--calib-data {bad} is not valid JSON lines: " in err
    assert not (tmp_path / "o").exists()


# -- panel names: the rule stated, NAME= refused, a file that also reads as NAME=SOURCE refused as ambiguous ---


@pytest.mark.parametrize("value", ["ü=st.txt", "=st.txt", "a" * 65 + "=st.txt", "my text=st.txt"])
def test_a_name_that_breaks_the_rule_is_refused_stating_it(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "st.txt").write_text("some text")
    problem = named_texts_problem([value], "--data")
    assert problem.startswith(f"--data {value}: no such file or folder, and ")
    assert "1 to 64 ASCII letters, digits, '_', '.' or '-', the first a letter or digit" in problem


def test_a_name_with_no_source_is_refused_not_sent_to_the_hub():
    assert named_texts_problem(["a="], "--data") == (
        "--data a= names the text 'a' but no source after '='; write NAME=SOURCE, e.g. a=wiki.txt"
    )


def test_a_file_that_also_reads_as_name_and_source_is_ambiguous(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "q=wk.txt").write_text("the file")
    assert named_texts_problem(["q=wk.txt"], "--data") is None  # wk.txt is not there: the file, as before
    (tmp_path / "wk.txt").write_text("the source")
    problem = named_texts_problem(["q=wk.txt"], "--data")
    assert problem.startswith("--data q=wk.txt is ambiguous: ") and "write ./q=wk.txt for the file" in problem
    assert named_texts_problem(["./q=wk.txt"], "--data") is None
    assert named_texts(["./q=wk.txt", "q=./wk.txt"]) == [NamedText("q=wk", "./q=wk.txt"), NamedText("q", "./wk.txt")]


def test_panel_names_are_refused_in_one_line_before_anything_loads(capsys, tmp_path, model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "st.txt").write_text("some text")
    out = tmp_path / "report"
    for value in ["my text=st.txt", "a="]:
        err = one_line_refusal(capsys, "eval", model, "--data", value, "--out", out, "--no-speed", "--seq-len", "32")
        assert f"--data {value}" in err and "no such file or folder; check the path" not in err
    assert not out.exists()


# -- the text column applies to sources with columns; plain text has none ------------------------------------


def test_a_text_column_does_not_apply_to_plain_text(tmp_path):
    (tmp_path / "x.txt").write_text("plain\ntext")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "1.txt").write_text("in a folder")
    assert load_text(str(tmp_path / "x.txt"), text_column="content").text == "plain\ntext"
    assert load_text(str(tmp_path / "folder"), text_column="content", max_chars=5).text == "in a folder"  # streamed


def test_a_panel_of_plain_text_and_json_lines_with_a_text_column(capsys, tmp_path, model):
    (tmp_path / "x.txt").write_text("Once upon a time there was a cat. " * 20)
    (tmp_path / "y.jsonl").write_text(
        "\n".join(json.dumps({"content": f"row {i} of the dog story"}) for i in range(20))
    )
    out = tmp_path / "report"
    data = ["a=" + str(tmp_path / "x.txt"), "b=" + str(tmp_path / "y.jsonl")]
    argv = ["eval", model, "--data", *data, "--text-column", "content", "--out", out, "--no-speed", "--seq-len", "32"]
    code, err = run_cli(capsys, *argv, "-q")
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert [t["name"] for t in report["data"]] == ["a", "b"] and report["data"][1]["rows"] == 20


# -- a path that is not a regular file: refused before open() would block -------------------------------------


def test_a_named_pipe_is_refused_not_opened(capsys, tmp_path, model):
    import os

    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(UserError, match="is not a regular file or folder"):
        load_text(str(tmp_path / "pipe.txt"))  # open() would wait for a writer forever
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text("text")
    os.mkfifo(tmp_path / "folder" / "b.txt")
    with pytest.raises(UserError, match=r"folder/b\.txt is not a regular file or folder"):
        load_text(str(tmp_path / "folder"))
    out = tmp_path / "report"
    err = one_line_refusal(capsys, "eval", model, "--data", tmp_path / "pipe.txt", "--out", out, "--seq-len", "32")
    assert f"--data {tmp_path / 'pipe.txt'} is not a regular file or folder" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("option", "fix"),
    [
        ("--score-data", "--score-text-column"),  # generate's: it named --text-column, which generate does not have
        ("--calib-data", "--calib-text-column"),
        ("--data", "--text-column"),
        ("data", "text_column"),
        ("eval_data", "text_column"),
    ],
)
def test_a_missing_column_names_the_option_that_picks_it(tmp_path, option, fix):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "some text"}) + "\n")
    with pytest.raises(UserError, match=rf"{option} .* has no column 'text'; pass {fix} with one of \['body'\]"):
        load_text(str(tmp_path / "d.jsonl"), option=option)


def test_a_source_of_code_is_read_by_its_content_column_where_text_is_not_named(tmp_path):
    """The Stack's and CodeParrot's files keep their text in `content`: a mixture's sources share one text_column, so
    such a source in a mixture of `text` sources is read by `content`; a column asked by name is still that one."""
    (tmp_path / "code.jsonl").write_text(json.dumps({"content": "def f():\n    return 1\n", "path": "f.py"}) + "\n")
    assert load_text(str(tmp_path / "code.jsonl")).text == "def f():\n    return 1\n"
    assert load_text(str(tmp_path / "code.jsonl"), text_column="path").text == "f.py"
