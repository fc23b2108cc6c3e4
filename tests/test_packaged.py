"""What gqaify packages: the recipes and accelerate configs, listed, copied and found by name, each as its
registry entry says."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from gqaify.entry.cli import main
from gqaify.errors import UserError
from gqaify.packaged import (
    LAUNCH_REGISTRY,
    RECIPE_REGISTRY,
    RECIPES,
    entry,
    find,
    first_line,
    recipe_by_name,
    recipe_names,
)
from gqaify.uptrain.settings import load_recipe
from helpers import REPO, needs_assets, one_line_refusal


def test_the_registries_and_the_files_on_disk_agree():
    """Every YAML under recipes/ is one entry of the registries, and every entry's file is there: a recipe added
    without its entry (never listed, copied or found) or an entry whose file went fails here, naming it."""
    on_disk = {p.relative_to(RECIPES).with_suffix("").as_posix() for p in RECIPES.rglob("*.yaml")}
    listed = recipe_names()
    assert len(set(listed)) == len(listed), f"named twice in the registries: {listed}"
    assert not (unlisted := sorted(on_disk - set(listed))), (
        f"YAML files under recipes/ no registry entry names: {unlisted}"
    )
    assert not (missing := sorted(set(listed) - on_disk)), f"registry entries whose file is not in recipes/: {missing}"
    assert all("/" not in r.name for r in RECIPE_REGISTRY) and all(
        c.name.startswith("accelerate/") and c.name.count("/") == 1 for c in LAUNCH_REGISTRY
    )
    assert (REPO / "recipes").resolve() == RECIPES  # the checkout's recipes/ is the packaged folder


def test_recipes_readme_names_every_packaged_file_the_registries_list():
    """recipes/README.md's table and its accelerate line name what the registries list, no more, no fewer (in the
    order the README reads best: the main recipe first)."""
    readme = (RECIPES / "README.md").read_text()
    table = re.findall(r"^\| `([\w.-]+)\.yaml` \|", readme, re.M)
    assert sorted(table) == sorted(r.name for r in RECIPE_REGISTRY)
    line = next(line for line in readme.splitlines() if line.startswith("`accelerate/`:"))
    named = re.findall(r"`([\w-]+)\.yaml`", line)
    assert sorted(named) == sorted(c.name.removeprefix("accelerate/") for c in LAUNCH_REGISTRY)


def test_every_listed_recipe_loads_by_name_through_the_settings_parser_and_is_what_its_entry_says(
    tmp_path, monkeypatch
):
    """Each entry of the registry, by its name from a folder that is no checkout, read by uptrain's own parser:
    every key of its file is a setting with a valid value, and its entry's `converts` names the model it names and
    the shape its kv_heads (or its MLA cache) make."""
    from gqaify.settings import text_lists
    from gqaify.uptrain.settings import UPTRAIN, parse

    monkeypatch.chdir(tmp_path)
    for recipe in RECIPE_REGISTRY:
        settings = parse(["--recipe", recipe.name])
        values = text_lists(UPTRAIN.settings, load_recipe(recipe.file))  # a recipe's one text is a list of one
        assert all(getattr(settings, k) == v for k, v in values.items() if not isinstance(v, float)), recipe.name
        parent, shape = recipe.converts.split(" -> ")
        assert Path(settings.model).name.lower().removesuffix("-hf") == parent.lower(), recipe.name
        if settings.attention == "mla":
            assert shape == f"MLA {settings.kv_rank + settings.rope_dims}", recipe.name
        else:
            assert shape == ("MQA" if settings.kv_heads == 1 else f"GQA-{settings.kv_heads}"), recipe.name
        assert recipe.summary and "\n" not in recipe.summary
    assert not list(tmp_path.iterdir())


def test_every_listed_accelerate_config_reads_as_the_launch_its_entry_says_and_recipes_say_if_they_take_several():
    """Each config's processes are its num_processes, as --plan reads it; a recipe launched (by its own first line
    or a config's) with several processes is declared distributed, and one declared for one process never is."""
    from gqaify.uptrain.plan import Launch

    launched = {}  # recipe -> the processes of every packaged config whose first line runs it, or its own runs under
    for config in LAUNCH_REGISTRY:
        assert Launch.read(config.file).processes == config.processes, config.name
        for recipe in re.findall(r"--recipe recipes/([\w.-]+)\.yaml", first_line(config.file)):
            launched.setdefault(recipe, set()).add(config.processes)
    for recipe in RECIPE_REGISTRY:
        for config in re.findall(r"--config_file recipes/(accelerate/[\w-]+)\.yaml", first_line(recipe.file)):
            launched.setdefault(recipe.name, set()).add(entry(config).processes)
    for recipe in RECIPE_REGISTRY:
        assert recipe.distributed == (max(launched.get(recipe.name, {1})) > 1), (recipe.name, launched)


@pytest.mark.parametrize("config", LAUNCH_REGISTRY, ids=lambda c: c.name)
def test_every_packaged_accelerate_config_is_complete_for_accelerates_own_config_class(config):
    """accelerate's ClusterConfig requires compute_environment, distributed_type, mixed_precision, use_cpu and debug,
    and `accelerate launch` fills in what a file leaves out (BaseConfig.process_config): a config that leans on it
    is one deleted line from accelerate's own traceback (a file without its distributed_type stops there, before
    gqaify runs). Each packaged config gives every key accelerate would fill in, so that its class is made from the
    file as it stands, and its loading adds nothing; accelerate's own loader reads it as --plan does."""
    import dataclasses

    from accelerate.commands.config.config_args import BaseConfig, ClusterConfig, load_config_from_file

    from gqaify.uptrain.plan import Launch

    data = yaml.safe_load(config.file.read_text())
    required = {f.name for f in dataclasses.fields(ClusterConfig) if f.default is dataclasses.MISSING}
    assert required <= set(data), sorted(required - set(data))
    assert BaseConfig.process_config(dict(data)) == data  # accelerate fills in nothing
    made = ClusterConfig(**data)
    loaded = load_config_from_file(str(config.file))
    assert loaded == made and loaded.num_processes == config.processes == Launch.read(config.file).processes
    assert loaded.distributed_type == data["distributed_type"]


def test_every_recipe_and_config_is_listed_with_what_it_is_and_its_command(capsys):
    """Each entry: its name and what it is on one line, the descriptions in one column, and under it, indented to
    that column, the command that runs it from any folder (its first line runs it from a checkout only: a wheel's
    user got accelerate's FileNotFoundError for recipes/accelerate/cpu.yaml), or the config's own file."""
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads, under = lines[::2], lines[1::2]
    assert [line.split()[0] for line in heads] == recipe_names() and len(heads) == len(under)
    starts = {len(head) - len(head[len(head.split()[0]) :].lstrip()) for head in heads}  # each description's column
    assert len(starts) == 1 and {len(shown) - len(shown.lstrip()) for shown in under} == starts, (heads, under)
    by_name = dict(zip((line.split()[0] for line in heads), zip(heads, under, strict=True), strict=True))
    # two entries as a user reads them, written out here
    head, shown = by_name["smollm2-135m-mqa"]
    assert head.split(None, 1)[1] == (
        "SmolLM2-135M-Instruct -> MQA (one process or several): lsq fitted layer by layer, distilled from the parent "
        "on five kinds of text (code among them), on a CPU"
    )
    assert shown.strip() == (
        "gqaify generate HuggingFaceTB/SmolLM2-135M-Instruct runs/smollm2-parent-text --tokens 32768 -q && "
        "gqaify uptrain --recipe smollm2-135m-mqa"
    )
    head, shown = by_name["accelerate/cpu"]
    assert head.split(None, 1)[1] == "1 process: the CPU, full precision"
    assert Path(shown.strip()).read_bytes() == (REPO / "recipes" / "accelerate" / "cpu.yaml").read_bytes()
    for name, (_, shown) in by_name.items():
        words = shown.split()
        assert not [w for w in words if w.startswith(("recipes/", "../", "$T/", "$G"))], shown  # no checkout's path
        assert all(Path(w).exists() for w in words if w.startswith("/")), shown
        if "--recipe" in words:  # the recipe it names is this entry's, by name or by its packaged path
            named = words[words.index("--recipe") + 1]
            assert named == name or Path(named).read_bytes() == (REPO / "recipes" / f"{name}.yaml").read_bytes()
    assert "one process or several" in heads[0] and heads[1].split(" (")[1].startswith("one process)")


def test_a_packaged_file_is_found_by_each_spelling_of_its_name_and_a_recipe_only_among_recipes():
    recipe, config = RECIPES / "smollm2-135m-mqa.yaml", RECIPES / "accelerate" / "fsdp.yaml"
    for name in ("smollm2-135m-mqa", "smollm2-135m-mqa.yaml", "recipes/smollm2-135m-mqa.yaml"):
        assert find(name) == recipe and recipe_by_name(name) == recipe
    for name in ("accelerate/fsdp", "accelerate/fsdp.yaml", "recipes/accelerate/fsdp.yaml"):
        assert find(name) == config
        with pytest.raises(UserError, match=re.escape(f"--recipe {name} is an accelerate config, not a recipe")):
            recipe_by_name(name)
    for name in ("nope", "fsdp", "accelerate/smollm2-135m-mqa", "../recipes/smollm2-135m-mqa"):
        assert find(name) is None and recipe_by_name(name) is None


def test_a_yaml_file_no_registry_entry_names_is_never_found_nor_listed(tmp_path, monkeypatch):
    """The registries are the list, not the folder: a stray file beside the recipes is not a recipe."""
    import gqaify.packaged

    shutil.copytree(RECIPES, tmp_path / "recipes")
    (tmp_path / "recipes" / "stray.yaml").write_text("# gqaify uptrain --recipe recipes/stray.yaml\nlr: 1.0\n")
    monkeypatch.setattr(gqaify.packaged, "RECIPES", tmp_path / "recipes")
    assert find("stray") is None and recipe_by_name("stray") is None and "stray" not in recipe_names()
    assert find("smollm2-135m-mqa") == tmp_path / "recipes" / "smollm2-135m-mqa.yaml"
    assert "stray" not in gqaify.packaged.listing()


def test_a_recipe_is_copied_out_byte_for_byte_and_never_over_a_file(capsys, tmp_path):
    assert main(["recipes", "cp", "smollm2-135m-mqa", str(tmp_path / "mine.yaml")]) == 0
    assert (tmp_path / "mine.yaml").read_bytes() == (RECIPES / "smollm2-135m-mqa.yaml").read_bytes()
    assert main(["recipes", "cp", "accelerate/fsdp", str(tmp_path)]) == 0  # into a folder, under its own name
    assert (tmp_path / "fsdp.yaml").read_bytes() == (RECIPES / "accelerate" / "fsdp.yaml").read_bytes()
    capsys.readouterr()
    (tmp_path / "mine.yaml").write_text("edited")
    for args, expect in (
        (["smollm2-135m-mqa", str(tmp_path / "mine.yaml")], "already exists and is kept"),
        (["nope"], "no packaged recipe or config 'nope'"),
        ([], "needs the NAME of a recipe"),
        (["smollm2-135m-mqa", str(tmp_path / "no" / "x.yaml")], "does not exist; create it"),
    ):
        code = main(["recipes", "cp", *args])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and expect in err, err
    assert (tmp_path / "mine.yaml").read_text() == "edited" and not (tmp_path / "no").exists()


def test_a_recipe_copied_to_a_read_only_place_is_one_line(capsys, read_only):
    """Only PermissionError was caught: a read-only file system (EROFS) was a traceback."""
    code = main(["recipes", "cp", "smollm2-135m-mqa", str(read_only)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"cannot copy to {read_only / 'smollm2-135m-mqa.yaml'}: " in err
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    assert f": {reason}; choose another place" in err and not list(read_only.iterdir())


def test_a_recipe_copy_that_fails_while_writing_leaves_nothing(capsys, tmp_path, monkeypatch):
    import builtins
    import errno

    opened = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(builtins, "open", lambda path, mode="r", *a, **k: Full(opened(path, mode, *a, **k)))
    code = main(["recipes", "cp", "smollm2-135m-mqa", str(tmp_path / "mine.yaml")])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2 and "No space left on device; choose another place" in err and not list(tmp_path.iterdir())


def test_uptrain_finds_a_packaged_recipe_by_name_from_any_folder(tmp_path, monkeypatch):
    from gqaify.uptrain.settings import parse

    monkeypatch.chdir(tmp_path)
    settings = parse(["--recipe", "ref-mha-6L-gqa2", "--model", "m", "--output_dir", "o", "--data", "d.txt"])
    expected = yaml.safe_load((RECIPES / "ref-mha-6L-gqa2.yaml").read_text())
    assert settings.seq_len == expected["seq_len"] and settings.lr == expected["lr"]
    (tmp_path / "ref-mha-6L-gqa2").write_text("seq_len: 12\n")  # a file of that name here wins over the packaged
    again = parse(
        ["--recipe", "ref-mha-6L-gqa2", "--model", "m", "--output_dir", "o", "--data", "d.txt", "--max_tokens", "128"]
    )
    assert again.seq_len == 12
    (tmp_path / "ref-mha-6L-gqa2").unlink()
    (tmp_path / "ref-mha-6L-gqa2.yaml").write_text("seq_len: 14\n")  # what `gqaify recipes cp NAME .` writes
    assert (
        parse(
            [
                "--recipe",
                "ref-mha-6L-gqa2",
                "--model",
                "m",
                "--output_dir",
                "o",
                "--data",
                "d.txt",
                "--max_tokens",
                "128",
            ]
        ).seq_len
        == 14
    )
    (tmp_path / "ref-mha-6L-gqa2.yaml").unlink()
    assert (
        parse(
            ["--recipe", "recipes/smollm2-135m-mqa.yaml", "--model", "m", "--output_dir", "o", "--data", "d.txt"]
        ).max_tokens
        == load_recipe(RECIPES / "smollm2-135m-mqa.yaml")["max_tokens"]
    )  # the checkout's path, from a folder that has no recipes/


@needs_assets
def test_the_recipes_name_hub_text_and_the_local_copies_are_first_line_overrides():
    """The local copies in ../shared are the first line's overrides only: each recipe itself names hub datasets (or
    the corpus its first command writes); a first line that gives local copies (the CPU recipes') gives every text
    it trains and evaluates on, each beside the checkout, so it runs offline; the 8-GPU recipe's needs the hub."""
    from gqaify.text.loading import named_texts
    from gqaify.uptrain.settings import parse

    offline = []
    for recipe in [r.file for r in RECIPE_REGISTRY]:
        line = recipe.read_text().splitlines()[0].removeprefix("# ")
        assignments, _, commands = line.rpartition("; ")
        variables = dict(a.split("=", 1) for a in shlex.split(assignments))
        written = []  # what the line's own first commands write (gqaify generate's OUT)
        for command in commands.split(" && "):
            words = shlex.split(command)
            for name, value in variables.items():
                words = [w.replace(f"${name}", value) for w in words]
            if words[:2] == ["gqaify", "generate"]:
                written.append(words[3])
                continue
            settings = parse(words[words.index("--recipe") :])
            if variables:  # the local copies: every text is here, or the line's first command writes it
                for source in [t.source for t in named_texts([*settings.data, *settings.eval_data])]:
                    assert source in written or (REPO / source).exists(), (recipe.name, source)
                offline.append(recipe.stem)
        packaged = parse(["--recipe", str(recipe)])
        for source in [t.source for t in named_texts([*packaged.data, *packaged.eval_data])]:
            assert source in written or ("/" in source and not source.startswith((".", "/"))), (recipe.name, source)
    assert offline == ["ref-mha-6L-gqa2", "smollm2-135m-mla", "smollm2-135m-mla256", "smollm2-135m-mqa"]


def test_an_accelerate_config_named_as_a_recipe_is_one_line_saying_where_it_goes(capsys, tmp_path, monkeypatch):
    """Its seven keys were five 'unknown key' complaints that never said it is the launch's config."""
    monkeypatch.chdir(tmp_path)
    for name in ("accelerate/fsdp", "recipes/accelerate/cpu.yaml"):
        code = main(["uptrain", "--recipe", name, "--max_tokens", "4096"])
        err = capsys.readouterr().err
        stem = name.removeprefix("recipes/").removesuffix(".yaml")
        assert code == 2 and err.count("\n") == 1 and "unknown key" not in err, err
        assert f"--recipe {name} is an accelerate config, not a recipe; pass it to `accelerate launch" in err
        assert f"--config_file {RECIPES / stem}.yaml -m gqaify.uptrain --recipe RECIPE`, or to --plan {stem}" in err
    assert not list(tmp_path.iterdir())


def test_an_accelerate_config_given_by_its_path_as_a_recipe_is_one_line_saying_where_it_goes(capsys, tmp_path):
    """A file that exists is read as a recipe; accelerate's keys (compute_environment, distributed_type) say what
    it is, wherever it lies."""
    config = tmp_path / "my launch.yaml"
    shutil.copy(RECIPES / "accelerate" / "fsdp.yaml", config)
    code = main(["uptrain", "--recipe", str(config), "--max_tokens", "4096"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "unknown key" not in err, err
    quoted = shlex.quote(str(config))
    said = f"--recipe {config} is an accelerate config, not a recipe; pass it to `accelerate launch --config_file "
    assert said in err
    assert f"{quoted} -m gqaify.uptrain --recipe RECIPE`, or to --plan {quoted} for the memory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my launch.yaml"]


def test_the_commands_a_recipe_gives_for_an_installed_gqaify_name_it_and_write_what_it_reads(tmp_path, monkeypatch):
    """The `#   gqaify ...` lines of a recipe's comment run it by name from a folder that is no checkout: each names
    this recipe, and a `gqaify generate` among them writes the corpus the recipe trains on."""
    from gqaify.text.loading import named_texts
    from gqaify.uptrain.settings import parse

    monkeypatch.chdir(tmp_path)
    by_name = {}
    for recipe in [r.file for r in RECIPE_REGISTRY]:
        lines = [line.removeprefix("#").strip() for line in recipe.read_text().splitlines() if line.startswith("#   ")]
        commands = [shlex.split(line) for line in lines if line.startswith("gqaify ")]
        runs = [c for c in commands if c[:2] == ["gqaify", "uptrain"]]
        if not runs:
            continue
        by_name[recipe.stem] = runs
        for run in runs:
            assert run[2:4] == ["--recipe", recipe.stem]
            settings = parse(run[2:])
            assert settings.max_tokens == load_recipe(recipe).get("max_tokens")
            written = [c[3] for c in commands if c[:2] == ["gqaify", "generate"]]
            local = [t.source for t in named_texts(settings.data) if not ("/" in t.source and "@" in t.source)]
            assert local == written, (recipe.name, local, written)  # what it reads that is no hub dataset
    assert sorted(by_name) == ["ref-mha-6L-gqa2", "smollm2-135m-mla", "smollm2-135m-mla256", "smollm2-135m-mqa"]


def test_the_listing_says_what_model_stands_for_and_model_pasted_as_printed_is_refused_at_once(capsys, tmp_path):
    """`gqaify recipes` printed `--model MODEL --distill_from MODEL` and said nothing of MODEL, which, pasted as it
    was, went to the hub as a model's name."""
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shown = lines[lines.index(next(line for line in lines if line.startswith("ref-mha-6L-gqa2"))) + 1].strip()
    assert shown == (
        "gqaify uptrain --recipe ref-mha-6L-gqa2 --model MODEL --distill_from MODEL  "
        "# MODEL: a model of your own to convert (a folder, hub id or .gguf file)"
    )
    (tmp_path / "text.txt").write_text("a few words of text\n" * 50)
    pasted = shlex.split(shown, comments=True)[1:]
    text = str(tmp_path / "text.txt")
    err = one_line_refusal(capsys, *pasted, "--data", text, "--eval_data", text, "--output_dir", str(tmp_path / "run"))
    said = "{} MODEL is a printed command's placeholder; replace it with a model of your own to convert"
    assert said.format("model") in err and said.format("distill_from") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


def test_a_recipes_hub_texts_the_hub_cannot_give_are_named_together_before_anything_is_written(tiny, capsys, tmp_path):
    """With a model of one's own, the recipe's run offline converted, then failed on its training text; run again,
    on its evaluation text: one at a time, where gqaify promises every problem at once. (HF_HUB_OFFLINE: conftest.)"""
    parent, out = str(tiny["parent"]), tmp_path / "run"
    err = one_line_refusal(
        capsys,
        "uptrain",
        "--recipe",
        "ref-mha-6L-gqa2",
        "--model",
        parent,
        "--distill_from",
        parent,
        "--output_dir",
        out,
    )
    assert "data roneneldan/TinyStories@validation[1000:] is not a local path and the Hugging Face hub" in err
    assert "; eval_data roneneldan/TinyStories@validation[:1000] is not a local path and the Hugging Face hub" in err
    assert not out.exists()
    missing = str(tmp_path / "missing.txt")  # a local text that is not there is named with them
    argv = ["uptrain", "--recipe", "ref-mha-6L-gqa2", "--model", parent, "--data", missing, "--output_dir", out]
    err = one_line_refusal(capsys, *argv)
    assert f"data {missing}: no such file or folder" in err and "eval_data roneneldan/TinyStories" in err
