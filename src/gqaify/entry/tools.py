"""The commands that run no stage (`stages.TOOLS`): their arguments and what runs them."""

from __future__ import annotations

import argparse


def recipes_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=("ls", "cp"), default="ls", help="ls (the default) or cp")
    parser.add_argument("name", nargs="?", help="with cp: the recipe or config to copy (as ls names it)")
    parser.add_argument("destination", nargs="?", help="with cp: a new file, or a folder (default .)")


def run_recipes(args: argparse.Namespace) -> None:
    """`gqaify recipes`: the listing, or one packaged file copied out. A copy is said once it is whole: where
    standard output cannot say so (`command.guarded_stdout`), the one line that reports it names the copy too, for
    the file is there and a second `cp` would be refused."""
    import shlex
    import sys

    from gqaify.errors import ResourceError, UserError
    from gqaify.packaged import copy_out, listing

    if args.action == "ls":
        if stray := [w for w in (args.name, args.destination) if w is not None]:
            raise UserError(
                f"gqaify recipes ls lists every packaged file and takes nothing more; drop {shlex.join(stray)} (gqaify "
                "recipes cp NAME copies one out)"
            )
        print(listing())
    elif not args.name:
        raise UserError("gqaify recipes cp needs the NAME of a recipe (gqaify recipes lists them)")
    else:
        target = copy_out(args.name, args.destination or ".")
        try:
            print(f"copied {args.name} to {target}")
            sys.stdout.flush()
        except (UserError, ResourceError) as exc:
            raise type(exc)(f"{exc}; the copy {target} is whole all the same") from None


def demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="runs/demo", help="where the converted model goes (default runs/demo)")
    parser.add_argument("--model", help="use this model instead of fetching SmolLM2 (hub id, folder or .gguf)")


def run_demo(args: argparse.Namespace) -> None:
    """`gqaify demo`: the main job (`entry.demo.run_demo`)."""
    from gqaify.command import quiet_transformers
    from gqaify.entry.demo import run_demo as demo

    quiet_transformers()
    demo(args.workdir, args.model)
