"""uptrain's output_dir keeps everything of the user's: it is claimed as convert's and generate's OUTs are (a second
run is refused at once, writing nothing), and a run removes there only what it wrote, by name, never a model or text
it reads however it is spelled; a damaged input is refused before the folder is touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gqaify.output.claims import claimed
from gqaify.records import TOOL
from helpers import one_line, run_uptrain, tree_hashes, uptrain_args

NEVER_TRAINED = {"tool": TOOL, "settings": {"data": "old.txt"}}  # what a run killed while converting leaves


def _users_files(out: Path) -> None:
    (out / "notes.txt").write_text("mine\n")
    (out / "my-report").mkdir()
    (out / "my-report" / "table.md").write_text("| mine |\n")


@pytest.mark.integration
def test_a_run_never_removes_the_model_it_trains_from_its_output_dir(tiny, tmp_path):
    """A run that converted into OUT/converted was killed before training; pointed at that conversion, the rerun
    into the same output_dir used to delete it (and run.json), then say the model was not found."""
    from gqaify.conversion.core import convert

    out = tmp_path / "OUT"
    out.mkdir()
    (out / "run.json").write_text(json.dumps(NEVER_TRAINED))
    convert(tiny["parent"], out / "converted", 2, progress=False)
    conversion = tree_hashes(out / "converted")
    spelled = os.path.relpath(out / "converted") + "/"  # relative, with a slash: the same folder however named
    rerun = run_uptrain(uptrain_args(tiny, out, "--model", spelled))
    assert rerun.returncode == 0, rerun.stderr
    assert tree_hashes(out / "converted") == conversion and (out / "final" / "config.json").is_file()
    assert "replaced its run.json;" in rerun.stderr  # and not converted/


@pytest.mark.integration
def test_a_changed_setting_over_a_run_that_never_trained_replaces_only_the_runs_files(tiny, tmp_path):
    """The rerun with one setting changed used to empty output_dir, the user's notes.txt and my-report/ included,
    silently: it now replaces run.json and converted/ alone, and says what changed."""
    out = tmp_path / "run"
    assert run_uptrain(uptrain_args(tiny, out, "--lr", "3e-4")).returncode == 0
    run = json.loads((out / "run.json").read_text())
    for name in [p.name for p in out.iterdir() if p.name != "run.json"]:
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    (out / "run.json").write_text(json.dumps({**run, "started": False, "completed": False}))
    (out / "converted").mkdir()  # as a run killed while converting leaves it
    _users_files(out)
    mine = {k: v for k, v in tree_hashes(out).items() if not k.startswith(("run.json", "converted"))}
    rerun = run_uptrain(uptrain_args(tiny, out, "--lr", "1e-4"))
    assert rerun.returncode == 0, rerun.stderr
    assert {k: v for k, v in tree_hashes(out).items() if k in mine} == mine
    assert not (out / "converted").exists() and (out / "final").is_dir()
    said = [line for line in rerun.stderr.splitlines() if "never trained" in line]
    assert len(said) == 1 and "(lr was 0.0003, now 0.0001): replaced its run.json, converted/;" in said[0]


@pytest.mark.integration
def test_a_damaged_parent_is_one_line_before_output_dir_is_touched(tiny, tmp_path):
    """A --parent whose safetensors (here its last shard) is cut to 1,000 bytes ended in a SafetensorError traceback
    (exit 1), and the cleanup that followed deleted the user's notes.txt."""
    damaged = tmp_path / "parent"
    damaged.mkdir()
    for f in tiny["parent"].iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    shard = sorted(damaged.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(1000)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps(NEVER_TRAINED))
    _users_files(out)
    before = tree_hashes(out)
    refused = run_uptrain(uptrain_args(tiny, out, "--parent", str(damaged)))
    line = one_line(refused.stderr)
    assert refused.returncode == 2 and f"parent {damaged}: corrupt shard" in line and "re-download" in line
    assert tree_hashes(out) == before


@pytest.mark.integration
def test_a_second_uptrain_into_a_claimed_output_dir_is_refused_writing_nothing(tiny, tmp_path):
    """Two runs into one output_dir both 'succeeded', one's final/ holding the other's model and metrics.jsonl both
    runs' steps. The claim is held here, as a live run holds it, so the refusal does not depend on timing."""
    out = tmp_path / "run"
    with claimed(out, "gqaify uptrain", option="output_dir"):
        before = tree_hashes(tmp_path)
        refused = run_uptrain(uptrain_args(tiny, out))
        assert tree_hashes(tmp_path) == before and not out.exists()
    line = one_line(refused.stderr)
    assert refused.returncode == 2
    assert f"{out} is being written by another gqaify uptrain (pid {os.getpid()}); wait for it" in line
    assert list(tmp_path.iterdir()) == []  # the claim went with its holder
    assert run_uptrain(uptrain_args(tiny, out)).returncode == 0  # and the folder is free again


@pytest.mark.integration
def test_an_output_dir_in_a_read_only_place_holds_its_claim_itself(tiny, tmp_path):
    """A writable output_dir whose parent cannot be written (as 0.2.0 trained into): its claim is held inside it,
    a second run finds it there, and the run trains and leaves no claim behind. (The parent: a read-only bind mount
    of itself; the output_dir: a tmpfs mounted on a folder in it.)"""
    place, out = tmp_path / "place", tmp_path / "place" / "run"
    out.mkdir(parents=True)
    mounts = [
        ["mount", "--bind", str(place), str(place)],
        ["mount", "-o", "remount,bind,ro", str(place)],
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(out)],
    ]
    for i, command in enumerate(mounts):
        if os.geteuid() != 0 or subprocess.run(command, capture_output=True).returncode != 0:
            for mounted in [place] if i else []:
                subprocess.run(["umount", str(mounted)], check=True)
            pytest.skip("a writable folder in a read-only one needs mounts, as root")
    try:
        assert not os.access(place, os.W_OK) and os.access(out, os.W_OK)
        with claimed(out, "gqaify uptrain", option="output_dir", inside=True):
            assert [p.name for p in out.iterdir()] == [".gqaify.claim"]
            refused = run_uptrain(uptrain_args(tiny, out))
        assert refused.returncode == 2 and "is being written by another gqaify uptrain" in one_line(refused.stderr)
        assert list(out.iterdir()) == []
        trained = run_uptrain(uptrain_args(tiny, out))
        assert trained.returncode == 0, trained.stderr[-2000:]
        assert (out / "final").is_dir() and not (out / ".gqaify.claim").exists()
    finally:
        subprocess.run(["umount", str(out)], check=True)
        subprocess.run(["umount", str(place)], check=True)


@pytest.mark.integration
def test_a_claim_is_never_written_through_a_hard_link(tiny, tmp_path):
    """An empty file of the user's, hard-linked at the claim's name, used to receive the claim's JSON and keep it."""
    notes = tmp_path / "notes.txt"
    notes.touch()
    os.link(notes, tmp_path / ".run.gqaify.claim")
    out = tmp_path / "run"
    refused = run_uptrain(uptrain_args(tiny, out))
    line = one_line(refused.stderr)
    assert refused.returncode == 2 and "is a file with other names (a hard link), not a claim gqaify wrote" in line
    assert notes.read_bytes() == b"" and notes.stat().st_nlink == 2 and not out.exists()


@pytest.mark.integration
def test_final_is_readable_as_every_output_is(tiny, tmp_path):
    """safetensors writes final/model.safetensors 0600 where every other output is 0644 (under umask 022)."""
    out = tmp_path / "run"
    assert run_uptrain(uptrain_args(tiny, out)).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (out / "final").iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


@pytest.mark.integration
def test_a_damaged_run_json_is_called_damaged_and_a_later_ones_names_its_version(tiny, tmp_path):
    """A damaged run.json was told to "resume with the gqaify that wrote it"."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text('{"tool": "gqaify", "kind": "run", "settings": ')
    line = one_line(run_uptrain(uptrain_args(tiny, out)).stderr)
    assert "run.json is damaged" in line and "use a new output_dir" in line and "wrote it" not in line
    later = {"tool": TOOL, "version": "99.0", "kind": "run", "settings": {}, "a field from later": 1}
    (out / "run.json").write_text(json.dumps(later))
    line = one_line(run_uptrain(uptrain_args(tiny, out)).stderr)
    assert "written by gqaify 99.0" in line and "resume the run with gqaify 99.0" in line


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
