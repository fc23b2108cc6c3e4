"""README's Python snippets run as written, from a folder laid out like the repository root (recipes/ beside it,
../shared/assets above it), and print what their comments say."""

import re
import subprocess
import sys

import pytest

from conftest import ASSETS, REPO, needs_assets

SNIPPETS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def expected_output(code: str) -> list[str]:
    """The comment after each print(...) line: what that line prints."""
    return [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(") and "#" in line]


def test_readme_has_python_snippets_with_their_output():
    assert len(SNIPPETS) >= 2 and all(expected_output(code) for code in SNIPPETS)


@needs_assets
@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet-{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs_and_prints_what_it_says(code, tmp_path):
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "recipes").symlink_to(REPO / "recipes")
    (tmp_path / "shared").symlink_to(ASSETS.parent)
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = expected_output(code)
    assert done.stdout.strip().splitlines()[-len(expected) :] == expected
