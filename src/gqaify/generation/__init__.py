"""Text the parent writes: a corpus sampled from a model, for calibration and uptraining.

    gqaify generate PARENT OUT --tokens 100000          sample 100k tokens from PARENT into the folder OUT
    gqaify convert PARENT CONV --kv-heads 1 --method lsq --calib-data OUT
    gqaify uptrain --recipe recipes/smollm2-135m-mqa.yaml --data OUT

A converted model recovers best on its parent's own distribution (LLM-QAT, arXiv 2305.17888): the parent's
text needs no corpus, matches every use the parent was trained for, and carries no domain of its own.
`settings.py` holds what can be asked (importing nothing heavy), `corpus.py` the sampling and the folder; the
stage's entry is `gqaify.generation.run(GenerateSettings(...))` (`corpus.generate_corpus`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["run"]

if TYPE_CHECKING:
    from gqaify.generation.corpus import generate_corpus as run


def __getattr__(name: str):
    if name != "run":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from gqaify.generation.corpus import generate_corpus

    globals()[name] = generate_corpus
    return generate_corpus
