"""Records read in a fresh process: a corpus record's counts bounded before anything is made of them (in 1 GiB of
memory), and `read_record` knowing every kind."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

import test_record_paths_and_kinds
from test_record_paths_and_kinds import copy_with_record

# test_record_paths_and_kinds.py's fixtures, shared: pytest finds a fixture by its name in this module
corpus = test_record_paths_and_kinds.corpus
run = test_record_paths_and_kinds.run


# -- a corpus record's counts -----------------------------------------------------------------------------------


# corpus_problems in a process of at most 1 GiB: a list made of a count of 10**12 is a MemoryError there, at once
BOUNDED = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from gqaify.text.corpus_format import corpus_problems
folder = Path(sys.argv[1])
print(corpus_problems(folder, sorted((folder / "data").iterdir()), "data"))
"""


@pytest.mark.parametrize(
    "changes",
    [
        {"shards": 10**12},
        {"shards": 10**12, "samples": 4 * 10**12},  # the counts agree with each other: the disk bounds them
        {"shards": "4"},
        {"shards": -1},
        {"tokens": None},
    ],
)
def test_a_corpus_records_counts_are_bounded_before_anything_is_made_of_them(corpus, tmp_path, changes):
    """A record of 10**12 shards made every reader build 10**12 paths (MemoryError); a count that is no number was
    a TypeError, a negative one named the first shard as one the record does not name."""
    folder = copy_with_record(corpus, tmp_path / "corpus", **changes)
    done = subprocess.run([sys.executable, "-c", BOUNDED, str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [problem] = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert str(folder / "gqaify.json") in problem and "gqaify generate" in problem, problem


# -- every kind, read and rerun ---------------------------------------------------------------------------------


READ = (
    "import sys\nfrom gqaify.records import read_record\nr = read_record(sys.argv[1])\nprint(type(r).__name__, r.kind)"
)


def test_read_record_knows_every_kind_in_a_fresh_process(tiny, run, corpus):
    """A conversion's record was "a 'conversion', which this gqaify does not read" until conversion.record was
    imported: its kind was registered by that import."""
    expected = {
        tiny["converted"]: "ConversionRecord conversion",
        run / "final": "ConversionRecord uptrained",
        run: "RunRecord run",
        corpus: "CorpusRecord corpus",
    }
    for folder, said in expected.items():
        done = subprocess.run([sys.executable, "-c", READ, str(folder)], capture_output=True, text=True)
        assert done.returncode == 0 and done.stdout.strip() == said, done.stderr[-2000:]
