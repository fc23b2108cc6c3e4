"""report.json read back typed (`Report.read`): the report eval wrote, equal; NaN as documented; a damaged file one
line naming it."""

import json
import math
import re
from dataclasses import replace

import pytest

import gqaify
from gqaify.errors import UserError
from gqaify.eval.report import markdown, write_report
from gqaify.eval.results import Diagnostics, ModelReport, PanelSummary, Report, Spread, TextInfo, TextScore
from gqaify.eval.settings import EvalSettings
from gqaify.testing import CORPUS, build_model, save_with_tokenizer

FAST = EvalSettings(seq_len=32, decode_context=16, decode_tokens=4, decode_batch=2, repeats=2, progress=False)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A report gqaify eval wrote (an MHA llama and its GQA-2 conversion, on two texts), and its folder."""
    root = tmp_path_factory.mktemp("report_json")
    parent = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), root / "parent")
    gqaify.convert(parent, root / "gqa2", kv_heads=2, progress=False)
    (root / "a.txt").write_text(CORPUS)
    (root / "b.txt").write_text(CORPUS[::-1])
    data = [str(root / "a.txt"), str(root / "b.txt")]
    report = gqaify.evaluate([str(parent), str(root / "gqa2")], data, root / "r", FAST)
    return report, root / "r"


def test_report_json_reads_back_typed_and_equal_to_the_report_eval_wrote(written):
    report, out = written
    read = Report.read(out / "report.json")
    assert read == report and Report.read(out) == report  # the file, or the folder holding it
    parent, gqa2 = read.models
    assert all(isinstance(t, TextInfo) for t in read.data) and len(read.data) == 2
    assert isinstance(gqa2, ModelReport) and all(isinstance(t, TextScore) for t in gqa2.texts)
    assert isinstance(gqa2.decode_spread, Spread) and isinstance(gqa2.parent_decode_spread, Spread)
    assert isinstance(gqa2.diagnostics, Diagnostics) and isinstance(gqa2.panel, PanelSummary)
    assert parent.panel is None and parent.texts[0].ratio_to_parent is None
    # the writer and the reader are one pair: what was read writes the same file
    assert read.to_dict() == json.loads((out / "report.json").read_text())
    assert markdown(read) == (out / "report.md").read_text()


def test_a_number_that_was_not_finite_reads_back_as_nan_or_none_where_its_field_may_be_none(written, tmp_path):
    """report.json writes NaN and infinity as null (JSON has neither): a float reads it back as NaN, a field that may
    be None as None."""
    report, _ = written
    nan = float("nan")
    gqa2 = report.models[1]
    texts = [replace(gqa2.texts[0], perplexity=nan, ratio_to_parent=nan), *gqa2.texts[1:]]
    diagnostics = replace(gqa2.diagnostics, attention_relative_error=[nan, 0.5])
    diverged = replace(gqa2, perplexity=nan, nll=math.inf, delta_perplexity=nan, texts=texts, diagnostics=diagnostics)
    write_report(replace(report, models=[report.models[0], diverged]), tmp_path / "r")

    read = Report.read(tmp_path / "r")
    got = read.models[1]
    assert math.isnan(got.perplexity) and math.isnan(got.nll)  # a float: NaN (the infinity too)
    assert got.delta_perplexity is None and got.texts[0].ratio_to_parent is None  # may be None: None
    assert math.isnan(got.texts[0].perplexity) and math.isnan(got.diagnostics.attention_relative_error[0])
    assert got.diagnostics.attention_relative_error[1] == 0.5
    assert read.models[0] == report.models[0] and got.texts[1:] == gqa2.texts[1:]
    assert "nan" in markdown(read)


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda text: text[: len(text) // 2], "is not JSON"),
        (lambda text: '{"mine": true}\n', "is not a report gqaify eval wrote"),
        (
            lambda text: re.sub(r'"perplexity": [^,]+', '"perplexity": "high"', text, count=1),
            "models.perplexity 'high'",
        ),
        (lambda text: text.replace('"notes"', '"later"', 1), "Report has no field 'later'"),
        (lambda text: text.replace('"tokens_scored"', '"tokens"', 1), "has no field 'tokens'"),
    ],
)
def test_a_damaged_report_json_is_one_line_naming_the_file(written, tmp_path, damage, said):
    _, out = written
    file = tmp_path / "report.json"
    file.write_text(damage((out / "report.json").read_text()))
    with pytest.raises(UserError) as caught:
        Report.read(file)
    message = str(caught.value)
    assert str(file) in message and said in message and "\n" not in message


def test_a_missing_report_json_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(UserError, match=f"cannot read {tmp_path / 'report.json'}"):
        Report.read(tmp_path)
