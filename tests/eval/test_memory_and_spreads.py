"""eval's capacity columns fill the memory the models really have by default, and every speed figure carries the
range of its runs."""

import psutil
import pytest

import gqaify
from gqaify.eval.report import markdown
from gqaify.eval.settings import EvalSettings


@pytest.fixture(scope="module")
def timed(tiny):
    """`tiny`'s parent and its GQA-2 conversion evaluated with their speed timed."""
    settings = EvalSettings(seq_len=32, decode_context=16, decode_tokens=4, decode_batch=2, repeats=3, progress=False)
    models = [str(tiny["parent"]), str(tiny["converted"])]
    return gqaify.evaluate(models, str(tiny["eval"]), tiny["root"] / "r", settings)


def test_the_default_memory_budget_is_this_machines_memory_and_the_report_says_so(timed):
    total = psutil.virtual_memory().total
    parent = timed.models[0]
    per_token = parent.kv_cache_bytes_per_token
    assert parent.max_context_at_budget == (total - parent.weights_bytes) // per_token
    assert timed.memory_budget == f"{total / 2**30:.1f} GiB, this machine's memory"
    assert f"K/V cache and weights in {timed.memory_budget}" in markdown(timed)


def test_every_speed_figure_has_the_range_of_its_runs(timed):
    text = markdown(timed)
    for m in timed.models:
        for spread, median in ((m.prefill_spread, m.prefill_tokens_per_s),
                               (m.batched_decode_spread, m.decode_tokens_per_s_batched)):  # fmt: skip
            assert spread is not None and spread.median == median and len(spread.runs) >= 3
            assert f"{spread.median:,.1f} ({spread.low:,.1f}–{spread.high:,.1f})" in text
