"""`accelerate launch -m gqaify.uptrain --recipe FILE [--key value ...]` (or `python -m gqaify.uptrain`): the
uptrain stage's own entry, running the `command_line` that `gqaify uptrain` runs too (`uptrain.entry`)."""

from __future__ import annotations

import sys

from gqaify.command import run_command
from gqaify.uptrain.entry import command_line

PROG = "python -m gqaify.uptrain"


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the command line `argv` (default: sys.argv[1:], the process's own, which exits with the status) and
    return its exit status (`gqaify.command`)."""
    words = sys.argv[1:] if argv is None else argv
    return run_command(lambda: command_line(words, prog), process_exit=argv is None)


if __name__ == "__main__":
    sys.exit(main())
