"""One way to configure every stage: the same fields from a --config file, options and keyword arguments;
gqaify.json and report.json rerun what made them; --help lists every field; bad settings exit 2 in one line."""

import dataclasses
import json
import os
import shutil
import threading
import types

import pytest
import yaml

import gqaify
from gqaify.conversion.settings import CONVERT, NOT_RECORDED, ConvertSettings
from gqaify.entry.cli import main
from gqaify.errors import UserError
from gqaify.eval.settings import EVAL
from gqaify.generation.settings import GENERATE
from gqaify.settings import parse
from gqaify.settings.fields import _RULES
from gqaify.summary import format_uptrain_summary
from gqaify.testing import CORPUS, build_model, save, save_with_tokenizer
from gqaify.uptrain.settings import UPTRAIN
from helpers import one_line, run_cli, tree_hashes

STAGES = [CONVERT, EVAL, UPTRAIN]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A GQA-4 llama in several shards, with a tokenizer (calibration reads text)."""
    model = build_model("llama", num_kv_heads=4, num_attention_heads=8, head_dim=8, vocab_size=300)
    directory = save_with_tokenizer(model, tmp_path_factory.mktemp("src") / "model")
    save(model, directory, "30KB")
    return directory


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_answers_with_the_installed_version(capsys, flag):
    from importlib.metadata import version

    assert main([flag]) == 0
    assert capsys.readouterr().out == f"gqaify {version('gqaify')}\n"


def test_every_stage_has_one_entry_of_one_shape():
    """gqaify.<stage>.run(settings) -> result, for every stage, taking that stage's settings and nothing else."""
    import inspect

    for stage, module in [
        (CONVERT, gqaify.conversion),
        (EVAL, gqaify.eval),
        (GENERATE, gqaify.generation),
        (UPTRAIN, gqaify.uptrain),
    ]:
        parameters = list(inspect.signature(module.run).parameters.values())
        assert [(p.name, p.annotation) for p in parameters] == [("settings", stage.settings.__name__)], stage.command


def test_evaluate_never_overwrites_what_its_settings_say():
    with pytest.raises(UserError, match="evaluate's models and its settings' models differ"):
        gqaify.evaluate(["parent"], "text.txt", "out", gqaify.EvalSettings(models=["another"]))


def test_every_field_is_an_option_with_its_help(capsys):
    for stage in STAGES:
        capsys.readouterr()
        assert main([stage.command, "--help"]) == 0
        shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        for field in dataclasses.fields(stage.settings):
            assert f"--{field.name}" in shown, (stage.command, field.name)
            assert " ".join(field.metadata["help"].split()[:4]) in shown, (stage.command, field.name)


@pytest.mark.parametrize(
    "command, records",
    [
        ("convert", "the gqaify.json gqaify convert wrote"),
        ("eval", "the report.json gqaify eval wrote"),
        ("generate", "the gqaify.json gqaify generate wrote"),
        ("uptrain", "the run.json or final/gqaify.json gqaify uptrain wrote"),
    ],
)
def test_each_commands_config_option_names_the_records_that_rerun_it(capsys, command, records):
    """`uptrain --help` said --recipe takes "the gqaify.json or report.json gqaify wrote", and an eval's report.json
    given to it is refused as eval's: each command names the records it reruns from (`Stage.record_files`)."""
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"YAML file of settings (its keys are the options below), or {records} (its settings: a rerun)" in text
    assert ("report.json" in text.split("--config FILE")[-1]) == (command == "eval")


def test_a_file_options_and_keywords_give_the_same_settings(tmp_path):
    values = {
        "src": "org/model",
        "out": "o",
        "kv_heads": 2,
        "method": "lsq",
        "calib_data": "c.txt",
        "calib_tokens": 4096,
        "dtype": "bfloat16",
        "force": True,
        "progress": False,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(values))
    options = [
        "org/model",
        "o",
        "--kv-heads",
        "2",
        "--method",
        "lsq",
        "--calib_data",
        "c.txt",
        "--calib-tokens",
        "4096",
        "--dtype",
        "bfloat16",
        "--force",
        "-q",
    ]
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
        (CONVERT, "src: a\nout: b\nkv_heads: 2\nattention: gqa2\n", "attention 'gqa2' is not one of gqa, mla; fix the"),
        (CONVERT, "- a\n- b\n", "must be a mapping of setting: value"),
        (CONVERT, "src: [a\n", "is not valid YAML (line 2)"),
        (EVAL, "models: [p, 3]\ndata: d\nout: r\n", "models ['p', 3] is not a list of text"),
        (EVAL, "data: d\n", "MODEL is required"),
        (UPTRAIN, "learning_rate: 1.0e-4\n", "unknown key 'learning_rate' (did you mean lr?)"),
    ],
)
def test_bad_files_are_refused_in_one_line(capsys, tmp_path, stage, text, expect):
    (tmp_path / "c.yaml").write_text(text)
    code, err = run_cli(capsys, stage.command, "--config", tmp_path / "c.yaml")
    assert code == 2 and err.count("\n") == 1 and expect in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.parametrize(
    "name, text", [("r.yaml", "micro_batch_size: auto\n"), ("r.json", '{"micro_batch_size": "auto"}')]
)
def test_a_word_a_number_field_takes_is_read_from_a_file_as_from_the_command_line(tmp_path, name, text):
    """micro_batch_size: auto, uptrain's own setting, was refused in every recipe and config file ("'auto' is not a
    whole number or one of auto"): a file's text was read as a number wherever the field takes one, even where the
    field takes that word too. Only the command line took it."""
    (tmp_path / name).write_text(text)
    argv = ["--recipe", str(tmp_path / name), "--model", "m", "--data", "d", "--output_dir", "o", "--max_tokens", "64"]
    assert parse(UPTRAIN, argv).micro_batch_size == "auto"
    (tmp_path / name).write_text(text.replace("auto", "3"))
    assert parse(UPTRAIN, argv).micro_batch_size == 3  # YAML's number, or JSON's text of one
    (tmp_path / name).write_text(text.replace("auto", "many"))
    with pytest.raises(UserError, match="micro_batch_size 'many' is not a whole number or one of auto; fix the file"):
        parse(UPTRAIN, argv)


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
    code, err = run_cli(
        capsys,
        "convert",
        os.path.relpath(source),
        "first",
        "--kv-heads",
        "2",
        "--method",
        "lsq",
        "--calib-data",
        "calib.txt",
        "--calib-tokens",
        "1024",
        "--calib-seq-len",
        "48",
        "--dtype",
        "bfloat16",
        "--max-shard-size",
        "20KB",
        "-q",
    )
    assert code == 0, err
    record = json.loads((first / "gqaify.json").read_text())
    assert record["settings"]["src"] == str(source.resolve()) and record["settings"]["out"] == str(first.resolve())
    assert record["settings"]["calib_data"] == [str((tmp_path / "calib.txt").resolve())]
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
    code, err = run_cli(
        capsys,
        "eval",
        parent,
        "--data",
        tmp_path / "text.txt",
        "--out",
        tmp_path / "r",
        "--seq-len",
        "32",
        "--no-speed",
        "-q",
    )
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


# -- a --config file from anyone: bounded in size, aliases and nesting; messages that say what is wrong


def test_any_yaml_alias_is_refused(capsys, tmp_path):
    (tmp_path / "c.yaml").write_text("src: &s a\nout: *s\nkv_heads: 1\n")
    code, err = run_cli(capsys, "convert", "--config", tmp_path / "c.yaml")
    assert code == 2 and err.count("\n") == 1 and "uses a YAML alias (*name) (line 2)" in err, err


def test_a_large_config_file_is_refused_before_it_is_parsed(capsys, tmp_path, monkeypatch):
    """50 MB of YAML parsed for 51 s before it was refused: YAML's parser is never started on it."""
    (tmp_path / "big.yaml").write_text("src: a\nout: b\nkv_heads: 1\n" + "# padding\n" * 110_000)

    def parsed(*args, **kwargs):
        raise AssertionError("the large file was parsed")

    monkeypatch.setattr(yaml, "load", parsed)
    code, err = run_cli(capsys, "convert", "--config", tmp_path / "big.yaml")
    assert code == 2 and err.count("\n") == 1, err
    assert "big.yaml is larger than 1 MiB of YAML; settings files are a few hundred bytes" in err


def test_a_huge_json_file_is_refused_before_it_is_read_whole(capsys, tmp_path):
    (tmp_path / "big.json").write_text('{"src": "' + "a" * (17 << 20) + '"}')
    code, err = run_cli(capsys, "convert", "--config", tmp_path / "big.json")
    assert code == 2 and err.count("\n") == 1 and "big.json is larger than 16 MiB" in err, err


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("src: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests values more than 32 deep (line 1)"),
        ('{"src": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests values too deeply"),
    ],
)
def test_deep_nesting_is_refused_in_one_line(capsys, tmp_path, text, expect):
    """A RecursionError, reported as an internal error."""
    (tmp_path / "deep.yaml").write_text(text)
    code, err = run_cli(capsys, "convert", "--config", tmp_path / "deep.yaml")
    assert code == 2 and err.count("\n") == 1 and expect in err, err


def test_a_message_shows_only_the_start_of_a_long_value(capsys, tmp_path):
    values = {"src": ["x" * 1000] * 10_000, "out": "o", "kv_heads": 1, "method": "y" * 100_000}
    (tmp_path / "c.json").write_text(json.dumps(values))
    code, err = run_cli(capsys, "convert", "--config", tmp_path / "c.json")
    assert code == 2 and err.count("\n") == 1 and len(err) < 800, err
    assert "src ['xxxx" in err and "...] is not text or empty" in err and "method 'yyyy" in err


def test_many_unknown_keys_are_named_five_at_a_time(capsys, tmp_path):
    (tmp_path / "c.yaml").write_text("".join(f"key{i}: 1\n" for i in range(40)))
    code, err = run_cli(capsys, "convert", "--config", tmp_path / "c.yaml")
    assert code == 2 and err.count("\n") == 1 and err.count("unknown key '") == 5, err
    assert err.count("c.yaml") == 1 and err.rstrip().endswith("'key4'; and 35 more unknown keys")


def test_a_folder_is_not_said_not_to_exist(capsys, tmp_path):
    code, err = run_cli(capsys, "convert", "--config", tmp_path)
    assert code == 2 and err.count("\n") == 1 and f"--config {tmp_path} is a folder, not a settings file" in err
    (tmp_path / "gqaify.json").write_text("{}")
    code, err = run_cli(capsys, "convert", "--config", tmp_path)
    assert code == 2 and f"is a folder, not a settings file; did you mean {tmp_path / 'gqaify.json'}?" in err


def test_a_device_is_not_said_not_to_exist(capsys):
    code, err = run_cli(capsys, "convert", "--config", "/dev/zero")
    assert code == 2 and err.count("\n") == 1, err
    assert "--config /dev/zero is a device, not a settings file; name the YAML file" in err


def test_a_pipe_is_read(tmp_path):
    """`--config <(...)`: the shell passes a pipe."""
    os.mkfifo(tmp_path / "pipe")
    writer = threading.Thread(target=(tmp_path / "pipe").write_text, args=("src: a\nout: b\nkv_heads: 1\n",))
    writer.start()
    assert parse(CONVERT, ["--config", str(tmp_path / "pipe")]).src == "a"
    writer.join()


@pytest.mark.parametrize(
    ("stage", "key"),
    [(CONVERT, "config"), (EVAL, "config"), (GENERATE, "config"), (UPTRAIN, "recipe"), (UPTRAIN, "config")],
)
def test_a_file_naming_another_file_is_told_so(capsys, tmp_path, stage, key):
    """It was told "unknown key 'config' (did you mean config?)"."""
    (tmp_path / "c.yaml").write_text(f"{key}: other.yaml\n")
    code, err = run_cli(capsys, stage.command, "--config", tmp_path / "c.yaml")
    assert code == 2 and err.count("\n") == 1, err
    assert f"a settings file cannot name another ({key}: ...); gqaify reads one" in err and "did you mean" not in err


@pytest.fixture(scope="module")
def records(source, tmp_path_factory):
    """A real gqaify.json and report.json."""
    folder = tmp_path_factory.mktemp("records")
    (folder / "text.txt").write_text(CORPUS)
    assert main(["convert", str(source), str(folder / "converted"), "--kv-heads", "1", "-q"]) == 0
    assert (
        main(
            [
                "eval",
                str(folder / "converted"),
                "--data",
                str(folder / "text.txt"),
                "--out",
                str(folder / "report"),
                "--seq-len",
                "32",
                "--no-speed",
                "-q",
            ]
        )
        == 0
    )
    return folder / "converted" / "gqaify.json", folder / "report" / "report.json"


def test_another_commands_record_is_named_with_its_command(capsys, records):
    """Each was told of its 23 unknown keys, in 1,675 characters."""
    conversion, report = records
    code, err = run_cli(capsys, "convert", "--config", report)
    assert code == 2 and err.count("\n") == 1, err
    assert (
        err == f"gqaify: error: --config {report} is an eval report, not convert's; use `gqaify eval --config "
        f"{report}`\n"
    )
    code, err = run_cli(capsys, "eval", "--config", conversion)
    assert code == 2 and f"is a conversion record, not eval's; use `gqaify convert --config {conversion}`" in err
    code, err = run_cli(capsys, "uptrain", "--recipe", conversion)
    assert code == 2 and "--recipe" in err and f"use `gqaify convert --config {conversion}`" in err


def test_another_commands_record_is_named_by_uptrains_python_parse(records):
    """With no stages handed, gqaify.uptrain.parse and load_recipe took none and said "unknown key 'src' ..."."""
    from gqaify.errors import UserError
    from gqaify.uptrain.settings import load_recipe
    from gqaify.uptrain.settings import parse as parse_uptrain

    conversion, report = records
    for read in (lambda path: parse_uptrain(["--recipe", str(path)]), load_recipe):
        with pytest.raises(UserError) as refused:
            read(conversion)
        assert str(refused.value).endswith(
            f"is a conversion record, not uptrain's; use `gqaify convert --config {conversion}`"
        ), refused.value
        with pytest.raises(UserError) as refused:
            read(report)
        assert "is an eval report, not uptrain's; use `gqaify eval --config" in str(refused.value)


def test_the_stage_registry_and_what_it_lists_agree(capsys):
    """Every entry of `gqaify.entry.stages.STAGES` names a `Stage` of its own command and a command line that answers
    --help; `gqaify` has a command for each (and for recipes and demo, which run no stage); every parser knows them
    all, the Python API's included."""
    import gqaify.uptrain
    from gqaify.entry.cli import build_parser, main
    from gqaify.entry.stages import STAGES
    from gqaify.settings import Stage
    from gqaify.settings.registry import every_stage, resolve

    stages = every_stage()
    assert [s.command for s in stages] == [e.name for e in STAGES] and all(isinstance(s, Stage) for s in stages)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {e.name for e in STAGES} | {"recipes", "demo"}
    for entry in STAGES:
        with pytest.raises(SystemExit) as done:
            resolve(entry.command_line)(["--help"], f"gqaify {entry.name}")
        assert done.value.code == 0 and f"usage: gqaify {entry.name}" in capsys.readouterr().out
        assert main([entry.name, "--help"]) == 0
    assert {s.command for s in stages} >= {"convert", "eval", "generate", "uptrain"}
    assert gqaify.uptrain.parse.__defaults__[-1] is None  # the Python API's parse names other stages' files too


def test_every_kind_of_record_reruns_the_one_command_whose_entry_lists_it():
    """A command's name was written three times: its entry, its `Stage` and the kinds of record that rerun it. The
    entry holds it alone: each kind of record is listed by one entry, and a `Stage` no entry names has no command."""
    from gqaify.entry.stages import STAGES
    from gqaify.records import KINDS
    from gqaify.settings import Stage
    from gqaify.settings.registry import rerun_by

    listed = [kind for entry in STAGES for kind in entry.records]
    assert sorted(listed) == sorted(KINDS)  # each kind once, and none gqaify does not know
    assert {kind: rerun_by(kind) for kind in KINDS} == {k: e.name for e in STAGES for k in e.records}
    with pytest.raises(LookupError, match="no entry of the declared stages names the Stage of EvalSettings"):
        print(Stage(EVAL.settings, "a stage no entry names").command)


def test_another_commands_settings_file_is_named_with_its_command(capsys, tmp_path):
    (tmp_path / "c.yaml").write_text("src: a\nout: b\nkv_heads: 1\nmethod: lsq\n")
    code, err = run_cli(capsys, "eval", "--config", tmp_path / "c.yaml")
    assert code == 2 and err.count("\n") == 1, err
    assert "holds gqaify convert's settings, not eval's; use `gqaify convert --config" in err


@pytest.mark.parametrize("given", [["--max-new-tokens", "5"], ["--max_new_tokens", "5"]])
def test_max_new_tokens_is_answered_with_generate_tokens(capsys, given):
    """It was told "did you mean --max-tokens", a different setting (the text evaluated)."""
    code, err = run_cli(capsys, "eval", "m", *given)
    dashed = given[0][2:].count("-") > 0
    expect = "--generate-tokens" if dashed else "--generate_tokens"
    assert code == 2 and err.count("\n") == 1 and f"unknown option {given[0]} (did you mean {expect}?)" in err, err


def test_a_path_with_a_newline_stays_on_one_summary_line(capsys, source, tmp_path):
    out = tmp_path / "new\nline"
    assert main(["convert", str(source), str(out), "--kv-heads", "1", "-q"]) == 0
    printed = capsys.readouterr().out
    assert f"  saved to        {str(out)!r}\n" in printed and "\nline" not in printed


def test_paths_with_a_newline_stay_on_one_line_of_what_eval_prints(capsys, source, tmp_path):
    model, out = tmp_path / "new\nline", tmp_path / "re\nport"
    shutil.copytree(source, model)
    (tmp_path / "text.txt").write_text(CORPUS)
    assert (
        main(
            [
                "eval",
                str(model),
                "--data",
                str(tmp_path / "text.txt"),
                "--out",
                str(out),
                "--seq-len",
                "32",
                "--no-speed",
                "-q",
            ]
        )
        == 0
    )
    # the table's header, rule and row; the panel's title, header (the model's name), rule and row; the report
    lines = capsys.readouterr().out.splitlines()
    # (the model named as the panel names it, by the shortest ending of its path: here its folder's name)
    named = repr(model.name)
    assert len(lines) == 9 and lines[2].startswith(f"{named}  ") and lines[5].endswith(named), lines
    assert lines[8] == f"report: {str(out / 'report.md')!r}, report.json; plots: {str(out)!r}/*.png"
    assert f"| {named} |" in (out / "report.md").read_text()


def test_uptrain_summary_paths_stay_on_one_line():
    result = types.SimpleNamespace(
        steps=1,
        tokens=10,
        loss=1.0,
        eval_perplexity=None,
        final="a\nb",
        metrics="m\tx.csv",
        plot="p\n.png",
        forecast=None,
    )
    lines = format_uptrain_summary(result).splitlines()
    assert lines[1:] == ["  model           'a\\nb'", "  metrics         'm\\tx.csv', plot 'p\\n.png'"]


@pytest.mark.parametrize("command", ["convert", "generate", "uptrain"])
def test_a_seed_past_what_the_generators_take_is_one_line_before_anything_is_written(capsys, tmp_path, command):
    """--seed 99999999999999999999999 was a traceback in convert and generate, and left generate's OUT behind."""
    src = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), tmp_path / "src")
    (tmp_path / "t.txt").write_text(CORPUS)
    args = {
        "convert": [str(src), str(tmp_path / "out"), "--kv-heads", "2", "--seed"],
        "generate": [str(src), str(tmp_path / "out"), "--tokens", "64", "--seed"],
        "uptrain": [
            "--model",
            str(src),
            "--output_dir",
            str(tmp_path / "out"),
            "--data",
            str(tmp_path / "t.txt"),
            "--max_tokens",
            "64",
            "--seed",
        ],
    }[command]
    capsys.readouterr()
    code = main([command, *args, "99999999999999999999999"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "must be a whole number from 0 to 2**32 - 1" in err, err
    assert not (tmp_path / "out").exists()


# -- a key given twice in a settings file: refused, not the last one taken


@pytest.mark.parametrize(
    ("command", "flag", "text", "expect"),
    [
        ("convert", "--config", "src: a\nout: b\nkv_heads: 1\nout: c\n", "gives the key 'out' twice (lines 2 and 4)"),
        ("convert", "--config", "src: a\nout: b\nkv_heads: 1\nx: {k: 1, k: 2}\n", "gives the key 'k' twice (line 4)"),
        (
            "uptrain",
            "--recipe",
            "model: a\nlr: 1.0e-4\nseq_len: 8\nlr: 2.0e-4\n",
            "gives the key 'lr' twice (lines 2 and 4)",
        ),
        ("convert", "--config", '{"src": "a", "out": "b", "kv_heads": 1, "out": "c"}', "gives the key 'out' twice"),
    ],
)
def test_a_key_given_twice_in_a_settings_file_is_refused(capsys, tmp_path, command, flag, text, expect):
    """PyYAML kept the last value of a repeated key: a file whose first `lr` a reader took for the one in force."""
    (tmp_path / "s.yaml").write_text(text)
    before = tree_hashes(tmp_path)
    code, err = run_cli(capsys, command, flag, tmp_path / "s.yaml")
    assert code == 2 and one_line(err) == f"gqaify: error: {flag} {tmp_path / 's.yaml'} {expect}; keep one", err
    assert tree_hashes(tmp_path) == before


def test_uptrain_takes_q_and_quiet_for_no_progress(tmp_path):
    """`gqaify uptrain -q` was an unknown option; convert, eval and generate take -q/--quiet."""
    from gqaify.uptrain.settings import parse as parse_uptrain

    args = ["--model", "m", "--output_dir", str(tmp_path / "out"), "--data", "t.txt", "--max_tokens", "4096"]
    assert parse_uptrain(args).progress
    assert not parse_uptrain([*args, "-q"]).progress
    assert not parse_uptrain([*args, "--quiet"]).progress


# -- a rerun from gqaify.json that changes what its calib_sha256 pins besides the text


@pytest.fixture(scope="module")
def mixture_record(source, tmp_path_factory):
    """A conversion calibrated on a mixture of two named texts weighed 2 1: its folder and its texts."""
    folder = tmp_path_factory.mktemp("mixture")
    prose, verse = folder / "prose.txt", folder / "verse.txt"
    prose.write_text(CORPUS * 4)
    verse.write_text(" ".join(reversed((CORPUS * 4).split())))
    calib = ["--calib-data", f"p={prose}", f"v={verse}", "--calib-weights", "2", "1", "--calib-tokens", "1000"]
    argv = ["convert", source, folder / "first", "--kv-heads", "2", "--method", "lsq", *calib, "--calib-seq-len", "48"]
    assert main([str(a) for a in [*argv, "-q"]]) == 0
    return folder


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        (
            ["--calib-weights", "1", "1"],
            "--calib-weights 1 1 differs from the recorded conversion's 2 1, and calib_sha256 pins the mixture by its "
            "sources' names, weights and texts; give --calib-weights 2 1 for the recorded mixture, or pass "
            "--calib-sha256 '' to convert with the new weights",
        ),
        (
            ["--calib-data", "prose={prose}", "verse={verse}"],
            "--calib-data names its sources prose, verse where the recorded conversion named them p, v, and "
            "calib_sha256 pins the mixture by its sources' names, weights and texts; use the recorded names, or pass "
            "--calib-sha256 '' to convert under the new ones",
        ),
    ],
)
def test_a_rerun_that_reweighs_or_renames_the_mixture_says_so(capsys, mixture_record, changed, said):
    """Both were refused as "the text changed since the recorded conversion", which it had not."""
    folder = mixture_record
    changed = [c.format(prose=folder / "prose.txt", verse=folder / "verse.txt") for c in changed]
    before = tree_hashes(folder)
    code, err = run_cli(
        capsys, "convert", "--config", folder / "first" / "gqaify.json", "--out", folder / "b", *changed
    )
    assert code == 2 and one_line(err) == f"gqaify: error: {said}", err
    assert tree_hashes(folder) == before and not (folder / "b").exists()


def test_a_rerun_with_the_recorded_mixture_however_written_converts(capsys, monkeypatch, mixture_record):
    """The same names and shares (4 2 is 2 1; a relative path is the recorded absolute one) are the recorded mixture."""
    folder = mixture_record
    monkeypatch.chdir(folder)
    given = ["--calib-data", "p=prose.txt", "v=./verse.txt", "--calib-weights", "4", "2", "-q"]
    code, err = run_cli(capsys, "convert", "--config", folder / "first" / "gqaify.json", "--out", folder / "c", *given)
    assert code == 0, err
    first, again = (json.loads((folder / f / "gqaify.json").read_text()) for f in ("first", "c"))
    assert again["calibration"]["sha256"] == first["calibration"]["sha256"] == first["settings"]["calib_sha256"]


# -- each field declared once


SETTINGS = [CONVERT.settings, EVAL.settings, GENERATE.settings, UPTRAIN.settings]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.__name__)
def test_no_field_of_the_settings_is_declared_twice(settings):
    """`progress` was declared four times, `dtype`, `seed` and `trust_remote_code` three times, uptrain's calib_split
    and calib_text_column again with other defaults: each field is declared by one class of the MRO, and a class
    that gives it another default or help lists it in its `overrides`."""
    import inspect

    names = {f.name for f in dataclasses.fields(settings)}
    declared: dict[str, list[str]] = {}
    for cls in settings.__mro__:
        for name in set(inspect.get_annotations(cls)) & names:
            if name not in vars(cls).get("overrides", ()):
                declared.setdefault(name, []).append(cls.__name__)
    assert {name: owners for name, owners in declared.items() if len(owners) > 1} == {}
    assert set(declared) == names


def declaring(settings, name: str) -> type:
    """The class of `settings`' MRO that declares the field `name` (not one that only overrides it)."""
    import inspect

    return next(
        c for c in settings.__mro__ if name in inspect.get_annotations(c) and name not in vars(c).get("overrides", ())
    )


def test_the_fields_of_a_conversion_are_declared_once_for_convert_and_uptrain():
    """kv_heads was declared by convert (at least 1, "1 is MQA") and by uptrain (a positive integer) with rules of
    their own: every field uptrain shares with convert (the conversion it runs, and the groups) is declared by one
    class, which uptrain words for itself with `override`."""
    convert_fields = {f.name for f in dataclasses.fields(CONVERT.settings)}
    shared = convert_fields & {f.name for f in dataclasses.fields(UPTRAIN.settings)}
    assert {"kv_heads", "kv_cut", "attention", "method", "calib_data"} <= shared
    apart = {n: (declaring(CONVERT.settings, n), declaring(UPTRAIN.settings, n)) for n in shared}
    assert {n: owners for n, owners in apart.items() if owners[0] is not owners[1]} == {}
    convert = CONVERT.settings(src="a", out="b", kv_heads=0).problems()
    uptrain = UPTRAIN.settings(model="a", output_dir="b", data="d", max_tokens=10**6, kv_heads=0).problems()
    assert convert == ["--kv-heads 0 must be a whole number of at least 1; 1 is MQA"]  # each names it its own way
    assert uptrain == ["kv_heads must be a whole number of at least 1, got 0; 1 is MQA"]


@pytest.mark.parametrize(
    ("settings", "data", "names", "split"),
    [
        (CONVERT.settings, "calib_data", ["calib_data", "calib_weights", "calib_split", "calib_text_column"], "train"),
        (UPTRAIN.settings, "data", ["data", "data_weights", "split", "text_column"], "train"),
        (UPTRAIN.settings, "eval_data", ["eval_data", "eval_split"], "test"),
        (GENERATE.settings, "score_data", ["score_data", "score_weights", "score_split", "score_text_column"], "train"),
        (EVAL.settings, "data", ["data", "split", "text_column"], "test"),
    ],
)
def test_a_text_is_declared_once_and_placed_under_each_stages_names(settings, data, names, split):
    """A text a stage reads (sources, weights, split, column) was declared four times under four prefixes: one
    `Texts` now declares it, placed where each stage lists it, with the same rules and help worded after its name."""
    from gqaify.settings import Needs, OnePerItem
    from gqaify.text.loading import named_texts_problem

    fields = {f.name: f for f in dataclasses.fields(settings)}
    order = [f.name for f in dataclasses.fields(settings)]
    assert order[order.index(data) : order.index(data) + len(names)] == names
    assert fields[data].metadata[_RULES] == (named_texts_problem,)
    assert fields[next(n for n in names if n.endswith("split"))].default == split
    weights = [n for n in names if n.endswith("weights")]
    if weights:
        rules = fields[weights[0]].metadata[_RULES]
        assert rules == (Needs(data, f"weighs {data} sources"), OnePerItem(data))
        assert fields[weights[0]].metadata["help"].startswith(f"one weight per {data} source: ")


def test_a_texts_sources_field_is_named_after_its_data():
    from gqaify.settings import Settings
    from gqaify.text.settings import Texts

    with pytest.raises(TypeError, match="the sources' field is named NAME_data or data"):

        class Misnamed(Settings):
            calib = Texts("calibration text", "a mixture")

    with pytest.raises(TypeError, match="declares split twice, once as data = Texts"):

        class Twice(Settings):
            data = Texts("text", "a panel")
            split: str = "train"


def test_an_override_changes_a_default_and_keeps_the_type_and_rules():
    """Uptrain's calib_split defaults to None (the training data's split) where convert's is "train"; both keep the
    one declaration's rules, and None is text only where the default made it so."""
    from gqaify.conversion.settings import ConvertSettings
    from gqaify.uptrain.settings import UptrainSettings

    assert UptrainSettings().calib_split is None and ConvertSettings().calib_split == "train"
    assert UptrainSettings.overrides == {"calib_split", "calib_text_column", "seed", "push_to_hub", "kv_heads"}
    with pytest.raises(UserError, match="calib_split None is not text"):
        ConvertSettings(calib_split=None)
    helps = [next(f for f in dataclasses.fields(s) if f.name == "seed").metadata["help"] for s in SETTINGS[::3]]
    assert helps == ["seed for --method random", "seed for the data order and the run"]  # convert's, uptrain's
    for stage in (CONVERT, UPTRAIN):
        problem = stage.settings(seed=2**32).problems()
        assert any("must be a whole number from 0 to 2**32 - 1" in p for p in problem), problem


def test_words_after_double_dash_are_positionals_not_unknown_options(capsys, tmp_path):
    """`gqaify convert SRC -- --out --kv-heads 1` (an output folder named like an option) answered "unknown option
    --kv-heads (did you mean --kv-heads?)"."""
    from helpers import one_line_refusal

    err = one_line_refusal(capsys, "convert", tmp_path / "src", "--", "--out", "--kv-heads", "1")
    assert "unexpected argument --kv-heads after '--'" in err and "then '--' and all the positionals" in err


def test_an_accelerate_config_and_a_command_line_option_in_a_settings_file_are_named(tmp_path, capsys):
    """`gqaify convert --config recipes/accelerate/fsdp.yaml` listed unknown keys with "did you mean kv_rank?"; a
    recipe holding `plan:` was "unknown key 'plan' (did you mean parent?)"."""
    from gqaify.entry.cli import main
    from helpers import REPO

    fsdp = REPO / "recipes" / "accelerate" / "fsdp.yaml"
    assert main(["convert", "--config", str(fsdp)]) == 2
    err = capsys.readouterr().err
    assert "is an accelerate config (distributed_type, compute_environment), not gqaify settings" in err, err
    assert "did you mean" not in err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\nplan: accelerate/cpu\n")
    assert main(["uptrain", "--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "plan is a command-line option (--plan), not a setting" in err, err
