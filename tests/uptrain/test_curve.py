"""The recovery curve: where a run evaluates, the power law fitted to its points, and the forecast it gives, checked
against synthetic curves whose law is known; and the curve a real run draws."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from PIL import Image

from gqaify.errors import UserError
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from gqaify.uptrain.curve import (
    CurvePoint,
    PowerLaw,
    eval_steps,
    fit_power_law,
    forecast,
    read_forecast,
    write_forecast,
)
from gqaify.uptrain.metrics import read_metrics
from helpers import uptrain_args as args


def law(scale: float, exponent: float, tokens: list[int], noise: float = 0.0, seed: int = 0) -> list[CurvePoint]:
    """Points on KL = scale · t^-exponent, each multiplied by exp(N(0, noise)) from a seeded generator."""
    rng = random.Random(seed)
    return [
        CurvePoint(t, t / 100, scale * t**-exponent * math.exp(rng.gauss(0, noise)), None, {"a": 1.0}) for t in tokens
    ]


TOKENS = [1_000 * 2**k for k in range(8)]


def test_evaluations_are_spaced_evenly_in_log_tokens_and_end_at_the_last_step():
    steps = eval_steps(1000, 3)
    assert steps == [10, 100, 1000]
    assert eval_steps(20, 8) == sorted({max(1, round(20 ** (k / 8))) for k in range(1, 9)})
    assert eval_steps(20, 8)[-1] == 20 and len(eval_steps(20, 8)) == len(set(eval_steps(20, 8)))
    assert eval_steps(3, 8) == [1, 2, 3]  # steps that round alike are one evaluation
    assert eval_steps(50, 0) == [50]  # no points: the end alone


def test_the_fit_recovers_an_exact_power_law():
    found = fit_power_law([p.tokens for p in law(3.0, 0.3, TOKENS)], [p.mean_kl for p in law(3.0, 0.3, TOKENS)])
    assert found.exponent == pytest.approx(0.3, abs=1e-12) and found.exponent_se == pytest.approx(0, abs=1e-12)
    assert found.at(10**6) == pytest.approx(3.0 * 1e6**-0.3, rel=1e-12)
    assert found.tokens_for(0.1) == pytest.approx((3.0 / 0.1) ** (1 / 0.3), rel=1e-9)


def test_the_forecast_of_an_exact_law_is_its_solution():
    points = law(3.0, 0.3, TOKENS)
    found = forecast(points, 0.05)
    assert found.status == "on track"
    expected = (3.0 / 0.05) ** (1 / 0.3) - TOKENS[-1]  # tokens where 3 t^-0.3 = 0.05, less those seen
    assert found.tokens_to_target == pytest.approx(expected, rel=1e-6)
    assert found.tokens_to_target_low == pytest.approx(expected, rel=1e-6)  # no spread: the points are on the line
    assert found.tokens_to_target_high == pytest.approx(expected, rel=1e-6)


def test_a_noisy_law_is_recovered_within_its_stated_uncertainty():
    truth = (2.0 / 0.2) ** (1 / 0.15) - TOKENS[-1]  # more tokens until 2 t^-0.15 = 0.2
    exponents = ranges = 0
    for seed in range(40):  # seeded: the same 40 curves on every machine
        points = law(2.0, 0.15, TOKENS, noise=0.03, seed=seed)
        found = forecast(points, 0.2)
        exponents += abs(found.law.exponent - 0.15) <= 2 * found.law.exponent_se
        assert found.tokens_to_target_low < found.tokens_to_target < found.tokens_to_target_high
        ranges += found.tokens_to_target_low <= truth <= found.tokens_to_target_high
    # ± 2 standard errors covers ~91% with 6 degrees of freedom (Student's t): 200 seeds gave 93%
    assert exponents >= 34 and ranges >= 34


def test_a_flat_curve_is_said_to_have_flattened():
    level = [1.05, 1.0, 1.01, 0.99, 1.0, 1.01, 0.995, 1.0]  # no trend, the highest point first
    points = [CurvePoint(t, t / 100, kl, None, {"a": 1.0}) for t, kl in zip(TOKENS, level, strict=True)]
    found = forecast(points, 0.1)
    assert found.status == "flattened" and found.tokens_to_target is None
    assert "flattened" in found.sentence()


def test_the_first_steps_disturbance_is_not_the_trend():
    """A converted model is often disturbed by its first steps before it recovers: the points up to the highest
    are left out, and the law after it is found exactly."""
    rising = [CurvePoint(t, 0.0, kl, None, {}) for t, kl in ((500, 2.0), (700, 9.0))]
    found = forecast(rising + law(3.0, 0.3, TOKENS), 0.05)
    assert found.law.points == len(TOKENS) and found.law.exponent == pytest.approx(0.3, abs=1e-9)
    assert found.tokens_to_target == pytest.approx((3.0 / 0.05) ** (1 / 0.3) - TOKENS[-1], rel=1e-6)


def test_a_reached_target_too_few_points_and_no_teacher_are_said_so():
    assert forecast(law(3.0, 0.3, TOKENS), 10.0).status == "reached"
    assert forecast(law(3.0, 0.3, TOKENS[:2]), 0.1).status == "too few points"
    blind = [CurvePoint(t, 0.0, None, None, {"a": 5.0}) for t in TOKENS]
    assert forecast(blind, 0.1).status == "no teacher"


def test_a_run_draws_its_curve_and_reads_its_forecast_back_typed(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    settings = parse(
        args(tiny, out, "--eval_data", str(tiny["eval"]), "--distill_from", str(tiny["parent"]), "--eval_points", "4")
    )
    result = uptrain(settings)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "eval_perplexity" in r]
    assert [r["step"] for r in rows] == [0, *eval_steps(20, 4)]  # 20 steps: 1280 tokens / 64 per step
    seconds = [r["train_seconds"] for r in rows]
    assert seconds[0] == 0 and all(b > a for a, b in zip(seconds, seconds[1:], strict=False))
    found = read_forecast(out)
    assert found == result.forecast and [p.tokens for p in found.points] == [r["tokens"] for r in rows]
    assert [p.mean_kl for p in found.points] == [r["eval_kl"] for r in rows]
    assert found.target_kl == 0.15 and found.status in {"on track", "flattened", "reached"}
    assert json.loads((out / "recovery.json").read_text())["status"] == found.status
    report = (out / "recovery.md").read_text()
    assert found.sentence() in report and report.count("\n| ") == len(rows) + 1  # the header and a row a point
    with Image.open(out / "recovery.png") as image:
        image.load()
        assert (image.format, image.size) == ("PNG", (1680, 504))  # 14 x 4.2 inches at 120 dpi
    # the finished run asked for another target: a forecast for it (a new --target_kl was silently ignored)
    again = parse(
        args(
            tiny,
            out,
            "--eval_data",
            str(tiny["eval"]),
            "--distill_from",
            str(tiny["parent"]),
            "--eval_points",
            "4",
            "--target_kl",
            "0.0001",
        )
    )
    assert uptrain(again).forecast.target_kl == 0.0001 == read_forecast(out).target_kl
    assert f"its forecast for target_kl 0.0001: {read_forecast(out).sentence()}" in capsys.readouterr().out


def test_a_target_the_trend_reaches_only_past_a_thousand_times_the_tokens_seen_is_beyond_reach():
    """KL ∝ t^-0.04 from 1.85 reaches 0.15 after ~1e31 tokens: said to be beyond reach, not printed as a number."""
    found = forecast(law(3.0, 0.04, TOKENS), 0.15)
    assert found.status == "beyond reach" and found.tokens_to_target is None
    assert "beyond 1,000 times the tokens seen" in found.sentence()


def test_a_run_that_ended_further_from_its_parent_than_it_started_gets_no_forecast():
    """A run that ended twice as far from its parent as its conversion was got "about 228k more tokens to reach"
    with no word of it: its curve falls after an early rise, but never back to where it began."""
    start = [CurvePoint(0, 0.0, 0.05, None, {"a": 1.0})]
    found = forecast(start + law(3.0, 0.3, TOKENS), 0.01)  # ends at 3.0 * 128000^-0.3 = 0.088
    assert found.status == "moved away" and found.tokens_to_target is None
    assert "1.8x the 0.050 the run started from" in found.sentence() and "lower lr" in found.sentence()
    nearer = [CurvePoint(0, 0.0, 0.5, None, {"a": 1.0})]
    assert forecast(nearer + law(3.0, 0.3, TOKENS), 0.05).status == "on track"  # ends below where it began


def test_a_start_at_no_distance_from_the_parent_is_no_alarm():
    """A run whose conversion started at KL 0 (a LoRA against its own teacher) divided by it in the sentence."""
    start = [CurvePoint(0, 0.0, 0.0, None, {"a": 1.0})]
    found = forecast(start + law(3.0, 0.3, TOKENS), 0.01)
    assert found.status != "moved away" and found.sentence()


def test_recovery_json_reads_back_typed_and_equal_to_the_forecast_written(tmp_path):
    """recovery.json through the records' machinery: every field checked against its type, the law and the points
    typed; a number that is not finite reads back as it was."""
    points = law(3.0, 0.3, TOKENS, noise=0.05)
    points[-1] = CurvePoint(points[-1].tokens, 1.5, points[-1].mean_kl, 1.25, {"a": 2.0, "b": math.inf})
    for target in (0.05, 10.0, 1e-9):  # on track (a law, a range), reached, beyond reach
        found = forecast(points, target)
        write_forecast(tmp_path, found)
        read = read_forecast(tmp_path)
        assert read == found and isinstance(read.points[0], CurvePoint)
        assert read.law is None or isinstance(read.law, PowerLaw)
    assert read_forecast(tmp_path / "elsewhere") is None  # a folder that holds none


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda text: text[:-20], "Expecting"),
        (lambda text: text.replace('"tokens_seen": ', '"tokens_seen": "many", "was": ', 1), "has no field 'was'"),
        (lambda text: re.sub(r'"tokens_seen": \d+', '"tokens_seen": "many"', text, count=1), "tokens_seen 'many'"),
        (lambda text: re.sub(r'"status": "[a-z ]+"', '"status": "soon"', text, count=1), "status 'soon' is not one"),
    ],
)
def test_a_damaged_recovery_json_is_one_line_naming_the_file(tmp_path, damage, said):
    write_forecast(tmp_path, forecast(law(3.0, 0.3, TOKENS), 0.05))
    file = tmp_path / "recovery.json"
    file.write_text(damage(file.read_text()))
    with pytest.raises(UserError) as caught:
        read_forecast(tmp_path)
    message = str(caught.value)
    assert str(file) in message and said in message and "\n" not in message


@pytest.mark.parametrize(
    ("options", "title"),
    [
        ({}, "parent (lora)"),
        ({"kv_heads": 1}, "parent as MQA (lora)"),
        ({"kv_heads": 2, "distill_weight": 1.0}, "parent as GQA-2 (lora, distilled)"),
        ({"kv_cut": 4}, "parent as GQA, 1/4 cache (lora)"),
        ({"kv_cut": 2.5, "attention": "mla"}, "parent as MLA, 1/2.5 cache (lora)"),
        (
            {"kv_heads": 1, "attention": "mla", "kv_rank": 62, "rope_dims": 66},
            "parent as MLA, latent 62 + rotary 66 (lora)",
        ),
        ({"kv_heads": 2, "attention": "mla"}, "parent as MLA, the source's cache size (lora)"),
    ],
)
def test_the_recovery_plots_title_names_the_attention_a_converting_run_trains(options, title):
    from gqaify.uptrain.evaluation import curve_title
    from gqaify.uptrain.settings import UptrainSettings

    options = {"distill_weight": 0.0, **options}
    assert curve_title(UptrainSettings(model="runs/parent", trainable="lora", **options)) == title


@pytest.mark.parametrize("target", [1e300, 1e-300])
def test_a_far_target_draws_without_a_warning(tmp_path, target):
    """`--target-kl 1e300` sent four matplotlib "overflow encountered in exp" warnings to the terminal, -q or not:
    a target more than a thousand times off the measured KL is left off the plot, and the trend stops within it."""
    import warnings

    from gqaify.uptrain.curve import plot_curve

    found = forecast(law(3.0, 0.3, TOKENS), target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_curve(found, None, tmp_path / "recovery.png", "far")
    assert Image.open(tmp_path / "recovery.png").size[0] > 0


def test_a_forecast_is_said_to_two_significant_figures():
    """Forecasts from six points were printed to seven figures ("about 312,336 more tokens"); the record keeps the
    exact figure, the sentence says what is known."""
    found = forecast(law(3.0, 0.3, TOKENS), 0.05)
    expected = round(found.tokens_to_target, 2 - len(str(found.tokens_to_target)))
    assert f"about {expected:,} more tokens" in found.sentence() and expected != found.tokens_to_target
