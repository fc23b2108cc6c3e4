"""`gqaify generate`: the parent's corpus, the same from its seed, resumable after a kill, a dataset folder."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MODELS, needs_assets, tree_hashes
from gqaify.cli import main

STORIES = MODELS / "stories260K"
SMALL = ["--length", "48", "--batch-size", "4", "-q"]


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

    from gqaify.data import load_text

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
def test_a_corpus_killed_mid_run_resumes_without_repeating_or_skipping(tmp_path):
    assert generate(tmp_path / "whole", "--tokens", "3000") == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "gqaify.cli", "generate", str(STORIES), str(out), "--tokens", "3000", *SMALL]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out / "data" / "train-00002.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    found = shards(out)
    assert 3 <= len(found) < len(shards(tmp_path / "whole"))  # stopped part-way
    assert generate(out, "--tokens", "3000") == 0
    assert shards(out) == shards(tmp_path / "whole")
    assert not [p for p in (out / "data").iterdir() if p.name.startswith(".")]


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


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--tokens", "0"], "--tokens 0 must be at least 1"),
        (["--temperature", "nan"], "--temperature nan must be a positive number"),
        (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
        (["--greedy-tokens", "300"], "--greedy-tokens 300 must be 0 or more and below --length 256"),
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
    assert [r["prompt"] for r in rows] == ["Once upon a time", "The little dog"] * 2
    assert all(r["text"].startswith(r["prompt"]) and r["tokens"] > 0 for r in rows)


@needs_assets
def test_a_prompt_longer_than_the_positions_is_refused(tmp_path, capsys):
    prompts = tmp_path / "long.txt"
    prompts.write_text("Once upon a time " * 200 + "\n")
    assert generate(tmp_path / "p", "--prompts", str(prompts)) == 2
    assert "exceeds the 512 positions" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


@needs_assets
def test_a_checkpoint_and_no_dataset_converts_calibrated_and_uptrains(tmp_path):
    """README's three commands on the MHA twin of stories260K: the parent's text is the only data, and the
    uptrained model's KL to the parent on it falls."""
    from gqaify.uptrain.report import read_metrics

    parent, text = MODELS / "stories260K-mha", tmp_path / "parent-text"
    assert main(["generate", str(parent), str(text), "--tokens", "6000", "--length", "128", "-q"]) == 0
    assert (
        main(
            [
                "convert",
                str(parent),
                str(tmp_path / "mqa"),
                "--kv-heads",
                "1",
                "--method",
                "lsq",
                "--calib-data",
                str(text),
                "--calib-tokens",
                "2048",
                "--calib-seq-len",
                "128",
                "-q",
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "mqa" / "gqaify.json").read_text())
    assert record["calibration"]["data"] == [str(text)] and "held out" in record["calibration"]["holdout"]
    assert (
        main(
            [
                "uptrain",
                "--model",
                str(tmp_path / "mqa"),
                "--data",
                str(text),
                "--distill_from",
                str(parent),
                "--distill_weight",
                "1",
                "--max_tokens",
                "8192",
                "--seq_len",
                "128",
                "--lr",
                "1e-3",
                "--eval_data",
                str(text),
                "--eval_split",
                "train",
                "--eval_tokens",
                "1024",
                "--output_dir",
                str(tmp_path / "up"),
                "--save_every",
                "0",
                "--no_progress",
            ]
        )
        == 0
    )
    kl = [r["eval_kl"] for r in read_metrics(tmp_path / "up" / "metrics.jsonl") if "eval_kl" in r]
    assert len(kl) == 2 and kl[-1] < 0.8 * kl[0]
    config = json.loads((tmp_path / "up" / "final" / "config.json").read_text())
    assert config["num_key_value_heads"] == 1


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
