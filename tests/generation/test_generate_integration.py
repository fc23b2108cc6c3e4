"""`gqaify generate` in processes of its own: a corpus killed mid-run resumes without repeating or skipping, two
seeds into one OUT at once leave one seed's corpus, several processes write the corpus one process writes and
resume it when killed; and README's three commands from a checkpoint with no dataset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gqaify.entry.cli import main
from helpers import (
    CPU_PROCESSES,
    MODELS,
    accelerate_launch,
    kill_every_process,
    needs_assets,
    one_line,
    run_cli,
    tree_hashes,
)
from test_generate import SMALL, STORIES, generate, shards

# Loaded first by every Python process started with its folder on PYTHONPATH (`held_env`): once
# gqaify.generation.corpus is imported, a process that has written shard LAST or a later one waits there (until it
# is killed), so that a test that kills it once that shard is on disk knows what it holds, on any machine.
_HOLD_AFTER_SHARD = """
import importlib.abc, importlib.util, sys, time

class HoldAfterShard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "gqaify.generation.corpus":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            write = module._write_shard

            def write_then_hold(out, index, rows):
                write(out, index, rows)
                while index >= LAST:
                    time.sleep(1)

            module._write_shard = write_then_hold

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, HoldAfterShard())
"""


def held_env(folder: Path, last: int) -> dict:
    """The environment of CPU processes that wait once they have written shard `last` or a later one."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(_HOLD_AFTER_SHARD.replace("LAST", str(last)))
    return {**CPU_PROCESSES, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


@needs_assets
def test_a_corpus_killed_mid_run_resumes_without_repeating_or_skipping(tmp_path):
    assert generate(tmp_path / "whole", "--tokens", "3000") == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "gqaify.entry.cli", "generate", str(STORIES), str(out), "--tokens", "3000", *SMALL]
    env = held_env(tmp_path / "hook", 2)  # it waits once shard 2 is written: killed, it holds shards 0-2
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out / "data" / "train-00002.jsonl").exists() and time.monotonic() < deadline:
        assert process.poll() is None, "generate ended before shard 2"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    found = shards(out)
    assert len(found) == 3 < len(shards(tmp_path / "whole"))  # stopped part-way: shards 0-2
    assert generate(out, "--tokens", "3000") == 0
    assert shards(out) == shards(tmp_path / "whole")
    assert not [p for p in (out / "data").iterdir() if p.name.startswith(".")]


# real models end to end: seconds each
@needs_assets
def test_a_checkpoint_and_no_dataset_converts_calibrated_and_uptrains(tmp_path):
    """README's three commands on the MHA twin of stories260K: the parent's text is the only data, and the
    uptrained model's KL to the parent on it falls."""
    from gqaify.uptrain.metrics import read_metrics

    parent, text = MODELS / "stories260K-mha", tmp_path / "parent-text"
    assert main(["generate", str(parent), str(text), "--tokens", "6000", "--length", "128", "-q"]) == 0
    assert (
        main(
            [
                "convert",
                str(parent),
                str(tmp_path / "mqa"),
                "--kv-heads",
                "1",
                "--method",
                "lsq",
                "--calib-data",
                str(text),
                "--calib-tokens",
                "2048",
                "--calib-seq-len",
                "128",
                "-q",
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "mqa" / "gqaify.json").read_text())
    assert record["calibration"]["data"] == [str(text)] and "held out" in record["calibration"]["holdout"]
    assert (
        main(
            [
                "uptrain",
                "--model",
                str(tmp_path / "mqa"),
                "--data",
                str(text),
                "--distill_from",
                str(parent),
                "--distill_weight",
                "1",
                "--max_tokens",
                "8192",
                "--seq_len",
                "128",
                "--lr",
                "1e-3",
                "--eval_data",
                str(text),
                "--eval_split",
                "train",
                "--eval_tokens",
                "1024",
                "--output_dir",
                str(tmp_path / "up"),
                "--save_every",
                "0",
                "--no_progress",
            ]
        )
        == 0
    )
    kl = [r["eval_kl"] for r in read_metrics(tmp_path / "up" / "metrics.jsonl") if "eval_kl" in r]
    assert len(kl) >= 2 and kl[-1] < 0.8 * kl[0]  # the start and the curve's points
    config = json.loads((tmp_path / "up" / "final" / "config.json").read_text())
    assert config["num_key_value_heads"] == 1


# -- one run at a time, the prompts it began with, the room it needs ------------------------------------------------


@needs_assets
def test_two_seeds_into_one_out_at_once_leave_one_seeds_corpus(tmp_path, capsys):
    """The attack: seeds 7 and 8 into one OUT, 0.2-0.5 s apart, both exited 0 with shards of both seeds under a
    record of one. Made deterministic: the seed-7 run waits after its first shard until the seed-8 run is over."""
    out, go = tmp_path / "c", tmp_path / "go"
    wait = f"""
import pathlib, time
import gqaify.generation.corpus as corpus
sample = corpus._sample_shard
def waiting(parent, prompts, s, shard):
    if shard == 1:
        print("waiting", flush=True)
        while not pathlib.Path({str(go)!r}).exists():
            time.sleep(0.02)
    return sample(parent, prompts, s, shard)
corpus._sample_shard = waiting
"""
    argv = ["generate", STORIES, out, "--tokens", "600", *SMALL, "--seed", "7"]
    script = f"import sys\n{wait}\nfrom gqaify.entry.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    first = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout.readline() == "waiting\n", first.communicate()
        before = tree_hashes(out)
        code, err = run_cli(capsys, "generate", STORIES, out, "--tokens", "600", *SMALL, "--seed", "8")
        assert code == 2 and f"is being written by another gqaify generate (pid {first.pid})" in one_line(err)
        assert tree_hashes(out) == before  # the refused run touched nothing
    finally:
        go.touch()
        first.communicate(timeout=120)
    assert first.returncode == 0
    assert generate(tmp_path / "seed7", "--seed", "7") == 0
    assert shards(out) == shards(tmp_path / "seed7")
    record = json.loads((out / "gqaify.json").read_text())
    assert record["complete"] and record["settings"]["seed"] == 7


def launch_two(out: Path, *extra: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """`accelerate launch` of two CPU processes (gloo) writing one corpus."""
    cmd = [*accelerate_launch("gqaify.entry.cli"), "generate", str(STORIES), str(out), *SMALL, *extra]
    return subprocess.Popen(cmd, env=env or CPU_PROCESSES, cwd=out.parent, text=True, **popen)


def record_of(out: Path) -> dict:
    """The corpus's record, but for where it is (settings.out)."""
    record = json.loads((out / "gqaify.json").read_text())
    return {**record, "settings": {k: v for k, v in record["settings"].items() if k != "out"}}


@needs_assets
def test_two_processes_write_the_corpus_one_process_writes(tmp_path):
    """Shard k is a function of the seed and k: shared out among processes, the corpus is byte for byte the one
    process's, its record too (a last round's extra shard removed)."""
    assert generate(tmp_path / "one", "--tokens", "1500", "--top-logprobs", "4") == 0
    two = launch_two(tmp_path / "two", "--tokens", "1500", "--top-logprobs", "4", stdout=subprocess.PIPE)
    stdout, _ = two.communicate(timeout=600)
    assert two.returncode == 0
    assert stdout.count("tokens") >= 1 and stdout.count(str(tmp_path / "two")) == 1  # one summary per launch
    assert shards(tmp_path / "two") == shards(tmp_path / "one")
    assert record_of(tmp_path / "two") == record_of(tmp_path / "one")


@needs_assets
def test_a_corpus_whose_processes_were_killed_resumes_to_the_same_corpus(tmp_path):
    assert generate(tmp_path / "whole", "--tokens", "3000") == 0
    out, env = tmp_path / "killed", held_env(tmp_path / "hook", 3)
    process = launch_two(out, "--tokens", "3000", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (out / "data" / "train-00003.jsonl").exists() and time.monotonic() < deadline:
        assert process.poll() is None, "the launch ended before shard 3"
        time.sleep(0.05)
    kill_every_process(process)
    found = shards(out)  # stopped part-way, often with a gap: shard 3 written, shard 2 not yet
    assert "data/train-00003.jsonl" in found and len(found) <= 5 < len(shards(tmp_path / "whole"))  # 0-4 at most
    assert generate(out, "--tokens", "3000") == 0  # resumed by one process: the same corpus either way
    assert shards(out) == shards(tmp_path / "whole")
    assert record_of(out) == record_of(tmp_path / "whole")
