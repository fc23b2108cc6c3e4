"""The records gqaify writes (gqaify.json, run.json): each kind read back typed by `read_record`, the shapes earlier
versions wrote too (tests/data/records/VERSION/, written by that version), and what this one writes read back
exactly as it was written."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import gqaify
from gqaify.conversion.record import ConversionRecord
from gqaify.conversion.settings import CalibrationRecord
from gqaify.output.destination import written_kind
from gqaify.records import (
    CONVERSION,
    CORPUS,
    PROVENANCE_FILE,
    REPORT,
    RUN,
    RUN_FILE,
    TOOL,
    UPTRAINED,
    CorpusRecord,
    Provenance,
    ReportRecord,
    RunRecord,
    UptrainedRecord,
    Uptraining,
    as_json,
    listed_files,
    read_provenance,
    read_record,
    record_text,
)
from helpers import REPO

FIXTURES = REPO / "tests" / "data" / "records"
# each file an earlier version wrote: the type it reads back as, its kind, what outputs calls its folder
EARLIER = {
    "conversion.json": (ConversionRecord, CONVERSION, "a converted model"),
    "conversion-calibrated.json": (ConversionRecord, CONVERSION, "a converted model"),
    "corpus.json": (CorpusRecord, CORPUS, "a corpus"),
    "report.json": (ReportRecord, REPORT, "an eval report"),
    "run.json": (RunRecord, RUN, None),
    "run-plain.json": (RunRecord, RUN, None),
    "uptrained.json": (ConversionRecord, UPTRAINED, "an uptrained model"),
    "uptrained-plain.json": (UptrainedRecord, UPTRAINED, "an uptrained model"),
}
VERSIONS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


def placed(fixture: Path, folder: Path) -> Path:
    """`folder` holding `fixture` where gqaify finds it: run.json in an output_dir, else gqaify.json."""
    folder.mkdir()
    shutil.copyfile(fixture, folder / (RUN_FILE if fixture.name.startswith("run") else PROVENANCE_FILE))
    return folder


def test_every_version_has_a_fixture_of_each_kind():
    assert VERSIONS and all(sorted(p.name for p in (FIXTURES / v).glob("*.json")) == sorted(EARLIER) for v in VERSIONS)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(EARLIER))
def test_an_earlier_versions_record_reads_back_typed_with_every_value(version, name, tmp_path):
    """Read back and written again, an earlier version's record is what it held, with today's header: the kind it
    did not say (and the version an uptrained model's record kept only in its "uptrain"), eval's "command" gone."""
    fixture = FIXTURES / version / name
    cls, kind, holds = EARLIER[name]
    folder = placed(fixture, tmp_path / "f")
    record = read_record(folder)
    assert type(record) is cls and record.tool == TOOL and record.kind == kind and record.version == version
    raw = json.loads(fixture.read_text())
    expected = {k: v for k, v in raw.items() if k != "command"} | {"kind": kind, "version": version}
    assert as_json(record) == expected
    assert read_provenance(folder) == Provenance(version=version, kind=kind)
    assert written_kind(folder) == holds
    assert listed_files(folder) == (set(raw["files"]) if "files" in raw else None)


@pytest.mark.parametrize("version", VERSIONS)
def test_nested_records_read_back_as_their_types(version, tmp_path):
    calibrated = read_record(placed(FIXTURES / version / "conversion-calibrated.json", tmp_path / "c"))
    raw = json.loads((FIXTURES / version / "conversion-calibrated.json").read_text())
    assert isinstance(calibrated.calibration, CalibrationRecord)
    assert calibrated.calibration.sha256 == raw["calibration"]["sha256"]
    assert [s.tokens for s in calibrated.calibration.sources] == [s["tokens"] for s in raw["calibration"]["sources"]]
    assert calibrated.source_geometry.num_kv_heads == raw["source_geometry"]["num_kv_heads"]
    uptrained = read_record(placed(FIXTURES / version / "uptrained.json", tmp_path / "u"))
    raw = json.loads((FIXTURES / version / "uptrained.json").read_text())["uptrain"]
    assert isinstance(uptrained.uptrain, Uptraining) and uptrained.uptrain.model == raw["from"]
    assert (uptrained.uptrain.steps, uptrained.uptrain.data_sha256) == (raw["steps"], raw["data_sha256"])
    run = read_record(placed(FIXTURES / version / "run.json", tmp_path / "r"))
    raw = json.loads((FIXTURES / version / "run.json").read_text())
    assert run.started and run.completed and run.parent_perplexities == raw["parent_perplexities"]


def test_a_run_json_of_before_versions_and_data_hashes_reads_with_neither(tmp_path):
    (tmp_path / RUN_FILE).write_text(json.dumps({"tool": TOOL, "settings": {"data": "old.txt"}}))
    run = read_record(tmp_path)
    assert run == RunRecord(version=None, settings={"data": "old.txt"})
    assert not run.started and run.data_sha256 is None and run.parent_perplexities is None


@pytest.mark.parametrize(
    ("value", "header"),
    [
        ({"tool": "other", "kind": CORPUS}, None),  # another tool's
        ({"settings": {}}, None),  # a file of settings
        ([1, 2], None),
        ({"tool": TOOL, "version": "9", "kind": "hologram"}, "hologram"),  # a kind of a later gqaify
        ({"tool": TOOL, "version": "9", "kind": REPORT, "settings": {}, "pixels": 3}, REPORT),  # a later field
        ({"tool": TOOL, "version": "9", "kind": REPORT}, REPORT),  # its settings missing
    ],
)
def test_what_is_not_a_record_gqaify_reads(value, header, tmp_path):
    """Not a record of gqaify's: None. A record of gqaify's it cannot read: ValueError, its header still read."""
    (tmp_path / PROVENANCE_FILE).write_text(json.dumps(value))
    if header is None:
        assert read_record(tmp_path) is None and read_provenance(tmp_path) is None
        return
    with pytest.raises(ValueError, match=header):
        read_record(tmp_path)
    assert read_provenance(tmp_path) == Provenance(version="9", kind=header)


def test_a_models_record_of_another_kind_is_no_conversion_to_carry_over(tmp_path):
    """uptrain's final/ carries over the record of the conversion it trained (`ConversionRecord.read`); a record of
    another kind, one a later gqaify writes included, is none, and the uptraining is all final/ says."""
    for value in ({"tool": TOOL, "version": "9", "kind": "hologram"}, {"tool": TOOL, "version": "9", "kind": RUN}):
        (tmp_path / PROVENANCE_FILE).write_text(json.dumps(value))
        assert ConversionRecord.read(tmp_path) is None
    (tmp_path / PROVENANCE_FILE).write_text(json.dumps({"tool": TOOL, "version": "9", "kind": CONVERSION, "x": 1}))
    with pytest.raises(ValueError, match="'x'"):
        ConversionRecord.read(tmp_path)


def test_a_damaged_record_is_an_error_to_read_and_has_no_header(tmp_path):
    (tmp_path / PROVENANCE_FILE).write_text(json.dumps({"tool": TOOL, "version": "9"})[:20])  # cut short
    with pytest.raises(ValueError):
        read_record(tmp_path)
    assert read_provenance(tmp_path) is None and listed_files(tmp_path) is None and written_kind(tmp_path) is None


def test_a_record_without_its_version_still_has_a_header(tmp_path):
    """A damaged record that still says its tool and kind: its header is read (the version not known), and --force's
    checks name what the folder holds instead of failing over the version's absence."""
    (tmp_path / PROVENANCE_FILE).write_text(json.dumps({"tool": TOOL, "kind": CORPUS}))
    assert read_provenance(tmp_path) == Provenance(version=None, kind=CORPUS)
    assert written_kind(tmp_path) == "a corpus"
    with pytest.raises(ValueError):
        read_record(tmp_path)


def test_a_run_is_read_from_its_run_json_whatever_lies_beside_it(tmp_path):
    """uptrain's output_dir is read by its run.json, even where a gqaify.json lies beside it (which `read_record`
    prefers): the run it holds is the one run.json records."""
    from gqaify.uptrain.run_folder import read_run_record, save_run

    run = RunRecord(version="9", settings={"data": ["a.txt"]}, data_sha256="0" * 64, started=True)
    save_run(tmp_path, run)
    (tmp_path / PROVENANCE_FILE).write_text(record_text(ReportRecord(version="9", settings={})))
    assert read_run_record(tmp_path) == run


def test_an_unreadable_run_json_is_never_to_be_deleted(tmp_path):
    """A run.json gqaify cannot read sits beside the run's checkpoints: a later gqaify's is to be resumed with that
    version, a damaged one (this version's, or none's) says so; either may go to a new output_dir, never "delete it"."""
    from gqaify.errors import UserError
    from gqaify.uptrain.run_folder import read_run_record

    later = json.dumps({"tool": TOOL, "version": "9", "kind": RUN, "settings": {}, "pixels": 3})
    for text, says in ((later, "was written by gqaify 9, which this gqaify"), ("{cut", "is damaged (")):
        (tmp_path / RUN_FILE).write_text(text)
        with pytest.raises(UserError) as caught:
            read_run_record(tmp_path)
        message = str(caught.value)
        assert message.startswith(f"output_dir {tmp_path}'s {RUN_FILE} {says}") and "\n" not in message
        assert message.endswith("or use a new output_dir" if text == later else "(this one is left as it is)")
        assert "delete" not in message


def test_a_folder_without_a_record_and_a_file_read_none(tmp_path):
    assert read_record(tmp_path) is None and read_provenance(tmp_path) is None
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert read_record(tmp_path / "x.gguf") is None and read_record(tmp_path / "missing") is None


# -- what this version writes -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory) -> dict[str, Path]:
    """A folder of each kind, written by this gqaify's own writers from the tiny models: a conversion, a corpus, an
    eval report, an uptraining run (its output_dir and final/) of a converted model and of one it did not convert."""
    from gqaify.eval.settings import EvalSettings
    from gqaify.generation import run as generate
    from gqaify.generation.settings import GenerateSettings
    from gqaify.uptrain import UptrainSettings
    from gqaify.uptrain import run as uptrain

    root = tmp_path_factory.mktemp("written")
    parent, converted, text = tiny["parent"], tiny["converted"], tiny["train"]
    generate(
        GenerateSettings(model=str(parent), out=str(root / "corpus"), tokens=32, length=8, batch_size=4, progress=False)
    )
    gqaify.evaluate([str(parent)], str(text), root / "report", EvalSettings(seq_len=32, speed=False, progress=False))
    common = {
        "data": [str(text)],
        "seq_len": 16,
        "micro_batch_size": 2,
        "grad_accum": 1,
        "max_tokens": 64,
        "save_every": 0,
        "progress": False,
    }
    uptrain(
        UptrainSettings(
            model=str(converted),
            output_dir=str(root / "run"),
            eval_data=[str(tiny["eval"])],
            parent=str(parent),
            eval_tokens=64,
            **common,
        )
    )
    uptrain(UptrainSettings(model=str(parent), output_dir=str(root / "plain"), **common))
    return {
        "conversion": converted,
        "corpus": root / "corpus",
        "report": root / "report",
        "run": root / "run",
        "uptrained": root / "run" / "final",
        "run-plain": root / "plain",
        "uptrained-plain": root / "plain" / "final",
    }


KINDS = {
    "conversion": (ConversionRecord, CONVERSION),
    "corpus": (CorpusRecord, CORPUS),
    "report": (ReportRecord, REPORT),
    "run": (RunRecord, RUN),
    "uptrained": (ConversionRecord, UPTRAINED),
    "run-plain": (RunRecord, RUN),
    "uptrained-plain": (UptrainedRecord, UPTRAINED),
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_record_this_version_writes_reads_back_exactly(written, name):
    """The file holds exactly the record read back from it (no key lost, none added), under today's header."""
    folder = written[name]
    cls, kind = KINDS[name]
    file = folder / (RUN_FILE if name.startswith("run") else PROVENANCE_FILE)
    record = read_record(folder)
    assert type(record) is cls and (record.tool, record.version, record.kind) == (TOOL, gqaify.__version__, kind)
    assert record_text(record) == file.read_text()
    assert list(json.loads(file.read_text()))[:3] == ["tool", "version", "kind"]  # the header first


def test_what_the_records_say_of_their_runs(written, tiny):
    run, plain = read_record(written["run"]), read_record(written["run-plain"])
    assert run.completed and run.started and run.parent_perplexity == next(iter(run.parent_perplexities.values()))
    assert (
        plain.completed
        and plain.parent_perplexities is None
        and "parent_perplexity" not in json.loads((written["run-plain"] / RUN_FILE).read_text())
    )
    final = read_record(written["uptrained"])
    assert final.uptrain.model == str(tiny["converted"]) and final.uptrain.data_sha256 == run.data_sha256
    assert replace(final, kind=CONVERSION, uptrain=None, files=None) == replace(
        read_record(written["conversion"]), files=None
    )
    assert read_record(written["uptrained-plain"]).uptrain.model == str(tiny["parent"])
    corpus = read_record(written["corpus"])
    assert corpus.complete and corpus.tokens >= 32 and corpus.files == ["data"]


def test_every_records_settings_are_listed_in_their_stages_order(written):
    """A record's settings list the stage's own fields first, then its groups' (`settings.recorded`), whichever
    record holds them: an uptrained model's "uptrain" and run.json's too, not the dataclass's order (which puts the
    inherited groups, progress, trust_remote_code, push_to_hub and seed, first)."""
    from gqaify.conversion.settings import ConvertSettings
    from gqaify.eval.settings import EvalSettings
    from gqaify.generation.settings import GenerateSettings
    from gqaify.settings import ordered_fields
    from gqaify.uptrain import UptrainSettings

    def order(settings: dict, cls: type) -> list[str]:
        names = [f.name for f in ordered_fields(cls)]
        return sorted((k for k in settings if k in names), key=names.index)

    said = {
        "conversion": (read_record(written["conversion"]).settings, ConvertSettings),
        "corpus": (read_record(written["corpus"]).settings, GenerateSettings),
        "report": (read_record(written["report"]).settings, EvalSettings),
        "run": (read_record(written["run"]).settings, UptrainSettings),
        "uptrained": (read_record(written["uptrained"]).uptrain.settings, UptrainSettings),
        "uptrained-plain": (read_record(written["uptrained-plain"]).uptrain.settings, UptrainSettings),
    }
    for name, (settings, cls) in said.items():
        assert [k for k in settings if k in order(settings, cls)] == order(settings, cls), name
    assert list(said["uptrained"][0]) == [f.name for f in ordered_fields(UptrainSettings)]
    assert list(said["run"][0])[-1] == "processes" and "progress" not in said["run"][0]


def test_recorded_settings_hold_the_dataclass_values():
    from dataclasses import asdict

    from gqaify.settings import recorded
    from gqaify.uptrain import UptrainSettings

    s = UptrainSettings(model="m", data=["a.txt", "b=c.txt"], output_dir="o", seed=3, progress=False)
    assert recorded(s) == asdict(s) and len(recorded(s)) == len(asdict(s))


@pytest.mark.parametrize("name", sorted(EARLIER))
def test_a_record_written_again_reads_back_equal(name, tmp_path):
    """`record_text` and `read_record` are inverses on every kind, the optional fields left out included."""
    record = read_record(placed(FIXTURES / VERSIONS[-1] / name, tmp_path / "a"))
    again = replace(record, version=gqaify.__version__)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / (RUN_FILE if name.startswith("run") else PROVENANCE_FILE)).write_text(record_text(again))
    assert read_record(tmp_path / "b") == again


def test_the_tools_name_is_written_only_by_the_record_layer():
    found = [
        str(p.relative_to(REPO))
        for p in (REPO / "src").rglob("*.py")
        if p.name != "records.py" and json.dumps({"tool": TOOL})[1:-1] in p.read_text()
    ]
    assert found == []
