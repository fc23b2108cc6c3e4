"""`gqaify eval`: its settings from the command line (before torch is loaded), the evaluation, its table."""

from __future__ import annotations

from pathlib import Path

from gqaify.command import quiet_transformers
from gqaify.eval.settings import EVAL
from gqaify.settings import parse


def command_line(argv: list[str], prog: str) -> None:
    settings = parse(EVAL, argv, prog=prog)
    quiet_transformers()

    from gqaify.eval.core import run
    from gqaify.eval.report import format_table
    from gqaify.summary import printable

    report = run(settings)
    print(format_table(report))
    if report.frontier is not None:
        from gqaify.eval.caches.report import verdict_text

        print("\n" + verdict_text(report.frontier))
    out = Path(settings.out)
    print(f"report: {printable(out / 'report.md')}, report.json; plots: {printable(out)}/*.png")
