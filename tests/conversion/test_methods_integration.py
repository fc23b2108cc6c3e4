"""Calibrated methods on a real model end to end (ref-mha-6L, seconds each): aligned and lsq start far closer to
the parent than the GQA paper's mean, and sequential lsq closer than parallel."""

from __future__ import annotations

from transformers import AutoTokenizer

import gqaify
from helpers import MODELS, load, needs_assets
from test_methods import TEXT


# real models end to end: seconds each
@needs_assets
def test_calibrated_conversions_start_far_closer_to_the_parent_than_the_papers_mean_on_ref_mha_6l(tmp_path):
    from gqaify.eval.perplexity import perplexity

    src = MODELS / "ref-mha-6L"
    text = (TEXT / "wikitext-2-raw-test.txt").read_text()
    ids = AutoTokenizer.from_pretrained(src)(text[:20_000], return_tensors="pt").input_ids[0, :2048]
    # not the eval text
    calibration = dict(calib_data=str(TEXT / "tinyshakespeare.txt"), calib_tokens=4096, calib_seq_len=512)
    found = {}
    gqaify.convert(src, tmp_path / "mean", 2, progress=False)  # the GQA paper's conversion: no calibration
    found["mean", "none"] = perplexity(load(tmp_path / "mean"), ids, 512, 512, progress=False).perplexity
    for method, grouping, mode in (
        ("aligned", "contiguous", "sequential"),
        ("lsq", "contiguous", "sequential"),
        ("lsq", "similarity", "sequential"),
        ("lsq", "contiguous", "parallel"),
    ):
        out = tmp_path / f"{method}-{grouping}-{mode}"
        gqaify.convert(src, out, 2, method=method, **calibration, calib_mode=mode, grouping=grouping, progress=False)
        found[method, grouping, mode] = perplexity(load(out), ids, 512, 512, progress=False).perplexity
    mean = found["mean", "none"]
    assert all(ppl < 0.5 * mean for key, ppl in found.items() if key[0] != "mean"), found


# real models end to end: seconds each
@needs_assets
def test_sequential_lsq_starts_closer_to_the_parent_than_parallel_lsq_on_ref_mha_6l(tmp_path):
    """Layer by layer, each layer repaired against the parent's outputs, beats fitting every layer on the parent's
    activations (calibration: WikiText-2 validation; evaluation: WikiText-2 test)."""
    from gqaify.eval.perplexity import perplexity

    src = MODELS / "ref-mha-6L"
    text = (TEXT / "wikitext-2-raw-test.txt").read_text()
    ids = AutoTokenizer.from_pretrained(src)(text[:20_000], return_tensors="pt").input_ids[0, :4096]
    calibration = dict(calib_data=str(TEXT / "wikitext-2-valid-tokenized.txt"), calib_tokens=16384, calib_seq_len=512)
    found = {}
    for mode in ("parallel", "sequential"):
        gqaify.convert(src, tmp_path / mode, 2, method="lsq", **calibration, calib_mode=mode, progress=False)
        found[mode] = perplexity(load(tmp_path / mode), ids, 512, 512, progress=False).perplexity
    assert found["sequential"] < 0.95 * found["parallel"], found
