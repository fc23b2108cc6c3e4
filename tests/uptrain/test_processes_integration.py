"""Uptraining across processes and kills: SIGKILL and resume, two processes against one, FSDP2, a rank stopped
mid-run (the loop's exactness where it is hardest; a file of its own so that it runs beside the others)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from helpers import (
    CPU_PROCESSES,
    REPO,
    accelerate_launch,
    kill_every_process,
    losses,
    run_uptrain,
)
from helpers import uptrain_args as args

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("trainable", [[], ["--trainable", "lora", "--lora_rank", "4"]], ids=["all", "lora"])
def test_sigkill_then_resume_equals_uninterrupted(tiny, tmp_path, trainable):
    """Kill the run with SIGKILL after its first checkpoint, rerun the same command: same losses, same weights."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    settings = ("--max_tokens", "16000", "--save_every", "25", *trainable)  # 250 steps
    assert run_uptrain(args(tiny, whole, *settings)).returncode == 0
    process = subprocess.Popen(
        [sys.executable, "-m", "gqaify", "uptrain", *args(tiny, cut, *settings)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not list((cut / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (cut / "final").exists(), "the run finished before it was killed; give it more steps"
    assert list((cut / "checkpoints").glob("step-*"))
    resumed = run_uptrain(args(tiny, cut, *settings))
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout
    assert losses(cut) == pytest.approx(losses(whole), abs=1e-6) and len(losses(cut)) == 250
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


# Loaded into each launched process (as sitecustomize): where the process group is ended, how many DDP models are
# still alive, written to DDP_ALIVE_AT_END/rank-N.
_COUNT_DDP_AT_END = """
import gc, os
from pathlib import Path
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

_destroy = dist.destroy_process_group

def _counted(*args, **kwargs):
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    (Path(os.environ["DDP_ALIVE_AT_END"]) / f"rank-{os.environ['RANK']}").write_text(str(alive))
    return _destroy(*args, **kwargs)

dist.destroy_process_group = _counted
"""


def test_two_processes_agree_with_one_at_the_same_global_batch(tiny, tmp_path):
    """2 processes x micro-batch 2 x accumulation 1 = 1 process x 2 x 2: the same blocks per step. And each process
    frees its DDP model before it ends the process group: where DDP's reducer held the group's last reference, gloo's
    destructor waited, holding the GIL, for a worker thread that needed it, and the process never exited."""
    one, two = tmp_path / "one", tmp_path / "two"
    uptrain(parse(args(tiny, one)))
    common = args(tiny, two, "--grad_accum", "1")
    hook, counts = tmp_path / "hook", tmp_path / "ddp-alive"
    hook.mkdir()
    counts.mkdir()
    (hook / "sitecustomize.py").write_text(_COUNT_DDP_AT_END)
    path = os.pathsep.join(p for p in [str(hook), CPU_PROCESSES.get("PYTHONPATH")] if p)
    done = subprocess.run(
        [*accelerate_launch("gqaify.uptrain"), *common, "--dist_timeout", "300"],
        capture_output=True,
        text=True,
        env={**CPU_PROCESSES, "PYTHONPATH": path, "DDP_ALIVE_AT_END": str(counts)},
        cwd=tmp_path,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert {f.name: f.read_text() for f in counts.iterdir()} == {"rank-0": "0", "rank-1": "0"}
    assert json.loads((two / "run.json").read_text())["settings"]["processes"] == 2
    assert len(losses(two)) == 20
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)


def test_processes_that_do_not_join_one_group_are_refused(tiny, tmp_path):
    """What torchrun without ACCELERATE_USE_CPU gives on a CPU machine: each process alone, WORLD_SIZE 2."""
    done = run_uptrain(args(tiny, tmp_path / "run"), env={**os.environ, "WORLD_SIZE": "2"})
    assert done.returncode == 2 and "ACCELERATE_USE_CPU=1" in done.stderr


FSDP = REPO / "recipes" / "accelerate" / "fsdp.yaml"


def launch_fsdp(argv: list[str], cwd: Path, **popen) -> subprocess.Popen:
    """The packaged FSDP2 config on two CPU processes (gloo), in full precision: what a user's 8 GPUs launch."""
    launch = [*accelerate_launch("gqaify.uptrain", FSDP), *argv, "--dist_timeout", "300"]
    return subprocess.Popen(launch, env=CPU_PROCESSES, cwd=cwd, text=True, **popen)


def run_fsdp(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    process = launch_fsdp(argv, cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = process.communicate(timeout=900)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def stored_corpus(tiny):
    """The tiny parent's own text, with its top-8 log-probabilities at every position."""
    from gqaify.entry.cli import main

    corpus = tiny["root"] / "stored"
    if not corpus.exists():
        argv = ["generate", str(tiny["parent"]), str(corpus), "--tokens", "3000", "--length", "40"]
        assert main([*argv, "--top-logprobs", "8", "-q"]) == 0
    return corpus


FULL_KL = ["--distill_from", "PARENT", "--distill_weight", "0.5"]


@pytest.mark.parametrize(
    "teaching",
    [
        FULL_KL,
        [*FULL_KL, "--no_shard_teacher"],
        ["--data", "CORPUS", "--distill_from_data", "--distill_weight", "1", "--trainable", "attention"],
        [*FULL_KL, "--trainable", "lora", "--lora_rank", "4"],
    ],
    ids=["full-kl", "full-kl-whole-teacher", "stored-top-k-attention", "full-kl-lora"],
)
def test_fsdp2_on_two_processes_agrees_with_one_process(tiny, stored_corpus, tmp_path, teaching):
    """2 processes sharded (FSDP2) x micro-batch 2 = 1 process x 2 x accumulation 2, distilled from the live parent
    (sharded or whole in each process) or from its stored top-k, training everything, the attention or LoRA
    adapters: the same losses step by step, the same final weights within float tolerance, saved as one process
    saves them (tied embeddings once)."""
    teaching = [{"PARENT": str(tiny["parent"]), "CORPUS": str(stored_corpus)}.get(a, a) for a in teaching]
    one, two = tmp_path / "one", tmp_path / "two"
    uptrain(parse(args(tiny, one, *teaching)))
    done = run_fsdp(args(tiny, two, "--grad_accum", "1", *teaching), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((two / "run.json").read_text())
    assert record["settings"]["processes"] == 2 and record["completed"]
    assert record["distributed_type"] == "FSDP"
    assert json.loads((one / "run.json").read_text())["distributed_type"] == "NO"
    assert losses(two) == pytest.approx(losses(one), rel=1e-4) and len(losses(two)) == len(losses(one))
    a, b = load_file(one / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)


def test_fsdp2_trains_an_mla_model_as_one_process_does(tiny, tmp_path):
    """gqaify's MLA model (DeepSeek-V3's class) sharded over 2 processes (FSDP2, each decoder layer of its own
    class wrapped): one process's losses and weights, its latent's down-projection held as converted in both."""
    from gqaify.entry.cli import main

    mla = tmp_path / "mla"
    assert main(["convert", str(tiny["parent"]), str(mla), "--kv-heads", "2", "--attention", "mla", "-q"]) == 0
    one, two = tmp_path / "one", tmp_path / "two"
    model = ["--model", str(mla), "--lr", "1e-3"]
    uptrain(parse([*args(tiny, one), *model]))
    done = run_fsdp([*args(tiny, two, "--grad_accum", "1"), *model], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((two / "run.json").read_text())["distributed_type"] == "FSDP"
    assert losses(two) == pytest.approx(losses(one), rel=1e-4) and len(losses(two)) == len(losses(one))
    start, a, b = (load_file(m / "model.safetensors") for m in (mla, one / "final", two / "final"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
    down = [name for name in a if "kv_a_proj_with_mqa" in name]
    assert down and all(torch.equal(a[name], start[name]) and torch.equal(b[name], start[name]) for name in down)


def test_an_fsdp_wrap_class_the_model_lacks_is_refused(tiny, tmp_path):
    """A config naming a decoder layer class the model does not have (a Llama config's LlamaDecoderLayer for
    another architecture): refused in one line naming the model's own class and the fix (accelerate's own error
    was a traceback and an internal error), nothing written."""
    config = tmp_path / "fsdp-mistral.yaml"
    wrap = "  fsdp_transformer_layer_cls_to_wrap: MistralDecoderLayer\n"
    config.write_text(FSDP.read_text().replace("fsdp_config:\n", "fsdp_config:\n" + wrap))
    out = tmp_path / "run"
    launch = [*accelerate_launch("gqaify.uptrain", config), *args(tiny, out, "--grad_accum", "1")]
    env = {**CPU_PROCESSES, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(launch, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode != 0 and "internal error" not in done.stderr
    refusal = (
        "gqaify: error: the accelerate config's fsdp_transformer_layer_cls_to_wrap names MistralDecoderLayer, which "
        "LlamaForCausalLM does not have (its decoder layer: LlamaDecoderLayer); remove the key (FSDP then wraps the "
        "model's own decoder layer) or name that class"
    )
    assert refusal in done.stderr.splitlines(), done.stderr[-3000:]
    assert not out.exists()


def test_fsdp_version_1_on_cpus_is_refused(tiny, tmp_path):
    """FSDP1 needs a device: on CPU processes the launch is refused in one line (accelerate's own error was a
    traceback), nothing written. Each process says it, in one write with its newline (`command.say`): with stderr
    unbuffered, `print` wrote the line and its newline apart and the two processes' lines could run into one, so
    it runs unbuffered here. Whether the second process says it before the launcher stops it is a race: at least
    one refusal, and every line whole."""
    config = tmp_path / "fsdp1.yaml"
    config.write_text(FSDP.read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    out = tmp_path / "run"
    launch = [*accelerate_launch("gqaify.uptrain", config), *args(tiny, out, "--grad_accum", "1")]
    env = {**CPU_PROCESSES, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(launch, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode != 0
    refusal = (
        "gqaify: error: the launch asks for FSDP version 1, which needs GPUs; set fsdp_version: 2 in its accelerate "
        "config (FSDP2 shards on CPU processes too)"
    )
    said = [line for line in done.stderr.splitlines() if "gqaify:" in line]
    whole = [  # each line whole: the refusal, or the stop of a process the launcher ended before it refused
        line == refusal or (line.startswith("gqaify: stopped by SIGTERM; ") and line.count("gqaify:") == 1)
        for line in said
    ]
    assert refusal in said and all(whole), done.stderr[-3000:]
    assert "internal error" not in done.stderr
    assert not out.exists()


def test_two_processes_killed_on_every_rank_resume_to_the_uninterrupted_weights(tiny, tmp_path):
    settings = (
        "--grad_accum",
        "1",
        "--max_tokens",
        "6400",
        "--save_every",
        "20",
        "--distill_from",
        str(tiny["parent"]),
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = run_fsdp(args(tiny, whole, *settings), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    process = launch_fsdp(args(tiny, cut, *settings), tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not list((cut / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_every_process(process)  # every rank at once
    assert not (cut / "final").exists(), "the run finished before it was killed; give it more steps"
    resumed = run_fsdp(args(tiny, cut, *settings), tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert losses(cut) == pytest.approx(losses(whole), abs=1e-6)
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("stopped", "signum"), [(1, signal.SIGKILL), (0, signal.SIGTERM)])
def test_a_rank_stopped_mid_run_makes_the_other_say_so_in_one_line(tiny, tmp_path, stopped, signum):
    """One process of an FSDP2 launch killed, or stopped by SIGTERM, once a checkpoint exists: the other's next
    collective fails in gloo, and it says in one line that another process of the launch stopped and how to resume,
    with no traceback, exit 1 (a traceback and "internal error" before). The launcher keeps each process's stderr
    apart (--tee, --log_dir) and reports each exit status; it looks at its processes every 5 s here, so that its
    own SIGTERM to the survivor (`command._sigterm_as_interrupt` ignores it) does not race with the survivor's end."""
    settings = ("--grad_accum", "1", "--max_tokens", "64000", "--save_every", "20")  # 1,000 steps
    out, logs = tmp_path / "run", tmp_path / "logs"
    launch = accelerate_launch("gqaify.uptrain", FSDP)
    at = launch.index("-m", 3)  # the launched module's -m: the launcher's own options go before it
    launch[at:at] = ["--tee", "3", "--log_dir", str(logs), "--monitor_interval", "5"]
    launcher = subprocess.Popen(
        [*launch, *args(tiny, out, *settings), "--dist_timeout", "300"],
        env=CPU_PROCESSES,
        cwd=tmp_path,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 600
    while not list((out / "checkpoints").glob("step-*")) and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launcher.poll() is None, "the run ended before a process could be stopped"
    import psutil

    children = psutil.Process(launcher.pid).children(recursive=True)
    ranks = {int(p.environ()["RANK"]): p for p in children if "RANK" in p.environ()}
    ranks[stopped].send_signal(signum)
    _, summary = launcher.communicate(timeout=300)
    survivor = 1 - stopped

    def exit_status(rank: int) -> int:  # the launcher's failure report gives each failed process's status
        found = re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*exitcode\s*: (-?\d+)", summary)
        assert found, summary[-3000:]
        return int(found.group(1))

    def said(rank: int) -> str:
        return next(logs.glob(f"**/attempt_0/{rank}/stderr.log")).read_text()

    err = said(survivor)
    assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("gqaify:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("gqaify: error: another process of the launch stopped; the last checkpoint is step ")
    assert lines[0].endswith(": rerun the same command to resume from it") and " of 1000, in " in lines[0]
    assert exit_status(survivor) == 1
    assert launcher.returncode == 1 and not (out / "final").exists()
    if signum == signal.SIGTERM:  # the stopped process says so itself
        assert exit_status(stopped) == 143
        assert "gqaify: stopped by SIGTERM; the last checkpoint is step " in said(stopped)
