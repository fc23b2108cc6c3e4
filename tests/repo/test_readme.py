"""The Python snippets of README and the docs pages run as written, from a folder laid out like the repository root
(recipes/ beside it, ../shared/assets above it), and print what their comments say; the docs site builds with
every link and anchor found."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from helpers import ASSETS, REPO, needs_assets

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SNIPPETS = {
    f"{page.stem}-{i}": code
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
}


def expected_output(code: str) -> list[str]:
    """The comment after each print(...) line: what that line prints."""
    return [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(") and "#" in line]


def test_snippets_say_what_they_print():
    assert "README-0" in SNIPPETS and len(SNIPPETS) >= 4
    silent = [name for name, code in SNIPPETS.items() if not expected_output(code)]
    assert not silent, silent


@pytest.mark.integration
@needs_assets
@pytest.mark.parametrize("code", SNIPPETS.values(), ids=SNIPPETS.keys())
def test_snippet_runs_and_prints_what_it_says(code, tmp_path):
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "recipes").symlink_to(REPO / "recipes")
    (tmp_path / "shared").symlink_to(ASSETS.parent)
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = expected_output(code)
    assert done.stdout.strip().splitlines()[-len(expected) :] == expected


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is absent: pip install 'gqaify[docs]'")
def test_docs_site_builds_strictly(tmp_path):
    """mkdocs.yml's strict mode and link validation turn a broken link or anchor, or a page left out of the
    navigation, into a failure."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    quiet = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=quiet)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "serve" / "index.html").is_file()


def _figures(text: str) -> list[str]:
    """The measured figures a text quotes: numbers with a decimal point or thousands separators (× and all)."""
    return re.findall(r"(?<![\w.])\d[\d,]*\.\d+(?![\d.])|(?<![\w.])\d{1,3}(?:,\d{3})+(?![\d,])", text)


def test_every_figure_readme_quotes_has_its_benchmark_row():
    """README quotes measured figures (rounded); each is a number of the benchmark pages, where the command that
    measures it stands. The suite's own timings (its Tests section) and the Python version are not benchmarks."""
    readme = (REPO / "README.md").read_text()
    readme = readme.split("## Tests")[0].replace("Python 3.10", "")
    pages = [REPO / "docs" / "benchmarks.md", *sorted((REPO / "docs" / "benchmarks").glob("*.md"))]
    benchmarks = "\n".join(page.read_text() for page in pages)
    measured = [float(n.replace(",", "")) for n in _figures(benchmarks)]
    measured += [float(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.,])", benchmarks)]

    def backed(figure: str) -> bool:
        decimals = len(figure.split(".")[1]) if "." in figure else 0
        value = float(figure.replace(",", ""))
        return any(round(m, decimals) == value for m in measured)

    unbacked = [f for f in _figures(readme) if not backed(f)]
    assert unbacked == []
