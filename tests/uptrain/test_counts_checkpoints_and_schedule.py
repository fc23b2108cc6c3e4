"""Uptraining's counts, checks and schedule: every count option bounded, the model's record read before the first
step, checkpoints of short runs by default, and a warm-up whose first step trains and is logged as it ran."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gqaify.errors import UserError
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from gqaify.uptrain.metrics import read_metrics
from gqaify.uptrain.student import lr_factor
from helpers import one_line_error, run_uptrain
from helpers import uptrain_args as args

SPIN = 300  # seconds: a refusal takes a few; the loop without end that it replaced never returned


def default_checkpoints(argv: list[str]) -> list[str]:
    """`argv` without uptrain_args' `--save_every 0`: the run checkpoints as it does by default."""
    at = argv.index("--save_every")
    return argv[:at] + argv[at + 2 :]


# -- counts and their bounds ---------------------------------------------------------------------------------


@pytest.mark.integration
def test_eval_points_past_the_runs_steps_are_refused_in_one_line_before_anything_is_written(tiny, tmp_path):
    out = tmp_path / "run"
    two_steps = ("--max_tokens", "128")  # 2 steps of 2 x 2 blocks of 16 tokens
    done = run_uptrain(args(tiny, out, *two_steps, "--eval_points", "10000000000"), timeout=SPIN)
    line = one_line_error(done)
    assert "eval_points 10,000,000,000 is more than the 2 optimizer steps of this run" in line
    assert "give at most 2" in line and not out.exists()
    assert parse(args(tiny, out, *two_steps, "--eval_points", "2")).eval_points == 2  # the bound itself is fine
    assert parse(args(tiny, out, *two_steps)).evaluations() == 8  # the default fits any run: merged steps


def test_eval_points_are_checked_against_the_steps_of_the_launchs_processes(tiny, tmp_path):
    settings = parse(args(tiny, tmp_path / "run", "--eval_points", "15"))  # 20 steps in one process
    assert settings.step_problem(processes=1) is None
    assert "eval_points 15 is more than the 10 optimizer steps" in settings.step_problem(processes=2)


def test_a_dist_timeout_past_a_week_is_refused(tiny, tmp_path):
    with pytest.raises(UserError, match=r"dist_timeout 100000000000000000000 is more than the 604,800 allowed"):
        parse(args(tiny, tmp_path / "run", "--dist_timeout", str(10**20)))  # was an OverflowError after the claim


def test_a_lora_rank_past_the_models_hidden_size_is_refused_before_output_dir_is_touched(tiny, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "run"
    with pytest.raises(UserError, match="lora_rank 65 is more than the hidden size 64 of "):
        uptrain(parse(args(tiny, out, "--trainable", "lora", "--lora_rank", "65")))
    assert not out.exists()


@pytest.mark.integration
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


@pytest.mark.integration
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


# -- checkpoints by default ----------------------------------------------------------------------------------


def test_a_short_run_checkpoints_every_tenth_of_its_steps_by_default(tiny, tmp_path):
    out = tmp_path / "run"
    settings = parse(default_checkpoints(args(tiny, out, "--save_total_limit", "99")))
    assert settings.save_every is None
    uptrain(settings)  # 20 steps
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == [f"step-{n:07d}" for n in range(2, 21, 2)]


def test_a_default_run_also_checkpoints_after_ten_minutes_without_one_and_an_explicit_save_every_alone(tiny, tmp_path):
    by_default = parse(default_checkpoints(args(tiny, tmp_path / "run")))
    assert [by_default.checkpoint_due(step, 1000, 0) for step in (99, 100, 1000)] == [False, True, True]
    assert by_default.checkpoint_due(3, 1000, seconds_since=600) and not by_default.checkpoint_due(3, 1000, 599.9)
    assert by_default.checkpoint_due(1, 5, 0)  # a run shorter than ten steps: every step
    every_300 = parse(args(tiny, tmp_path / "run", "--save_every", "300"))
    assert not every_300.checkpoint_due(3, 1000, seconds_since=10**6)
    assert [every_300.checkpoint_due(step, 1000, 0) for step in (300, 301, 1000)] == [True, False, True]
    none = parse(args(tiny, tmp_path / "run"))  # save_every 0
    assert not none.checkpoint_due(1000, 1000, seconds_since=10**6)


# -- the learning rate -----------------------------------------------------------------------------------------


def test_the_first_warm_up_step_trains_and_metrics_log_the_lr_each_step_used(tiny, tmp_path):
    out = tmp_path / "run"
    used, changed, before = [], [], {}

    def pre(optimizer, *_):
        if isinstance(optimizer, torch.optim.AdamW):
            used.append(optimizer.param_groups[0]["lr"])
            before["weight"] = optimizer.param_groups[0]["params"][0].detach().clone()

    def post(optimizer, *_):
        if isinstance(optimizer, torch.optim.AdamW):
            changed.append(not torch.equal(before["weight"], optimizer.param_groups[0]["params"][0]))

    hooks = [
        register_optimizer_step_pre_hook(pre),
        register_optimizer_step_post_hook(post),
    ]
    try:
        uptrain(parse(args(tiny, out, "--max_tokens", "256", "--warmup", "2", "--schedule", "linear")))  # 4 steps
    finally:
        for hook in hooks:
            hook.remove()
    logged = [r["lr"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert logged == used  # the lr each step used, not the next step's
    assert used == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 0.5e-3])  # warm-up from above 0, then linear decay
    assert changed == [True] * 4  # the first step too


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_no_step_of_any_schedule_runs_at_lr_0(schedule):
    for steps, warmup in ((1, 1), (2, 0), (10, 3), (10, 10)):
        factors = [lr_factor(k, warmup, steps, schedule) for k in range(steps)]
        assert all(0 < f <= 1 for f in factors), (steps, warmup, factors)
        assert factors[min(warmup, steps - 1)] == (1.0 if warmup < steps else warmup / (warmup + 1))
