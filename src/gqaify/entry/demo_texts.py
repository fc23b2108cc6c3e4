"""The demo's texts, from what every install of gqaify has: nothing is fetched for them and nothing beside a checkout
is read, so that `gqaify demo` runs where only the package index answers (its model comes from a PyPI wheel).

    kind     fitted on (calibration and training)           judged on (the report and the uptraining's panel)
    verse    tiny-shakespeare's first half                   its second half
    code     7 modules of this Python's standard library     4 others
    docs     this Python's help topics (pydoc_data)          -
    licence  -                                               this Python's LICENSE.txt: legal prose, never fitted on

tiny-shakespeare (public domain) ships in the wheel (gqaify/texts/, its source in the README there), cut in two at a
blank line near its middle as benchmarks/commands.py cuts it; the rest is the Python running gqaify, which every
install has. A text this Python lacks (a distribution that strips its documentation or licence) is left out, and the
demo says so. Each text is written into the demo's folder (`written`), for the stages to read as files.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from gqaify.output.whole import write_text_whole

SHIPPED = Path(__file__).resolve().parents[1] / "texts"
SHAKESPEARE = SHIPPED / "tinyshakespeare.txt"
# Disjoint sets of standard-library modules (benchmarks/commands.py fits on the first and judges on the second)
CODE_FIT = ("difflib", "shlex", "calendar", "pprint", "statistics", "csv", "configparser")
CODE_JUDGED = ("argparse", "dataclasses", "textwrap", "fractions")


@dataclass(frozen=True)
class DemoText:
    """One text of the demo: its name in a mixture or a report, where it comes from (as the demo says it), and its
    text (None: this Python has none)."""

    name: str
    origin: str
    text: str | None


@dataclass(frozen=True)
class DemoTexts:
    """What the demo fits on (a mixture) and what it judges on (a panel), each text there; and those this Python
    lacks."""

    fit: list[DemoText]
    judged: list[DemoText]
    missing: list[DemoText]

    def describe(self) -> str:
        """A few lines saying where each text comes from, and which this Python lacks."""
        lines = ["the demo's texts, none fetched:"]
        for label, texts in (("fitted on", self.fit), ("judged on", self.judged), ("left out", self.missing)):
            lines += [f"  {label:9}  {t.name}: {t.origin}" for t in texts]
        return "\n".join(lines)


def demo_texts() -> DemoTexts:
    """The demo's texts, read from the wheel and from this Python (see the module's docstring)."""
    first, second = shakespeare_halves()
    shipped, stdlib = "tiny-shakespeare (public domain, shipped with gqaify)", "this Python's standard library"
    fit = [
        DemoText("verse", f"{shipped}, first half", first),
        DemoText("code", f"{stdlib}: {', '.join(CODE_FIT)}", stdlib_modules(CODE_FIT)),
        DemoText("docs", "this Python's help topics (pydoc_data), prose about Python", _help_topics()),
    ]
    judged = [
        DemoText("shakespeare", f"{shipped}, second half", second),
        DemoText("code", f"{stdlib}: {', '.join(CODE_JUDGED)}", stdlib_modules(CODE_JUDGED)),
        DemoText("licence", "this Python's LICENSE.txt, legal prose: a kind never fitted on", _read(licence())),
    ]
    missing = [t for t in fit + judged if not t.text]
    return DemoTexts([t for t in fit if t.text], [t for t in judged if t.text], missing)


def written(texts: list[DemoText], folder: Path, stem: str) -> list[str]:
    """`texts` written into `folder` as `{stem}-NAME.txt` (each rewritten only where it differs, whole or not at
    all), as the NAME=PATH values a mixture or a panel takes."""
    folder.mkdir(parents=True, exist_ok=True)
    values = []
    for t in texts:
        path = folder / f"{stem}-{t.name}.txt"
        if _read(path) != t.text:
            write_text_whole(path, t.text)
        values.append(f"{t.name}={path}")
    return values


def shakespeare_halves() -> tuple[str, str]:
    """tiny-shakespeare cut in two at the blank line nearest past its middle: one half to fit on, one to judge."""
    verse = SHAKESPEARE.read_text(encoding="utf-8")
    half = verse.index("\n\n", len(verse) // 2)
    return verse[:half], verse[half:].lstrip()


def stdlib_modules(names: tuple[str, ...]) -> str | None:
    """The source of the standard-library modules `names`, joined by blank lines; None where one has no source."""
    sources = []
    for name in names:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if not origin or not origin.endswith(".py") or (source := _read(Path(origin))) is None:
            return None
        sources.append(source)
    return "\n\n".join(sources)


def licence() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def _help_topics() -> str | None:
    """The topics `help()` shows (pydoc_data.topics), joined by blank lines in the order of their names."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return None
    return "\n\n".join(topics[name].strip() for name in sorted(topics)) or None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
