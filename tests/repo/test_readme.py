"""Every Python snippet of README and the docs pages says what it prints (a comment after each print), and every
figure README quotes has its benchmark row."""

import re

from helpers import REPO

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
