"""What the benchmarks run and judge on, built in one place: the command lines (`gqaify convert`, `eval`,
`generate`, `uptrain`, `python -m gqaify.uptrain`, `accelerate launch`) and the panel of texts.

    python benchmarks/commands.py          # the panel's texts and a sample of each command line, run nothing

Each builder returns the argv a script hands to `subprocess.run`: `gqaify STAGE` as this Python runs it
(`python -m gqaify.entry.cli`; `program` swaps in a wrapper such as `python -c CODE` that calls the CLI's `main`),
or `python -m gqaify.uptrain` (what `accelerate launch -m gqaify.uptrain` runs), alone or after `accelerate_launch`.
A stage's settings are keyword arguments named as its fields, in the order given: `calib_tokens=16384` is
`--calib-tokens 16384` (`--calib_tokens` for uptrain, as its recipes and --help spell it); True is the flag alone,
False its `--no-` form, None leaves it out, a list gives its items and a dict its `name=path` items (a named text).
A name that is no field or option of the stage is refused when the line is built, not minutes into a run; what the
user of a script passes as free words (`--override`) goes in `extra`, after the settings, as given.

The panel: five kinds of text, none of them calibrated or trained on by any benchmark, each named as reports name
it (`PANEL`); tiny-shakespeare's second half, the Python code and the licence are made from other texts
(`made_texts`, written once per output folder by `write_texts`), the others are the files in ../shared/assets/text.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "assets" / "text"
MODELS = REPO.parent / "shared" / "assets" / "models"

Word = str | int | float | os.PathLike
GQAIFY = (sys.executable, "-m", "gqaify.entry.cli")  # `gqaify`, this Python's
UNDERSCORED = {"uptrain"}  # stages whose options the benchmarks spell --like_this (their recipes' keys)

# -- the panel ------------------------------------------------------------------------------------------------


# name in the reports -> a file of ../shared/assets/text, or the name of a text `made_texts` makes
PANEL: dict[str, Path | str] = {
    "wikitext": TEXT / "wikitext-2-raw-test.txt",
    "shakespeare": "shakespeare-2",
    "tinystories": TEXT / "tinystories-valid-head.txt",
    "code": "code-b",
    "licence": "licence",
}


def made_texts() -> dict[str, str]:
    """The texts made from others, by name, as the demo makes its own (`gqaify.entry.demo_texts`): tiny-shakespeare
    cut in two at a blank line near its middle, two disjoint sets of modules of this Python's standard library (real
    code nobody here wrote: A calibrates, B is the panel's), and that Python's LICENSE.txt (legal prose)."""
    from gqaify.entry.demo_texts import CODE_FIT, CODE_JUDGED, licence, shakespeare_halves, stdlib_modules

    first, second = shakespeare_halves()
    return {
        "shakespeare-1": first,
        "shakespeare-2": second,
        "code-a": stdlib_modules(CODE_FIT),
        "code-b": stdlib_modules(CODE_JUDGED),
        "licence": licence().read_text(),
    }


def write_texts(folder: Path) -> dict[str, Path]:
    """The made texts written into `folder` (each rewritten only where it differs), by name."""
    folder.mkdir(parents=True, exist_ok=True)
    made = made_texts()
    for name, text in made.items():
        path = folder / f"{name}.txt"
        if not path.is_file() or path.read_text() != text:  # a second run at once reads it as it is
            path.write_text(text)
    return {name: folder / f"{name}.txt" for name in made}


def panel(texts: Mapping[str, Path]) -> dict[str, Path]:
    """The panel's files by name, the made ones from `texts` (what `write_texts` returned)."""
    return {name: texts[source] if isinstance(source, str) else source for name, source in PANEL.items()}


def panel_contents(names: Iterable[str] = PANEL) -> dict[str, str]:
    """The panel's texts `names` as text, read without writing anything."""
    made = made_texts()
    return {name: made[PANEL[name]] if isinstance(PANEL[name], str) else PANEL[name].read_text() for name in names}


def mixture(texts: Mapping[str, Path], parent_text: Path | None = None) -> dict[str, Path]:
    """The mixture the panel benchmarks calibrate and train on, by name: WikiText-2 validation, tiny-shakespeare's
    first half, the TinyStories sample and, where given, a corpus the parent wrote (`gqaify generate`)."""
    parent = {} if parent_text is None else {"parent": parent_text}
    return {
        "wikitext": TEXT / "wikitext-2-valid-tokenized.txt",
        "verse": texts["shakespeare-1"],
        "stories": TEXT / "tinystories-train-sample.txt",
        **parent,
    }


# -- the command lines -----------------------------------------------------------------------------------------


@functools.cache
def _known(stage: str) -> frozenset[str]:
    """The names a command line of `stage` takes: its settings' fields, its settings file's flags and its options
    that are no settings."""
    from gqaify.settings.registry import every_stage

    found = next((s for s in every_stage() if s.command == stage), None)
    if found is None:
        raise ValueError(f"no gqaify stage {stage!r}; one of {', '.join(s.command for s in every_stage())}")
    flags = [*found.config_flags, *(o.flag for o in found.options)]  # --config (uptrain's --recipe), --plan
    return frozenset([*found.field_names(), *(f.lstrip("-").replace("-", "_") for f in flags)])


def options(stage: str, **values: Word | bool | Sequence[Word] | Mapping[str, Word] | None) -> list[str]:
    """The options that give `values` to `stage`, in their order (see the module's docstring).

    Raises:
        ValueError: a name that is no field or option of `stage`.
    """
    if unknown := sorted(set(values) - _known(stage)):
        raise ValueError(f"gqaify {stage} has no setting {', '.join(unknown)}; see gqaify {stage} --help")
    sep = "_" if stage in UNDERSCORED else "-"
    words: list[str] = []
    for name, value in values.items():
        flag = f"--{name.replace('_', sep)}"
        if value is None:
            continue
        if value is True:
            words.append(flag)
        elif value is False:
            words.append(f"--no{sep}{name.replace('_', sep)}")
        elif isinstance(value, Mapping):
            words += [flag, *(f"{k}={v}" for k, v in value.items())]
        elif isinstance(value, list | tuple):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return words


def gqaify(
    stage: str,
    *positionals: Word,
    quiet: bool = False,
    extra: Sequence[Word] = (),
    program: Sequence[str] = GQAIFY,
    **values,
) -> list[str]:
    """`gqaify STAGE POSITIONALS --setting value ... [-q] EXTRA`, run by `program`."""
    return [
        *program,
        stage,
        *map(str, positionals),
        *options(stage, **values),
        *(["-q"] if quiet else []),
        *map(str, extra),
    ]


def convert(src: Word, out: Word, **kwargs) -> list[str]:
    """`gqaify convert SRC OUT ...` (the keywords as `gqaify`'s)."""
    return gqaify("convert", src, out, **kwargs)


def evaluate(models: Iterable[Word], **kwargs) -> list[str]:
    """`gqaify eval MODEL ... ` (the parent first; the keywords as `gqaify`'s)."""
    return gqaify("eval", *models, **kwargs)


def generate(model: Word, out: Word, **kwargs) -> list[str]:
    """`gqaify generate MODEL OUT ...` (the keywords as `gqaify`'s)."""
    return gqaify("generate", model, out, **kwargs)


def accelerate_launch(config: Word, num_processes: int | None = None) -> list[str]:
    """`accelerate launch --config_file CONFIG [--num_processes N]`, as this Python runs it: what precedes the
    program it launches (`uptrain(launcher=...)`, or a script's path and its arguments)."""
    processes = [] if num_processes is None else ["--num_processes", str(num_processes)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), *processes]


def uptrain(*, extra: Sequence[Word] = (), launcher: Sequence[str] = (sys.executable,), **values) -> list[str]:
    """`python -m gqaify.uptrain --setting value ... EXTRA` (one process), or under `launcher`
    (`accelerate_launch(...)`)."""
    return [*launcher, "-m", "gqaify.uptrain", *options("uptrain", **values), *map(str, extra)]


class _Written(dict):
    """What `write_texts(Path("OUT/texts"))` returns, without writing (or reading) anything."""

    def __missing__(self, name: str) -> Path:
        return Path(f"OUT/texts/{name}.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    texts = _Written()
    print("panel:")
    for name, path in panel(texts).items():
        print(f"  {name:<12} {path}")
    samples = [
        convert("PARENT", "OUT", kv_heads=1, method="lsq", calib_data=mixture(texts), quiet=True),
        evaluate(["PARENT", "OUT"], data=panel(texts), split="train", speed=False, out="REPORT", quiet=True),
        generate("PARENT", "CORPUS", tokens=32_768, seed=0, quiet=True),
        uptrain(model="OUT", data=mixture(texts), output_dir="RUN", progress=False),
        uptrain(launcher=accelerate_launch("CONFIG", 2), model="OUT", output_dir="RUN"),
    ]
    for argv in samples:
        print(" ".join(argv))


if __name__ == "__main__":
    main()
