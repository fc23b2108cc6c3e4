"""What every `gqaify` command takes: `--help` for each, `--config FILE` for exactly the commands README says."""

from __future__ import annotations

import argparse
import re

import pytest

from gqaify.entry.cli import build_parser, main
from helpers import REPO


def commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_the_commands_that_take_a_config_file_are_those_readme_names(capsys, tmp_path):
    """README said "every command" takes --config; recipes and demo take none (they have no settings to keep)."""
    readme = " ".join((REPO / "README.md").read_text().split())
    named = re.search(r"the four that run a stage \(([^)]*)\) take a `--config FILE`", readme)
    assert named, "README's sentence on --config moved"
    named = set(re.findall(r"`(\w+)`", named.group(1)))
    assert len(named) == 4 and named < set(commands()) and {"recipes", "demo"} <= set(commands()) - named
    (tmp_path / "x.yaml").write_text("{}\n")
    for command in commands():
        assert main([command, "--help"]) == 0, command
        assert ("--config" in capsys.readouterr().out) == (command in named), command
        if command not in named:
            assert main([command, "--config", str(tmp_path / "x.yaml")]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"gqaify {command} takes no --config (it has no settings to keep)" in err, (
                err
            )


def _documented_command_lines() -> list[tuple[str, str, str]]:
    """(file, command, line) for every `gqaify COMMAND ...` line in a code block of README and docs/, its
    continuation lines joined (a synopsis spread over indented lines)."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for block in re.findall(r"```[^\n]*\n(.*?)```", path.read_text(), flags=re.S):
            lines = block.splitlines()
            for i, line in enumerate(lines):
                command = re.match(r"\s*(?:\S*/)?gqaify (\w+)", line)
                if command is None:
                    continue
                joined = [line]
                for more in lines[i + 1 :]:
                    if not more.startswith(" ") or re.match(r"\s*(?:\S*/)?gqaify ", more):
                        break
                    joined.append(more)
                found.append((path.name, command.group(1), " ".join(joined).split("#")[0]))
    return found


def test_every_option_the_docs_show_exists(capsys):
    """convert.md's synopsis left out --gguf-type; a renamed option would have left the docs showing the old one."""
    options = {}
    for command in commands():
        main([command, "--help"])
        # --key: the synopses' placeholder for any setting (`[--key value ...]`)
        options[command] = set(re.findall(r"--[a-z][a-z0-9_-]*", capsys.readouterr().out)) | {"--help", "--key"}
    lines = _documented_command_lines()
    assert len(lines) > 20  # the scan finds the docs' commands
    unknown = [
        (name, command, flag)
        for name, command, line in lines
        if command in options
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", line)
        if flag not in options[command] and flag.replace("_", "-") not in options[command]
    ]
    assert unknown == []


@pytest.mark.parametrize("command", ["convert", "eval", "generate"])
def test_each_commands_synopsis_names_every_option(capsys, command):
    """convert.md's synopsis left out --gguf-type: a page's synopsis (its first code block) names every option its
    command's --help lists."""
    main([command, "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]  # the usage lines: every option, and nothing of the prose
    flags = re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", usage)
    listed = {f.replace("_", "-") for f in flags} - {"--help"}
    page = "generate.md" if command == "generate" else f"{command}.md"
    synopsis = re.search(r"```[^\n]*\n(.*?)```", (REPO / "docs" / page).read_text(), flags=re.S).group(1)
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", synopsis))
    shown |= {f"--{flag[5:]}" for flag in shown if flag.startswith("--no-")} | {f"--no-{f[2:]}" for f in shown}
    positional_twins = {"--src", "--out", "--model", "--models", "--progress", "--no-progress", "--quiet"}  # SRC, -q
    assert sorted(listed - shown - positional_twins) == []


def test_out_after_the_options_is_the_positional_it_is(tmp_path, capsys):
    """`gqaify convert SRC --kv-heads 2 OUT` was "unknown option OUT (did you mean --out?)": a positional after the
    options is taken where it is unambiguous, as every CLI's users expect; a second OUT is still one too many."""
    from gqaify.testing import build_model, save_with_tokenizer

    src = save_with_tokenizer(
        build_model("llama", num_kv_heads=4, num_attention_heads=4, vocab_size=320), tmp_path / "src"
    )
    assert main(["convert", str(src), "--kv-heads", "2", str(tmp_path / "out"), "-q"]) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    assert main(["convert", str(src), "--kv-heads", "2", str(tmp_path / "a"), str(tmp_path / "b"), "-q"]) == 2
    assert "unknown option" in capsys.readouterr().err and not (tmp_path / "a").exists()


def test_help_says_each_default_once_and_titles_its_groups_in_words(capsys):
    """--help printed "(default f16 ...) (default: None)" and a group titled "... (`ATTENTION_INFO`) and, for MLA, its
    cache's widths: a conversion's,:"; `gqaify --help` described GQA/MQA only."""
    for command in commands():
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        text = " ".join(out.split())
        assert "(default: None)" not in text, command
        assert not re.search(r"\(default[^()]*\) \(default: ", text), command
        titles = re.findall(r"\n(\S[^\n]*):\n", out)
        assert all("`" not in t and not t.endswith(",") for t in titles), (command, titles)
    assert main(["--help"]) == 0
    assert "latent attention (MLA)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "argv, says",
    [
        (["recipes", "ls", "extra"], "gqaify recipes ls lists every packaged file and takes nothing more; drop extra"),
        (["recipes", "ls", "a", "b"], "takes nothing more; drop a b"),
        (["--constraints", "convert"], "--constraints prints a path and runs nothing else; drop convert"),
        (["--constraints", "recipes", "ls"], "--constraints prints a path and runs nothing else; drop recipes ls"),
        (["--version", "eval", "x"], "--version prints the version and runs nothing else; drop eval x"),
        (["-V", "--constraints"], "-V prints the version and runs nothing else; drop --constraints"),
    ],
)
def test_stray_words_are_refused_not_ignored(capsys, argv, says):
    """`gqaify recipes ls extra` listed the recipes and `gqaify --constraints convert` printed the path, each exit 0,
    the word the user gave read by nothing. They are refused in one line, exit 2, printing nothing."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("gqaify: error: ") and says in err, err


def test_the_printing_options_alone_or_verbose_still_print(capsys):
    from gqaify.packaged import CONSTRAINTS

    for argv in (["--constraints"], ["-v", "--constraints"], ["--constraints", "--verbose"]):
        assert main(argv) == 0 and capsys.readouterr().out == f"{CONSTRAINTS}\n", argv
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("gqaify ")
    assert main(["--cons", "convert"]) == 2  # no abbreviation: argparse read it as --constraints, deaf to convert
    assert capsys.readouterr().out == ""
