"""The texts a record names, as a rerun from any folder finds them: local paths located, texts pinned by SHA-256.

    located("st.txt")              "/home/me/runs/st.txt": a local path absolute, its links resolved (a hub name,
                                   or a path that is not there, as given); NAME=SOURCE keeps its NAME
    local_path(model)              the same of a model, file or folder (no NAME=)
    calib_sha256, score_sha256,    the SHA-256 of the text a stage read, in the settings its record holds: a rerun
    data_sha256 (`Pin`)            (`--config RECORD`) that reads other text says so (`Pin.problem`), and the
                                   setting given '' accepts any text

Only the standard library is imported (the settings' rules use it before anything heavy).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from gqaify.model.locations import exists
from gqaify.text.loading import NamedText, _default_name


def local_path(value: str) -> str:
    """A model, folder or file named by `value` as a rerun from any folder finds it: an existing local path
    absolute, its links resolved; a hub name, or a path that is not there, as given."""
    path = Path(value).expanduser()
    return str(path.resolve()) if exists(path) else value


def located(value: str) -> str:
    """A text's SOURCE or NAME=SOURCE as a rerun from any folder finds it: its SOURCE's `local_path`, under the name
    it had (NAME= is added where the resolved path's own name differs: a link's)."""
    text = NamedText.parse(value)
    found = local_path(text.source)
    if found == text.source:
        return value
    return found if text.name == _default_name(found) and text.source == value else f"{text.name}={found}"


def located_all(values: list[str] | None) -> list[str] | None:
    """`located` of each value (None: None)."""
    return None if values is None else [located(v) for v in values]


def text_sha256(text: str) -> str:
    """The SHA-256 of a text read (as UTF-8): for a text file read whole, what `sha256sum` prints."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def panel_sha256(named: list[tuple[str, str]]) -> str:
    """The SHA-256 that pins several texts (NAME, its text's SHA-256) at once: one text's own; for several, of
    their names and SHA-256s in order, so that a text changed, added, removed or renamed is seen."""
    if len(named) == 1:
        return named[0][1]
    return hashlib.sha256("\n".join(f"{name}\t{sha256}" for name, sha256 in named).encode()).hexdigest()


def sha256_problem(sha256: str, name: str) -> str | None:
    """A pin setting's rule: a SHA-256 (64 hex digits), or '' (any text)."""
    if not sha256 or (len(sha256) == 64 and all(c in "0123456789abcdefABCDEF" for c in sha256)):
        return None
    return (
        f"{name} {sha256!r} is not a SHA-256 (64 hex digits); copy it from the gqaify.json that recorded it, "
        "or leave it unset"
    )


@dataclass(frozen=True)
class Pin:
    """A setting that pins the text a stage reads by its SHA-256 (the stage's record holds it in its settings)."""

    setting: str  # "calib_sha256"
    run: str  # what the record records: "conversion"
    effect: str  # what other text would change: "the weights would differ"
    verb: str  # what a rerun does: "convert"

    def problem(self, texts: str, pinned: str | None, sha256: str) -> str | None:
        """A problem if the text read (its SHA-256 `sha256`) is not the text the setting holds (`pinned`; None or
        '': any text), said as `texts` ("--calib-data wiki.txt"). Not waived by --force, which says OUT may be
        replaced: accepting other text is said on its own."""
        if not pinned or sha256 == pinned.lower():
            return None
        return (
            f"{texts}: the text changed since the recorded {self.run} (SHA-256 {sha256[:12]}, {self.setting} "
            f"{pinned[:12]}), so {self.effect}; restore the text, or pass --{self.setting.replace('_', '-')} '' to "
            f"{self.verb} with the text as it is now"
        )
