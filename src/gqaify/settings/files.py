"""A settings file read with care, as it may come from anyone: a YAML mapping (at most 1 MiB, no aliases, no deep
nesting, each key once) or a JSON record gqaify wrote (its "settings", at most 16 MiB); unknown keys refused with
the nearest name, another command's settings named as such, and no message showing more than a value's start.

Only the standard library and PyYAML are imported.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import typing
from pathlib import Path

import yaml

from gqaify.errors import UserError, raise_if_problems
from gqaify.records import KINDS, TOOL, Kind, rerun_settings
from gqaify.settings.fields import _describe, _hints, _is_a, current_names, shown
from gqaify.settings.registry import every_stage, rerun_by
from gqaify.settings.stage import Stage, nearest

# A settings file is a few hundred bytes; a record gqaify wrote, a few KB (tens for a large model's per-layer fits).
# Larger files are refused before they are parsed: PyYAML reads about 1 MB a second, so 50 MB took 51 s.
MAX_YAML_BYTES = 1 << 20
MAX_JSON_BYTES = 16 << 20  # json parses in C, 100 times faster: a record may be larger
MAX_DEPTH = 32  # of YAML (PyYAML composes nodes recursively); settings are values and lists of values


def read_config(stage: Stage, path: str | Path, stages: tuple[Stage, ...] | None = None) -> dict:
    """The settings a --config file holds, as a dict of known keys.

    A YAML mapping of field: value; or a record gqaify wrote (any gqaify.json, uptrain's run.json, an evaluation's
    report.json), whose settings are taken where it is this command's (`records.KINDS`, `registry.rerun_by`), else
    refused, naming the command that reruns it. `stages` are the commands' a file that holds one of theirs is named
    as such (default: every declared one, `registry.every_stage`).

    Raises:
        UserError: no such file, or not a file; too large, not YAML, not a mapping; a YAML alias, deep nesting;
            an unknown key (named with the nearest valid one), or another command's settings (named).
    """
    return read_settings_file(stage, path, stages)[0]


def read_settings_file(stage: Stage, path: str | Path, stages: tuple[Stage, ...] | None = None) -> tuple[dict, bool]:
    """What `read_config` reads, and whether the file is a record gqaify wrote (a rerun)."""
    path = Path(path).expanduser()
    # os.path.exists, as gqaify.model.locations.exists (a layer above): False, not ENAMETOOLONG, for too long a name
    if not os.path.exists(path) and stage.packaged is not None:
        if os.path.exists(local := path.with_name(f"{path.name}.yaml")):
            path = local  # NAME for ./NAME.yaml (what `gqaify recipes cp NAME .` writes) before the packaged NAME
        elif (found := stage.packaged(str(path))) is not None:
            path = found  # a packaged recipe, by name
    where = f"{stage.config_flags[0]} {path}"
    values, record = _settings_in(stage, _parse(_read_text(path, where), where), where, path)
    values = current_names(stage.settings, values, where)
    _check_keys(stage, values, record, where, path, stages)
    return _numbers_from_text(values, stage, where), record


def read_data(path: Path, where: str):
    """The data of a YAML or JSON file read as settings files are (size, aliases, depth, repeated keys), e.g. an
    accelerate config; `where` names it in messages ("--plan FILE").

    Raises:
        UserError: not a readable file, too large, not UTF-8, not YAML, a YAML alias, deep nesting, a key twice.
    """
    return _parse(_read_text(Path(path), where), where)


def _read_text(path: Path, where: str) -> str:
    """The text of a settings file (a regular file, or a pipe such as `<(...)`), read only up to the cap."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(
            f"{where} does not exist; check the path (gqaify recipes lists the packaged recipes, which "
            "--recipe finds by name)"
        ) from None
    except OSError as exc:
        raise UserError(f"{where} cannot be read ({exc.strerror}); check the path") from None
    if stat.S_ISDIR(mode):
        inside = [path / n for n in ("gqaify.json", "report.json") if (path / n).is_file()]
        hint = f"did you mean {inside[0]}?" if inside else "name the YAML file, or the gqaify.json or report.json"
        raise UserError(f"{where} is a folder, not a settings file; {hint}")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise UserError(f"{where} is a device, not a settings file; name the YAML file")
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{where} cannot be read ({exc.strerror}); check the path") from None
    if len(data) > MAX_JSON_BYTES:
        raise UserError(
            f"{where} is larger than {MAX_JSON_BYTES >> 20} MiB; settings files are a few hundred "
            "bytes: name the settings file"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{where} is not UTF-8 text; name the YAML settings file") from None


def _parse(text: str, where: str):
    """The data in `text`: JSON (a record gqaify wrote), else YAML (at most MAX_YAML_BYTES, without aliases)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:  # json's own bound on nesting
        raise UserError(f"{where} nests values too deeply; write values and lists of values") from None
    except _RepeatedKey as exc:
        raise UserError(f"{where} gives the key {exc.key!r} twice; keep one") from None
    except ValueError:  # not JSON: YAML
        pass
    if len(text.encode("utf-8")) > MAX_YAML_BYTES:
        raise UserError(
            f"{where} is larger than {MAX_YAML_BYTES >> 20} MiB of YAML; settings files are a few "
            "hundred bytes: name the settings file"
        )
    try:
        return yaml.load(text, Loader=_SettingsLoader) or {}
    except _Refused as exc:
        line = f" (line {exc.problem_mark.line + 1})" if exc.problem_mark is not None else ""
        raise UserError(f"{where} {exc.problem}{line}; {exc.fix}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise UserError(f"{where} is not valid YAML{f' (line {mark.line + 1})' if mark else ''}; fix it") from None


class _RepeatedKey(Exception):  # not a ValueError, which `_parse` takes for "not JSON"
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are each given once (json keeps the last of a repeated key)."""
    values = {}
    for key, value in pairs:
        if key in values:
            raise _RepeatedKey(key)
        values[key] = value
    return values


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, fix: str, mark):
        super().__init__(problem)
        self.problem, self.fix, self.problem_mark = problem, fix, mark


class _SettingsLoader(yaml.SafeLoader):
    """PyYAML's safe loader, without aliases, at most MAX_DEPTH deep, and with each key of a mapping given once.

    An alias (`*name`) repeats a whole subtree by reference: nine levels of nine aliases are 81 aliases in a few
    hundred bytes, but 9**9 values to any code that walks them (a message's repr ran out of memory). Counting
    aliases would not catch that, and a settings file has no need for them, so every alias is refused.

    An integer Python will not read (more digits than `sys.get_int_max_str_digits()`) is refused naming its key.
    """

    _depth = 0
    _keys: tuple[str, ...] = ()  # the keys of the mappings whose values are being composed, outermost first

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            raise _Refused("uses a YAML alias (*name)", "write the value itself: settings files allow no aliases", mark)
        if self._depth >= MAX_DEPTH:
            raise _Refused(f"nests values more than {MAX_DEPTH} deep", "write values and lists of values", mark)
        self._depth += 1
        keys = self._keys
        if isinstance(index, yaml.ScalarNode):  # a mapping's value, `index` its key
            self._keys = (*keys, index.value)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._keys = keys
        self._check_integer(node, index.value if isinstance(index, yaml.ScalarNode) else (keys or (None,))[-1])
        return node

    def _check_integer(self, node, key: str | None) -> None:
        """Refuse an integer scalar that Python's int() will not read (its int-str conversion limit)."""
        if not isinstance(node, yaml.ScalarNode) or node.tag != "tag:yaml.org,2002:int":
            return
        try:
            self.construct_yaml_int(node)
        except ValueError:
            digits = sum(c.isdigit() for c in node.value)
            whose = f"gives {key} an integer" if key is not None else "holds an integer"
            raise _Refused(
                f"{whose} of {digits:,} digits", "no setting takes a number that long: fix the value", node.start_mark
            ) from None

    def construct_mapping(self, node, deep=False):
        """A mapping whose keys are each given once: PyYAML keeps the last of a repeated key, silently dropping
        the value the reader of the file may take for the one in force."""
        if isinstance(node, yaml.MappingNode):
            lines = {}  # key: the line it is first given on
            for key_node, _ in node.value:
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in lines:
                        where = f"line {line}" if lines[key] == line else f"lines {lines[key]} and {line}"
                        raise _Refused(f"gives the key {key!r} twice ({where})", "keep one", None)
                    lines[key] = line
                except TypeError:  # an unhashable key: PyYAML's own error names it
                    continue
        return super().construct_mapping(node, deep=deep)


def _settings_in(stage: Stage, values, where: str, path: Path) -> tuple[dict, bool]:
    """The settings mapping in a file's data (a record's: `records.rerun_settings`, or an eval's report.json's
    "settings"), and whether it was a record gqaify wrote.

    Raises:
        UserError: a record another command reruns (named with that command), or one without settings.
    """
    rerun = rerun_settings(values, path.name)
    if rerun is not None:
        kind, settings = rerun
        if (command := rerun_by(kind)) != stage.command:
            raise UserError(
                f"{where} is {KINDS[kind].said}, not {stage.command}'s; use `gqaify {command} --config "
                f"{shlex.quote(str(path))}`"
            )
        if settings is None:
            raise UserError(f"{where} has no settings gqaify can read; check the file")
        return _where_it_sits(settings, KINDS[kind], where, path), True
    record = isinstance(values, dict) and values.get("tool") == TOOL and "settings" in values
    if record:
        values = values["settings"]
        if not isinstance(values, dict):
            raise UserError(f"{where} has no settings gqaify can read; check the file")
    if not isinstance(values, dict):
        raise UserError(f"{where} must be a mapping of setting: value; see --help for the settings")
    return values, record


def _where_it_sits(settings: dict, kind: Kind, where: str, path: Path) -> dict:
    """A record's settings, with the setting that is the folder its file sits in (`Kind.sits_in`) that folder, as it
    is now: run.json reruns the run beside it, wherever its folder was moved or copied since it was written (the
    folder it names inside would be the original's).

    Raises:
        UserError: such a record read under another name than its own: away from its folder, it addresses none.
    """
    if kind.sits_in is None:
        return settings
    file, setting = kind.sits_in
    if path.name != file:
        raise UserError(
            f"{where} is {kind.said} renamed: it reruns the folder it sits in, where it is {file}; give the {file} "
            f"in that folder (a folder moved or copied whole reruns where it is now), or a YAML of the settings"
        )
    return {**settings, setting: str(path.parent.resolve())}


def _check_keys(
    stage: Stage, values: dict, record: bool, where: str, path: Path, stages: tuple[Stage, ...] | None
) -> None:
    """Refuse a key that names another settings file, another command's settings, or unknown keys (5 named)."""
    flags = {f.lstrip("-").replace("-", "_") for f in stage.config_flags}
    nested = [key for key in values if key in flags]
    if nested:
        raise UserError(
            f"{where}: a settings file cannot name another ({nested[0]}: ...); gqaify reads one, "
            "so copy that file's settings into this one"
        )
    known = set(stage.field_names())
    unknown = [key for key in values if key not in known]
    if not unknown:
        return
    owner = _owner(stage, list(values), every_stage() if stages is None else stages)
    if owner is not None:
        what = f"is {owner.record_kind}" if record else f"holds gqaify {owner.command}'s settings"
        readable = set(values) <= set(owner.field_names())  # else only the other command's own run reads it
        fix = (
            f"use `gqaify {owner.command} {owner.config_flags[0]} {shlex.quote(str(path))}`"
            if readable
            else f"name {stage.command}'s settings file instead"
        )
        raise UserError(f"{where} {what}, not {stage.command}'s; {fix}")
    if stage.foreign_file is not None and (said := stage.foreign_file(values, where)):
        raise UserError(said)
    if is_accelerate_config(values):  # accelerate's own file, given to gqaify (uptrain's foreign_file says it first)
        raise UserError(
            f"{where} is an accelerate config (distributed_type, compute_environment), not gqaify settings: give it "
            f"to `accelerate launch --config_file {shlex.quote(str(path))} -m gqaify.uptrain`, or to uptrain's --plan"
        )
    options = {o.flag.lstrip("-").replace("-", "_"): o.flag for o in stage.options}
    if said := [key for key in unknown if key in options]:  # `plan:` in a recipe
        raise UserError(
            f"{where}: {said[0]} is a command-line option ({options[said[0]]}), not a setting; give it there"
        )
    problems = [f"unknown key {shown(key)}{nearest(stage, str(key))}" for key in unknown[:5]]
    more = [f"and {len(unknown) - 5} more unknown keys"] if len(unknown) > 5 else []
    raise UserError(f"{where}: " + "; ".join(problems + more))


def is_accelerate_config(values: dict) -> bool:
    """Whether a settings file's `values` are an accelerate config: accelerate writes compute_environment and
    distributed_type into every config it makes, and no gqaify command has either."""
    return {"compute_environment", "distributed_type"} <= set(values)


def _owner(stage: Stage, keys: list, stages: tuple[Stage, ...]) -> Stage | None:
    """The other command whose settings `keys` are: it knows 3/4 of them or more, and more than `stage` does."""

    def known(s: Stage) -> int:
        return len(set(keys) & set(s.field_names()))

    best = max((stage, *stages), key=known)
    if best.command != stage.command and known(best) > known(stage) and known(best) >= 0.75 * len(keys):
        return best
    return None


def _numbers_from_text(values: dict, stage: Stage, where: str) -> dict:
    """Numbers YAML read as text (`lr: 1e-4` lacks the dot YAML wants) as numbers, as argparse would convert them;
    text that is no number is refused here, naming the file, before argparse reports it as an option's. Text the
    field takes as it is (micro_batch_size's `auto`) stays text."""
    hints = _hints(stage.settings)
    converted, problems = dict(values), []
    for key, value in values.items():
        number = next((t for t in (int, float) if t in (hints[key], *typing.get_args(hints[key]))), None)
        if number is None or not isinstance(value, str) or _is_a(value, hints[key]):
            continue
        try:
            converted[key] = number(value)
        except ValueError:
            problems.append(f"{where}: {key} {shown(value)} is not {_describe(hints[key])}; fix the file")
    raise_if_problems(problems)
    return converted
