"""A corpus is read only as its record describes it: each damaged or incomplete corpus a hostile user made is refused
by every reader (uptrain's distill_from_data, eval, calibration) with exit 2 and one line, before anything is
written, and the corpus is left as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gqaify.entry.cli import main
from gqaify.text.corpus_format import corpus_problems
from helpers import one_line_refusal, tree_hashes
from helpers import uptrain_args as args

K = 4


@pytest.fixture(scope="module")
def corpus(tiny) -> Path:
    """A corpus of 4 shards of 4 samples with the parent's top-4 log-probabilities, from the tiny parent."""
    out = tiny["root"] / "corpus"
    if not out.exists():
        argv = ["--tokens", "160", "--length", "12", "--batch-size", "4", "--top-logprobs", str(K), "-q"]
        assert main(["generate", str(tiny["parent"]), str(out), *argv]) == 0
    assert len(list((out / "data").iterdir())) >= 3
    return out


def shard(folder: Path, index: int = 1) -> Path:
    return folder / "data" / f"train-{index:05d}.jsonl"


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))  # NaN and Infinity as Python's json writes them


def edit_row(folder: Path, change) -> None:
    """Apply `change` to the second row of the second shard."""
    rows = rows_of(shard(folder))
    change(rows[1])
    write_rows(shard(folder), rows)


def edit_record(folder: Path, change) -> None:
    record = json.loads((folder / "gqaify.json").read_text())
    change(record)
    (folder / "gqaify.json").write_text(json.dumps(record, indent=2) + "\n")


def set_value(column: str, value, at: tuple[int, ...] = (2, 1)):
    def change(row: dict) -> None:
        target = row[column]
        for i in at[:-1]:
            target = target[i]
        target[at[-1]] = value

    return change


def incomplete(folder: Path) -> None:
    """What a generate killed (SIGKILL) after its third shard leaves: whole shards, a record not complete."""
    done = 3
    for path in sorted((folder / "data").iterdir())[done:]:
        path.unlink()
    tokens = sum(row["tokens"] for i in range(done) for row in rows_of(shard(folder, i)))
    edit_record(folder, lambda r: r.update(complete=False, shards=done, samples=4 * done, tokens=tokens))


def cut_mid_line(folder: Path) -> None:
    text = shard(folder).read_text()
    shard(folder).write_text(text[: len(text) - 40])


def drop_last_row(folder: Path) -> None:
    write_rows(shard(folder), rows_of(shard(folder))[:-1])


def drop_column(folder: Path) -> None:
    write_rows(shard(folder), [{k: v for k, v in row.items() if k != "top_logprobs"} for row in rows_of(shard(folder))])


# (damage, what the one line says)
ATTACKS = {
    "nan-logprob": (lambda f: edit_row(f, set_value("top_logprobs", float("nan"))), "not finite (NaN or infinite)"),
    "inf-logprob": (lambda f: edit_row(f, set_value("top_logprobs", float("-inf"))), "not finite (NaN or infinite)"),
    "positive-logprob": (lambda f: edit_row(f, set_value("top_logprobs", 3.0)), "top_logprobs are above 0"),
    "id-past-vocab": (lambda f: edit_row(f, set_value("top_ids", 320)), "id 320 in top_ids, outside the model's"),
    "input-id-past-vocab": (lambda f: edit_row(f, set_value("input_ids", 999, (3,))), "id 999 in input_ids"),
    "negative-id": (lambda f: edit_row(f, set_value("top_ids", -3)), "negative id in top_ids (-3)"),
    "ragged-rows": (lambda f: edit_row(f, lambda r: r["top_logprobs"].pop()), "row 2 has top_logprobs for other"),
    "ragged-position": (lambda f: edit_row(f, lambda r: r["top_ids"][2].pop()), "row 2 holds 3 top_ids at a position"),
    "missing-column": (drop_column, "has no column 'top_logprobs'"),
    "shard-deleted": (lambda f: shard(f).unlink(), "lacks 1 of the"),
    "shard-emptied": (lambda f: shard(f).write_text(""), "holds 0 of its 4 rows (cut short)"),
    "shard-cut-mid-line": (cut_mid_line, "cannot be read"),
    "shard-cut-at-a-line": (drop_last_row, "holds 3 of its 4 rows (cut short)"),
    "record-says-another-k": (
        lambda f: edit_record(f, lambda r: r["settings"].update(top_logprobs=8)),
        f"holds the top {K} top_ids at each position, the record's top 8",
    ),
    "incomplete": (incomplete, "is an incomplete corpus"),
    "extra-shard": (lambda f: shutil.copy(shard(f), shard(f, 99)), "which its record does not name"),
    "tokens-changed": (lambda f: edit_row(f, lambda r: r.update(tokens=r["tokens"] + 1)), "the shards were changed"),
    "record-damaged": (
        lambda f: edit_record(f, lambda r: r.update(pixels=3)),  # this version's record, with a field it never wrote
        "holds a corpus whose record is damaged",
    ),
    "record-cut-short": (  # not JSON: it was read as a folder of plain text without a word
        lambda f: (f / "gqaify.json").write_text((f / "gqaify.json").read_text()[:40]),
        "gqaify.json is damaged",
    ),
    "record-vocab-negative": (  # it was blamed on "another tokenizer's" ids
        lambda f: edit_record(f, lambda r: r.update(vocab_size=-1)),
        "says vocab_size -1, which no tokenizer has: it is damaged",
    ),
    "record-tokens-float": (  # it blamed changed shards and suggested writing into the non-empty OUT
        lambda f: edit_record(f, lambda r: r.update(tokens=1e30)),
        "tokens 1e+30 is not a whole number); write it again (gqaify generate)",
    ),
    "record-tokens-past-its-shards": (
        lambda f: edit_record(f, lambda r: r.update(tokens=10**30)),
        "says tokens 1,000,000,000,000,000,000,000,000,000,000, more than its 16 samples of at most 12 tokens",
    ),
    "record-of-a-later-gqaify": (
        lambda f: edit_record(f, lambda r: r.update(version="99.0", pixels=3)),  # a field this gqaify does not know
        "holds a corpus written by gqaify 99.0, whose record this gqaify",
    ),
}


@pytest.fixture
def damaged(corpus, tmp_path, request):
    """A copy of the corpus, damaged as the test's parameter says; (its folder, what the refusal says)."""
    damage, said = ATTACKS[request.param]
    copy = shutil.copytree(corpus, tmp_path / "corpus")
    damage(copy)
    return copy, said


@pytest.mark.parametrize("damaged", list(ATTACKS), indirect=True)
def test_distill_from_data_refuses_a_damaged_corpus_before_writing_anything(damaged, tiny, tmp_path, capsys):
    folder, said = damaged
    before = tree_hashes(folder)
    out = tmp_path / "run"
    argv = ["uptrain", *args(tiny, out, "--data", str(folder), "--distill_from_data", "--distill_weight", "1")]
    err = one_line_refusal(capsys, *argv)
    assert said in err and str(folder) in err
    fix = "generate the corpus from the model's parent" if "vocabulary" in err else "gqaify generate"
    assert fix in err
    assert not out.exists()  # no run.json, no output_dir
    assert tree_hashes(folder) == before


@pytest.mark.parametrize(
    "damaged", ["incomplete", "shard-deleted", "nan-logprob", "record-of-a-later-gqaify"], indirect=True
)
def test_eval_and_calibration_refuse_a_damaged_or_incomplete_corpus(damaged, tiny, tmp_path, capsys):
    folder, said = damaged
    before = tree_hashes(folder)
    report = tmp_path / "report"
    data = ("--data", folder, "--split", "train", "--seq-len", "16")
    err = one_line_refusal(capsys, "eval", tiny["parent"], *data, "--out", report)
    assert said in err and not report.exists()
    out = tmp_path / "mqa"
    calib = ("--calib-data", folder, "--calib-split", "train", "--calib-tokens", "256", "--calib-seq-len", "16")
    err = one_line_refusal(capsys, "convert", tiny["parent"], out, "--kv-heads", "1", "--method", "lsq", *calib)
    assert said in err and not out.exists()
    assert tree_hashes(folder) == before


@pytest.mark.parametrize("damaged", ["incomplete", "shard-deleted"], indirect=True)
def test_the_command_the_refusal_names_repairs_the_corpus(damaged, corpus):
    folder, _ = damaged
    files = sorted((folder / "data").iterdir())
    assert corpus_problems(folder, files, "data")
    assert main(["generate", "--config", str(folder / "gqaify.json"), "--out", str(folder), "-q"]) == 0
    assert corpus_problems(folder, sorted((folder / "data").iterdir()), "data") == []
    assert tree_hashes(folder)["data/train-00001.jsonl"] == tree_hashes(corpus)["data/train-00001.jsonl"]


def test_stored_log_probabilities_of_a_loose_file_are_checked_too(tmp_path):
    from gqaify.errors import UserError
    from gqaify.uptrain.data import packed_stored_blocks

    row = {"text": "", "input_ids": [1, 2, 3], "top_ids": [[1, 2]] * 3, "top_logprobs": [[-0.1, float("nan")]] * 3}
    write_rows(tmp_path / "c.jsonl", [row] * 4)
    with pytest.raises(UserError, match="12 top_logprobs are not finite"):
        packed_stored_blocks(str(tmp_path / "c.jsonl"), "train", seq_len=4)


def test_stored_log_probabilities_streamed_are_checked_as_they_are_read(tmp_path):
    """A NaN in stored log-probabilities read by a streamed run reached the loss, and the run was told its lr was
    likely too high."""
    from gqaify.errors import UserError
    from gqaify.uptrain.data import packed_stored_blocks

    row = {"text": "", "input_ids": [1, 2, 3], "top_ids": [[1, 2]] * 3, "top_logprobs": [[-0.1, float("nan")]] * 3}
    write_rows(tmp_path / "c.jsonl", [row] * 4)
    blocks = packed_stored_blocks(str(tmp_path / "c.jsonl"), "train", seq_len=4, streaming=True)
    with pytest.raises(UserError, match="12 top_logprobs are not finite") as caught:
        next(iter(blocks))
    assert "(streamed: checked as it is read" in str(caught.value) and "lr" not in str(caught.value)
