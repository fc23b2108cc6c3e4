"""What gqaify packages, from a wheel built from this tree and installed as users install it (not editable), run
from a folder that is no checkout: the tested pins it carries, a conversion and an uptraining from a recipe by name,
a packaged recipe's hub datasets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gqaify.testing import CORPUS, build_model, save_with_tokenizer
from helpers import ASSETS, CLOSED, MODELS, REPO, needs_assets


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from this tree, once for this file's tests."""
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    return next(dist.glob("gqaify-*.whl"))


def test_the_wheel_carries_the_constraints(wheel):
    """A wheel user could not get the tested pins: constraints.txt was not in the wheel."""
    with zipfile.ZipFile(wheel) as z:
        assert z.read("gqaify/constraints.txt") == (REPO / "constraints.txt").read_bytes()


def test_the_wheels_pinned_extra_requires_the_constraints_versions(wheel):
    """`pip install "gqaify[pinned]"` applies the tested pins in the install itself: they are the wheel's metadata."""
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    required = re.findall(r'^Requires-Dist: (\S+)==(\S+); extra == "pinned"$', metadata, re.M)
    constraints = (REPO / "constraints.txt").read_text().splitlines()
    assert ("torch", "2.13.0") in required and all(f"{name}=={version}" in constraints for name, version in required)


def test_the_wheel_carries_the_demos_text_and_its_licence(wheel):
    """The demo's texts were ../shared's beside a checkout, or the hub's: no user had them offline."""
    text = REPO / "src" / "gqaify" / "texts"
    with zipfile.ZipFile(wheel) as z:
        assert z.read("gqaify/texts/tinyshakespeare.txt") == (text / "tinyshakespeare.txt").read_bytes()
        assert "public domain" in z.read("gqaify/texts/README.md").decode()


def _demo_runs_offline(gqaify_on: Path, tmp_path: Path) -> None:
    """`gqaify demo` with gqaify imported from `gqaify_on` alone, run from a folder with nothing beside it, the hub
    off, on a tiny model (--model): it runs to its end on what gqaify and this Python hold, judges on three kinds of
    text, and its baseline conversion by mean-pooling draws no warning of gqaify's against it."""
    work = tmp_path / "elsewhere"
    positions = {"max_position_embeddings": 1024}  # the demo's windows: 1,024 tokens
    model = build_model("llama", num_kv_heads=4, num_attention_heads=8, head_dim=8, vocab_size=320, **positions)
    save_with_tokenizer(model, work / "tiny")
    env = {**os.environ, "PYTHONPATH": str(gqaify_on), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": CLOSED}
    done = subprocess.run(
        [sys.executable, "-m", "gqaify.entry.cli", "demo", "--model", "tiny", "--workdir", "demo"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tiny-shakespeare (public domain, shipped with gqaify), first half" in done.stdout
    assert "read no calibration text" not in done.stderr, done.stderr
    report = json.loads((work / "demo" / "eval" / "report.json").read_text())
    assert [t["name"] for t in report["data"]] == ["shakespeare", "code", "licence"]
    assert "after 12,288 tokens" in done.stdout.splitlines()[-2]


@pytest.mark.slow
def test_the_demo_runs_from_an_installed_wheel_with_the_hub_off_and_no_shared_beside_it(wheel, tmp_path):
    """`gqaify demo` on a fresh machine exited 2 after 15 s: its text was the hub's WikiText-2 unless ../shared sat
    beside the checkout. Installed from the wheel into a folder with nothing beside it, it runs offline."""
    site = tmp_path / "install" / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    _demo_runs_offline(site, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / ".git").exists(), reason="this tree is no git checkout to clone")
def test_the_demo_runs_from_a_fresh_clone_with_the_hub_off_and_no_shared_beside_it(tmp_path):
    """README's main job from a fresh clone: only what git tracks (a text the demo reads but nobody committed would
    be missing there), with no ../shared beside the clone, the hub off."""
    clone = tmp_path / "fresh" / "gqaify"
    done = subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (clone.parent.parent / "shared").exists()
    _demo_runs_offline(clone / "src", tmp_path)


@pytest.mark.slow
def test_an_installed_wheel_converts_and_uptrains_from_a_recipe_by_name(wheel, tmp_path):
    """The wheel built from this tree, installed (not editable) into a folder of its own and put first on the path,
    run from a folder that is no checkout: convert, a packaged recipe by name, and the demo's recipe found."""
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
            [sys.executable, "-m", "gqaify.entry.cli", *args], cwd=work, env=env, capture_output=True, text=True
        )

    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gqaify, gqaify.entry.demo as d; print(gqaify.__file__); print(d.RECIPE.is_file())",
        ],
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


# A stand-in for the hub in the process a test starts: datasets.load_dataset serves each hub dataset named here
# (name, config, split) from a local copy, as a hub that answered (or datasets' cache) would, and records every hub
# dataset asked for in ASKED; any other hub dataset is refused as the offline hub refuses it.
MIRROR = r"""
import json, sys
import datasets

served, asked = json.loads(sys.argv[1]), sys.argv[2]
load = datasets.load_dataset

def mirrored(path, name=None, *args, split=None, **kwargs):
    if kwargs.get("data_files") is not None or path in ("text", "json", "csv", "parquet"):
        return load(path, name, *args, split=split, **kwargs)  # a local file: datasets' own builders
    with open(asked, "a") as f:
        f.write(json.dumps([path, name, split]) + "\n")
    local = served.get(json.dumps([path, name, split]))
    if local is None:
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")
    return load("text", data_files={"train": [local]}, split="train", sample_by="document")  # the slice served

datasets.load_dataset = mirrored
from gqaify.entry.cli import main
sys.exit(main(sys.argv[3:]))
"""


@needs_assets
def test_a_packaged_recipe_runs_by_name_outside_a_checkout_with_its_hub_datasets(tmp_path):
    """ref-mha-6L-gqa2 by name from a folder that is no checkout, the hub unreachable and its two hub datasets served
    by a local mirror: the recipe asks the hub for exactly the text it names, converts, trains and evaluates; without
    a model of its own it is refused in one line naming what to pass, nothing written (its texts looked up first, in
    the mirror: the hub unreachable, a text not in datasets' cache is named in the same line)."""
    text = ASSETS / "text"
    served = {
        json.dumps(["roneneldan/TinyStories", None, "validation[1000:]"]): str(text / "tinystories-train-sample.txt"),
        json.dumps(["roneneldan/TinyStories", None, "validation[:1000]"]): str(text / "tinystories-valid-head.txt"),
    }
    asked = tmp_path / "asked.jsonl"
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "HF_ENDPOINT": CLOSED, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}

    def gqaify(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", MIRROR, json.dumps(served), str(asked), "uptrain", "--recipe", *args]
        return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)

    refused = gqaify("ref-mha-6L-gqa2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "model ../shared/assets/models/ref-mha-6L does not exist here" in refused.stderr
    assert "pass --model with" in refused.stderr and "pass --distill_from with" in refused.stderr
    assert not list(work.iterdir())  # the texts were looked up (in the mirror, the cache's stand-in), nothing written
    assert set(asked.read_text().splitlines()) == set(served)

    model = str(MODELS / "ref-mha-6L")
    small = ["--max_tokens", "2048", "--eval_tokens", "512", "--eval_every", "0", "--save_every", "0"]
    done = gqaify("ref-mha-6L-gqa2", "--model", model, "--distill_from", model, *small, "--no_progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(asked.read_text().splitlines()) == set(served)  # the checks' and the run's reads
    out = work / "runs" / "ref-mha-6L-gqa2"  # the recipe's output_dir, from the working directory
    assert json.loads((out / "final" / "config.json").read_text())["num_key_value_heads"] == 2
    assert "uptrained 1 steps, 2,048 tokens" in done.stdout, done.stdout
