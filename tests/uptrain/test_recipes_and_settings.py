"""Uptraining's settings: the recipes (each loads, names its command, runs from a checkout), the accelerate configs,
the command line over a recipe, and what a conversion inside uptraining calibrates on."""

from __future__ import annotations

import json

import pytest

from gqaify.errors import UserError
from gqaify.settings import text_lists
from gqaify.text.loading import named_texts
from gqaify.uptrain import UptrainSettings, parse
from gqaify.uptrain.settings import load_recipe
from helpers import (
    REPO,
    needs_assets,
    one_line,
    run_cli,
    uptrain_args,
)

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))


# -- settings and recipes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_loads_and_names_its_command(recipe):
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# ") and "gqaify" in first and str(recipe.relative_to(REPO)) in first
    values = text_lists(UptrainSettings, load_recipe(recipe))  # a recipe's one text is a list of one
    settings = parse(["--recipe", str(recipe)])
    assert all(getattr(settings, key) == value for key, value in values.items() if not isinstance(value, float))


@needs_assets
def test_the_smollm2_recipes_first_line_runs_it_offline_from_a_checkout():
    """The first line is every step (the parent-written corpus, then the conversion and training) with the local
    copies of the data in ../shared; the recipe itself names its data as a user has it: hub datasets, and the
    corpus the first step writes."""
    import shlex

    recipe = REPO / "recipes" / "smollm2-135m-mqa.yaml"
    line = recipe.read_text().splitlines()[0].removeprefix("# ")
    assignments, _, commands = line.rpartition("; ")
    variables = dict(a.split("=", 1) for a in shlex.split(assignments))
    generate, train = (shlex.split(c) for c in commands.split(" && "))
    assert generate[:2] == ["gqaify", "generate"] and train[:2] == ["gqaify", "uptrain"]

    def expanded(word: str) -> str:
        for name, value in variables.items():
            word = word.replace(f"${name}", value)
        return word

    corpus = expanded(generate[3])
    settings = parse([expanded(w) for w in train[2:]])
    assert settings.model == settings.distill_from == expanded(generate[2]) and settings.kv_heads == 1
    for source in [t.source for t in named_texts([*settings.data, *settings.eval_data])]:
        assert source == corpus or (REPO / source).is_file(), source  # every text is here, or the first step's
    assert corpus in [t.source for t in named_texts(settings.data)]
    assert not {t.source for t in named_texts(settings.data)} & {t.source for t in named_texts(settings.eval_data)}
    packaged = parse(["--recipe", str(recipe)])
    for source in [t.source for t in named_texts([*packaged.data, *packaged.eval_data])]:
        assert source == corpus or ("/" in source and not source.startswith(".")), source  # hub names, the corpus
    assert packaged.calib_data is None and packaged.calibrated_on_data().calib_data == packaged.data


def test_recipes_and_accelerate_configs_are_packaged():
    names = {r.name for r in RECIPES}
    assert {"smollm2-135m-mqa.yaml", "ref-mha-6L-gqa2.yaml", "llama2-7b-gqa8.yaml"} <= names
    assert {c.stem for c in ACCELERATE_CONFIGS} == {"cpu", "single-gpu", "multi-gpu", "fsdp"}


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=[c.name for c in ACCELERATE_CONFIGS])
def test_accelerate_configs_load(config):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(config))
    assert loaded.compute_environment.value == "LOCAL_MACHINE"
    if config.stem == "fsdp":
        assert loaded.distributed_type.value == "FSDP" and loaded.fsdp_config["fsdp_version"] == 2


def test_command_line_overrides_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\noutput_dir: o\ndata: d\nmax_tokens: 4096\nlr: 3.0e-4\nlog_to: [csv]\n")
    settings = parse(["--recipe", str(recipe), "--lr", "1e-3", "--trainable", "attention"])
    assert (settings.lr, settings.trainable, settings.max_tokens, settings.log_to) == (1e-3, "attention", 4096, ["csv"])


def test_pretraining_fraction_of_pretraining_tokens():
    s = UptrainSettings(model="m", output_dir="o", data="d", pretraining_fraction=0.05, pretraining_tokens=2_000_000)
    assert s.training_tokens() == 100_000


def test_a_calibrated_conversion_is_fitted_on_the_training_data_unless_told_otherwise(tmp_path):
    """With kv_heads and a calibrated method, calib_data (and its weights) default to the training mixture."""
    argv = ["--model", "m", "--output_dir", str(tmp_path / "o"), "--kv_heads", "1", "--method", "lsq"]
    mixture = ["--data", "a=a.txt", "b=b.txt", "--data_weights", "2", "1", "--max_tokens", "4096"]
    settings = parse([*argv, *mixture])
    conversion = settings.conversion(tmp_path / "c")
    assert conversion.calib_data == ["a=a.txt", "b=b.txt"] and conversion.calib_weights == [2.0, 1.0]
    assert settings.calib_data is None  # the recorded settings keep what was asked
    own = parse([*argv, *mixture, "--calib_data", "c.txt"]).conversion(tmp_path / "c")
    assert own.calib_data == ["c.txt"] and own.calib_weights is None
    plain = parse([*argv[:-2], "--method", "mean", *mixture]).conversion(tmp_path / "c")
    assert plain.calib_data is None  # mean-pooling reads no text


def test_a_seq_len_past_the_models_positions_is_named_with_them_not_only_as_a_budget(tiny, tmp_path, capsys):
    """`--seq-len 1000000000000` was refused as a budget smaller than one optimizer step, the model's positions
    unnamed: the settings' own check ran before the model's config was read. The command line names them first,
    reading the local model's config.json (before torch is loaded, nothing written)."""
    positions = json.loads((tiny["converted"] / "config.json").read_text())["max_position_embeddings"]
    argv = uptrain_args(tiny, tmp_path / "run", "--seq_len", "1000000000000")
    code, err = run_cli(capsys, "uptrain", *argv)
    assert code == 2 and one_line(err).startswith(
        f"gqaify: error: seq_len 1000000000000 exceeds the {positions} positions of {tiny['converted']}; lower "
        "seq_len; the 1,280 training tokens are fewer than one optimizer step"
    )
    assert not (tmp_path / "run").exists()


def test_a_hub_models_positions_are_read_from_the_hub_cache_and_a_gguf_s_from_its_header(tiny, tmp_path, monkeypatch):
    """A hub id was refused on the step budget alone: only a local folder's config.json was read. The hub's own
    cache on this machine holds the config of a model fetched before, and a GGUF's header states its context;
    nothing is fetched."""
    from gqaify.model.locations import local_positions

    config = json.loads((tiny["converted"] / "config.json").read_text())
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 96}))
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert local_positions("someone/tiny") == 96
    assert local_positions("someone/other") is None  # never fetched: nothing here says
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_context_length(2048)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert local_positions(tmp_path / "m.gguf") == 2048


def test_a_setting_under_its_former_name_is_read_as_the_setting(tmp_path):
    """budget_fraction became pretraining_fraction ("budget" is the cache's word): a recipe, a command line and a
    run.json an earlier gqaify wrote under the former name still read; given under both names, refused."""
    base = ["--model", "m", "--output_dir", str(tmp_path / "o"), "--data", "d", "--pretraining_tokens", "1000000"]
    recipe = tmp_path / "old.yaml"
    recipe.write_text("model: m\noutput_dir: o\ndata: d\nbudget_fraction: 0.5\npretraining_tokens: 1000000\n")
    assert parse(["--recipe", str(recipe)]).training_tokens() == 500_000
    assert parse([*base, "--budget-fraction", "0.25"]).training_tokens() == 250_000
    assert "budget" not in " ".join(UptrainSettings.__dataclass_fields__)  # the field has its one name now
    recipe.write_text("model: m\noutput_dir: o\ndata: d\nbudget_fraction: 0.5\npretraining_fraction: 0.5\n")
    with pytest.raises(UserError, match="budget_fraction and pretraining_fraction both given; .* give one"):
        parse(["--recipe", str(recipe)])
    run = json.loads((REPO / "tests/data/records/0.1.0/run.json").read_text())
    assert "budget_fraction" in run["settings"]  # what 0.1.0 wrote
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.json").write_text(json.dumps(run))
    assert parse(["--config", str(tmp_path / "r" / "run.json")]).pretraining_fraction is None


def test_a_setting_under_both_its_names_on_the_command_line_is_refused(tmp_path):
    argv = ["--model", "m", "--output_dir", str(tmp_path / "o"), "--data", "d", "--pretraining_tokens", "1000000"]
    with pytest.raises(UserError, match="--budget-fraction and --pretraining-fraction both given; .* give one"):
        parse([*argv, "--budget-fraction", "0.25", "--pretraining-fraction=0.5"])
