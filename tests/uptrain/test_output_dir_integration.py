"""uptrain's output_dir, each run in a process of its own: claimed as convert's and generate's OUTs are (a second
run refused, writing nothing; a read-only place; never through a hard link), a run removes there only what it
wrote, never the model it trains from, a damaged input is refused before the folder is touched, and final/ is
readable as every output is."""

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


def test_final_is_readable_as_every_output_is(tiny, tmp_path):
    """safetensors writes final/model.safetensors 0600 where every other output is 0644 (under umask 022)."""
    out = tmp_path / "run"
    assert run_uptrain(uptrain_args(tiny, out)).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (out / "final").iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


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
