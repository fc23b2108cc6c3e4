"""`--kv-cut X`: the cache as 1/X of the source's, for GQA (the K/V heads that make it) and for MLA (any X, its split
given or chosen on calibration text), checked against the conversions the explicit options make."""

from __future__ import annotations

import json

import pytest
import torch

import gqaify
from gqaify.conversion.mla.output import StartTrial
from gqaify.conversion.mla.split import candidate_splits
from gqaify.conversion.record import ConversionRecord
from gqaify.entry.cli import main
from gqaify.eval.settings import EvalSettings
from gqaify.testing import CORPUS, build_model, save_with_tokenizer
from helpers import calibrated_on, one_line, run_cli, tree_hashes

LAYERS, HEADS, HEAD_DIM = 2, 4, 16  # build_model's Llama: its cache is 2 x 4 x 16 = 128 values per token and layer


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """A tiny MHA Llama (4 K/V heads of 16) with a tokenizer, and calibration text beside it."""
    root = tmp_path_factory.mktemp("cut")
    src = save_with_tokenizer(build_model("llama", num_kv_heads=HEADS, vocab_size=320), root / "parent")
    (root / "calib.txt").write_text(CORPUS * 8)
    return src


def weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for path in sorted(folder.glob("*.safetensors")) for k, v in load_file(path).items()}


def test_a_gqa_cut_is_the_conversion_to_the_heads_it_names(parent, tmp_path):
    """--kv-cut 2 on 4 K/V heads is --kv-heads 2: the same tensors; the record says both."""
    assert main(["convert", str(parent), str(tmp_path / "cut"), "--kv-cut", "2", "-q"]) == 0
    assert main(["convert", str(parent), str(tmp_path / "heads"), "--kv-heads", "2", "-q"]) == 0
    cut, heads = weights(tmp_path / "cut"), weights(tmp_path / "heads")
    assert cut.keys() == heads.keys() and all(torch.equal(cut[k], heads[k]) for k in cut)
    record = json.loads((tmp_path / "cut" / "gqaify.json").read_text())
    assert (record["kv_heads"], record["settings"]["kv_cut"], record["settings"]["kv_heads"]) == (2, 2.0, 2)
    assert (
        main(["convert", "--config", str(tmp_path / "cut" / "gqaify.json"), "--out", str(tmp_path / "again"), "-q"])
        == 0
    )
    assert weights(tmp_path / "again").keys() == cut.keys()


def test_an_mla_cut_with_one_width_given_takes_the_rest_for_the_other(parent, tmp_path):
    """--kv-cut 2 leaves 64 values: --kv-rank 40 leaves 24 for the rotary key (12 rotary pairs in every layer, each
    frequency's pairs turned across the 4 heads)."""
    out = tmp_path / "mla"
    calib = str(parent.parent / "calib.txt")
    argv = ["--attention", "mla", "--kv-cut", "2", "--kv-rank", "40", *calibrated_on(calib)]
    assert main(["convert", str(parent), str(out), *argv, "-q"]) == 0
    mla = json.loads((out / "gqaify.json").read_text())["mla"]
    assert (mla["kv_rank"], mla["rope_dims"]) == (40, 24) and "splits" not in mla
    assert [sum(len(pairs) for pairs in layer) for layer in mla["rotary_pairs"]] == [12] * LAYERS
    assert mla["turned"] is True  # four K/V heads: each frequency's pairs turned across them


def test_an_mla_cut_alone_chooses_its_split_on_the_calibration_text_and_records_every_one_tried(parent, tmp_path):
    """--kv-cut 3 leaves floor(128 / 3) = 42 values; the splits tried are `candidate_splits`', the two closest to the
    parent on the held-out calibration windows are fitted, the closer after its fit is kept, and eval counts and
    measures its cache."""
    out = tmp_path / "mla"
    calib = str(parent.parent / "calib.txt")
    argv = ["--attention", "mla", "--kv-cut", "3", *calibrated_on(calib)]
    assert main(["convert", str(parent), str(out), *argv, "-q"]) == 0
    mla = json.loads((out / "gqaify.json").read_text())["mla"]
    tried = [(s["kv_rank"], s["rope_dims"]) for s in mla["splits"]]
    assert tried == candidate_splits(HEADS, HEADS, HEAD_DIM, 42) == [(34, 8), (26, 16), (18, 24), (10, 32)]
    assert all(s["kl"] > 0 for s in mla["splits"])
    closest = sorted(mla["splits"], key=lambda s: s["kl"])[:2]  # before the fit: these two are fitted
    assert [s for s in mla["splits"] if "fitted_kl" in s] == sorted(closest, key=mla["splits"].index)
    kept = min(closest, key=lambda s: s["fitted_kl"])  # after it: the closer kept
    assert (mla["kv_rank"], mla["rope_dims"]) == (kept["kv_rank"], kept["rope_dims"])
    settings = EvalSettings(seq_len=32, speed=False, progress=False)
    entry = gqaify.evaluate([str(out)], calib, tmp_path / "report", settings).models[0]
    assert entry.kv_cache_bytes_per_token == 42 * LAYERS * 4 and entry.cached_values == 42
    assert entry.kv_cache_bytes_analytic == entry.kv_cache_bytes_measured == 32 * 42 * LAYERS * 4


def test_an_mla_cut_whole_heads_make_keeps_the_start_closer_to_the_parent(parent, tmp_path, capsys):
    """--kv-cut 2 on 4 K/V heads: 2 heads make the cache, so two starts are tried, the GQA-2 conversion rewritten
    exactly and the parent compressed to the same 64 values. Mean-pooling random heads loses much; the parent
    compressed and fitted loses less, and is kept: the output is that conversion, and the record says both."""
    out, alone = tmp_path / "cut", tmp_path / "alone"
    calib = calibrated_on(parent.parent / "calib.txt")
    assert (
        main(["convert", str(parent), str(out), "--attention", "mla", "--kv-cut", "2", "--method", "mean", *calib]) == 0
    )
    said, told = capsys.readouterr()
    record = json.loads((out / "gqaify.json").read_text())
    mla = record["mla"]
    kls = {trial["start"]: trial["kl"] for trial in mla["starts"]}
    # said before the conversion began (the fits are most of its time; MLA fits went minutes without a word)
    splits = len(mla["splits"])
    assert told.splitlines()[0] == (
        f"MLA at 64 values per token and layer, after the G-head conversion: {splits} splits of the parent's cache "
        "judged, the 2 closest each fitted layer by layer (2 layers, 0 refinement steps each, on 32 windows), then "
        "that start and GQA-2's exact rewrite judged on up to 2,048 unseen calibration tokens. The fits take several "
        "times the G-head conversion's time; each shows its bar."
    )
    assert record["kv_heads"] == 2 and list(kls) == ["GQA-2", "parent"] and 0 < kls["parent"] < kls["GQA-2"]
    assert mla["from_parent"] is True and mla["kv_rank"] + mla["rope_dims"] == 64 and not mla["exact"]
    assert mla["judged_on"] == 2048  # the calibration text's next 2,048 tokens (below)
    # where the rewrite's time went, by step, in the record and the summary
    assert list(mla["seconds"]) == ["splits", "fits", "starts"] and min(mla["seconds"].values()) >= 0
    steps = ", ".join(f"{step} {seconds:.1f}" for step, seconds in mla["seconds"].items())
    assert f"  MLA rewrite     {sum(mla['seconds'].values()):.1f} s ({steps})" in said
    assert "from the parent)" in said and "MLA start       the parent compressed" in said
    assert "the closer on 2,048 tokens of calibration text no fit read" in said
    # both KLs to the same decimals (the summary printed 2.9 beside 0.9828), as the card says them too
    tried = f"GQA-2 {kls['GQA-2']:.3f}, parent {kls['parent']:.3f}"
    assert f"(KL {tried} nats/token)" in said and f"(KL per token: {tried})" in (out / "README.md").read_text()
    assert "K/V heads       4, the parent's, compressed into the latent" in said and "fit error" not in said
    assert "from the parent) in " in said  # the unkept GQA-2 conversion's --method is not the written model's
    read = ConversionRecord.read(out)  # read back typed
    assert read.rewrite.starts[1] == StartTrial("parent", kls["parent"]) and read.attention.endswith("from the parent)")
    argv = ["--kv-heads", str(HEADS), "--attention", "mla", "--kv-cut", "2", "--method", "mean", *calib]
    assert main(["convert", str(parent), str(alone), *argv, "-q"]) == 0  # the parent's own heads: compressed alone
    kept, expected = weights(out), weights(alone)
    assert kept.keys() == expected.keys() and all(torch.equal(kept[k], expected[k]) for k in kept)


def test_an_mla_cut_whole_heads_make_keeps_the_exact_rewrite_where_it_is_closer(parent, tmp_path, monkeypatch):
    """Where the GQA-2 conversion's exact rewrite is the closer start (here the judge is told so: the starts' KLs
    given in the order they are measured), it is what is written, the same as --kv-heads 2 alone writes, and the
    record keeps both starts and the splits the parent's start tried."""
    import gqaify.conversion.mla.output as mla_output

    told = iter([0.25, 0.5])  # the exact rewrite's, then the parent's
    monkeypatch.setattr(mla_output, "held_out_kls", lambda reference, models, windows: [next(told) for _ in models])
    calib = calibrated_on(parent.parent / "calib.txt")
    out, alone = tmp_path / "cut", tmp_path / "alone"
    assert main(["convert", str(parent), str(out), "--attention", "mla", "--kv-cut", "2", *calib, "-q"]) == 0
    assert main(["convert", str(parent), str(alone), "--attention", "mla", "--kv-heads", "2", *calib, "-q"]) == 0
    mla = json.loads((out / "gqaify.json").read_text())["mla"]
    assert mla["starts"] == [{"start": "GQA-2", "kl": 0.25}, {"start": "parent", "kl": 0.5}]
    assert mla["exact"] and "from_parent" not in mla and len(mla["splits"]) > 1
    kept, expected = weights(out), weights(alone)
    assert kept.keys() == expected.keys() and all(torch.equal(kept[k], expected[k]) for k in kept)


@pytest.mark.parametrize(
    ("told", "kept"),
    [
        ({"prose": (0.5, 0.2), "verse": (0.3, 0.4)}, "parent"),  # closer as a whole, further on verse: kept
        ({"prose": (0.5, 0.45), "verse": (0.3, 0.4)}, "exact"),  # further as a whole
    ],
)
def test_the_starts_are_judged_source_by_source_and_the_closer_as_a_whole_is_kept(
    parent, tmp_path, monkeypatch, capsys, told, kept
):
    """Each start's KL is recorded on each calibration source's unseen tokens, and the one closer over all of them
    is kept. Keeping the parent's start only where it was closer on every source was measured and dropped: on
    SmolLM2 at 16,384 tokens it kept MQA where the parent's start is closer on all five panel texts (the KLs are told
    here, per source, in the order the judge measures them: each source in --calib-data order, the exact rewrite's,
    then the parent's)."""
    import gqaify.conversion.mla.output as mla_output

    (tmp_path / "prose.txt").write_text(CORPUS * 8)
    (tmp_path / "verse.txt").write_text(" ".join(reversed(CORPUS.split())) * 8)
    order = iter([told[name][start] for name in ("prose", "verse") for start in (0, 1)])
    monkeypatch.setattr(mla_output, "held_out_kls", lambda reference, models, windows: [next(order) for _ in models])
    calib = ["--calib-data", str(tmp_path / "prose.txt"), str(tmp_path / "verse.txt"), "--calib-seq-len", "64"]
    calib += ["--calib-tokens", "2048"]
    out, alone = tmp_path / "cut", tmp_path / "alone"
    assert main(["convert", str(parent), str(out), "--attention", "mla", "--kv-cut", "2", *calib]) == 0
    said = capsys.readouterr().out
    mla = ConversionRecord.read(out).rewrite
    assert [start.by_source for start in mla.starts] == [{n: kls[i] for n, kls in told.items()} for i in (0, 1)]
    tokens = mla.judged_on / 2  # the two sources' unseen tokens, alike here
    assert [start.kl for start in mla.starts] == [
        pytest.approx(sum(kls[i] * tokens for kls in told.values()) / mla.judged_on) for i in (0, 1)
    ]
    if kept == "parent":
        assert mla.from_parent and "MLA start       the parent compressed, the closer" in said
    else:
        assert not mla.from_parent and "MLA start       the exact rewrite of GQA-2, the closer" in said
        assert main(["convert", str(parent), str(alone), "--attention", "mla", "--kv-heads", "2", *calib, "-q"]) == 0
        written, expected = weights(out), weights(alone)
        assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in written)


@pytest.mark.parametrize(("tokens", "unseen"), [(2048, 2048), (4096, 2432), (6528, 0)])
def test_the_two_starts_are_judged_on_calibration_text_no_fit_read(parent, tmp_path, monkeypatch, tokens, unseen):
    """Both starts read every calibration window (GQA's fit its second moments, MLA's its covariance), so the judge
    reads the text past them: the tokens after the first --calib-tokens of the source, as many again (what the
    tokenizer makes of the text, read here directly), or what is left of it; where nothing is left, the fits'
    held-out windows, and the record and the summary say which."""
    from transformers import AutoTokenizer

    import gqaify.conversion.mla.output as mla_output

    judged = []

    def judge(reference, models, windows):  # both starts in one pass over the windows: one list a start
        judged.extend([windows] * len(models))
        return [0.5] * len(models)

    monkeypatch.setattr(mla_output, "held_out_kls", judge)
    calib = ["--calib-data", str(parent.parent / "calib.txt"), "--calib-seq-len", "64", "--calib-tokens", str(tokens)]
    out = tmp_path / "cut"
    assert main(["convert", str(parent), str(out), "--attention", "mla", "--kv-cut", "2", *calib, "-q"]) == 0
    mla = json.loads((out / "gqaify.json").read_text())["mla"]
    ids = AutoTokenizer.from_pretrained(parent)(CORPUS * 8).input_ids
    assert len(ids) == 6528  # the calibration text holds this many tokens
    starts = judged[-2:]  # the two starts' judge (the fit's own judging comes before)
    assert starts[0] == starts[1] or all(torch.equal(a, b) for a, b in zip(*starts, strict=True))
    if unseen:
        assert mla["judged_on"] == unseen and torch.cat(starts[0]).tolist() == ids[tokens : tokens + unseen]
    else:
        assert "judged_on" not in mla and sum(len(w) for w in starts[0]) < tokens  # the held-out windows


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--kv-cut", "3"],
            "no whole number of the source's 4 K/V heads caches 1/3 of them; GQA cuts this model by 1, 2, 4",
        ),
        (["--kv-cut", "4", "--kv-heads", "2"], "--kv-heads 2 and --kv-cut 4 disagree (the cut means 1 K/V heads)"),
        (["--kv-cut", "1.0000000001"], "--kv-cut 1.0000000001: no whole number of the source's 4 K/V heads"),
        ([], "say how small the cache becomes: --kv-heads G (1 = MQA) or --kv-cut X"),
        (["--kv-cut", "0.5"], "--kv-cut"),
        (["--kv-cut", "3", "--attention", "mla"], "add --calib-data"),
        (
            ["--kv-cut", "2", "--attention", "mla", "--kv-rank", "30", "--rope-dims", "24", "--calib-data", "x.txt"],
            "--kv-rank 30 and --rope-dims 24 cache 54 values, where --kv-cut 2 means 64",
        ),
        (["--kv-cut", "200", "--attention", "mla", "--calib-data", "x.txt"], "too few for a rotary pair"),
        (
            ["--kv-cut", "2", "--attention", "mla", "--kv-rank", "30", "--calib-data", "x.txt"],
            "--kv-cut 2 with --kv-rank 30 leaves a rotary key of 34 values, not a multiple of 8",
        ),
        # a width that takes every value the cut leaves was "the latent needs at least 1 and the rotary key 2",
        # naming neither option the user gave
        (
            ["--kv-cut", "2", "--attention", "mla", "--rope-dims", "64", "--calib-data", "x.txt"],
            "--kv-cut 2 leaves 64 values per token and layer, and --rope-dims 64 takes every one, leaving the latent "
            "none (it needs at least 1); give --rope-dims below 64",
        ),
        (
            ["--kv-cut", "2", "--attention", "mla", "--rope-dims", "96", "--calib-data", "x.txt"],
            "and --rope-dims 96 takes more than that",
        ),
        (
            ["--kv-cut", "2", "--attention", "mla", "--kv-rank", "70", "--calib-data", "x.txt"],
            "and --kv-rank 70 leaves the rotary key 0 (it needs at least 2); give --kv-rank at most 56",
        ),
    ],
)
def test_a_cut_that_cannot_be_made_is_one_line_and_writes_nothing(parent, tmp_path, capsys, argv, says):
    argv = [str(parent.parent / "calib.txt") if a == "x.txt" else a for a in argv]
    before = tree_hashes(parent)
    code, err = run_cli(capsys, "convert", parent, tmp_path / "out", *argv)
    assert code == 2 and one_line(err) and says in err
    assert sorted(tmp_path.iterdir()) == [] and tree_hashes(parent) == before


# -- uptrain's conversion takes the cut too --------------------------------------------------------------------------


def uptrain_argv(parent, tmp_path, *more):
    (tmp_path / "train.txt").write_text(CORPUS * 4)
    argv = ["--model", parent, "--output_dir", tmp_path / "run", "--data", tmp_path / "train.txt", "--seq_len", "16"]
    return [*map(str, argv), "--micro_batch_size", "2", "--max_tokens", "320", "--no-progress", *more]


def test_uptrain_converts_to_the_cut_it_is_given(parent, tmp_path):
    """uptrain's kv_cut is the conversion's: GQA at 1/2 of 4 K/V heads trains the 2-head model convert makes."""
    from gqaify.uptrain import parse
    from gqaify.uptrain import run as uptrain

    uptrain(parse(uptrain_argv(parent, tmp_path, "--kv_cut", "2")))
    assert main(["convert", str(parent), str(tmp_path / "heads"), "--kv-heads", "2", "-q"]) == 0
    converted, heads = weights(tmp_path / "run" / "converted"), weights(tmp_path / "heads")
    assert converted.keys() == heads.keys() and all(torch.equal(converted[k], heads[k]) for k in heads)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_uptrains_mla_cut_is_chosen_on_its_data_and_its_plan_counts_no_less_than_it_trains(parent, tmp_path):
    """An MLA cut alone in uptrain: the split chosen on the training data (its calibration text by default) and
    recorded; the memory plan of the same settings, made before any split is chosen, counts no fewer weights than
    the model the run trained, and the GQA cut plans as the heads it names."""
    from safetensors.torch import load_file

    from gqaify.uptrain import parse
    from gqaify.uptrain import run as uptrain
    from gqaify.uptrain.plan import Launch, plan

    argv = uptrain_argv(parent, tmp_path, "--attention", "mla", "--kv_cut", "4", "--calib_seq_len", "64")
    uptrain(parse(argv))
    record = json.loads((tmp_path / "run" / "converted" / "gqaify.json").read_text())
    mla = record["mla"]
    assert mla["kv_rank"] + mla["rope_dims"] == 2 * HEADS * HEAD_DIM // 4 and len(mla["splits"]) > 1
    assert record["settings"]["calib_data"] == [str(tmp_path / "train.txt")]
    trained = load_file(tmp_path / "run" / "final" / "model.safetensors")
    one = Launch(1, False, "no")
    assert plan(parse(argv), one).student >= 4 * sum(t.numel() for t in trained.values())
    cut = plan(parse(uptrain_argv(parent, tmp_path, "--kv_cut", "2")), one)
    assert cut == plan(parse(uptrain_argv(parent, tmp_path, "--kv_heads", "2")), one)
