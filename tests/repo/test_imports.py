"""What is imported when: --help and usage errors answer without torch; `import gqaify` loads nothing heavy; a
mean conversion loads only what it uses. Checked in a fresh interpreter, by the modules present afterwards."""

import json
import subprocess
import sys

import pytest

from gqaify.testing import build_model, save
from helpers import REPO

HEAVY = ("torch", "transformers", "accelerate", "datasets", "matplotlib")


def loaded_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.parametrize("argv", [["--help"], ["demo", "--bogus"], ["bogus"]])
def test_help_and_usage_errors_load_nothing_heavy(argv):
    code = (
        f"from gqaify.entry.cli import main\nimport contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()), "
        f"contextlib.redirect_stderr(io.StringIO()):\n    main({argv!r})"
    )
    assert loaded_after(code) == []


@pytest.mark.integration
@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "--help"],
        ["eval", "--help"],
        ["uptrain", "--help"],
        ["convert", "a", "b", "--kv-heads", "two"],
        ["eval", "m", "--data", "d"],
        ["convert", "--config", "nowhere.yaml"],
    ],
)
def test_a_command_parses_its_settings_without_transformers(argv):
    """The settings parser is gqaify's own (transformers' HfArgumentParser loaded its package: 2 s of --help)."""
    code = (
        f"from gqaify.entry.cli import main\nimport contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()), "
        f"contextlib.redirect_stderr(io.StringIO()):\n    main({argv!r})"
    )
    assert loaded_after(code) == []


@pytest.mark.integration
def test_import_gqaify_is_light_and_names_resolve_on_use():
    assert (
        loaded_after(
            "import gqaify; gqaify.ConvertSettings; gqaify.EvalSettings; gqaify.UptrainSettings; gqaify.__version__"
        )
        == []
    )
    assert "torch" in loaded_after("import gqaify; gqaify.convert")


@pytest.mark.integration
def test_a_mean_conversion_loads_only_torch(tmp_path):
    src = save(build_model("llama", num_kv_heads=4), tmp_path / "src")
    code = f"import gqaify\ngqaify.convert({str(src)!r}, {str(tmp_path / 'out')!r}, kv_heads=2, progress=False)"
    assert loaded_after(code) == ["torch"]


# The layers of the package, lowest first: a module imports only from layers below its own (or its own package).
LAYERS = [
    {"_version", "errors", "sizes", "shipped", "logs", "records", "progress"},
    {"model", "output", "figures", "packaged"},
    {"settings", "command"},  # command: exit statuses and what an error leaves (`output.whole` says a full disk)
    {"summary", "text", "testing"},
    {"conversion"},
    {"eval", "generation"},  # eval asks a model's shape what it holds (`conversion.shapes`)
    {"uptrain"},
    {"uptrain.__main__"},  # `python -m gqaify.uptrain`: an entry, like cli
    {"entry"},  # the `gqaify` command, the stages it runs, the demo
    {"gqaify"},
    {"__main__"},
]


def import_graph() -> dict[str, set[str]]:
    """Every gqaify module and the gqaify modules it imports, at its top or inside a function, by statement or by
    name (`imported_names`), read from the source (so that an import made only on some path counts as much as one
    made at load)."""
    import ast

    src = REPO / "src"
    modules = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {
        name: {m for m in imported_names(ast.parse(path.read_text())) if m in modules and m != name}
        for name, path in modules.items()
    }


BY_NAME = {"import_module", "__import__"}


def imported_names(tree) -> set[str]:
    """The module names a module's syntax tree imports: by `import`/`from` statements, and by name: the argument of
    `importlib.import_module`/`__import__` when it is a string, and when it is not (a name looked up in a table),
    every string of the module that reads as a module path ("gqaify.eval.core", "gqaify.eval.core:EVAL")."""
    import ast

    imported, by_name = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in BY_NAME:
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                imported.add(first.value.split(":")[0])
            else:
                by_name = True
    if by_name:
        imported |= {
            n.value.split(":")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("gqaify.")
        }
    return imported


@pytest.mark.parametrize(
    "source",
    [
        'importlib.import_module("gqaify.eval.core")',
        '__import__("gqaify.eval.core")',
        'WHERE = {"eval": "gqaify.eval.core:EVAL"}\ndef f(k):\n    return importlib.import_module(WHERE[k])',
    ],
)
def test_an_import_by_name_is_seen(source):
    import ast

    assert "gqaify.eval.core" in imported_names(ast.parse(source))


def part(module: str) -> str:
    """The top-level piece of gqaify a module belongs to: "conversion" for gqaify.conversion.core; a subpackage's
    `__main__` is an entry of its own ("uptrain.__main__")."""
    if module.endswith(".__main__") and module.count(".") > 1:
        return module.split(".", 1)[1]
    return module.split(".")[1] if "." in module else module


def test_imports_run_from_higher_layers_to_lower_ones():
    layer = {piece: i for i, pieces in enumerate(LAYERS) for piece in pieces}
    graph = import_graph()
    assert {part(m) for m in graph} == set(layer), "place each new module in LAYERS"
    upward = [
        f"{m} imports {t}"
        for m, targets in graph.items()
        for t in targets
        if part(m) != part(t) and layer[part(t)] >= layer[part(m)]
    ]
    assert upward == []


def test_no_module_imports_itself_through_others():
    graph, seen, cycles = import_graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = "open"
        for target in sorted(graph[module]):
            if seen.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in seen:
                visit(target, [*path, target])
        seen[module] = "done"

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
    assert cycles == []
