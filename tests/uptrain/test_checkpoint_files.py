"""A checkpoint holds data only (safetensors and JSON) and is read back without pickle: a run folder someone sent
runs no code when resumed, and a resumed run still ends as the uninterrupted one."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file

from gqaify.entry.cli import main
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from helpers import one_line, tree_hashes, uptrain_args


class _RunsCode:
    """A pickle whose loading runs a shell command (as a hostile `custom_checkpoint_0.pkl` would)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _checkpoints(out):
    return sorted((out / "checkpoints").glob("step-*"))


def test_a_resumed_run_reads_no_pickle_and_ends_as_the_uninterrupted_one(tiny, tmp_path, monkeypatch):
    """Every file of a checkpoint is JSON or safetensors; a run resumed from its middle checkpoint, with a pickle
    that runs a command planted where accelerate kept its custom state, ends with the uninterrupted run's weights
    and losses, and the command never ran (nothing is unpickled: pickle.load and torch.load are made to fail)."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    settings = ("--save_every", "10", "--save_total_limit", "3")  # 20 steps
    uptrain(parse(uptrain_args(tiny, whole, *settings)))
    uptrain(parse(uptrain_args(tiny, cut, *settings)))
    middle, last = _checkpoints(cut)
    assert {p.suffix for c in (middle, last) for p in c.iterdir()} == {".json", ".safetensors"}
    shutil.rmtree(cut / "final")
    shutil.rmtree(last)
    marker = tmp_path / "ran"
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin"):
        (middle / name).write_bytes(pickle.dumps(_RunsCode(f"touch {marker}")))

    def refused(*args, **kwargs):
        raise AssertionError("a checkpoint was read with pickle")

    monkeypatch.setattr(pickle, "load", refused)
    monkeypatch.setattr(torch, "load", refused)
    uptrain(parse(uptrain_args(tiny, cut, *settings)))
    assert not marker.exists()
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    wholes = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows if "loss" in r] == [r["loss"] for r in wholes if "loss" in r]


def test_a_checkpoint_of_accelerates_pickles_is_refused_not_loaded(tiny, tmp_path, capsys):
    """A checkpoint in the format earlier gqaify wrote (accelerate's pickles, no state.json) is refused in one
    line, exit 2, and the folder is left as it was; a damaged progress.json names the file."""
    out = tmp_path / "run"
    settings = ("--save_every", "10", "--save_total_limit", "3")
    uptrain(parse(uptrain_args(tiny, out, *settings)))
    shutil.rmtree(out / "final")
    last = _checkpoints(out)[-1]
    (last / "state.json").unlink()
    capsys.readouterr()
    code = main(["uptrain", *uptrain_args(tiny, out, *settings)])
    err = capsys.readouterr().err
    assert code == 2 and one_line(err), err
    assert f"checkpoint {last} was written by an earlier gqaify as pickles" in err and "never loaded" in err
    assert not (out / "final").exists()
    shutil.rmtree(last)
    middle = _checkpoints(out)[-1]
    progress = json.loads((middle / "progress.json").read_text())
    (middle / "progress.json").write_text(json.dumps({**progress, "tokens": "ten"}))
    assert main(["uptrain", *uptrain_args(tiny, out, *settings)]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and f"checkpoint {middle}'s progress.json is damaged (tokens 'ten')" in err, err


def test_checkpoints_are_readable_as_every_output_is(tiny, tmp_path):
    """Checkpoints' model.safetensors were written 0600 (safetensors' own mode) where every other output is 0644
    under umask 022: every file of a checkpoint has the mode the user's umask gives."""
    out = tmp_path / "run"
    uptrain(parse(uptrain_args(tiny, out, "--save_every", "10")))
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for c in _checkpoints(out) for p in c.iterdir()}
    assert {"model.safetensors", "optimizer.safetensors", "state.json"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_a_checkpoint_whose_files_hold_the_wrong_things_is_called_damaged(tiny, tmp_path, capsys):
    """A random generators' file that parses but lacks its fields was a KeyError traceback ("internal error")."""
    out = tmp_path / "run"
    uptrain(parse(uptrain_args(tiny, out, "--save_every", "10", "--save_total_limit", "3")))
    shutil.rmtree(out / "final")
    last = _checkpoints(out)[-1]
    (last / "rng-0.json").write_text(json.dumps({"python": []}))
    capsys.readouterr()
    assert main(["uptrain", *uptrain_args(tiny, out, "--save_every", "10", "--save_total_limit", "3")]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and f"checkpoint {last}'s rng-0.json is damaged (" in err, err
    assert "resume from the one before it" in err, err


def _stopped_at_15(tiny, out) -> list:
    """A run of 20 steps with checkpoints at 10, 15 and 20, its final/ and last checkpoint removed (as a run stopped
    after step 15 leaves it): the checkpoints left, oldest first."""
    uptrain(parse(uptrain_args(tiny, out, "--save_every", "5", "--save_total_limit", "3")))
    shutil.rmtree(out / "final")
    shutil.rmtree(_checkpoints(out)[-1])
    return _checkpoints(out)


def test_a_users_copy_of_a_checkpoint_is_neither_resumed_from_nor_removed(tiny, tmp_path, capsys, caplog):
    """A copy made beside a checkpoint before experimenting (step-0000015.bak, which carries the list of files gqaify
    wrote) was resumed from, as the latest, then removed whole by rotation. It is left alone and named in a warning;
    the run resumes from its own step-0000015 and rotation removes that one alone."""
    out = tmp_path / "run"
    ten, fifteen = _stopped_at_15(tiny, out)
    copy = out / "checkpoints" / "step-0000015.bak"
    shutil.copytree(fifteen, copy)
    before = tree_hashes(copy)
    capsys.readouterr()
    assert main(["uptrain", *uptrain_args(tiny, out, "--save_every", "5", "--save_total_limit", "1")]) == 0
    said = capsys.readouterr()
    assert f"resuming from {fifteen} (step 15 of 20)" in said.out
    assert f"left {copy} alone (not named as gqaify names its checkpoints)" in caplog.text
    assert tree_hashes(copy) == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000015.bak", "step-0000020"]


def test_a_run_json_that_lists_no_checkpoints_resumes_from_those_named_as_gqaify_names_them(tiny, tmp_path, capsys):
    """A run.json of a gqaify that did not yet list the checkpoints it wrote: the real folders named as gqaify names
    them are taken for the run's (as that gqaify took them), and listed from then on; a copy is still left alone."""
    out = tmp_path / "run"
    ten, fifteen = _stopped_at_15(tiny, out)
    record = json.loads((out / "run.json").read_text())
    del record["checkpoints"]
    (out / "run.json").write_text(json.dumps(record))
    shutil.copytree(fifteen, fifteen.with_name("step-0000015.bak"))
    capsys.readouterr()
    assert main(["uptrain", *uptrain_args(tiny, out, "--save_every", "5", "--save_total_limit", "1")]) == 0
    assert f"resuming from {fifteen} (step 15 of 20)" in capsys.readouterr().out
    assert json.loads((out / "run.json").read_text())["checkpoints"] == ["step-0000020"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000015.bak", "step-0000020"]


@pytest.mark.parametrize("leads_to", ["another disk", "the run folder"])
def test_a_checkpoint_that_is_a_link_is_left_alone_and_said_to_be_one(tiny, tmp_path, capsys, caplog, leads_to):
    """checkpoints/step-0000010 as a link (its folder moved to another disk, with the user's notes in it): rotation
    removed the checkpoint's files there, through the link, with a warning naming the link as the folder "kept". A
    link into the run folder itself, holding only the checkpoint, ended in a traceback mid-run ("Cannot call rmtree
    on a symbolic link"). Either is left alone, named as a link to where it leads, and never resumed from."""
    out = tmp_path / "run"
    ten, fifteen = _stopped_at_15(tiny, out)
    target = tmp_path / "disk" / ten.name if leads_to == "another disk" else out / "kept-step-10"
    target.parent.mkdir(exist_ok=True)
    ten.rename(target)
    if leads_to == "another disk":
        (target / "notes.txt").write_text("mine")
    ten.symlink_to(target, target_is_directory=True)
    before = tree_hashes(target)
    capsys.readouterr()
    assert main(["uptrain", *uptrain_args(tiny, out, "--save_every", "5", "--save_total_limit", "1")]) == 0
    said = capsys.readouterr()
    assert f"resuming from {fifteen} (step 15 of 20)" in said.out
    assert f"left {ten} alone (a link to {target})" in caplog.text and "Traceback" not in said.err
    assert tree_hashes(target) == before and ten.is_symlink()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000010", "step-0000020"]


def test_a_link_where_the_run_would_write_a_checkpoint_is_refused_before_training(tiny, tmp_path, capsys):
    """A link (or anything not the run's) named as a checkpoint the run has still to write would be replaced by it,
    and a checkpoints/ that is a link would have checkpoints written and removed through it: each is refused in one
    line naming where it leads, before training, and nothing is changed."""
    out = tmp_path / "run"
    ten, fifteen = _stopped_at_15(tiny, out)
    target = tmp_path / "disk" / fifteen.name
    target.parent.mkdir()
    fifteen.rename(target)
    fifteen.symlink_to(target, target_is_directory=True)
    before = tree_hashes(tmp_path)
    capsys.readouterr()
    assert main(["uptrain", *uptrain_args(tiny, out, "--save_every", "5")]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{fifteen} is not a checkpoint of this run (a link to {target}), and the run would write its step 15" in err
    assert tree_hashes(tmp_path) == before
    fifteen.unlink()
    fifteen.parent.rename(tmp_path / "disk" / "checkpoints")
    fifteen.parent.symlink_to(tmp_path / "disk" / "checkpoints", target_is_directory=True)
    assert main(["uptrain", *uptrain_args(tiny, out, "--save_every", "5")]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{fifteen.parent} is a link to {tmp_path / 'disk' / 'checkpoints'}, and gqaify writes" in err


@pytest.mark.parametrize(
    ("file", "damage", "said"),
    [
        ("model.safetensors", lambda b: (1 << 40).to_bytes(8, "little") + b[8:], "SafetensorError"),
        ("rng-0.json", lambda b: json.dumps({**json.loads(b), "python": [3, [-1] * 625, None]}).encode(), "Overflow"),
    ],
)
def test_a_checkpoint_damaged_past_what_its_readers_check_is_called_damaged(tiny, tmp_path, capsys, file, damage, said):
    """A safetensors header that says it is too large (safetensors' own SafetensorError, neither an OSError nor a
    ValueError) and a random generator's state out of range (OverflowError) were "internal error" tracebacks, exit 1;
    the line names the damaged file, not only its checkpoint."""
    out = tmp_path / "run"
    settings = ("--save_every", "10", "--save_total_limit", "3")
    uptrain(parse(uptrain_args(tiny, out, *settings)))
    shutil.rmtree(out / "final")
    last = _checkpoints(out)[-1]
    (last / file).write_bytes(damage((last / file).read_bytes()))
    capsys.readouterr()
    assert main(["uptrain", *uptrain_args(tiny, out, *settings)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"checkpoint {last}'s {file} is damaged ({said}" in err and "resume from the one before it" in err, err
    assert not (out / "final").exists()


@pytest.mark.parametrize("renamed", [False, True])
def test_a_checkpoint_past_the_runs_end_is_called_damaged(tiny, tmp_path, capsys, renamed):
    """A checkpoint whose progress.json says step 25 of a 20-step run was resumed from, and the run declared complete
    with final/ written from it. Its progress.json is called damaged, naming the file, whether its folder says step
    20 or (renamed and listed in run.json as one of the run's) step 25."""
    out = tmp_path / "run"
    settings = ("--save_every", "10", "--save_total_limit", "3")
    uptrain(parse(uptrain_args(tiny, out, *settings)))
    shutil.rmtree(out / "final")
    last = _checkpoints(out)[-1]
    progress = json.loads((last / "progress.json").read_text())
    (last / "progress.json").write_text(json.dumps({**progress, "step": 25}))
    said = "step 25, in the checkpoint of step 20"
    if renamed:
        last = last.rename(last.with_name("step-0000025"))
        record = json.loads((out / "run.json").read_text())
        (out / "run.json").write_text(
            json.dumps({**record, "checkpoints": [*record.get("checkpoints", []), last.name]})
        )
        said = "step 25, past the run's 20 steps"
    capsys.readouterr()
    assert main(["uptrain", *uptrain_args(tiny, out, *settings)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"checkpoint {last}'s progress.json is damaged ({said})" in err, err
    assert not (out / "final").exists()
