"""Text the user has, scored by the parent once (`gqaify generate --score-data`): the stored top-K equals the live
teacher's on the same tokens, and a run from it trains as a run with the live teacher does."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gqaify.generation.corpus import generate_corpus
from gqaify.generation.settings import GenerateSettings
from gqaify.text.loading import packed_blocks
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from gqaify.uptrain.metrics import read_metrics
from helpers import one_line, run_cli
from helpers import uptrain_args as args


def scored(
    tiny, out, *sources, tokens: int, k: int = 8, length: int = 16, batch_size: int = 2, **extra
) -> GenerateSettings:
    settings = GenerateSettings(
        model=str(tiny["parent"]),
        out=str(out),
        score_data=[str(s) for s in sources],
        tokens=tokens,
        length=length,
        batch_size=batch_size,
        top_logprobs=k,
        progress=False,
        **extra,
    )
    generate_corpus(settings)
    return settings


def rows_of(out) -> list[dict]:
    return [json.loads(line) for path in sorted((out / "data").iterdir()) for line in path.read_text().splitlines()]


def test_stored_top_k_of_a_text_equals_the_live_teachers(tiny, tmp_path):
    out = tmp_path / "scored"
    scored(tiny, out, tiny["train"], tokens=160)
    tokenizer = AutoTokenizer.from_pretrained(tiny["parent"])
    blocks = packed_blocks(str(tiny["train"]), "train", "text", tokenizer, 16)
    rows = rows_of(out)
    assert len(rows) == 10 and all(r["tokens"] == 16 for r in rows)  # 160 tokens: 5 shards of 2 blocks
    parent = AutoModelForCausalLM.from_pretrained(tiny["parent"])
    for g, row in enumerate(rows):
        assert row["input_ids"] == blocks[g]["input_ids"].tolist()  # one source: its blocks in order
        with torch.no_grad():
            logits = parent(input_ids=torch.tensor([row["input_ids"]])).logits[0]
        live, ids = torch.log_softmax(logits, -1).topk(8, dim=-1)
        assert row["top_ids"] == ids.tolist()
        # 5 decimals kept (half of 1e-5), and float32's own noise at these magnitudes: batches of 2 and of 1, or
        # another CPU, sum in another order
        noise = 8 * torch.finfo(torch.float32).eps * live.abs().max().item()
        torch.testing.assert_close(torch.tensor(row["top_logprobs"]), live, rtol=0, atol=5e-6 + noise)
    record = json.loads((out / "gqaify.json").read_text())
    assert record["complete"] and record["tokens"] == 160 and len(record["score_sha256"]) == 64


def test_a_mixture_is_drawn_by_its_weights_and_the_same_settings_write_the_same_bytes(tiny, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("Once upon a time a small robot learned to sing. " * 40)
    first = scored(tiny, tmp_path / "a", f"wiki={tiny['train']}", f"story={other}", tokens=640, score_weights=[3, 1])
    scored(tiny, tmp_path / "b", f"wiki={tiny['train']}", f"story={other}", tokens=640, score_weights=[3, 1])
    assert (tmp_path / "a" / "data").iterdir() and all(
        (tmp_path / "a" / "data" / p.name).read_bytes() == p.read_bytes() for p in (tmp_path / "b" / "data").iterdir()
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny["parent"])
    story = {tuple(b["input_ids"].tolist()) for b in packed_blocks(str(other), "train", "text", tokenizer, 16)}
    wiki = {tuple(b["input_ids"].tolist()) for b in packed_blocks(str(tiny["train"]), "train", "text", tokenizer, 16)}
    rows = rows_of(tmp_path / "a")
    from_story = sum(tuple(r["input_ids"]) in story for r in rows)
    assert all(tuple(r["input_ids"]) in story | wiki for r in rows) and len(rows) == 40
    assert 4 <= from_story <= 17  # a quarter of 40 expected: 10 (the draw is seeded, the bounds are 3 sigma)
    assert first.score_weights == [3, 1]


def test_a_run_from_scored_text_trains_as_a_run_with_the_live_teacher(tiny, tmp_path):
    """With K the whole vocabulary the stored KL is the full KL: the two runs see the same blocks in the same
    order and must agree step by step, within the 5 decimals a stored log-probability keeps."""
    tokenizer = AutoTokenizer.from_pretrained(tiny["parent"])
    blocks = len(packed_blocks(str(tiny["train"]), "train", "text", tokenizer, 16))
    corpus = tmp_path / "scored"
    # every block once (shards of one), each with the whole of the tiny parent's vocabulary
    scored(tiny, corpus, tiny["train"], tokens=blocks * 16, k=320, batch_size=1)
    live = tmp_path / "live"
    stored = tmp_path / "stored"
    budget = ("--max_tokens", "256", "--eval_points", "0")
    uptrain(parse(args(tiny, live, "--distill_from", str(tiny["parent"]), *budget)))
    uptrain(parse(_stored_args(tiny, stored, corpus, budget)))
    losses = [[r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] for run in (live, stored)]
    assert len(losses[0]) == 4
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    for name, tensor in AutoModelForCausalLM.from_pretrained(live / "final").state_dict().items():
        trained = AutoModelForCausalLM.from_pretrained(stored / "final").state_dict()[name]
        torch.testing.assert_close(trained, tensor, rtol=1e-3, atol=1e-5)


def _stored_args(tiny, out, corpus, budget) -> list[str]:
    argv = args(tiny, out, "--distill_from_data", *budget)
    argv[argv.index("--data") + 1] = str(corpus)
    return argv


def test_scoring_refuses_sampling_options_and_more_tokens_than_the_text_holds(tiny, tmp_path, capsys):
    code, err = run_cli(capsys, "generate", tiny["parent"], tmp_path / "x", "--score-data", tiny["train"], "--chat")
    assert code == 2 and "--chat chooses how the parent samples" in err and "--top-logprobs K" in err
    assert not (tmp_path / "x").exists()
    code, err = run_cli(
        capsys, "generate", tiny["parent"], tmp_path / "y", "--score-data", tiny["train"], "--top-logprobs", "4",
        "--length", "16", "--tokens", "10000000", "--no-progress",
    )  # fmt: skip
    assert code == 2 and "more than the" in err and "lower --tokens" in err and not (tmp_path / "y").exists()


def test_scoring_refuses_a_shard_larger_than_its_tokens_and_scores_what_it_is_asked(tiny, tmp_path, capsys):
    """`--tokens 64 --length 16` scored 256 tokens without a word: one whole shard of the default --batch-size, 16
    blocks. A shard larger than --tokens is refused, saying why and what fits, and writes nothing; what fits scores
    the 64 tokens asked."""
    argv = ["generate", tiny["parent"], tmp_path / "x", "--score-data", tiny["train"], "--top-logprobs", "4"]
    argv += ["--tokens", "64", "--length", "16", "--no-progress"]
    code, err = run_cli(capsys, *argv)
    assert code == 2 and one_line(err).endswith(
        "--score-data scores whole shards of --batch-size 16 blocks of --length 16, 256 tokens, more than --tokens "
        "64; lower --batch-size to 4, or raise --tokens to 256"
    )
    assert not (tmp_path / "x").exists()
    code, err = run_cli(capsys, *argv, "--tokens", "8")
    assert code == 2 and "--tokens 8 is less than one block of --length 16 (--score-data scores whole blocks)" in err
    assert run_cli(capsys, *argv, "--batch-size", "4")[0] == 0
    assert sum(row["tokens"] for row in rows_of(tmp_path / "x")) == 64
    assert json.loads((tmp_path / "x" / "gqaify.json").read_text())["tokens"] == 64


def test_a_budget_that_ends_inside_a_shard_says_how_many_tokens_it_scored(tiny, tmp_path, capsys):
    """`--tokens 80` in shards of 64 tokens scores two whole shards, 128 tokens: the summary said "scored 128 tokens"
    without a word of the 80 asked."""
    from gqaify.entry.cli import main

    argv = ["generate", tiny["parent"], tmp_path / "x", "--score-data", tiny["train"], "--top-logprobs", "4"]
    capsys.readouterr()
    assert (
        main([str(a) for a in [*argv, "--tokens", "80", "--length", "16", "--batch-size", "4", "--no-progress"]]) == 0
    )
    said = capsys.readouterr().out
    assert sum(row["tokens"] for row in rows_of(tmp_path / "x")) == 128
    assert "scored 128 tokens (--tokens 80, its last shard filled whole) in 8 blocks, 2 shard(s)" in said
    assert main([str(a) for a in [*argv[:2], tmp_path / "y", *argv[3:], "--tokens", "64", "--length", "16",
                                  "--batch-size", "4", "--no-progress"]]) == 0  # fmt: skip
    assert "scored 64 tokens in 4 blocks, 1 shard(s)" in capsys.readouterr().out  # what was asked: no more said


def test_uptrain_refuses_scored_text_read_in_other_blocks(tiny, tmp_path):
    corpus = tmp_path / "scored"
    scored(tiny, corpus, tiny["train"], tokens=64)
    argv = _stored_args(tiny, tmp_path / "run", corpus, ("--seq_len", "8"))
    with pytest.raises(Exception, match="scored in blocks of 16 tokens.*set seq_len 16"):
        uptrain(parse(argv))
    assert not (tmp_path / "run").exists()


def test_a_scored_corpus_extends_to_more_tokens_of_the_same_text(tiny, tmp_path, capsys):
    """A complete scored corpus asked for a larger --tokens was refused as 'gives other tokens' though its text was
    the same: its pin covered the samples it was begun with, which the longer order starts with."""
    out = tmp_path / "scored"
    scored(tiny, out, tiny["train"], tokens=160)
    first = rows_of(out)
    scored(tiny, out, tiny["train"], tokens=320)
    rows = rows_of(out)
    assert len(rows) == 20 and rows[:10] == first
    record = json.loads((out / "gqaify.json").read_text())
    assert record["complete"] and record["tokens"] == 320
    scored(tiny, out, tiny["train"], tokens=480)  # and again: the record pins the order it was extended to
    assert len(rows_of(out)) == 30 and rows_of(out)[:20] == rows
    rows = rows_of(out)
    (tmp_path / "other.txt").write_text(tiny["train"].read_text()[::-1])
    code, err = run_cli(
        capsys,
        "generate",
        tiny["parent"],
        out,
        "--score-data",
        tmp_path / "other.txt",
        "--tokens",
        "480",
        "--length",
        "16",
        "--batch-size",
        "2",
        "--top-logprobs",
        "8",
    )
    assert code == 2 and "other" in err and rows_of(out) == rows  # other text is still refused
