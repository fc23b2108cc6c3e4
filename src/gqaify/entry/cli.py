"""The `gqaify` command: parses arguments and runs the command they name (exit status: `gqaify.command`).

Only argparse and gqaify's light modules are imported here, so that `--help` and usage errors answer before
torch is loaded; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import shlex
import sys
import textwrap
from pathlib import Path

from gqaify._version import __version__
from gqaify.command import flushed, guarded_stdout, reader_gone, run_command, said
from gqaify.conversion.registry import shape_titles
from gqaify.entry.stages import STAGES, TOOLS
from gqaify.errors import ResourceError, UserError
from gqaify.packaged import CONSTRAINTS
from gqaify.settings import OneLineParser
from gqaify.settings.registry import StageEntry, resolve


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="gqaify",
        allow_abbrev=False,  # --cons must not quietly mean --constraints (`_printing_alone` reads the words)
        description=f"Convert MHA checkpoints to {shape_titles()}, uptrain, and evaluate.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("-V", "--version", action="version", version=f"gqaify {__version__}")
    parser.add_argument(
        "--constraints",
        action=_PrintPath,
        path=CONSTRAINTS,
        help="print the path of the versions gqaify is tested with, for pip's -c: "
        'pip install -c "$(gqaify --constraints)" gqaify',
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    # every command that runs a stage (`gqaify.entry.stages`): its options, --config and --help are its settings
    # parser's, built when the command runs
    for entry in STAGES:
        sub.add_parser(entry.name, help=entry.help, add_help=False).set_defaults(run=functools.partial(_run, entry))

    # every command that runs none (`gqaify.entry.stages.TOOLS`): no settings, so no --config
    for tool in TOOLS:
        parser_of = sub.add_parser(
            tool.name,
            help=tool.help,
            description=_wrapped(tool.description),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        resolve(tool.arguments)(parser_of)
        parser_of.set_defaults(run=resolve(tool.run))
    return parser


class _PrintPath(argparse.Action):
    """An option that prints a packaged file's path and exits, as --version prints the version."""

    def __init__(self, option_strings, dest, path: Path, help: str):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)
        self.path = path

    def __call__(self, parser, namespace, values, option_string=None):
        print(self.path)
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:], the process's own, which exits with the status) and
    return its exit status (`gqaify.command`)."""
    try:
        with guarded_stdout():  # --help, --version and --constraints print too
            return _main(sys.argv[1:] if argv is None else argv, process_exit=argv is None)
    except (UserError, ResourceError) as exc:  # standard output closed, or unwritable while an option printed
        return said(exc)


def _main(words: list[str], process_exit: bool) -> int:
    """`main` once standard output is guarded."""
    parser = build_parser()
    try:
        command = next((w for w in words if not w.startswith("-")), None)
        tools = {tool.name for tool in TOOLS}
        if command in tools and any(w.split("=")[0] == "--config" for w in words):
            parser.error(f"gqaify {command} takes no --config (it has no settings to keep): give its options instead")
        if refused := _printing_alone(words):
            parser.error(refused)
        args, rest = parser.parse_known_args(words)
        if rest and args.command in tools:  # the stages' options belong to their settings parsers
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:  # --help, --version, --constraints, or a usage error already reported on one line
        return flushed(int(exc.code or 0))
    except BrokenPipeError:  # `gqaify --help | true`: the reader left before the text was written
        return reader_gone()
    args.rest, args.prog = rest, f"gqaify {args.command}"
    return run_command(lambda: args.run(args), verbose=args.verbose, process_exit=process_exit)


# gqaify's own options that print something and run nothing (argparse prints as it meets them, deaf to what follows)
PRINTING = {"-V": "the version", "--version": "the version", "--constraints": "a path"}


def _printing_alone(words: list[str]) -> str | None:
    """Why `words` are refused where they give one of gqaify's options that print something and run nothing
    (`PRINTING`) beside another word (`gqaify --constraints convert`: a command argparse never reads), or None."""
    leading = list(itertools.takewhile(lambda w: w.startswith("-"), words))  # gqaify's own options
    printing = next((w for w in leading if w in PRINTING), None)
    if printing is None:
        return None
    others = [w for w in words if w != printing and w not in ("-v", "--verbose")]
    if not others:
        return None
    return f"{printing} prints {PRINTING[printing]} and runs nothing else; drop {shlex.join(others)}"


def _wrapped(description: str) -> str:
    """A description's paragraphs wrapped to 100 columns, its indented lines (examples) kept as written."""
    paragraphs = description.split("\n\n")
    return "\n\n".join(p if p.startswith(" ") else textwrap.fill(p, 100) for p in paragraphs)


def _run(entry: StageEntry, args) -> None:
    """The stage `entry` names, on the rest of the command line."""
    resolve(entry.command_line)(args.rest, args.prog)


if __name__ == "__main__":
    sys.exit(main())
