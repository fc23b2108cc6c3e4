"""`gqaify convert`: its settings from the command line (before torch is loaded), the conversion, its summary."""

from __future__ import annotations

from gqaify.command import quiet_transformers, written_before_a_stop
from gqaify.conversion.settings import CONVERT
from gqaify.settings import parse


def command_line(argv: list[str], prog: str) -> None:
    settings = parse(CONVERT, argv, prog=prog)  # --help and bad options answer before torch is loaded
    quiet_transformers()  # its loading bars, -q or not: gqaify's own bars say what runs

    from gqaify.conversion.core import convert_with
    from gqaify.summary import format_summary

    result = convert_with(settings)
    with written_before_a_stop(f"{result.out} is complete: the conversion ended before the stop"):
        print(format_summary(result))
