"""uptrain's output_dir keeps everything of the user's: it is claimed as convert's and generate's OUTs are (a second
run is refused at once, writing nothing), and a run removes there only what it wrote, by name, never a model or text
it reads however it is spelled; a damaged input is refused before the folder is touched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import one_line, tree_hashes, uptrain_args


def test_a_run_removes_its_own_files_inside_a_folder_it_reads_but_never_what_it_reads(tmp_path):
    """output_dir inside the model's folder: run.json is still the run's to replace (nothing was removed, and the
    old conversion would have been trained under new settings); a model inside output_dir is kept."""
    from gqaify.uptrain.run_folder import remove_run_files

    model = tmp_path / "ckpt"
    out = model / "up"
    (out / "converted").mkdir(parents=True)
    (out / "run.json").write_text("{}")
    (model / "config.json").write_text("{}")
    assert remove_run_files(out, {"run.json", "converted"}, reads=[model]) == ["run.json", "converted/"]
    assert (model / "config.json").is_file() and list(out.iterdir()) == []
    (out / "converted").mkdir()
    assert remove_run_files(out, {"converted"}, reads=[(out / "converted").resolve()]) == []
    assert (out / "converted").is_dir()


def test_a_runs_folder_is_recorded_absolute_and_its_record_reruns_it_from_any_folder(tiny, tmp_path, monkeypatch):
    """run.json recorded output_dir as typed (relative): `--config ../u1/run.json` from another folder then started a
    new run in ./u1 there. The folder is recorded absolute, and the record addresses its own run from anywhere."""
    from gqaify.uptrain import parse
    from gqaify.uptrain import run as uptrain

    monkeypatch.chdir(tmp_path)
    first = uptrain(parse(uptrain_args(tiny, Path("u1"))))
    record = json.loads((tmp_path / "u1" / "run.json").read_text())
    assert record["settings"]["output_dir"] == str(tmp_path / "u1")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    again = uptrain(parse(["--config", "../u1/run.json"]))
    assert again.final == tmp_path / "u1" / "final" and again.steps == first.steps
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_moved_or_copied_run_resumes_where_it_is(tiny, tmp_path, capsys):
    """A run's identity is its settings, not its folder's path: a run folder moved (or copied) resumes in its new
    place, and a setting that really differs is named without advice to delete the run's checkpoints."""
    from gqaify.entry.cli import main

    settings = ("--save_every", "10")
    assert main(["uptrain", *uptrain_args(tiny, tmp_path / "u1", *settings)]) == 0
    shutil.rmtree(tmp_path / "u1" / "final")
    shutil.copytree(tmp_path / "u1", tmp_path / "copy")
    (tmp_path / "u1").rename(tmp_path / "u2")
    capsys.readouterr()
    for folder in ("u2", "copy"):
        assert main(["uptrain", *uptrain_args(tiny, tmp_path / folder, *settings)]) == 0
        assert "resuming from" in capsys.readouterr().out
        assert (tmp_path / folder / "final" / "model.safetensors").is_file()
    shutil.rmtree(tmp_path / "u2" / "final")
    assert main(["uptrain", *uptrain_args(tiny, tmp_path / "u2", *settings, "--lr", "5e-4")]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "(it had lr=0.001, now 0.0005); rerun with lr as it had" in err and "delete" not in err


def test_a_moved_or_copied_runs_own_record_reruns_it_where_it_is(tiny, tmp_path, capsys):
    """`--config DIR/run.json` addressed the output_dir recorded inside: after `mv ua ub`, ub's run.json started a new
    run from step 1 in ua, and a copy's run.json resumed the original. A run.json reruns the run in the folder it sits
    in; read under another name, away from its folder, it is refused saying so."""
    from gqaify.entry.cli import main

    ua, ub, uc = tmp_path / "ua", tmp_path / "ub", tmp_path / "uc"
    assert main(["uptrain", *uptrain_args(tiny, ua, "--save_every", "10")]) == 0
    shutil.rmtree(ua / "final")
    shutil.rmtree(ua / "checkpoints" / "step-0000020")  # as a run stopped after step 10 leaves it
    ua.rename(ub)
    capsys.readouterr()
    assert main(["uptrain", "--config", str(ub / "run.json"), "--save_every", "10", "--no_progress"]) == 0
    assert f"resuming from {ub / 'checkpoints' / 'step-0000010'} (step 10 of 20)" in capsys.readouterr().out
    assert (ub / "final" / "model.safetensors").is_file() and not ua.exists()
    assert json.loads((ub / "run.json").read_text())["settings"]["output_dir"] == str(ub)
    shutil.rmtree(ub / "final")
    shutil.rmtree(ub / "checkpoints" / "step-0000020")
    shutil.copytree(ub, uc, symlinks=True)
    original = tree_hashes(ub)
    assert main(["uptrain", "--config", str(uc / "run.json"), "--save_every", "10", "--no_progress"]) == 0
    assert f"resuming from {uc / 'checkpoints' / 'step-0000010'} (step 10 of 20)" in capsys.readouterr().out
    assert (uc / "final" / "model.safetensors").is_file() and tree_hashes(ub) == original
    shutil.copyfile(ub / "run.json", tmp_path / "settings.json")
    assert main(["uptrain", "--config", str(tmp_path / "settings.json"), "--no_progress"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"--recipe {tmp_path / 'settings.json'} is an uptraining run's record renamed" in err, err
    assert tree_hashes(ub) == original and not ua.exists()


@pytest.mark.parametrize("depth", ["run", "a/b/run", "."])
def test_an_output_dir_inside_the_model_it_trains_is_refused(tiny, tmp_path, depth, capsys):
    """`--output-dir MODEL/run` wrote checkpoints and final/ into the user's model (convert refuses that layout);
    refused at any depth, writing nothing."""
    from gqaify.entry.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny["converted"], model)
    before = tree_hashes(model)
    out = model / depth
    assert main(["uptrain", *uptrain_args(tiny, out, "--model", str(model))]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and f"output_dir {out} is inside model {model}, which the run reads" in err, err
    assert tree_hashes(model) == before


def test_an_attention_shape_without_a_conversion_is_refused(tiny, tmp_path, capsys):
    """`uptrain --attention mla` with no kv_heads or kv_cut trained the model as it was while run.json recorded
    attention: mla; refused in one line, nothing written."""
    from gqaify.entry.cli import main

    assert main(["uptrain", *uptrain_args(tiny, tmp_path / "run", "--attention", "mla")]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "attention mla shapes a conversion, and this run converts nothing" in err, err
    assert not (tmp_path / "run").exists()


def test_a_run_json_with_a_mistyped_setting_is_called_damaged(tiny, tmp_path, capsys):
    """A run.json whose setting has the wrong type was "another run's checkpoints (it had lr='fast', ...)": damage
    reported as something else. It is named as damage, with the setting, and the folder is left as it is."""
    from gqaify.entry.cli import main

    out = tmp_path / "run"
    assert main(["uptrain", *uptrain_args(tiny, out, "--save_every", "10")]) == 0
    shutil.rmtree(out / "final")
    record = json.loads((out / "run.json").read_text())
    record["settings"]["lr"] = "fast"
    (out / "run.json").write_text(json.dumps(record))
    before = tree_hashes(out)
    capsys.readouterr()
    assert main(["uptrain", *uptrain_args(tiny, out, "--save_every", "10")]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and f"output_dir {out}'s run.json is damaged (lr 'fast' is not a number" in err, err
    assert "another run" not in err and tree_hashes(out) == before
