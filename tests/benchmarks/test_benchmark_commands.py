"""benchmarks/commands.py: the one place the benchmarks build gqaify's command lines and define the panel of texts.
The scripts themselves are run by hand (minutes to hours); here, what they would run is checked without running it."""

from __future__ import annotations

import ast
import importlib.util
import sys

import pytest

from helpers import REPO

BENCHMARKS = REPO / "benchmarks"


@pytest.fixture(scope="module")
def commands():
    spec = importlib.util.spec_from_file_location("benchmark_commands", BENCHMARKS / "commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_become_the_options_each_command_spells(commands):
    texts = {"wikitext": "w.txt", "verse": "v.txt"}
    assert commands.convert("SRC", "OUT", kv_heads=1, calib_data=texts, calib_tokens=8, quiet=True) == [
        *commands.GQAIFY,
        "convert",
        "SRC",
        "OUT",
        "--kv-heads",
        "1",
        "--calib-data",
        "wikitext=w.txt",
        "verse=v.txt",
        "--calib-tokens",
        "8",
        "-q",
    ]
    assert commands.evaluate(["P", "C"], data="d.txt", tasks=["a", "b"], speed=False, generate=True, out=None) == [
        *commands.GQAIFY,
        "eval",
        "P",
        "C",
        "--data",
        "d.txt",
        "--tasks",
        "a",
        "b",
        "--no-speed",
        "--generate",
    ]
    # uptrain as its recipes spell it; --recipe and --plan are its flags, though no settings; extra words last
    launcher = commands.accelerate_launch("cfg.yaml", 2)
    assert commands.uptrain(
        launcher=launcher, recipe="r.yaml", calib_data="", progress=False, plan="p.yaml", extra=["--lr", "1"]
    ) == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "cfg.yaml",
        "--num_processes",
        "2",
        "-m",
        "gqaify.uptrain",
        "--recipe",
        "r.yaml",
        "--calib_data",
        "",
        "--no_progress",
        "--plan",
        "p.yaml",
        "--lr",
        "1",
    ]
    assert commands.gqaify("uptrain", program=["py", "-c", "CODE"], max_tokens=4) == [
        "py",
        "-c",
        "CODE",
        "uptrain",
        "--max_tokens",
        "4",
    ]


def test_a_setting_the_command_does_not_have_is_refused_before_anything_runs(commands):
    with pytest.raises(ValueError, match="gqaify convert has no setting calib_token, kv_head; see gqaify convert"):
        commands.convert("SRC", "OUT", kv_head=1, calib_token=8)
    with pytest.raises(ValueError, match="gqaify eval has no setting recipe"):
        commands.evaluate(["P"], recipe="r.yaml")  # uptrain's flag, not eval's
    with pytest.raises(ValueError, match="no gqaify stage 'train'"):
        commands.options("train", lr=1)


def test_the_panel_is_five_kinds_of_text_none_of_them_calibrated_or_trained_on(commands, tmp_path):
    texts = {name: tmp_path / f"{name}.txt" for name in ("shakespeare-1", "shakespeare-2", "code-a", "code-b")}
    texts["licence"] = tmp_path / "licence.txt"
    panel = commands.panel(texts)
    assert list(panel) == ["wikitext", "shakespeare", "tinystories", "code", "licence"]
    trained = commands.mixture(texts, tmp_path / "parent")
    assert list(trained) == ["wikitext", "verse", "stories", "parent"]
    assert not set(panel.values()) & set(trained.values())
    assert panel["shakespeare"] == texts["shakespeare-2"] and trained["verse"] == texts["shakespeare-1"]
    made = commands.made_texts()  # the demo's two sets of standard-library modules: none of one in the other
    assert (
        made["code-a"]
        and made["code-b"]
        and made["code-a"] not in made["code-b"]
        and made["code-b"] not in made["code-a"]
    )


def test_no_benchmark_builds_a_gqaify_or_accelerate_command_line_by_hand():
    """Every script runs gqaify and accelerate through benchmarks/commands.py: a module name that starts one (the
    string itself, not code that imports it) appears nowhere else."""
    programs = {"gqaify.entry.cli", "gqaify.uptrain", "accelerate.commands.launch", "gqaify"}
    found = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        if script.name == "commands.py":
            continue
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Constant) and node.value in programs:
                found.append(f"{script.name}:{node.lineno} {node.value!r}")
    assert not found, found
