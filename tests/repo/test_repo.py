"""The repository keeps its promises: README's commands are the ones CI runs."""

import re

import pytest

from helpers import REPO


def test_ci_runs_the_readme_test_command():
    command = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("python3")]
    assert len(command) == 1
    assert f"\n{command[0]}\n" in (REPO / "README.md").read_text()


def test_readme_main_job_uses_the_same_constraints():
    readme = (REPO / "README.md").read_text()
    assert "pip install -q -c constraints.txt -e . && .venv/bin/gqaify demo" in readme
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text().splitlines()


def pins_tested() -> dict[str, str]:
    """constraints.txt's pins, by name as pip compares names (lower case, "-" for "_")."""
    pinned = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[name.lower().replace("_", "-")] = version
    return pinned


def test_declared_lower_bounds_are_the_tested_versions():
    """pyproject's lower bounds are exactly the versions constraints.txt pins (the ones the tests ran with)."""
    import tomllib

    pinned = pins_tested()
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dependency in dependencies:
        name, lower = re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", dependency).groups()
        tested = pinned[name.lower().replace("_", "-")]
        assert tested.startswith(lower) and tuple(map(int, lower.split("."))) <= tuple(map(int, tested.split("."))), (
            dependency,
            tested,
        )


CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def test_readme_installs_from_pypi_in_one_line_with_the_pins_and_torchs_cpu_build():
    """README's wheel route was `pip install gqaify && pip install -q -c "$(gqaify --constraints)" gqaify`: the first
    install pulled torch 2.14.1 with 15 NVIDIA wheels and untested transformers and accelerate, which the second then
    downgraded. One install takes the pins (the `pinned` extra) and, on a machine with no GPU, torch's CPU build."""
    readme = (REPO / "README.md").read_text()
    assert f'\npython3 -m venv .venv && .venv/bin/pip install -q "gqaify[pinned]" {CPU_INDEX}\n' in readme
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        unpinned = re.findall(r"pip install (?:-q )?(?:-c \S+ )?gqaify\b(?!\[)", page.read_text())
        assert not unpinned, (page.name, unpinned)  # gqaify without its pins: the newest of everything


def test_the_pinned_extra_holds_the_tested_version_of_every_dependency():
    """`gqaify[pinned]` installs constraints.txt's version of each dependency (and of no package at another)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = dict(pin.lower().replace("_", "-").split("==") for pin in project["optional-dependencies"]["pinned"])
    needed = {re.match(r"[A-Za-z0-9_.-]+", d).group().lower().replace("_", "-") for d in project["dependencies"]}
    assert needed <= set(extra) and {name: pins_tested()[name] for name in extra} == extra


def test_contributing_layout_names_every_module():
    """docs/contributing.md's layout is where a new contributor looks for a room: it names every module of src/
    (a package's __init__.py aside)."""
    src = REPO / "src" / "gqaify"
    layout = (REPO / "docs" / "contributing.md").read_text()
    modules = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.py") if p.name != "__init__.py")
    missing = [m for m in modules if not re.search(rf"(^|\s){re.escape(m)}(?![\w/])", layout, re.M)]
    assert not missing, f"docs/contributing.md's layout does not name {missing}"


def test_no_module_in_src_is_over_500_lines():
    """A module past 500 lines holds more than one idea: give the next one a room of its own."""
    src = REPO / "src" / "gqaify"
    long = {p.relative_to(src).as_posix(): n for p in src.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"


def too_long_or_wide(source: str) -> list[str]:
    """The functions of `source` whose body, its docstring aside, is over 60 lines, or that take over 8 parameters
    (self and cls aside): "name (N lines, P parameters)"."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
        lines = node.end_lineno - body[0].lineno + 1
        a = node.args
        named = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        params = len(named) - (named[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)
        if lines > 60 or params > 8:
            found.append(f"{node.name} ({lines} lines, {params} parameters)")
    return found


def test_no_function_in_src_is_over_60_lines_or_8_parameters():
    """A function past 60 lines or 8 parameters does more than one thing: name its parts."""
    src = REPO / "src" / "gqaify"
    modules = sorted(src.rglob("*.py"))
    found = {p.relative_to(src).as_posix(): f for p in modules if (f := too_long_or_wide(p.read_text()))}
    assert not found, f"functions over the bar: {found}"


def test_the_function_bar_counts_a_body_past_its_docstring_and_the_parameters_past_self():
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    assert too_long_or_wide(f'def f():\n    """doc\n    more"""\n{body}') == ["f (61 lines, 0 parameters)"]
    sixty = body.removesuffix("    x60 = 60\n")
    assert too_long_or_wide(f'def f():\n    """doc"""\n{sixty}') == []
    assert too_long_or_wide("def f(self, a, b, c, d, e, f, g, h): pass") == []
    assert too_long_or_wide("def f(a, b, c, d, e, f, g, *h, i=1): pass") == ["f (1 lines, 9 parameters)"]


TEST_MODULES = {"tests"} | {p.stem for p in (REPO / "tests").rglob("*.py")}  # conftest, helpers, test_*


def imports_from_tests(tree) -> list[str]:
    """What a script's syntax tree takes from tests/: imports of its modules (conftest, helpers, ...), at the top or
    inside a function, and sys.path changes that name tests."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in TEST_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in TEST_MODULES]
        elif isinstance(node, ast.Call) and "sys.path" in ast.unparse(node.func) and "tests" in ast.unparse(node):
            found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize(
    "source",
    [
        "from conftest import build_model",
        "def f():\n    import helpers",
        "import tests.conftest",
        'import sys\nsys.path.insert(0, str(REPO / "tests"))',
    ],
)
def test_a_benchmark_taking_anything_from_tests_is_seen(source):
    import ast

    assert imports_from_tests(ast.parse(source))
    assert not imports_from_tests(
        ast.parse("from gqaify.testing import build_model\nimport sys\nsys.path.insert(0, 'x')")
    )


def integration_marks(tree) -> list[int]:
    """The lines of a test module's syntax tree that mark a test integration in code: `pytest.mark.integration` (or
    `mark.integration`) as a decorator, `pytestmark`, a `pytest.param`'s marks, or anywhere else."""
    import ast

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "integration" and ast.unparse(node.value).endswith("mark")
    ]


@pytest.mark.parametrize(
    "source",
    [
        "@pytest.mark.integration\ndef test_x():\n    pass",
        "pytestmark = [pytest.mark.slow, pytest.mark.integration]",
        "from pytest import mark\n\n@mark.integration\ndef test_x():\n    pass",
        '@pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.integration)])\ndef test_x(x):\n    pass',
    ],
)
def test_a_test_marked_integration_in_code_is_seen(source):
    import ast

    assert integration_marks(ast.parse(source))
    assert not integration_marks(ast.parse('@pytest.mark.slow\ndef test_x():\n    """integration"""'))


def test_no_test_is_marked_integration_in_code_its_files_name_is_the_mark():
    """A test is an integration test by where it is written: every test of a test_<topic>_integration.py file, and
    only those (conftest.py marks them as it collects them). A mark in code would be a second place that says so,
    and a file's name would no longer tell which of its tests the edit loop leaves out."""
    import ast

    tests = REPO / "tests"
    marked = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted(tests.rglob("*.py"))
        if path != tests / "conftest.py"
        for line in integration_marks(ast.parse(path.read_text()))
    ]
    assert not marked, f"marked integration in code (move the test to its test_<topic>_integration.py): {marked}"


CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}


def timed_asserts(tree) -> list[int]:
    """The lines of a test module's syntax tree whose `assert` judges how long something took: a clock read
    (`time.monotonic()`, `perf_counter()`, `time.time()`), or a name bound from one, compared with anything but a
    name `deadline`. A deadline bounds a wait for what a test waits on (a file, a line, a process), so that a
    hang fails rather than stalls: that is not a timing assertion."""
    import ast

    def reads_clock(node) -> bool:
        return any(
            isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
            and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) in CLOCKS
            for n in ast.walk(node)
        )  # fmt: skip

    timed = {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and reads_clock(node.value)
        for t in node.targets
        if isinstance(t, ast.Name) and t.id != "deadline"
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [compare.left, *compare.comparators]
            if any(isinstance(side, ast.Name) and side.id == "deadline" for side in sides):
                continue
            if any(reads_clock(side) or (isinstance(side, ast.Name) and side.id in timed) for side in sides):
                found.append(node.lineno)
    return found


@pytest.mark.parametrize(
    "source",
    [
        "started = time.monotonic()\nrun()\nassert time.monotonic() - started < 2",
        "t0 = perf_counter()\nrun()\nelapsed = perf_counter() - t0\nassert ok and elapsed < 5, elapsed",
        "sent = time.time()\nanswered = time.time() - sent\nassert said == 'x' and answered < 2",
    ],
)
def test_a_timing_assertion_is_seen(source):
    import ast

    assert timed_asserts(ast.parse(source))
    deadline = "deadline = time.monotonic() + 60\nwhile not done():\n    assert time.monotonic() < deadline"
    assert not timed_asserts(ast.parse(deadline))


def test_no_test_asserts_how_long_something_took():
    """Speed is measured by benchmarks/, never by a timed test: a time limit passes on one machine and fails on a
    slower or busier one, whatever the code does."""
    import ast

    timed = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for line in timed_asserts(ast.parse(path.read_text()))
    ]
    assert not timed, f"timing assertions (judge the behaviour the time stood for): {timed}"


def test_auto_is_written_once():
    """auto, the value gqaify chooses itself, is `gqaify.auto.AUTO` and tested by `is_auto` alone: the string "auto"
    was compared in nine places, and a setting added later compared it again."""
    import ast

    package = REPO / "src" / "gqaify"
    written = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in sorted(package.rglob("*.py"))
        if path != package / "auto.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value == "auto"
    ]
    assert not written, f'"auto" written outside gqaify/auto.py (use AUTO and is_auto): {written}'
