"""`gqaify generate`: the parent's corpus, the same from its seed, resumable after a kill, a dataset folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from gqaify.entry.cli import main
from gqaify.records import CORPUS, TOOL
from helpers import (
    MODELS,
    needs_assets,
    one_line,
    run_cli,
    tree_hashes,
)

STORIES = MODELS / "stories260K"
SMALL = ["--length", "24", "--batch-size", "8", "-q"]


def generate(out: Path, *extra: str) -> int:
    return main(["generate", str(STORIES), str(out), "--tokens", "600", *SMALL, *extra])


def shards(out: Path) -> dict[str, str]:
    return {k: v for k, v in tree_hashes(out).items() if k.startswith("data/")}


@needs_assets
def test_the_same_seed_writes_the_same_tokens_and_another_seed_does_not(tmp_path):
    assert generate(tmp_path / "a") == 0 and generate(tmp_path / "b") == 0
    assert generate(tmp_path / "c", "--seed", "1") == 0
    assert shards(tmp_path / "a") == shards(tmp_path / "b")
    assert shards(tmp_path / "a") != shards(tmp_path / "c")
    record = json.loads((tmp_path / "a" / "gqaify.json").read_text())
    assert record["kind"] == "corpus" and record["complete"] and record["tokens"] >= 600
    assert record["settings"]["seed"] == 0 and record["settings"]["temperature"] == 1.0


@needs_assets
def test_the_folder_loads_with_datasets_and_as_gqaify_data(tmp_path):
    import datasets

    from gqaify.text.loading import load_text

    assert generate(tmp_path / "c") == 0
    rows = datasets.load_dataset(str(tmp_path / "c"), split="train")
    record = json.loads((tmp_path / "c" / "gqaify.json").read_text())
    assert rows.num_rows == record["samples"] and sum(rows["tokens"]) == record["tokens"]
    assert load_text(str(tmp_path / "c"), "train").rows == record["samples"]  # gqaify.json is not read as data


@needs_assets
def test_extending_a_corpus_equals_writing_it_at_once(tmp_path):
    assert generate(tmp_path / "once", "--tokens", "1200") == 0
    assert generate(tmp_path / "twice") == 0
    assert generate(tmp_path / "twice", "--tokens", "1200") == 0
    assert shards(tmp_path / "twice") == shards(tmp_path / "once")


@needs_assets
def test_resuming_with_other_settings_is_refused(tmp_path, capsys):
    assert generate(tmp_path / "c") == 0
    before = tree_hashes(tmp_path / "c")
    capsys.readouterr()
    assert generate(tmp_path / "c", "--temperature", "0.7") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "temperature 1.0 -> 0.7" in err and "--config" in err
    assert tree_hashes(tmp_path / "c") == before


@needs_assets
def test_a_run_killed_before_its_first_record_is_started_afresh(tmp_path):
    out = tmp_path / "c"
    (out / "data").mkdir(parents=True)
    (out / ".gqaify.json.tmp").write_text("{")  # what a kill inside the first write of gqaify.json leaves
    assert generate(out) == 0 and generate(tmp_path / "whole") == 0
    assert shards(out) == shards(tmp_path / "whole")
    assert json.loads((out / "gqaify.json").read_text())["settings"]["device"] == "cpu"  # resolved, not "auto"


def test_a_folder_gqaify_did_not_write_is_refused(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["generate", "some/model", str(tmp_path / "mine")]) == 2
    assert "is not a corpus gqaify generate wrote" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_corpus_given_as_the_model_is_named_as_one(tiny, tmp_path, capsys):
    """A corpus (a folder gqaify generate wrote) given as MODEL was "could not be read (ValueError)": it is named as
    the corpus it is, to generate as to uptrain, and nothing is written."""
    corpus = tmp_path / "corpus"
    argv = ["--tokens", "32", "--length", "8", "--batch-size", "4", "-q"]
    assert main(["generate", str(tiny["parent"]), str(corpus), *argv]) == 0
    said = (
        f"MODEL {corpus} is a corpus gqaify generate wrote (text for --data or --calib-data), not a model (it has no "
        "config.json); name the model folder or hub id"
    )
    before = tree_hashes(corpus)
    code, err = run_cli(capsys, "generate", corpus, tmp_path / "again", *argv)
    assert code == 2 and one_line(err) == f"gqaify: error: {said}"
    run = ["--data", tiny["train"], "--output_dir", tmp_path / "run", "--max_tokens", "64", "--seq_len", "16"]
    code, err = run_cli(capsys, "uptrain", "--model", corpus, *run)
    assert code == 2 and said.replace("MODEL", "model", 1) in one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"] and tree_hashes(corpus) == before


def test_a_stop_after_the_corpus_is_written_says_it_is_complete(tiny, tmp_path, capsys, monkeypatch):
    """Stopped in its summary, once the corpus was whole, generate said "interrupted; nothing was written"."""
    import gqaify.summary

    def stopped(corpus):
        raise KeyboardInterrupt

    monkeypatch.setattr(gqaify.summary, "format_corpus_summary", stopped)
    out = tmp_path / "corpus"
    code, err = run_cli(capsys, "generate", tiny["parent"], out, "--tokens", "32", "--length", "8", "--batch-size", "4")
    assert code == 130 and err.endswith(
        f"gqaify: interrupted; {out} is complete: the corpus was written before the stop\n"
    )
    assert json.loads((out / "gqaify.json").read_text())["complete"]


def test_a_corpus_of_a_later_gqaify_is_said_to_be_one(tmp_path, capsys):
    """A corpus whose record this gqaify cannot read (a later one's, with a field it does not know) is no folder of
    something else: the refusal says which gqaify wrote it, in one line, and the corpus is left as it was."""
    out = tmp_path / "later"
    out.mkdir()
    record = {"tool": TOOL, "version": "99.0", "kind": CORPUS, "parent": "p", "settings": {}, "pixels": 3}
    (out / "gqaify.json").write_text(json.dumps(record))
    assert main(["generate", "some/model", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a corpus gqaify generate wrote" not in err
    assert f"{out} holds a corpus written by gqaify 99.0, whose record this gqaify" in err
    assert err.rstrip().endswith("go on with it with the gqaify that wrote it, or choose another OUT")
    assert json.loads((out / "gqaify.json").read_text()) == record
    assert [p.name for p in out.iterdir()] == ["gqaify.json"]


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--tokens", "0"], "--tokens 0 must be at least 1"),
        (["--temperature", "nan"], "--temperature nan must be a positive number"),
        (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
        (["--greedy-tokens", "300"], "--greedy-tokens 300 must be 0 or more and below --length 256"),
        (["--batch-size", "100000000"], "--batch-size 100000000 must be between 1 and --tokens 100000; a shard"),
        (["--chat"], "--chat wraps prompts in the chat template"),
        (["--device", "gpu"], "unknown --device 'gpu'; choose auto, cpu, cuda or cuda:N"),
        (["--prompts", "no/such/prompts.txt"], "--prompts no/such/prompts.txt cannot be read"),
    ],
)
def test_bad_settings_are_refused_in_one_line_before_any_work(tmp_path, capsys, option, said):
    assert main(["generate", "some/model", str(tmp_path / "out"), *option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err
    assert not (tmp_path / "out").exists()


@needs_assets
def test_prompts_are_continued_in_turn(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\nThe little dog\n")
    assert generate(tmp_path / "p", "--prompts", str(prompts)) == 0
    rows = [json.loads(line) for line in (tmp_path / "p" / "data" / "train-00000.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Once upon a time", "The little dog"] * 4  # a shard: one batch of 8
    assert all(r["text"].startswith(r["prompt"]) and r["tokens"] > 0 for r in rows)


@needs_assets
def test_a_prompt_longer_than_the_positions_is_refused(tmp_path, capsys, caplog):
    prompts = tmp_path / "long.txt"
    prompts.write_text("Once upon a time " * 200 + "\n")
    assert generate(tmp_path / "p", "--prompts", str(prompts)) == 2
    assert "exceeds the 512 positions" in one_line(capsys.readouterr().err)
    assert not [r for r in caplog.records if "Token indices sequence length" in r.getMessage()]  # refused, not warned
    assert not (tmp_path / "p").exists()


@needs_assets
def test_stored_top_logprobs_are_the_parents_at_every_position_of_the_sample(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert generate(tmp_path / "k", "--top-logprobs", "5") == 0
    rows = [json.loads(line) for line in (tmp_path / "k" / "data" / "train-00000.jsonl").read_text().splitlines()]
    parent = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    for row in rows:
        ids = row["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == row["text"]
        assert len(row["top_ids"]) == len(row["top_logprobs"]) == len(ids) and len(row["top_ids"][0]) == 5
        with torch.no_grad():
            expected = torch.log_softmax(parent(torch.tensor([ids])).logits[0].double(), -1)
        stored = torch.tensor(row["top_logprobs"], dtype=torch.float64)
        torch.testing.assert_close(stored, expected.gather(-1, torch.tensor(row["top_ids"])), atol=2e-5, rtol=0)
        assert torch.all(stored[:, 0] >= expected.max(-1).values - 2e-5)  # the most likely tokens, in order
        assert torch.all(stored[:, :-1] >= stored[:, 1:])


@needs_assets
def test_more_top_logprobs_than_the_vocabulary_is_refused(tmp_path):
    assert generate(tmp_path / "k", "--top-logprobs", "513") == 2  # stories260K has 512 tokens
    assert not (tmp_path / "k").exists()


# -- one run at a time, the prompts it began with, the room it needs ------------------------------------------------


@needs_assets
def test_a_run_into_an_out_another_run_holds_is_refused_and_writes_nothing(tmp_path, capsys):
    """The claim held here, as a live run holds it: a second run, new corpus or resumed, is one line and exit 2."""
    from gqaify.output.claims import claimed

    out = tmp_path / "c"
    with claimed(out, "gqaify generate"):
        code, err = run_cli(capsys, "generate", STORIES, out, "--tokens", "600", *SMALL, "--seed", "8")
        assert code == 2
        assert one_line(err) == (
            f"gqaify: error: {out} is being written by another gqaify generate (pid {os.getpid()}); wait for it or "
            "choose another OUT"
        )
        assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # the claim is gone with its holder
    assert generate(out, "--seed", "7") == 0
    before = tree_hashes(tmp_path)
    with claimed(out, "gqaify generate"):
        code, err = run_cli(capsys, "generate", STORIES, out, "--tokens", "1200", *SMALL, "--seed", "7")
        assert code == 2 and "is being written by another gqaify generate" in one_line(err)
    assert tree_hashes(tmp_path) == before


@needs_assets
def test_a_claim_a_killed_run_left_is_taken_over(tmp_path):
    out = tmp_path / "c"
    claim = tmp_path / ".c.gqaify.claim"
    claim.write_text('{"pid": 999999999, "command": "gqaify generate"}')  # what a SIGKILL leaves: a file, unlocked
    assert generate(out) == 0 and json.loads((out / "gqaify.json").read_text())["complete"]
    assert not claim.exists()


def _symbolic_link(claim: Path) -> None:
    claim.symlink_to(claim.with_name("notes.txt"))


CLAIM_NAME_TAKEN = {
    "a symbolic link": _symbolic_link,  # it was followed: notes.txt held the claim, then was deleted
    "a file of other content": lambda claim: claim.write_text("mine\n"),  # truncated, then deleted
    # an empty file of the user's under a second name: the claim was written into it, and stayed there
    "a file with other names (a hard link)": lambda claim: (claim.touch(), os.link(claim, claim.with_name("notes"))),
    "a FIFO": lambda claim: os.mkfifo(claim),  # a traceback, then deleted
    "a folder": lambda claim: (claim.mkdir(), (claim / "inside.txt").write_text("mine\n")),
}


@needs_assets
@pytest.mark.parametrize("what", CLAIM_NAME_TAKEN)
def test_what_holds_the_claims_name_is_refused_and_left_as_it_is(tmp_path, capsys, what):
    """`ln -s notes.txt .c.gqaify.claim; gqaify generate MODEL c` used to write the claim into notes.txt through the
    link; a user's own file of that name was truncated and deleted, a FIFO gave a traceback and was deleted."""
    out, claim = tmp_path / "c", tmp_path / ".c.gqaify.claim"
    (tmp_path / "notes.txt").write_text("my notes\n")
    CLAIM_NAME_TAKEN[what](claim)
    before, mode = tree_hashes(tmp_path), claim.lstat().st_mode
    code, err = run_cli(capsys, "generate", STORIES, out, "--tokens", "600", *SMALL)
    assert code == 2 and one_line(err) == (
        f"gqaify: error: {claim} is {what}, not a claim gqaify wrote; gqaify holds OUT {out} under that name and "
        "left it as it is: move it away, then rerun"
    )
    assert tree_hashes(tmp_path) == before and claim.lstat().st_mode == mode and not out.exists()
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


def test_a_claim_file_left_empty_is_taken_over(tmp_path):
    """What a claim is between its creation and its first write, and what a run killed in that instant leaves."""
    from gqaify.output.claims import claimed

    out, claim = tmp_path / "c", tmp_path / ".c.gqaify.claim"
    claim.touch()
    with claimed(out, "gqaify generate"):
        assert json.loads(claim.read_text()) == {"pid": os.getpid(), "command": "gqaify generate"}
    assert list(tmp_path.iterdir()) == []


@needs_assets
def test_the_record_names_the_prompts_absolutely_and_config_from_elsewhere_reads_them(tmp_path, monkeypatch):
    """A relative `prompts` in the record made `--config OUT/gqaify.json`, given in another folder, read that
    folder's file of the same name."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    (here / "prompts.txt").write_text("Once upon a time\n")
    (there / "prompts.txt").write_text("The little dog\n")
    monkeypatch.chdir(here)
    assert generate(Path("c"), "--prompts", "prompts.txt") == 0
    record = json.loads((here / "c" / "gqaify.json").read_text())
    assert record["settings"]["prompts"] == str(here / "prompts.txt")
    assert record["settings"]["out"] == str(here / "c")
    assert record["prompts_sha256"] == hashlib.sha256(b"Once upon a time\n").hexdigest()
    monkeypatch.chdir(there)
    assert main(["generate", "--config", str(here / "c" / "gqaify.json"), "--out", "again", "-q"]) == 0
    assert shards(there / "again") == shards(here / "c")
    rows = (there / "again" / "data" / "train-00000.jsonl").read_text().splitlines()
    assert {json.loads(row)["prompt"] for row in rows} == {"Once upon a time"}


@needs_assets
def test_resuming_after_the_prompts_changed_is_refused(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    out = tmp_path / "c"
    assert generate(out, "--prompts", str(prompts)) == 0
    prompts.write_text("The little dog\n")
    before = tree_hashes(tmp_path)
    for tokens in ("1200", "600"):  # to extend it, or to find it complete: either says it came from these prompts
        code, err = run_cli(capsys, "generate", STORIES, out, *SMALL, "--prompts", prompts, "--tokens", tokens)
        line = one_line(err)
        assert code == 2 and f"--prompts {prompts} changed since {out} was sampled from it" in line, line
        assert "put its prompts back to go on, or choose another OUT" in line
        assert tree_hashes(tmp_path) == before


@needs_assets
def test_lowering_tokens_on_a_finished_corpus_changes_nothing(tmp_path, capsys, caplog):
    """It rewrote the record's --tokens to the lower number, under a corpus that holds more: the record is what
    `--config OUT/gqaify.json` writes again, so it keeps what the corpus was sampled to."""
    out = tmp_path / "c"
    assert generate(out, "--tokens", "1200") == 0
    before = tree_hashes(out)
    code, err = run_cli(capsys, "generate", STORIES, out, *SMALL, "--tokens", "600")
    assert code == 0 and "more than --tokens 600; left as it is" in caplog.text
    assert tree_hashes(out) == before
    assert json.loads((out / "gqaify.json").read_text())["settings"]["tokens"] == 1200


@needs_assets
def test_too_little_disk_space_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """It started without looking: a new corpus is refused at a generous estimate, a resumed one at the bytes a
    token takes in its shards."""
    from gqaify.output import destination as outputs

    out = tmp_path / "c"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    code, err = run_cli(capsys, "generate", STORIES, out, *SMALL, "--tokens", "600")
    line = one_line(err)
    assert code == 2 and f"not enough disk space for {out}" in line and "has 1,000 free" in line, line
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert generate(out) == 0
    on_disk = sum(p.stat().st_size for p in (out / "data").iterdir())
    before = tree_hashes(tmp_path)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage._replace(free=50 * on_disk))
    code, err = run_cli(capsys, "generate", STORIES, out, *SMALL, "--tokens", "60000")  # 100 times as many
    assert code == 2 and "not enough disk space" in one_line(err)
    assert tree_hashes(tmp_path) == before
    code, err = run_cli(capsys, "generate", STORIES, out, *SMALL, "--tokens", "1200")  # twice: there is room
    assert code == 0, err


def test_shards_are_shared_out_in_order_and_the_corpus_ends_where_one_process_ends_it():
    from gqaify.generation.corpus import contiguous_shards, missing_shards, shards_enough

    known = {0: 100, 1: 100, 3: 100}  # shard 2 missing: a killed process's
    assert missing_shards(known, 2) == [2, 4] and contiguous_shards(known) == (2, 200)
    assert shards_enough(known, 150) == 2 and shards_enough(known, 250) is None
    known[2] = 10
    assert shards_enough(known, 250) == 4 and shards_enough(known, 310) == 4 and shards_enough(known, 311) is None


@needs_assets
@pytest.mark.parametrize("stop_after", [1, 99], ids=["part", "complete"])
def test_a_stopped_generate_says_what_it_holds_without_counting_past_the_target(
    tmp_path, capsys, monkeypatch, stop_after
):
    """A shard holds whole samples, so shards can hold more tokens than asked: it said "32,768 of 20,000 tokens"."""
    from gqaify.generation import corpus

    real, calls = corpus.write_record, []

    def stopping(out, record, s, shards, samples, tokens, complete):
        real(out, record, s, shards, samples, tokens, complete)
        calls.append(tokens)
        if not complete and shards and (len(calls) > stop_after or tokens >= s.tokens):
            raise KeyboardInterrupt

    monkeypatch.setattr(corpus, "write_record", stopping)
    code, err = run_cli(capsys, "generate", STORIES, tmp_path / "c", "--tokens", "600", *SMALL)
    line = one_line(err)
    assert code == 130 and f"{tmp_path / 'c'} holds " in line and " whole shard(s), " in line, line
    assert " of 600 tokens" not in line
    if stop_after == 1:
        assert "tokens (the corpus asked for 600); rerun the same command to go on from there" in line, line
    else:
        assert "the corpus is complete but its record was not yet written; rerun the same command" in line, line
    monkeypatch.setattr(corpus, "write_record", real)
    assert generate(tmp_path / "c") == 0  # the rerun finishes it


@pytest.mark.parametrize(
    ("option", "said", "not_said"),
    [
        (["--length", "0"], "--length 0 must be at least 1", "--greedy-tokens"),
        (["--tokens", "0"], "--tokens 0 must be at least 1", "--batch-size"),
    ],
)
def test_a_bad_bound_is_reported_alone_not_for_each_setting_it_bounds(tmp_path, capsys, option, said, not_said):
    code, err = run_cli(capsys, "generate", "some/model", tmp_path / "out", *option)
    assert code == 2 and one_line(err) and said in err and not_said not in err
