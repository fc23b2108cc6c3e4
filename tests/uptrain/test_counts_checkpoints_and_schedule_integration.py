"""Uptraining's counts in a process of its own: evaluation points past the run's steps refused before anything is
written, --help stating every count option's bound, and a model whose record cannot be read refused before
training."""

from __future__ import annotations

import json
import shutil

import pytest

from gqaify.uptrain import parse
from helpers import one_line_error, run_uptrain
from helpers import uptrain_args as args

SPIN = 300  # seconds: a refusal takes a few; the loop without end that it replaced never returned


# -- counts and their bounds ---------------------------------------------------------------------------------


def test_eval_points_past_the_runs_steps_are_refused_in_one_line_before_anything_is_written(tiny, tmp_path):
    out = tmp_path / "run"
    two_steps = ("--max_tokens", "128")  # 2 steps of 2 x 2 blocks of 16 tokens
    done = run_uptrain(args(tiny, out, *two_steps, "--eval_points", "10000000000"), timeout=SPIN)
    line = one_line_error(done)
    assert "eval_points 10,000,000,000 is more than the 2 optimizer steps of this run" in line
    assert "give at most 2" in line and not out.exists()
    assert parse(args(tiny, out, *two_steps, "--eval_points", "2")).eval_points == 2  # the bound itself is fine
    assert parse(args(tiny, out, *two_steps)).evaluations() == 8  # the default fits any run: merged steps


def test_help_states_the_bound_of_every_count_option():
    done = run_uptrain(["--help"])
    said = " ".join(done.stdout.split())
    assert done.returncode == 0
    for words in (
        "(0: the end only; at most the run's steps; default: 8, fewer in a shorter run)",  # eval_points
        "(0, or more than the run's steps: only at the start and the eval_points)",  # eval_every
        "more than the run's steps: the end only; default: every tenth of the run, and after 10 minutes",  # save_every
        "checkpoints kept (more than the run writes: all)",  # save_total_limit
        "(more than the run's steps: the end only)",  # log_every
        "at most a week",  # dist_timeout
        "for trainable lora (at most the model's hidden size)",  # lora_rank
    ):
        assert words in said, words


# -- the model's record, read before the first step ----------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ("later", "has no field 'a_later_field' (it was written by gqaify 99.0.0, this is gqaify "),
        ("damaged", "missing 1 required keyword-only argument: 'method'"),
    ],
)
def test_a_model_whose_record_cannot_be_read_is_refused_before_training(tiny, tmp_path, change, expect):
    model = tmp_path / "model"
    shutil.copytree(tiny["converted"], model)
    record = json.loads((model / "gqaify.json").read_text())
    if change == "later":
        record |= {"version": "99.0.0", "a_later_field": 1}
    else:
        del record["method"]
    (model / "gqaify.json").write_text(json.dumps(record))
    out = tmp_path / "run"
    argv = [a if a != str(tiny["converted"]) else str(model) for a in args(tiny, out, "--max_tokens", "64")]
    line = one_line_error(run_uptrain(argv))  # was a traceback writing final/, after the last step
    assert f"model {model}: {model / 'gqaify.json'} is not a conversion record this gqaify reads" in line
    assert expect in line
    fix = "upgrade gqaify" if change == "later" else "convert the model again with gqaify convert"
    assert fix in line and not out.exists()
