"""micro_batch_size auto: the largest micro-batch whose memory plan fits the device's memory with a margin, recorded
in run.json and kept on resume; refused where it cannot be planned."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from gqaify.entry.cli import main
from gqaify.uptrain import batch_size, parse
from gqaify.uptrain import run as uptrain
from gqaify.uptrain.plan import Launch, plan
from helpers import one_line, uptrain_args

ONE = Launch(1, False, "no")


def _settings(tiny, tmp_path, *extra):
    return parse(uptrain_args(tiny, tmp_path / "run", "--micro_batch_size", "auto", "--max_tokens", "16384", *extra))


def _total(s, blocks: int) -> int:
    return plan(dataclasses.replace(s, micro_batch_size=blocks), ONE).total


@pytest.mark.parametrize("fits", [1, 5, 13])
def test_auto_chooses_the_largest_micro_batch_whose_plan_fits(tiny, tmp_path, fits):
    """Against the plan itself, block by block: the choice is the largest micro-batch whose plan fits in the margin
    (rounded down to a multiple of 8 from 8 up), and one more block would not fit."""
    s = _settings(tiny, tmp_path)
    memory = int((_total(s, fits) + _total(s, fits + 1)) / 2 / batch_size.MARGIN)  # room for `fits`, not one more
    choice = batch_size.choose(s, ONE, memory)
    largest = max(b for b in range(1, 20) if _total(s, b) <= int(batch_size.MARGIN * memory))
    assert largest == fits
    assert choice.micro_batch_size == (largest - largest % 8 if largest >= 8 else largest)
    assert choice.planned == _total(s, choice.micro_batch_size) <= choice.fitted_in


def test_auto_keeps_one_evaluation_per_step_and_refuses_what_cannot_fit(tiny, tmp_path):
    s = _settings(tiny, tmp_path, "--max_tokens", "1280", "--eval_data", str(tiny["eval"]), "--eval_points", "4")
    most = 1280 // (16 * 2 * 4)  # 4 steps at least, of grad_accum 2 x 16-token blocks: 10 blocks, 8 rounded
    assert batch_size.choose(s, ONE, 2**40).micro_batch_size == most - most % 8 == 8
    with pytest.raises(Exception, match="micro_batch_size auto: one block of 16 tokens plans"):
        batch_size.choose(s, ONE, _total(s, 1))


def test_auto_is_recorded_in_run_json_and_kept_when_the_run_resumes(tiny, tmp_path, monkeypatch, capsys):
    s = _settings(tiny, tmp_path)
    monkeypatch.setattr(batch_size, "_memory", lambda processes: int(_total(s, 3) / batch_size.MARGIN) + 1)
    uptrain(s)
    out = capsys.readouterr().out
    assert "micro_batch_size auto: 3 blocks of 16 tokens (96 tokens per optimizer step and process)" in out
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["settings"]["micro_batch_size"] == 3
    shutil.rmtree(tmp_path / "run" / "final")  # resumed from its last checkpoint, on a device with more memory
    monkeypatch.setattr(batch_size, "_memory", lambda processes: 2**40)
    uptrain(s)
    assert "micro_batch_size auto: 3 blocks of 16 tokens (96 tokens per optimizer step and process), kept" in (
        capsys.readouterr().out
    )
    assert json.loads((tmp_path / "run" / "run.json").read_text())["settings"]["micro_batch_size"] == 3


def test_a_micro_batch_that_is_no_number_or_auto_and_a_plan_of_auto_are_refused(tiny, tmp_path, capsys):
    refusals = (
        ("many", "invalid int or auto value: 'many'"),
        ("0", "micro_batch_size must be a positive integer or auto"),
    )
    for value, said in refusals:
        code = main(["uptrain", *uptrain_args(tiny, tmp_path / "run", "--micro_batch_size", value)])
        err = capsys.readouterr().err
        assert code == 2 and one_line(err) and said in err, err
    argv = uptrain_args(tiny, tmp_path / "run", "--micro_batch_size", "auto", "--plan", "accelerate/cpu")
    assert main(["uptrain", *argv]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "--plan needs a micro_batch_size: auto is chosen on the device" in err, err
    assert not (tmp_path / "run").exists()


def test_a_plan_of_fp8_or_of_a_device_is_refused_by_what_it_is(tiny, tmp_path, capsys):
    """`--plan` accepted `mixed_precision: fp8` and called /dev/zero "no such accelerate config"."""
    config = tmp_path / "fp8.yaml"
    config.write_text("distributed_type: 'NO'\nnum_processes: 1\nmixed_precision: fp8\n")
    for plan_file, said in ((config, "gqaify plans mixed_precision no, bf16 or fp16, not fp8"),
                            ("/dev/zero", "--plan /dev/zero is a device, not an accelerate config")):  # fmt: skip
        assert main(["uptrain", *uptrain_args(tiny, tmp_path / "run", "--plan", str(plan_file))]) == 2
        err = capsys.readouterr().err
        assert one_line(err) and said in err, err


def test_a_plan_under_an_fsdp_config_naming_a_class_the_model_lacks_says_so(tiny, tmp_path, capsys):
    """The launch stopped on every rank in accelerate's traceback and torch's ChildFailedError; `--plan` says why
    before any process starts."""
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        "distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_transformer_layer_cls_to_wrap: NoSuchDecoderLayer\n"
    )
    assert main(["uptrain", *uptrain_args(tiny, tmp_path / "run", "--plan", str(config))]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "fsdp_transformer_layer_cls_to_wrap names NoSuchDecoderLayer, which" in err, err
    assert "its decoder layer: LlamaDecoderLayer" in err
    config.write_text(config.read_text().replace("NoSuchDecoderLayer", "LlamaDecoderLayer"))
    assert main(["uptrain", *uptrain_args(tiny, tmp_path / "run", "--plan", str(config))]) == 0
