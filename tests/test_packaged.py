"""What ships inside the package: the recipes and accelerate configs, listed, copied and found by name, from a wheel
installed as users install it (not editable) and run from a folder that is no checkout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from conftest import CORPUS, REPO, build_model, save_with_tokenizer
from gqaify.cli import main
from gqaify.packaged import RECIPES, recipe_names
from gqaify.uptrain.settings import load_recipe


def test_every_recipe_and_config_is_listed_with_its_command(capsys):
    shipped = sorted(p.relative_to(RECIPES).with_suffix("").as_posix() for p in RECIPES.rglob("*.yaml"))
    assert sorted(recipe_names()) == shipped and "smollm2-135m-mqa" in shipped and "accelerate/fsdp" in shipped
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == recipe_names()
    for line in lines:  # a recipe's command; an accelerate config's path, which accelerate reads
        name, shown = line.split(maxsplit=1)
        assert (
            ("gqaify uptrain" in shown or "accelerate launch" in shown)
            if "/" not in name
            else shown == str(RECIPES / f"{name}.yaml")
        )
    assert (REPO / "recipes").resolve() == RECIPES  # the checkout's recipes/ is the shipped folder


def test_a_recipe_is_copied_out_byte_for_byte_and_never_over_a_file(capsys, tmp_path):
    assert main(["recipes", "cp", "smollm2-135m-mqa", str(tmp_path / "mine.yaml")]) == 0
    assert (tmp_path / "mine.yaml").read_bytes() == (RECIPES / "smollm2-135m-mqa.yaml").read_bytes()
    assert main(["recipes", "cp", "accelerate/fsdp", str(tmp_path)]) == 0  # into a folder, under its own name
    assert (tmp_path / "fsdp.yaml").read_bytes() == (RECIPES / "accelerate" / "fsdp.yaml").read_bytes()
    capsys.readouterr()
    (tmp_path / "mine.yaml").write_text("edited")
    for args, expect in (
        (["smollm2-135m-mqa", str(tmp_path / "mine.yaml")], "already exists and is kept"),
        (["nope"], "no shipped recipe or config 'nope'"),
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


def test_uptrain_finds_a_shipped_recipe_by_name_from_any_folder(tmp_path, monkeypatch):
    from gqaify.uptrain.settings import parse

    monkeypatch.chdir(tmp_path)
    settings = parse(["--recipe", "ref-mha-6L-gqa2", "--model", "m", "--output_dir", "o", "--data", "d.txt"])
    expected = yaml.safe_load((RECIPES / "ref-mha-6L-gqa2.yaml").read_text())
    assert settings.seq_len == expected["seq_len"] and settings.lr == expected["lr"]
    (tmp_path / "ref-mha-6L-gqa2").write_text("seq_len: 12\n")  # a file of that name here wins over the shipped
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


@pytest.mark.slow
def test_an_installed_wheel_converts_and_uptrains_from_a_recipe_by_name(tmp_path):
    """The wheel built from this tree, installed (not editable) into a folder of its own and put first on the path,
    run from a folder that is no checkout: convert, a shipped recipe by name, and the demo's recipe found."""
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("gqaify-*.whl"))
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--target",
            str(tmp_path / "site"),
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), work / "parent")
    (work / "train.txt").write_text(CORPUS * 3)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}

    def gqaify(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "gqaify.cli", *args], cwd=work, env=env, capture_output=True, text=True
        )

    where = subprocess.run(
        [sys.executable, "-c", "import gqaify, gqaify.demo as d; print(gqaify.__file__); print(d.RECIPE.is_file())"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.stdout.split() == [str(tmp_path / "site" / "gqaify" / "__init__.py"), "True"], where.stderr
    assert "smollm2-135m-mqa" in gqaify("recipes").stdout
    done = gqaify("convert", "parent", "gqa2", "--kv-heads", "2", "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    # the recipe converts its model to 2 K/V heads first (method mean), then trains
    done = gqaify(
        "uptrain",
        "--recipe",
        "ref-mha-6L-gqa2",
        "--model",
        "parent",
        "--output_dir",
        "run",
        "--data",
        "train.txt",
        "--eval_data",
        "",
        "--distill_from",
        "",
        "--seq_len",
        "16",
        "--micro_batch_size",
        "2",
        "--grad_accum",
        "1",
        "--max_tokens",
        "128",
        "--save_every",
        "0",
        "--no_progress",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (work / "run" / "final" / "model.safetensors").is_file() and (work / "gqa2" / "gqaify.json").is_file()
    assert '"num_key_value_heads": 2' in (work / "run" / "final" / "config.json").read_text()
