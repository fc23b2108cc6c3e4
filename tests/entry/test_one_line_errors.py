"""Inputs that ended in a traceback are one line naming the problem and the fix, exit 2, nothing written: a data
name that is no path and no hub dataset, a name longer than the file system allows, an integer Python will not
read in a --config file, a malformed accelerate config, a record whose fields are of the wrong type, a damaged
parent given to eval."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gqaify._version import __version__
from gqaify.eval.settings import EvalSettings
from gqaify.records import CorpusRecord, Mistyped, ReportRecord, RunRecord, UptrainedRecord, as_json, from_json
from helpers import one_line_refusal, tree_hashes, uptrain_args

LONG = "a" * 300  # one name longer than any file system's NAME_MAX (255 bytes)


def eval_args(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["eval", tiny["parent"], "--out", out, "--seq-len", "16", "--no-speed", *extra]


# -- a. a data name that is neither a path nor a hub dataset ----------------------------------------------------


@pytest.mark.parametrize("value", ["@", ":x", "wiki=@test", "x:", "owner/name@"])
def test_a_data_name_that_is_no_path_and_no_hub_dataset_is_one_line(tiny, tmp_path, capsys, value):
    """`--data @` reached datasets' hub loader, whose IndexError was an internal error."""
    out = tmp_path / "report"
    err = one_line_refusal(capsys, *eval_args(tiny, out, "--data", value))
    source = value.partition("=")[2] or value
    assert f"--data {value}: no such file or folder, and {source!r} is no hub dataset" in err
    assert "owner/name[:config][@split]" in err and not out.exists()


@pytest.mark.parametrize(
    "argv, option",
    [
        (["generate", "{parent}", "{out}", "--top-logprobs", "2", "--score-data", "@"], "--score-data"),
        (["convert", "{parent}", "{out}", "--kv-heads", "2", "--method", "lsq", "--calib-data", ":x"], "--calib-data"),
        (["uptrain", *uptrain_args({"converted": "{converted}", "train": "@"}, Path("{out}"))], "data"),
        (
            [
                "uptrain",
                *uptrain_args({"converted": "{converted}", "train": "{train}"}, Path("{out}"), "--eval_data", "@"),
            ],
            "eval_data",
        ),
    ],
)
def test_every_commands_data_names_are_checked_at_parse_time(tiny, tmp_path, capsys, argv, option):
    out = tmp_path / "out"
    given = {"parent": tiny["parent"], "converted": tiny["converted"], "train": tiny["train"], "out": out}
    err = one_line_refusal(capsys, *[a.format(**given) for a in map(str, argv)])
    assert f"{option} " in err and "is no hub dataset" in err and not out.exists()


def test_hub_dataset_names_are_read_as_the_hub_writes_them():
    """The rule refuses what is no `owner/name[:config][@split]`, and nothing that is."""
    good = ["Salesforce/wikitext:wikitext-2-raw-v1@test", "wiki=gpt2", "tinystories@train[:10%]", "a.b-c_d/e"]
    assert not EvalSettings(models=["m"], data=good, out="o").problems()
    for bad in ("@test", "x//y", "wiki=owner/name/more", "na me", "x:y@"):
        assert any("is no hub dataset" in p for p in EvalSettings(models=["m"], data=[bad], out="o").problems()), bad


# -- b. a name longer than the file system allows ---------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, option",
    [
        (["eval", "{parent}", "--data", f"{LONG}.txt", "--out", "{out}"], "--data"),
        (["eval", "{parent}", LONG, "--data", "{train}", "--out", "{out}"], "MODEL"),
        (["eval", "{parent}", f"./{LONG}", "--data", "{train}", "--out", "{out}"], "MODEL"),
        (["generate", LONG, "{out}", "--tokens", "32"], "MODEL"),
        (["generate", "{parent}", "{out}", "--top-logprobs", "2", "--score-data", LONG], "--score-data"),
        (["convert", "{parent}", "{out}", "--kv-heads", "2", "--method", "lsq", "--calib-data", LONG], "--calib-data"),
        (["uptrain", *uptrain_args({"converted": LONG, "train": "{train}"}, Path("{out}"))], "model"),
    ],
)
def test_a_name_longer_than_the_file_system_allows_is_one_line(tiny, tmp_path, capsys, argv, option):
    """pathlib's exists() raises ENAMETOOLONG (Python 3.11): that was a traceback wherever a name was looked up."""
    out = tmp_path / "out"
    given = {"parent": tiny["parent"], "train": tiny["train"], "out": out}
    err = one_line_refusal(capsys, *[a.format(**given) for a in argv])
    assert f"{option} " in err and "names a path longer than the file system allows" in err and not out.exists()


@pytest.mark.parametrize("argv", [["eval", "--config", f"{LONG}.yaml"], ["uptrain", "--plan", LONG]])
def test_a_settings_or_accelerate_file_with_too_long_a_name_is_one_line(tiny, tmp_path, capsys, argv):
    if argv[0] == "uptrain":
        argv = ["uptrain", *uptrain_args(tiny, tmp_path / "out"), *argv[1:]]
    err = one_line_refusal(capsys, *argv)
    assert "aaaa" in err and not (tmp_path / "out").exists()


# -- c. an integer Python will not read in a --config file ------------------------------------------------------


@pytest.mark.parametrize(
    "text, key, line",
    [
        (f"seq_len: {'9' * 5000}\n", "seq_len", 1),
        ('{"seq_len": ' + "9" * 5000 + "}", "seq_len", 1),  # JSON (json.loads fails the same way)
        (f"seq_len: 16\ndata:\n  - a.txt\n  - {'9' * 5000}\n", "data", 4),
    ],
)
def test_an_integer_python_will_not_read_in_a_config_file_is_one_line_naming_its_key(
    tiny, tmp_path, capsys, text, key, line
):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    out = tmp_path / "report"
    err = one_line_refusal(capsys, *eval_args(tiny, out, "--config", config))
    assert f"--config {config} gives {key} an integer of 5,000 digits (line {line})" in err
    assert "fix the value" in err and not out.exists()


def test_an_integer_too_large_for_a_float_is_checked_against_its_range(tiny, tmp_path, capsys):
    """Range compared it through math.isfinite: OverflowError."""
    out = tmp_path / "report"
    err = one_line_refusal(capsys, "eval", tiny["parent"], "--data", tiny["eval"], "--out", out, "--seq-len", "9" * 400)
    assert "exceeds the 64 positions" in err and not out.exists()


# -- d. an accelerate config whose fsdp_config is malformed -----------------------------------------------------


@pytest.mark.parametrize(
    "fsdp_config, says",
    [
        (
            "fsdp_config:\n  - fsdp_version: 2\n",
            "fsdp_config must be a mapping of fsdp_* keys, got [{'fsdp_version': 2}]",
        ),
        ("fsdp_config: 7\n", "fsdp_config must be a mapping of fsdp_* keys, got 7"),
        ("fsdp_config:\n  fsdp_version: two\n", "fsdp_config's fsdp_version 'two' is not 1 or 2"),
        ("fsdp_config:\n  fsdp_version: [2]\n", "fsdp_config's fsdp_version [2] is not 1 or 2"),
        ("fsdp_config:\n  fsdp_version: 2.5\n", "fsdp_config's fsdp_version 2.5 is not 1 or 2"),
    ],
)
def test_an_accelerate_config_with_a_malformed_fsdp_config_is_one_line(tiny, tmp_path, capsys, fsdp_config, says):
    plan = tmp_path / "fsdp.yaml"
    plan.write_text(f"distributed_type: FSDP\nnum_processes: 2\n{fsdp_config}")
    out = tmp_path / "run"
    err = one_line_refusal(capsys, "uptrain", *uptrain_args(tiny, out), "--plan", plan)
    assert f"--plan {plan}: {says}" in err and not out.exists()


# -- e. a record whose fields are of the wrong type -------------------------------------------------------------

HEADER = {"tool": "gqaify", "version": __version__}


@pytest.mark.parametrize(
    "cls, value, says",
    [
        (
            CorpusRecord,
            {"parent": "p", "settings": {}, "shards": "x", "samples": 0, "tokens": 0, "complete": True},
            "shards 'x' is not a whole number",
        ),
        (
            CorpusRecord,
            {"parent": "p", "settings": {}, "shards": None, "samples": 0, "tokens": 0, "complete": True},
            "shards null is not a whole number",
        ),
        (
            CorpusRecord,
            {"parent": "p", "settings": {}, "shards": 1, "samples": [1], "tokens": 0, "complete": True},
            "samples [1] is not a whole number",
        ),
        (
            CorpusRecord,
            {"parent": "p", "settings": {}, "shards": 1, "samples": 1, "tokens": 0, "complete": "yes"},
            "complete 'yes' is not true or false",
        ),
        (
            CorpusRecord,
            {
                "parent": "p",
                "settings": {},
                "shards": 1,
                "samples": 1,
                "tokens": 0,
                "complete": True,
                "vocab_size": "512",
            },
            "vocab_size '512' is not a whole number or null",
        ),
        (RunRecord, {"settings": {}, "started": "yes"}, "started 'yes' is not true or false"),
        (RunRecord, {"settings": [1]}, "settings [1] is not a JSON object"),
        (
            RunRecord,
            {"settings": {}, "parent_perplexities": {"wiki": "x"}},
            "parent_perplexities {'wiki': 'x'} is not a JSON object, each value a number or null",
        ),
        (ReportRecord, {"settings": {}, "files": ["a", 2]}, "files ['a', 2] is not a list, each item text or null"),
        (
            UptrainedRecord,
            {"uptrain": {"from": "m", "steps": "x", "tokens": 1, "settings": {}}},
            "uptrain.steps 'x' is not a whole number",
        ),
    ],
)
def test_every_record_kind_is_read_with_its_fields_types_checked(cls, value, says):
    with pytest.raises(Mistyped) as raised:
        from_json(cls, {**HEADER, "kind": cls.kind, **value})
    assert str(raised.value) == says


def test_a_corpus_record_of_the_wrong_types_is_one_line_naming_the_file_the_field_and_the_fix(tiny, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    (corpus / "data").mkdir(parents=True)
    (corpus / "data" / "train-00000.jsonl").write_text(json.dumps({"text": "a b c", "prompt": "", "tokens": 3}) + "\n")
    record = CorpusRecord(version=__version__, parent="p", settings={}, shards=1, samples=1, tokens=3, complete=True)
    (corpus / "gqaify.json").write_text(json.dumps({**as_json(record), "complete": "yes"}))
    before, out = tree_hashes(corpus), tmp_path / "report"
    err = one_line_refusal(capsys, *eval_args(tiny, out, "--data", corpus))
    assert (
        f"{corpus / 'gqaify.json'} is not a corpus record this gqaify reads: complete 'yes' is not true or false" in err
    )
    assert "write it again (gqaify generate)" in err
    assert not out.exists() and tree_hashes(corpus) == before


def test_a_run_json_of_the_wrong_types_is_one_line_naming_the_file_the_field_and_the_fix(tiny, tmp_path, capsys):
    """ "started": "yes" was read as true: the run's folder taken for one whose training began."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({**HEADER, "kind": "run", "settings": {}, "started": "yes"}))
    before = tree_hashes(out)
    err = one_line_refusal(capsys, "uptrain", *uptrain_args(tiny, out))
    assert f"run.json is damaged ({out / 'run.json'} is not a run record this gqaify reads: started 'yes'" in err
    assert "use a new output_dir" in err and tree_hashes(out) == before


# -- f. a damaged parent given to eval ---------------------------------------------------------------------------


@pytest.mark.parametrize("damaged", [0, 1])
def test_a_truncated_model_given_to_eval_is_one_line_before_any_model_is_loaded(tiny, tmp_path, capsys, damaged):
    """The parent (first) or the model compared with it, a shard of its weights cut to 1,000 bytes: safetensors' error
    came out of transformers' load as a traceback (after the parent's evaluation, for the second)."""
    cut = shutil.copytree(tiny["parent"], tmp_path / "cut")
    shard = sorted(cut.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(1000)
    models = [tiny["converted"], tiny["converted"]]
    models[damaged] = cut
    out = tmp_path / "report"
    err = one_line_refusal(capsys, "eval", *models, "--data", tiny["eval"], "--out", out, "--seq-len", "16")
    assert f"MODEL {cut}: corrupt shard {shard}" in err and "re-download" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [["--constraints"], ["--help"], ["--version"], ["convert", "--help"], ["uptrain", "--help"], ["recipes"]],
    ids=lambda argv: " ".join(argv),
)
def test_a_closed_pipe_ends_every_command_quietly(argv):
    """`gqaify --constraints | true` ended in a BrokenPipeError traceback: output written after its reader has gone
    (here: a pipe whose reading end is closed before the command starts, so every write fails) ends the command
    with nothing on stderr: status 141 as a shell reports SIGPIPE, or 0 where the writer itself let the failed write
    go (argparse's --help and --version do)."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gqaify.entry.cli", *argv], stdout=write, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode in (0, 141), (done.returncode, done.stderr)


def test_a_number_that_is_not_finite_is_called_so(tmp_path, capsys):
    """`--target-kl inf` was "must be a positive number, got inf": inf is above every low bound, so the line says it
    must be finite."""
    from gqaify.entry.cli import main

    for value in ("inf", "1e400"):
        argv = ["uptrain", "--model", "m", "--output_dir", str(tmp_path / "r"), "--data", "d", "--max_tokens", "64"]
        assert main([*argv, "--target_kl", value]) == 2
        err = capsys.readouterr().err
        assert one_line_refusal_text(err) and "target_kl must be a positive number, and finite, got inf" in err, err


def one_line_refusal_text(err: str) -> bool:
    lines = err.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("gqaify")


def test_a_model_folder_given_as_text_is_named_a_model(tmp_path, capsys):
    """`--data s-mla` (a model folder) was read as JSON lines: "Couldn't cast array of type int64 to null"."""
    from gqaify.entry.cli import main
    from gqaify.testing import build_model, save_with_tokenizer

    model = save_with_tokenizer(build_model("llama", num_kv_heads=2, vocab_size=320), tmp_path / "model")
    assert main(["eval", str(model), "--data", str(model), "--out", str(tmp_path / "r"), "-q"]) == 2
    err = capsys.readouterr().err
    assert one_line_refusal_text(err) and f"--data {model} is a model folder (config.json and its weights)" in err
    assert not (tmp_path / "r").exists()
