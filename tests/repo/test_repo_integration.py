"""Every benchmark still runs: it answers --help in a process of its own, and imports only names that exist and
nothing from tests/."""

import subprocess
import sys

import pytest

from helpers import REPO
from test_repo import imports_from_tests

BENCHMARKS = sorted((REPO / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_every_benchmark_answers_help_and_imports_only_what_exists(script):
    """A benchmark that no longer runs cannot reproduce the figures the docs cite from it: each answers --help,
    every gqaify name it imports, at the top or inside a function, exists, and it imports nothing from tests/ (what
    it shares with the tests comes from gqaify, e.g. `gqaify.testing`), nor puts tests/ on its import path."""
    import ast
    import importlib

    tree = ast.parse(script.read_text())
    assert not (found := imports_from_tests(tree)), f"{script.name} imports from tests/: {found}"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "gqaify":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                        f"{script.name}: from {node.module} import {alias.name}"
                    )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gqaify":
                    importlib.import_module(alias.name)
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr[-2000:]
