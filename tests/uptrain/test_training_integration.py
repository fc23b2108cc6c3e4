"""Uptraining's loop end to end: task scores at each evaluation, a real model's loss going down, a calibrated
conversion before training, stored log-probabilities and mixtures refused or trained in a process of their own,
and layers compiled by torch.compile training as the plain ones."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from gqaify.conversion.core import convert
from gqaify.testing import CORPUS
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from gqaify.uptrain.metrics import read_metrics
from helpers import (
    MODELS,
    REPO,
    losses,
    needs_assets,
    one_line_error,
    run_uptrain,
)
from helpers import uptrain_args as args

# -- the loop ------------------------------------------------------------------------------------------------


# real models end to end: seconds each
@needs_assets
def test_eval_tasks_are_scored_at_each_evaluation_and_logged(tiny, tmp_path):
    model = tmp_path / "stories260K-gqa2"  # 512 positions: the tiny model's 64 cannot hold a story's sentences
    convert(MODELS / "stories260K-mha", model, 2, progress=False)
    out = tmp_path / "run"
    uptrain(
        parse(
            args(
                tiny,
                out,
                "--model",
                str(model),
                "--eval_tasks",
                "story_endings",
                "--eval_include_path",
                str(REPO / "tests" / "tasks"),
                "--eval_limit",
                "8",
                "--eval_every",
                "10",
                "--eval_points",
                "0",
            )
        )
    )
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "story_endings/acc" in r]
    assert [r["step"] for r in rows] == [0, 10, 20]  # no eval_data: the tasks alone are evaluated
    assert all(r["story_endings/acc"] * 8 == round(r["story_endings/acc"] * 8) for r in rows)  # 8 items each
    assert all(0 <= r["story_endings/acc_norm"] <= 1 and "eval_perplexity" not in r for r in rows)


def test_distill_from_data_needs_stored_log_probabilities(tiny, tmp_path):
    done = run_uptrain(args(tiny, tmp_path / "run", "--distill_from_data", "--distill_weight", "1"))
    assert done.returncode == 2 and "--top-logprobs" in one_line_error(done)
    assert not (tmp_path / "run" / "final").exists()
    both = run_uptrain(args(tiny, tmp_path / "two", "--distill_from_data", "--distill_from", str(tiny["parent"])))
    assert both.returncode == 2 and "two teachers" in one_line_error(both)
    warmer = run_uptrain(args(tiny, tmp_path / "warm", "--distill_from_data", "--temperature", "2"))
    assert warmer.returncode == 2 and "temperature 2.0 with distill_from_data" in one_line_error(warmer)
    assert not any(tmp_path.iterdir())


# real models end to end: seconds each
@needs_assets
def test_loss_goes_down_on_ref_mha_6L_converted_to_gqa2(tmp_path):
    recipe = REPO / "recipes" / "ref-mha-6L-gqa2.yaml"
    settings = parse(
        [
            "--recipe",
            str(recipe),
            "--model",
            str(MODELS / "ref-mha-6L"),
            "--output_dir",
            str(tmp_path / "run"),
            "--data",
            str(MODELS.parent / "text" / "tinystories-train-sample.txt"),
            "--distill_from",
            "",
            "--max_tokens",
            "24576",
            "--micro_batch_size",
            "4",
            "--grad_accum",
            "1",
            "--eval_data",
            "",
            "--save_every",
            "0",
            "--no_progress",
        ]
    )
    uptrain(settings)
    curve = losses(tmp_path / "run")
    assert len(curve) == 24 and sum(curve[-5:]) / 5 < 0.8 * sum(curve[:5]) / 5


def test_converts_with_a_calibrated_method_before_training(tiny, tmp_path):
    extra = (
        "--model",
        str(tiny["parent"]),
        "--kv_heads",
        "2",
        "--method",
        "lsq",
        "--grouping",
        "similarity",
        "--calib_data",
        str(tiny["train"]),
        "--calib_tokens",
        "1024",
        "--max_tokens",
        "320",
    )
    done = run_uptrain(args(tiny, tmp_path / "run", *extra))
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "run" / "final" / "gqaify.json").read_text())
    assert (record["method"], record["grouping"], record["kv_heads"]) == ("lsq", "similarity", 2)
    assert record["calibration"]["data"] == [str(tiny["train"])] and record["calibration"]["tokens"] <= 1024


def test_uptrain_on_a_mixture_and_a_mixture_with_stored_log_probabilities_refused(tiny, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(" ".join(reversed((CORPUS * 3).split())))
    out = tmp_path / "run"
    result = uptrain(parse(args(tiny, out, "--data", str(tiny["train"]), f"rev={other}", "--data_weights", "1", "2")))
    assert result.steps == 20 and (out / "final" / "model.safetensors").is_file()
    assert json.loads((out / "run.json").read_text())["settings"]["data_weights"] == [1.0, 2.0]
    line = one_line_error(
        run_uptrain(args(tiny, tmp_path / "r2", "--data", str(tiny["train"]), str(other), "--distill_from_data"))
    )
    assert "distill_from_data reads the log-probabilities stored with one corpus" in line
    assert not (tmp_path / "r2").exists()


# torch.compile builds its kernels: tens of seconds on a CPU
def test_compiled_layers_train_as_the_plain_ones_and_save_the_same_checkpoint(tiny, tmp_path):
    """compile: each decoder layer, the student's and the teacher's, compiled in place: the same losses to float
    precision, and a final model of the same tensors (no `_orig_mod.` names a wrapped model would save)."""
    teacher = ("--distill_from", str(tiny["parent"]), "--distill_weight", "0.5", "--save_every", "0")
    plain, compiled = tmp_path / "plain", tmp_path / "compiled"
    assert run_uptrain(args(tiny, plain, *teacher)).returncode == 0
    done = run_uptrain(args(tiny, compiled, *teacher, "--compile"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(compiled) == pytest.approx(losses(plain), rel=1e-4, abs=1e-5) and len(losses(plain)) > 3
    ours, theirs = (load_file(out / "final" / "model.safetensors") for out in (compiled, plain))
    assert ours.keys() == theirs.keys()
