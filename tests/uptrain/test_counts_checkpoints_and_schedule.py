"""Uptraining's counts, checks and schedule: every count option bounded, the model's record read before the first
step, checkpoints of short runs by default, and a warm-up whose first step trains and is logged as it ran."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gqaify.errors import UserError
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from gqaify.uptrain.metrics import read_metrics
from gqaify.uptrain.student import lr_factor
from helpers import uptrain_args as args


def default_checkpoints(argv: list[str]) -> list[str]:
    """`argv` without uptrain_args' `--save_every 0`: the run checkpoints as it does by default."""
    at = argv.index("--save_every")
    return argv[:at] + argv[at + 2 :]


# -- counts and their bounds ---------------------------------------------------------------------------------


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
