"""Uptraining's bad input and stops: one line naming the problem and the fix, nothing written or lost; a run killed
or stopped says what is left and resumes; output_dir refused where it holds something else; a full disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gqaify.records import TOOL
from gqaify.testing import CORPUS, build_model, save_with_tokenizer
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from gqaify.uptrain.metrics import read_metrics
from helpers import (
    one_line_error,
    run_uptrain,
)
from helpers import uptrain_args as args

# -- bad input -----------------------------------------------------------------------------------------------


def test_missing_recipe(tmp_path):
    assert "recipe nope.yaml does not exist" in one_line_error(run_uptrain(["--recipe", "nope.yaml"], cwd=tmp_path))


def test_unknown_recipe_key_names_the_nearest(tmp_path):
    (tmp_path / "r.yaml").write_text("model: m\nlearnin_rat: 1e-3\nsaev_every: 5\n")
    line = one_line_error(run_uptrain(["--recipe", str(tmp_path / "r.yaml")]))
    assert "unknown key 'learnin_rat'" in line and "unknown key 'saev_every' (did you mean save_every?)" in line


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        ("learning_rate", "lr?)"),
        ("per_device_train_batch_size", "micro_batch_size?)"),
        ("gradient_accumulation_steps", "grad_accum?)"),
        ("warmup_ratio", "warmup? a fraction"),
        ("num_train_epochs", "max_tokens? gqaify counts training tokens, not epochs)"),
        ("bf16", "mixed_precision?"),
    ],
)
def test_training_arguments_names_are_answered_with_ours(tmp_path, name, ours):
    (tmp_path / "r.yaml").write_text(f"model: m\n{name}: 1\n")
    line = one_line_error(run_uptrain(["--recipe", str(tmp_path / "r.yaml")]))
    assert f"unknown key {name!r} (did you mean {ours}" in line
    line = one_line_error(run_uptrain([f"--{name}", "1"]))
    assert f"unknown option --{name} (did you mean --{ours}" in line


def test_recipe_values_of_the_wrong_type(tmp_path):
    (tmp_path / "r.yaml").write_text("model: m\noutput_dir: o\ndata: d\nmax_tokens: [1, 2]\nmicro_batch_size: 2.5\n")
    line = one_line_error(run_uptrain(["--recipe", str(tmp_path / "r.yaml")]))
    assert "max_tokens [1, 2] is not a whole number or empty" in line
    assert "micro_batch_size 2.5 is not a whole number" in line


def test_unknown_option_names_the_nearest():
    line = one_line_error(run_uptrain(["--max_token", "5"]))
    assert "unknown option --max_token (did you mean --max_tokens?)" in line


@pytest.mark.parametrize(
    "options, expect",
    [
        (["--eval_limit", "5"], "eval_limit applies to eval_tasks"),
        (["--eval_tasks", "x", "--eval_limit", "-1"], "eval_limit -1 must be above 0"),
    ],
)
def test_bad_eval_task_settings(tiny, tmp_path, options, expect):
    line = one_line_error(run_uptrain(args(tiny, tmp_path / "run", *options)))
    assert expect in line and not (tmp_path / "run").exists()


@pytest.mark.parametrize("budget", ["0", "-5"])
def test_budget_must_be_positive(tiny, tmp_path, budget):
    line = one_line_error(run_uptrain(args(tiny, tmp_path / "run", "--max_tokens", budget)))
    assert "max_tokens must be > 0" in line and not (tmp_path / "run").exists()


def test_a_block_of_one_token_is_refused(tiny, tmp_path):
    line = one_line_error(run_uptrain(args(tiny, tmp_path / "run", "--seq_len", "1")))
    assert "seq_len must be at least 2, got 1" in line and not (tmp_path / "run").exists()


def test_a_diverged_run_stops_at_the_first_non_finite_loss_and_is_not_completed(tiny, tmp_path):
    out = tmp_path / "run"
    line = one_line_error(
        run_uptrain(args(tiny, out, "--lr", "1e30", "--warmup", "0", "--save_every", "1", "--save_total_limit", "99"))
    )
    assert "the training loss became" in line and "lower lr" in line
    step = int(line.split(" at step ")[1].split(":")[0])
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert step > 1 and [r["step"] for r in rows] == list(range(1, step))  # the non-finite step is not logged
    assert all(r["loss"] == r["loss"] for r in rows)  # no NaN
    assert not (out / "final").exists() and not json.loads((out / "run.json").read_text()).get("completed")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{n:07d}" for n in range(1, step)]


def test_data_smaller_than_one_block(tiny, tmp_path):
    (tmp_path / "short.txt").write_text("a few words")
    line = one_line_error(
        run_uptrain(args(tiny, tmp_path / "run", "--data", str(tmp_path / "short.txt"), "--seq_len", "64"))
    )
    assert "less than one block of seq_len 64" in line and not (tmp_path / "run").exists()


@pytest.mark.parametrize("convert_first", [False, True])
def test_empty_data_is_refused_and_nothing_is_written(tiny, tmp_path, convert_first):
    """Used to end in an IndexError, with converted/ and run.json left behind that refused the corrected rerun."""
    (tmp_path / "empty.txt").write_text("")
    extra = ("--model", str(tiny["parent"]), "--kv_heads", "2") if convert_first else ()
    line = one_line_error(run_uptrain(args(tiny, tmp_path / "run", *extra, "--data", str(tmp_path / "empty.txt"))))
    assert "gives 0 tokens, less than one block" in line and not (tmp_path / "run").exists()
    assert run_uptrain(args(tiny, tmp_path / "run", *extra)).returncode == 0  # the corrected rerun


def test_streaming_data_smaller_than_one_step(tiny, tmp_path):
    (tmp_path / "short.txt").write_text(CORPUS[:100])  # about 54 tokens: 3 blocks of 16, a step needs 4
    streamed = args(tiny, tmp_path / "run", "--streaming", "--data", str(tmp_path / "short.txt"))
    line = one_line_error(run_uptrain(streamed))
    assert "fewer than one step's 4" in line and not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["seq_len", "eval_seq_len"])
def test_windows_longer_than_the_models_positions_are_refused(tiny, tmp_path, key):
    long = args(tiny, tmp_path / "run", f"--{key}", "128", "--eval_data", str(tiny["eval"]))
    line = one_line_error(run_uptrain(long))
    assert f"{key} 128 exceeds the 64 positions" in line and not (tmp_path / "run").exists()


def test_a_run_killed_before_training_does_not_block_the_corrected_rerun(tiny, tmp_path):
    """A run.json with no training behind it (the process was killed while converting) is not another run."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"tool": TOOL, "settings": {"data": "old.txt"}}))  # no version, no kind
    (out / "converted").mkdir()
    assert run_uptrain(args(tiny, out)).returncode == 0
    assert not (out / "converted").exists() and (out / "final").is_dir()


def _start_uptrain(argv: list[str]) -> subprocess.Popen:
    # A shell's background job (`pytest ... &`, CI runners) starts with SIGINT ignored, and Python then keeps it
    # ignored: restore the default in the child so that it gets Ctrl-C as a terminal would deliver it.
    return subprocess.Popen(
        [sys.executable, "-m", "gqaify", "uptrain", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stopped_training_says_what_is_left_and_resumes(tiny, tmp_path, signum, status):
    out = tmp_path / "run"
    settings = ("--max_tokens", "16000", "--save_every", "25")  # 250 steps
    process = _start_uptrain(args(tiny, out, *settings))
    deadline = time.monotonic() + 300
    while not list((out / "checkpoints").glob("step-*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process.poll() is None, "the run ended before it could be stopped"
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == status, err
    line = err.strip().splitlines()[-1]
    assert "the last checkpoint is step" in line and "of 250" in line and "rerun the same command to resume" in line
    assert "nothing was written" not in err
    resumed = run_uptrain(args(tiny, out, *settings))
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout


# The conversion inside uptraining, stopped once its first tensor is in the shard: the process signals itself
# there, so the stop lands mid-write on every machine (a test polling for the shard from outside could miss it
# under load, the whole conversion done before it looked).
_STOP_AFTER_FIRST_TENSOR = """
import os, signal, sys
from gqaify.entry.cli import main
from gqaify.conversion.checkpoint import ShardWriter

done = ShardWriter._done
def done_then_stop(self, name):
    done(self, name)
    os.kill(os.getpid(), signal.SIGTERM)
ShardWriter._done = done_then_stop
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_uptrain_converts_leaves_nothing(tmp_path):
    """The conversion step of uptraining, stopped mid-write."""
    model = build_model("llama", num_kv_heads=8, num_attention_heads=8, head_dim=32, hidden_size=256, vocab_size=320)
    parent = save_with_tokenizer(model, tmp_path / "parent")
    (tmp_path / "train.txt").write_text(CORPUS * 3)
    out = tmp_path / "run"
    argv = ["--model", parent, "--kv_heads", "1", "--output_dir", out, "--data", tmp_path / "train.txt"]
    argv += ["--seq_len", "16", "--max_tokens", "640"]
    process = subprocess.run(
        [sys.executable, "-c", _STOP_AFTER_FIRST_TENSOR, "uptrain", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 143 and "nothing was written" in process.stderr.strip().splitlines()[-1], (
        process.stderr
    )
    assert not out.exists()


def test_calibration_inside_uptrain_reads_the_split_and_text_column(tiny, tmp_path):
    rows = [{"body": line} for line in (CORPUS * 6).split(". ")]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    extra = (
        "--model",
        str(tiny["parent"]),
        "--kv_heads",
        "2",
        "--method",
        "lsq",
        "--data",
        str(tmp_path / "d.jsonl"),
        "--text_column",
        "body",
        "--split",
        "validation",
        "--calib_data",
        str(tmp_path / "d.jsonl"),
        "--calib_tokens",
        "1024",
        "--max_tokens",
        "320",
    )
    done = run_uptrain(args(tiny, tmp_path / "run", *extra))
    assert done.returncode == 0, done.stderr
    calibration = json.loads((tmp_path / "run" / "final" / "gqaify.json").read_text())["calibration"]
    assert (calibration["split"], calibration["text_column"]) == ("validation", "body")


def test_missing_eval_data_leaves_an_empty_output_dir_as_it_was(tiny, tmp_path):
    (tmp_path / "run").mkdir()
    line = one_line_error(run_uptrain(args(tiny, tmp_path / "run", "--eval_data", str(tmp_path / "nope.txt"))))
    assert "eval_data" in line and "no such file" in line and list((tmp_path / "run").iterdir()) == []


def test_output_dir_of_another_run_is_refused(tiny, tmp_path):
    out = tmp_path / "run"
    uptrain(parse(args(tiny, out, "--save_every", "10")))
    before = sorted(p.name for p in out.rglob("*"))
    line = one_line_error(run_uptrain(args(tiny, out, "--lr", "5e-4")))
    assert "holds another run's checkpoints (it had lr=0.001, now 0.0005)" in line
    assert sorted(p.name for p in out.rglob("*")) == before


def test_training_data_that_changed_since_the_run_began_is_refused(tiny, tmp_path):
    """run.json records the SHA-256 of the training tokens; a rerun on data edited since used to resume the run on
    other text without a word."""
    out, data = tmp_path / "run", tmp_path / "train.txt"
    data.write_text(CORPUS * 3)
    argv = [str(data) if a == str(tiny["train"]) else a for a in args(tiny, out, "--save_every", "10")]
    uptrain(parse(argv))
    recorded = json.loads((out / "run.json").read_text())["data_sha256"]
    assert json.loads((out / "final" / "gqaify.json").read_text())["uptrain"]["data_sha256"] == recorded
    data.write_text("One more line.\n" + CORPUS * 3)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    line = one_line_error(run_uptrain(argv))
    assert f"data {data} changed since the run in output_dir {out} began" in line
    assert f"SHA-256 was {recorded[:12]}" in line and "use a new output_dir to train on it as it is now" in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_run_recorded_before_a_setting_existed_resumes_at_its_default(tiny, tmp_path):
    """A run.json written by an older gqaify lacks the settings added since; the run trained as their defaults
    say, so it is the same run, not "another run's checkpoints" (it was refused after an upgrade)."""
    out = tmp_path / "run"
    uptrain(parse(args(tiny, out, "--save_every", "10")))
    run = json.loads((out / "run.json").read_text())
    del run["settings"]["distill_from_data"], run["settings"]["temperature"]  # as if added since
    (out / "run.json").write_text(json.dumps(run))
    done = run_uptrain(args(tiny, out, "--save_every", "10"))
    assert done.returncode == 0 and "uptrained" in done.stdout, done.stderr
    line = one_line_error(run_uptrain(args(tiny, out, "--save_every", "10", "--temperature", "2")))
    assert "holds another run's checkpoints (it had temperature=1.0, now 2.0)" in line


def test_a_run_resumes_however_its_local_paths_are_spelled(tiny, tmp_path, monkeypatch):
    """run.json's paths are compared where they lead: `m`, `m/`, `./m`, its absolute path and the folder it links
    to are one model (each was refused as another run's checkpoints); so are a run.json's relative paths, as an
    older gqaify wrote them, read from the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").symlink_to(tiny["converted"])
    (tmp_path / "train.txt").write_text(CORPUS * 3)

    def argv(model: str, data: str, out: str) -> list[str]:
        given = args(tiny, tmp_path / "run", "--save_every", "10")
        given[1], given[3], given[5] = model, out, data  # --model, --output_dir, --data
        return given

    first = uptrain(parse(argv("m", "train.txt", "run")))
    for model, data, out in [
        ("m/", "./train.txt", "run/"),
        ("./m", str(tmp_path / "train.txt"), "./run"),
        (str(tiny["converted"]), "train.txt", str(tmp_path / "run")),
    ]:
        assert uptrain(parse(argv(model, data, out))).steps == first.steps, (model, data, out)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["settings"]["model"] == str(tiny["converted"].resolve())
    record["settings"].update(model="m", data=["train.txt"], output_dir="run")  # as an older gqaify wrote it
    (tmp_path / "run" / "run.json").write_text(json.dumps(record))
    assert uptrain(parse(argv(str(tmp_path / "m"), "train.txt", str(tmp_path / "run")))).steps == first.steps
    line = one_line_error(run_uptrain(argv("m", "train.txt", "run") + ["--lr", "5e-4"], cwd=tmp_path))
    assert "holds another run's checkpoints (it had lr=0.001, now 0.0005)" in line  # still another run


def test_output_dir_with_unrelated_files_is_refused(tiny, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert "holds no gqaify run" in one_line_error(run_uptrain(args(tiny, tmp_path / "run")))


def test_missing_model_and_settings_are_reported_together(tmp_path):
    line = one_line_error(run_uptrain(["--output_dir", str(tmp_path / "o"), "--seq_len", "0"]))
    assert "model is required" in line and "data is required" in line and "seq_len must be at least 2, got 0" in line


def test_tracker_whose_package_is_missing_is_refused(tiny, tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    line = one_line_error(run_uptrain(args(tiny, tmp_path / "run", "--log_to", "tensorboard")))
    assert "log_to tensorboard needs its package; pip install tensorboard" in line


@pytest.mark.parametrize(
    ("where", "expect"),
    [
        ("ro", "output_dir {out} is read-only; choose another output_dir"),
        ("ro/run", "cannot write {out}: its parent is not a writable folder; choose another output_dir"),
    ],
)
def test_output_dir_that_cannot_be_written_is_refused_before_any_work(tiny, read_only, where, expect):
    """It used to train, then end in a traceback (exit 1)."""
    out = read_only.parent / where
    line = one_line_error(run_uptrain(args(tiny, out)))
    assert expect.format(out=out) in line and list(read_only.iterdir()) == []


def _uptrain_with(patch: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`gqaify uptrain ARGV` in a process of its own, after the Python lines `patch` ran."""
    script = f"import sys\n{patch}\nfrom gqaify.entry.cli import main\nsys.exit(main(['uptrain', *sys.argv[1:]]))\n"
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True)


# The second checkpoint's save writes part of a file, then meets a full disk.
_FULL_ON_SECOND_SAVE = """
import errno
from pathlib import Path
from gqaify.uptrain import checkpoint_files
save_state = checkpoint_files.save_training_state
saves = []
def save_on_a_filling_disk(folder, *args, **kwargs):
    saves.append(folder)
    if len(saves) == 2:
        (Path(folder) / "model.safetensors").write_bytes(b"part of a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")
    return save_state(folder, *args, **kwargs)
checkpoint_files.save_training_state = save_on_a_filling_disk
"""


def test_a_full_disk_while_checkpointing_is_one_line_and_leaves_only_whole_checkpoints(tiny, tmp_path):
    """It used to end in a traceback (exit 1), leaving run.json and metrics; now: one line, exit 1, the partial
    checkpoint removed, run.json claiming no completion, metrics whole, and a rerun resumes from what is left."""
    out = tmp_path / "run"
    argv = args(
        tiny, out, "--save_every", "4", "--eval_data", str(tiny["eval"]), "--eval_every", "4", "--eval_points", "0"
    )
    done = _uptrain_with(_FULL_ON_SECOND_SAVE, argv)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"gqaify: error: no space left on the disk of output_dir {out}; the last checkpoint")
    assert "is step 4 of 20" in lines[0] and "rerun the same command to resume from it" in lines[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000004"]
    assert [p for p in out.rglob("*") if p.name.endswith(".tmp")] == [] and not (out / "final").exists()
    run = json.loads((out / "run.json").read_text())
    assert run["started"] and "completed" not in run
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl") if "eval_perplexity" in row] == [0, 4, 8]
    done = run_uptrain(argv)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "run.json").read_text())["completed"] and (out / "final" / "gqaify.json").is_file()


def test_a_full_disk_before_training_leaves_nothing(tiny, tmp_path):
    out = tmp_path / "run"
    patch = """
import errno
import gqaify.uptrain.run_folder as run_folder
def full(*args):
    raise OSError(errno.ENOSPC, "No space left on device")
run_folder.write_json = full
"""
    done = _uptrain_with(patch, args(tiny, out))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0] == f"gqaify: error: no space left on the disk of output_dir {out}; nothing was written"
    assert not out.exists()


def test_output_dir_name_longer_than_the_file_system_allows_is_refused(tiny, tmp_path):
    """It used to end in a traceback. Nothing is made beside output_dir: the file system's limit is the limit."""
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    out = tmp_path / ("o" * (name_max + 1))
    line = one_line_error(run_uptrain(args(tiny, out)))
    assert f"output_dir name is longer than the file system allows ({name_max + 1} bytes, at most {name_max})" in line
    assert list(tmp_path.iterdir()) == []
