"""`gqaify generate`: its settings from the command line (before torch is loaded), the corpus, its summary (once per
launch)."""

from __future__ import annotations

from gqaify.command import quiet_transformers, written_before_a_stop
from gqaify.generation.settings import GENERATE
from gqaify.settings import parse


def command_line(argv: list[str], prog: str) -> None:
    settings = parse(GENERATE, argv, prog=prog)
    quiet_transformers()

    from gqaify.generation.corpus import generate_corpus
    from gqaify.generation.processes import Processes
    from gqaify.summary import format_corpus_summary

    corpus = generate_corpus(settings)
    with written_before_a_stop(f"{corpus.out} is complete: the corpus was written before the stop"):
        if Processes.launched().main:  # one summary per launch
            print(format_corpus_summary(corpus))
