"""Records: what an artifact gqaify wrote says about itself, as frozen dataclasses, written and read back typed.

    gqaify.json   in a converted model's folder (`conversion.record.ConversionRecord`), an uptrained model's final/
                  (the same record with `uptrain`, or `UptrainedRecord` for a model gqaify did not convert), an eval
                  report's folder (`ReportRecord`) and a corpus's (`CorpusRecord`)
    run.json      in uptrain's output_dir (`RunRecord`): which run the folder holds, and how far it went

Every record opens with its `Provenance`: the tool, its version and the record's kind. `as_json(record)` is a
record's JSON value (`record_text`: its file's text); `read_record(folder)` reads one back typed, whichever kind it
is (`read_record_file(file)`: the record in that one file), and also reads the shapes that earlier versions wrote
(no kind: a conversion told by its "source", an eval report by "command": "eval", an uptrained model by "uptrain"
and no version of its own; a run.json by its name).

`from_json(cls, value)` reads a JSON object back as `cls`: nested records, lists of them, optional ones, each value
checked against its field's type (a `Mistyped` error names the field, whatever the kind of record). A field
declared `optional()` is left out of the JSON where it says nothing: while it holds its default (`optional()`: None),
or while another field is None (`optional(unless_none="calibration")`: what calibration measured is said only by a
calibrated conversion, null or not). Read back, a field left out takes its default. A field whose JSON key is not a
Python name (uptrain's "from") says so with `json_key(...)`. JSON has no NaN or infinity: a file whose writer wrote
them as null (eval's report.json) is read with `nan_for_null`, a null where a plain float is wanted read as NaN.

Every kind is listed once, in `KINDS`: the record types it is read as, and where a record of it keeps the settings
that rerun its stage (what `--config RECORD` reads, `rerun_settings`; the command it reruns is the stage's whose
entry lists the kind, `settings.registry.rerun_by`). A type declared above this
module, which imports no stage (a conversion's, in `gqaify.conversion.record`), is named, not imported, by the
package's front door, gqaify/__init__.py (`declare_types`), which Python runs before any gqaify module is imported,
and imported on the first read of its kind: `read_record` reads every kind whatever the caller imported.
`read_provenance` reads any record's header without its type: what outputs' --force rules need.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

TOOL = "gqaify"  # every record's "tool"
PROVENANCE_FILE = "gqaify.json"  # what produced a folder, and (under "files") every file gqaify wrote there
RUN_FILE = "run.json"  # uptrain's output_dir: the run it holds

# The kinds of record, as their "kind" says
CONVERSION = "conversion"  # a converted model
UPTRAINED = "uptrained"  # an uptrained model (final/): of a conversion (`ConversionRecord`) or not (`UptrainedRecord`)
REPORT = "report"  # an eval report
CORPUS = "corpus"  # a corpus gqaify generate wrote
RUN = "run"  # an uptraining run's output_dir (run.json)

_OMITTED_WITH = "gqaify_omitted_with"  # the field whose None leaves this one out of the JSON ("": its own default)
_KEY = "gqaify_json_key"  # the field's key in the JSON, where it is not the field's name

R = TypeVar("R")


def optional(default: Any = None, unless_none: str | None = None) -> Any:
    """A field left out of the JSON while it holds `default`, or, with `unless_none`, while that other field is
    None."""
    return dataclasses.field(default=default, metadata={_OMITTED_WITH: unless_none or ""})


def json_key(key: str, **field_options) -> Any:
    """A field written under `key` in the JSON (a name Python keeps for itself, such as "from")."""
    return dataclasses.field(metadata={_KEY: key}, **field_options)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Provenance:
    """What every record opens with: the tool that wrote it, its version and the kind of record (`CONVERSION`,
    `UPTRAINED`, `REPORT`, `CORPUS`, `RUN`)."""

    tool: str = TOOL
    version: str | None  # None: a record of an earlier gqaify that did not say
    kind: str


def as_json(record) -> dict:
    """`record` as a JSON object: its fields in order (nested records as objects), the optional ones that say
    nothing left out; a record with a method `stored(value)` stores itself as that says (read back by its
    `from_stored`)."""
    value = {}
    for f in dataclasses.fields(record):
        if _OMITTED_WITH in f.metadata:
            other = f.metadata[_OMITTED_WITH]
            if (getattr(record, other) is None) if other else getattr(record, f.name) == f.default:
                continue
        value[f.metadata.get(_KEY, f.name)] = _json(getattr(record, f.name))
    return record.stored(value) if hasattr(record, "stored") else value


def _json(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_json(value)
    if isinstance(value, (list, tuple)):
        return [_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _json(item) for key, item in value.items()}
    return value


def record_text(record) -> str:
    """`record` as the text of its JSON file."""
    return json.dumps(as_json(record), indent=2) + "\n"


def from_json(cls: type[R], value: dict, nan_for_null: bool = False) -> R:
    """The record of type `cls` that the JSON object `value` holds (`as_json` read back). With `nan_for_null`, a null
    where the field (or a list's item) is a float that may not be None reads as NaN: a number that was not finite,
    written as null; where the field may be None, a null is None. A record stored in a shape of its own (`as_json`)
    is read back through its classmethod `from_stored(value)`, and a base may name, from the value, the record that
    it is (a classmethod `variant(value)`, the type read: a shape's record under `ConversionRecord`).

    Raises:
        ValueError: a key `cls` has no field for (a record of something else, or of a later gqaify), a required
            field missing, or a value not of its field's type (`Mistyped`, naming the field).
    """
    if not isinstance(value, dict):
        raise ValueError(f"{cls.__name__} is a JSON object, not {type(value).__name__}")
    if hasattr(cls, "from_stored"):  # a record stored in a shape of its own (`as_json`)
        value = cls.from_stored(value)
    if hasattr(cls, "variant"):  # a field typed by a base, whose JSON says which record it is
        cls = cls.variant(value)
    hints, names = _hints(cls), {f.metadata.get(_KEY, f.name): f.name for f in dataclasses.fields(cls)}
    unknown = [key for key in value if key not in names]
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {unknown[0]!r}")
    read = {}
    for key, item in value.items():
        hint = hints[names[key]]
        if not _fits(hint, item, nan_for_null):
            raise Mistyped(key, item, _words(hint))
        try:
            read[names[key]] = _read(hint, item, nan_for_null)
        except Mistyped as exc:  # in a nested record: its field, under this one's
            raise Mistyped(f"{key}.{exc.field}", exc.value, exc.wanted) from None
    try:
        return cls(**read)
    except TypeError as exc:  # a required field missing
        raise ValueError(f"{cls.__name__}: {exc}") from None


class Mistyped(ValueError):
    """A record's field whose JSON value is not of the field's type: "started 'yes' is not true or false"."""

    def __init__(self, field: str, value, wanted: str):
        super().__init__(f"{field} {'null' if value is None else reprlib.repr(value)} is not {wanted}")
        self.field, self.value, self.wanted = field, value, wanted


# What a JSON value of a field of each type is, as a message says it
_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text", type(None): "null"}


def _fits(hint, value, nan_for_null: bool = False) -> bool:
    """Whether the JSON value `value` is of the field type `hint` (a record's, by its contents where it is one;
    a Literal's by its values' types: which values a field takes is its reader's to say); with `nan_for_null`, a
    null is a float."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(arm, value, nan_for_null) for arm in args)
    if origin is typing.Literal:
        return any(_fits(type(arg), value) for arg in args)
    if dataclasses.is_dataclass(hint) or hint is dict or origin is dict:
        return isinstance(value, dict) and (
            len(args) < 2 or all(_fits(args[1], v, nan_for_null) for v in value.values())
        )
    if hint in (list, tuple) or origin in (list, tuple):
        return isinstance(value, list) and (not args or all(_fits(args[0], v, nan_for_null) for v in value))
    if hint is float and value is None:
        return nan_for_null
    if hint in (int, float):
        return isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool)
    if hint in _WORDS:
        return isinstance(value, hint)
    return True  # Any, or a type JSON holds no values of: not checked


def _words(hint) -> str:
    """What a JSON value of the field type `hint` is: "a whole number or null"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_words(arm) for arm in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if dataclasses.is_dataclass(hint) or hint is dict or origin is dict:
        return "a JSON object" if len(args) < 2 else f"a JSON object, each value {_words(args[1])}"
    if hint in (list, tuple) or origin in (list, tuple):
        return f"a list, each item {_words(args[0])}" if args else "a list"
    return _WORDS.get(hint, getattr(hint, "__name__", str(hint)))


def _read(hint, value, nan_for_null: bool = False):
    """The JSON value `value`, which fits `hint`, read as it: records typed, with `nan_for_null` a plain float's null
    NaN (a null where the field may be None stays None)."""
    if value is None:
        return math.nan if nan_for_null and hint is float else None
    if dataclasses.is_dataclass(hint):
        return from_json(hint, value, nan_for_null)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        records = [a for a in args if dataclasses.is_dataclass(a)]
        if records and isinstance(value, dict):
            return from_json(records[0], value, nan_for_null)
        lists = [a for a in args if typing.get_origin(a) is list]
        return _read(lists[0], value, nan_for_null) if lists and isinstance(value, list) else value
    if origin is list and args:
        return [_read(args[0], item, nan_for_null) for item in value]
    if origin is dict and len(args) == 2:
        return {key: _read(args[1], item, nan_for_null) for key, item in value.items()}
    return value


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


# -- the records ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusRecord(Provenance):
    """A corpus's gqaify.json (`gqaify generate`): the parent, the settings, and how much of the corpus is there."""

    kind: str = CORPUS
    parent: str
    vocab_size: int | None = optional()  # the parent's: a reader's model must have it (None: an earlier record)
    prompts_sha256: str | None = optional()  # of --prompts: what a resumed run's must still hold
    score_sha256: str | None = optional()  # of --score-data's tokens: what a resumed run's must still give
    settings: dict  # as resolved (`settings.recorded`): a rerun's, `--config OUT/gqaify.json`
    shards: int  # whole shards 0..shards-1 in OUT/data
    samples: int
    tokens: int
    complete: bool  # False while a generate writes it, or after one was stopped
    files: list[str] | None = optional()  # every file gqaify wrote in OUT


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportRecord(Provenance):
    """An eval report's gqaify.json: the settings (`gqaify eval --config DIR/gqaify.json` reruns it), the files."""

    kind: str = REPORT
    settings: dict
    files: list[str] | None = optional()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Uptraining:
    """What an uptrained model's gqaify.json says of its uptraining (its "uptrain")."""

    version: str | None = None
    model: str = json_key("from")  # the model trained: a folder or a hub id
    steps: int
    tokens: int
    settings: dict  # every setting of the run, as resolved
    data_sha256: str | None = None  # of the training tokens (None: a run of a gqaify that did not record it)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UptrainedRecord(Provenance):
    """final/gqaify.json of a model gqaify did not convert: the uptraining is all there is to say (a converted
    model's final/ holds its `ConversionRecord` with `uptrain`)."""

    kind: str = UPTRAINED
    uptrain: Uptraining
    files: list[str] | None = optional()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunRecord(Provenance):
    """run.json in uptrain's output_dir: the settings and data that make it this run (a rerun must match both to
    resume), and how far it went."""

    kind: str = RUN
    settings: dict  # the settings that define the run (`run_folder._identity`)
    data_sha256: str | None = optional()  # of the training tokens (None: a run.json of an earlier gqaify)
    parent_perplexity: float | None = optional()  # on the first eval text: `parent_perplexities`' first
    parent_perplexities: dict[str, float] | None = optional()  # on each eval text, measured once per run
    started: bool = optional(False)  # training began: what the folder holds is this run's, kept if it stops
    distributed_type: str | None = optional()  # accelerate's (FSDP where the launch shards)
    completed: bool = optional(False)  # final/ written
    # the checkpoints gqaify made in this run folder, by name (checkpoints/step-N), each recorded before it is
    # written and dropped once removed: what the run resumes from and rotation removes (`checkpoint_files.Checkpoints`),
    # kept here rather than in a file that travels with a copy of a checkpoint (None: a run.json of an earlier gqaify)
    checkpoints: list[str] | None = optional()


# -- every kind -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of record: the types it is read as, and where it keeps the settings that rerun the stage that wrote it
    (`--config RECORD`; the stage is the one whose entry lists the kind: `settings.registry.rerun_by`)."""

    types: tuple[type, ...]  # the types declared here, tried in order (then those declared above, `declare_types`)
    said: str  # how messages name such a record
    settings: tuple[str, ...] = ("settings",)  # the keys that lead to its settings in the JSON
    not_settings: frozenset[str] = frozenset()  # keys among those settings that are no setting of its stage
    # (the name of its file, the setting that is the folder it sits in): such a record addresses where it is now, so
    # that a folder moved or copied is rerun where it is; read under another name, it is refused
    sits_in: tuple[str, str] | None = None
    file: str = PROVENANCE_FILE  # where in the folder it describes it is written, as --help names it


KINDS = {
    CONVERSION: Kind((), "a conversion record"),  # `ConversionRecord`, declared above (`declare_types`)
    # final/ of an uptraining: `UptrainedRecord`, or the conversion's record with "uptrain" (a converted model)
    UPTRAINED: Kind(
        (UptrainedRecord,), "an uptrained model's record", settings=("uptrain", "settings"), file="final/gqaify.json"
    ),
    REPORT: Kind((ReportRecord,), "an eval report", file="report.json"),
    CORPUS: Kind((CorpusRecord,), "a generated corpus's record"),
    # run.json: the settings that make the run, and the processes it was launched with (an accelerate launch's)
    RUN: Kind(
        (RunRecord,),
        "an uptraining run's record",
        not_settings=frozenset({"processes"}),
        sits_in=(RUN_FILE, "output_dir"),  # run.json reruns the run in its own folder, wherever that is now
        file=RUN_FILE,
    ),
}
_ABOVE: dict[str, tuple[str, ...]] = {}  # kind: the types declared above this module that it is read as, by name


def declare_types(named: dict[str, tuple[str, ...]]) -> None:
    """Name the record types declared above this module (which imports no stage), by kind, as "module:Class":
    each is imported on the first read of its kind. Called once, by gqaify/__init__.py, which Python runs before
    any gqaify module, so that `read_record` reads every kind whatever the caller imported."""
    _ABOVE.update(named)
    _types.cache_clear()


@functools.cache
def _types(kind: str) -> tuple[type, ...]:
    """The record types a record of `kind` is read as (none: a kind this gqaify does not know)."""
    above = [named_type(name) for name in _ABOVE.get(kind, ())]
    return (*(KINDS[kind].types if kind in KINDS else ()), *above)


def named_type(name: str) -> type:
    """The record type "module:Class" names, its module imported (a type declared above this module, read by it)."""
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)


# -- reading any of them ----------------------------------------------------------------------------------------


def read_record(folder: Path) -> Provenance | None:
    """The record in `folder`, typed by its kind: its gqaify.json, or in uptrain's output_dir its run.json. None
    where there is none (or `folder` is not a folder), or the JSON is not a record gqaify wrote.

    Raises:
        ValueError: the file is not JSON, or a record gqaify cannot read (of a later version, or damaged).
    """
    file = _record_file(Path(folder))
    return None if file is None else read_record_file(file)


def read_record_file(file: Path) -> Provenance | None:
    """The record in `file` (a gqaify.json, or uptrain's run.json, told by its name), typed by its kind; None where
    the JSON is not a record gqaify wrote. `read_record` without the choice of file: uptrain reads its run.json so,
    whatever lies beside it.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not JSON, or a record gqaify cannot read (of a later version, or damaged).
    """
    file = Path(file)
    value = _current(json.loads(file.read_text()), file.name)
    if value is None:
        return None
    kinds = _types(value["kind"])
    problems = []
    for cls in kinds:
        try:
            return from_json(cls, value)
        except ValueError as exc:
            problems.append(str(exc))
    if not kinds:
        raise ValueError(f"{file} records a {value['kind']!r}, which this gqaify does not read")
    raise ValueError(f"{file} is not a {value['kind']} record this gqaify reads: {'; '.join(problems)}")


def rerun_settings(value, name: str) -> tuple[str, dict | None] | None:
    """The kind of the record `value` (the JSON read from a file called `name`: a key of `KINDS`) and the settings it
    reruns its stage with (`Kind.settings`, without `Kind.not_settings`; None where they are not a JSON object); None
    where `value` is no record of a kind this gqaify knows."""
    value = _current(value, name)
    if value is None or value["kind"] not in KINDS:
        return None
    kind = KINDS[value["kind"]]
    settings = value
    for key in kind.settings:
        settings = settings.get(key) if isinstance(settings, dict) else None
    if not isinstance(settings, dict):
        return value["kind"], None
    return value["kind"], {key: item for key, item in settings.items() if key not in kind.not_settings}


def read_run(folder: Path) -> RunRecord | None:
    """An uptrain output_dir's run.json, typed (None: it holds none), whatever lies beside it."""
    path = Path(folder) / RUN_FILE
    record = read_record_file(path) if path.is_file() else None
    return record if isinstance(record, RunRecord) else None


def read_provenance(folder: Path) -> Provenance | None:
    """The header of the record in `folder` (as `read_record` finds it), whichever shape it has; None where there is
    none, or it cannot be read."""
    file = _record_file(Path(folder))
    try:
        value = None if file is None else _current(json.loads(file.read_text()), file.name)
    except (OSError, ValueError):
        return None
    return None if value is None else Provenance(tool=TOOL, version=value.get("version"), kind=value["kind"])


def listed_files(folder: Path) -> set[str] | None:
    """The files the gqaify.json in `folder` says gqaify wrote there, or None where there is no such list."""
    try:
        value = _current(json.loads((Path(folder) / PROVENANCE_FILE).read_text()), PROVENANCE_FILE)
    except (OSError, ValueError):
        return None
    files = None if value is None else value.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def _record_file(folder: Path) -> Path | None:
    """folder/gqaify.json, else folder/run.json; None where neither is a file."""
    return next((folder / n for n in (PROVENANCE_FILE, RUN_FILE) if (folder / n).is_file()), None)


def _current(value, name: str) -> dict | None:
    """The JSON object `value` (read from a file called `name`) in today's shape, with its kind; None where it is
    not a record gqaify wrote. An earlier version's shape is told by what it holds (see the module's docstring)."""
    if not isinstance(value, dict) or value.get("tool") != TOOL:
        return None
    if isinstance(value.get("kind"), str):
        return value
    rest = {k: v for k, v in value.items() if k not in ("tool", "version", "command")}
    version = value.get("version")
    if name == RUN_FILE:
        kind = RUN
    elif isinstance(value.get("uptrain"), dict):
        kind = UPTRAINED
        version = version or value["uptrain"].get("version")
    elif "source" in value:
        kind = CONVERSION
    elif value.get("command") == "eval":
        kind = REPORT
    else:
        return None
    return {"tool": TOOL, "version": version, "kind": kind, **rest}
