"""docs/contributing.md's rules about the layout, each a test: the layers it lists are the ones test_imports holds,
eval reaches the conversion through its shapes alone, a shape's folder imports of the wing only the contract and the
shapes' tools (and nothing imports it), eval reaches an engine's room through its interface alone, every package has
its test folder and the tests at the top are the top-level modules', an integration file sits beside its topic's
tests and shares what both use rather than writing it again, each registry is where the guide says, and the layout
names only modules that exist."""

import ast
import re
from pathlib import Path

from helpers import REPO
from test_imports import LAYERS, import_graph

GUIDE = REPO / "docs" / "contributing.md"
SRC = REPO / "src" / "gqaify"


def test_the_layers_the_guide_lists_are_the_ones_the_imports_are_checked_against():
    """The guide lists the layers a line each, lowest first, under the sentence that names `LAYERS`."""
    text = GUIDE.read_text()
    block = re.search(r"a layer a line \(a test keeps the two equal\):\n\n((?: {4}\S.*\n)+)", text)
    assert block, "docs/contributing.md lists the layers under 'a layer a line (a test keeps the two equal):'"
    listed = [set(line.split()) for line in block.group(1).splitlines()]
    assert listed == LAYERS


def test_eval_and_generation_import_of_the_conversion_its_shapes_alone():
    """eval asks a model's attention shape what it caches and holds (`conversion.shapes`); neither it nor generation
    reaches into the conversion's pipeline or a shape's folder."""
    graph = import_graph()
    reached = {
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith(("gqaify.eval", "gqaify.generation"))
        for target in targets
        if target.startswith("gqaify.conversion") and target not in ("gqaify.conversion", "gqaify.conversion.shapes")
    }
    assert reached == set()


# What a shape's folder may import of the rest of conversion/: the contract, and the tools any shape may use
SHAPE_TOOLS = {
    "gqaify.conversion.shape_contract",  # the contract it answers
    "gqaify.conversion.calibrate",  # the calibration text, read as the conversion reads it
    "gqaify.conversion.repair",  # the windows held out of a fit
    "gqaify.conversion.to_gguf",  # the GGUF writer
    "gqaify.conversion.papers",  # the papers it cites
}


def shape_folders() -> list[str]:
    """The packages of the registered shapes that have a folder of their own ("gqaify.conversion.mla")."""
    from gqaify.conversion.registry import ATTENTION_INFO

    modules = [info.shape.split(":")[0] for info in ATTENTION_INFO.values()]
    return sorted({m.rsplit(".", 1)[0] for m in modules if m.count(".") > 2})


def test_a_shape_folder_imports_only_the_contract_and_the_tools_and_nothing_imports_it():
    graph = import_graph()
    folders = shape_folders()
    assert folders == ["gqaify.conversion.mla"]
    for folder in folders:
        inside = {m for m in graph if m == folder or m.startswith(folder + ".")}
        taken = {
            f"{m} imports {t}"
            for m in inside
            for t in graph[m]
            if t.startswith("gqaify.conversion") and t not in inside and t not in SHAPE_TOOLS | {"gqaify.conversion"}
        }
        assert taken == set()
        assert graph[folder] == set(), f"{folder}/__init__.py imports nothing, so that its settings load no torch"
        importers = {f"{m} imports {t}" for m in set(graph) - inside for t in graph[m] if t in inside}
        assert importers == set(), "the registry names a shape's modules; conversion.shapes imports them when asked"


def test_eval_reaches_an_engines_room_through_the_interface_alone():
    """Each engine of --kv-cache is a room behind `eval.caches.engine` (`CacheEngine` for what eval asks before any
    model loads, `CacheRunner` for a model opened in it): no module imports a room, and every room registered in
    `ROOMS` answers the whole interface."""
    import importlib

    from gqaify.eval.caches.engine import ROOMS, CacheEngine

    graph = import_graph()
    rooms = set(ROOMS.values())
    engine = "gqaify.eval.caches.engine"  # which names each room in `ROOMS`, to import it when asked
    reached = {
        f"{m} imports {target}" for m, targets in graph.items() if m != engine for target in targets if target in rooms
    }
    assert reached == set()
    for module in rooms:
        assert isinstance(importlib.import_module(module).ENGINE, CacheEngine), module


def test_every_package_has_its_test_folder():
    """tests/ mirrors src/gqaify: each package (a folder of modules) has a folder of its tests at the same path,
    holding at least one test file, and each such folder is one the guide names."""
    packages = sorted({p.parent.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")} - {"."})
    missing = [p for p in packages if not list((REPO / "tests" / p).glob("test_*.py"))]
    assert missing == []
    named = re.search(r"a folder per package \(([^)]*)\)", GUIDE.read_text().replace("\n", " "))
    assert named and sorted(re.sub(r"\s+", "", named.group(1)).rstrip("/").split("/,")) == packages


def test_the_tests_at_the_top_are_the_top_level_modules_the_guide_lists():
    """The guide says the top-level modules' tests sit at the top of tests/ and lists them: the list is the files
    there (integration files beside their unit file), and each names a top-level module of the package."""
    text = GUIDE.read_text().replace("\n", " ")
    listed = re.search(r"top-level modules' tests at the top\s+\(([^)]*)\)", text)
    assert listed, "docs/contributing.md lists the tests at the top of tests/ after 'tests at the top'"
    named = sorted(re.sub(r"\s+", "", listed.group(1)).split(","))
    top = sorted({p.name.replace("_integration", "") for p in (REPO / "tests").glob("test_*.py")})
    assert named == top
    modules = [p.stem for p in SRC.glob("*.py")]
    topics = [Path(t).stem.removeprefix("test_") for t in top]
    assert all(any(m.startswith(t.split("_")[0]) for m in modules) for t in topics), topics


def test_an_integration_file_sits_beside_its_topics_unit_file():
    """A topic's integration tests go into test_<topic>_integration.py beside its test_<topic>.py, where it has
    one."""
    tests = REPO / "tests"
    apart = [
        f"{path.relative_to(tests)} is not beside {other.relative_to(tests)}"
        for path in tests.rglob("test_*_integration.py")
        for other in tests.rglob(path.name.replace("_integration.py", ".py"))
        if other.parent != path.parent
    ]
    assert apart == []


def defined_in(name: str) -> list[str]:
    """The modules of src/gqaify that assign `name` at their top level."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append(path.relative_to(SRC).as_posix())
    return found


def test_what_a_topics_two_files_both_use_is_written_once():
    """What both a topic's unit and integration files use is written once, in the unit file or helpers.py, and the
    integration file imports it: no function (a fixture, a helper) is defined in both."""
    twice = []
    for integration in sorted((REPO / "tests").rglob("test_*_integration.py")):
        unit = integration.with_name(integration.name.replace("_integration", ""))
        if not unit.exists():
            continue
        defined = [
            {n.name for n in ast.parse(f.read_text()).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for f in (unit, integration)
        ]
        twice += [f"{integration.relative_to(REPO)}: {name}" for name in sorted(defined[0] & defined[1])]
    assert twice == []


def test_each_registry_is_where_the_guide_says():
    """ "one entry of `METHOD_INFO` in `src/gqaify/conversion/registry.py`": every registry the guide places so is
    defined there, and nowhere else."""
    placed = re.findall(r"`([A-Z][A-Z_]+)` in\s+`src/gqaify/([\w/]+\.py)`", GUIDE.read_text())
    assert {name for name, _ in placed} >= {"ARCHITECTURES", "METHOD_INFO", "ATTENTION_INFO", "STAGES"}
    assert [(name, defined_in(name)) for name, path in placed if defined_in(name) != [path]] == []


def test_the_layout_names_only_modules_that_exist():
    """The layout's rooms are the tree's: a module it names that was moved or removed is a room that is not there."""
    layout = GUIDE.read_text().split("## Layout", 1)[1].split("```")[1]
    named = re.findall(r"^ {2}([\w/]+(?:\.py|/))", layout, re.M)
    assert len(named) > 50
    absent = [n for n in named if not (SRC / n).exists()]
    assert absent == []


def test_conftest_imports_nothing_heavy_at_its_top():
    """The process that hands out the test files reads tests/conftest.py too: torch there only delays the start."""
    tree = ast.parse((REPO / "tests" / "conftest.py").read_text())
    top = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    top += [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert [m for m in top if m.split(".")[0] in ("torch", "transformers", "gqaify", "accelerate", "datasets")] == []
