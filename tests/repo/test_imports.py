"""The layers of the package: a module imports only from the layers below its own (or its own package), at the
top or inside a function, by name too, and none imports itself through others."""

import pytest

from helpers import REPO

# The layers of the package, lowest first: a module imports only from layers below its own (or its own package).
LAYERS = [
    {"_version", "auto", "errors", "sizes", "shipped", "logs", "records", "progress", "kl"},  # kl: eval and uptrain
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
