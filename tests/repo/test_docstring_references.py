"""A docstring or comment that names a module or a name of gqaify in backticks (`conversion.shapes`,
`results.model_labels`, `archs.ARCHITECTURES`) names one that exists: docstrings pointed at `options.METHOD_INFO`
and `outputs.*` long after those modules were gone."""

from __future__ import annotations

import ast
import importlib
import re

from helpers import REPO

SRC = REPO / "src"
FILES = ("py", "json", "jsonl", "md", "yaml", "txt", "png", "csv", "safetensors", "gguf", "pkl")
REFERENCE = re.compile(r"`((?:[a-z_][a-z0-9_]*\.)+[A-Za-z_][A-Za-z0-9_]*)(?:\(\))?`")


def modules() -> dict[str, object]:
    """Every module of the package by dotted name, with its path."""
    found = {}
    for path in (SRC / "gqaify").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def _has(obj, name: str):
    """`obj`'s attribute `name`, or a dataclass field or annotation of that name (None: none)."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if name in (getattr(obj, "__dataclass_fields__", None) or {}) or name in (
        getattr(obj, "__annotations__", {}) or {}
    ):
        return ...  # a field: nothing further to look into
    return None


def resolves(dotted: str, here: str) -> bool:
    """Whether `dotted`, written in module `here`, names a module of gqaify or something in one: read from the
    package, from `here`'s own package, or from any module whose name is its first part (`archs.X` is
    gqaify.model.archs's X, wherever it is written)."""
    first, parts = dotted.split(".")[0], dotted.split(".")
    bases = {"", "gqaify.", here.rsplit(".", 1)[0] + ".", here + "."}
    bases |= {m[: -len(first)] for m in MODULES if m.endswith("." + first)}
    for base in sorted(bases):
        for k in range(len(parts), 0, -1):
            name = base + ".".join(parts[:k])
            if name not in MODULES:
                continue
            obj = importlib.import_module(name)
            for attribute in parts[k:]:
                obj = None if obj is ... else _has(obj, attribute)
                if obj is None:
                    break
            else:
                return True
    return False


def references(path) -> list[str]:
    """The backticked dotted names in `path`'s docstrings and comments that start with the name of a gqaify module,
    leaving out file names and a function's own parameters and variables (`state.ours` in a function of `state`)."""
    source = path.read_text()
    tree = ast.parse(source)
    texts: list[tuple[str, set[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            local = set()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                local = {a.arg for a in (*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs)}
                local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            if docstring := ast.get_docstring(node, clean=False):
                texts.append((docstring, local))
    texts += [(line.split("#", 1)[1], set()) for line in source.splitlines() if "#" in line]
    names = {m.rsplit(".", 1)[-1] for m in MODULES}
    return [
        found
        for text, local in texts
        for found in REFERENCE.findall(text)
        if found.split(".")[0] in names and found.split(".")[0] not in local and found.rsplit(".", 1)[-1] not in FILES
    ]


def test_every_dotted_reference_in_a_docstring_or_comment_resolves():
    unresolved = sorted(
        {
            (module, found)
            for module, path in MODULES.items()
            for found in references(path)
            if not resolves(found, module)
        }
    )
    assert unresolved == []


def test_the_check_finds_a_stale_name_and_passes_a_live_one():
    assert resolves("conversion.shapes.shape", "gqaify.eval.core") and resolves("archs.ARCHITECTURES", "gqaify.testing")
    assert not resolves("options.METHOD_INFO", "gqaify.conversion.core")  # a module gone
    assert not resolves("results.model_label", "gqaify.eval.report")  # a name gone
