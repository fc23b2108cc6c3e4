"""What several test modules share: running the command line (in this process or in a fresh one), reading its
one-line refusals, a recording stand-in for the hub's API, the settings of a short uptraining run, and several
processes launched on this CPU (and killed all at once)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

from gqaify.entry.cli import main

NOT_CACHED = "gqaify-tests/not-cached:none"  # a hub dataset no machine has in its cache
QUICK = 10.0  # seconds for a refusal that needs the hub; huggingface_hub's five retries alone wait 23 s


def run_cli(capsys, *argv) -> tuple[int, str]:
    """`gqaify ARGV` in this process: its exit status and what it wrote to stderr."""
    capsys.readouterr()  # drop what the test itself printed
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def run_uptrain(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`python -m gqaify uptrain ARGV` in a fresh process (as accelerate launches it)."""
    return subprocess.run([sys.executable, "-m", "gqaify", "uptrain", *argv], capture_output=True, text=True, **kwargs)


# Run before a command in a fresh process (`python -c HOLD_MID_WRITE ARGV...` is `gqaify ARGV`): once the first
# tensor is in a shard, the process waits there until it is stopped, so that a test that stops a conversion "mid-
# write" stops it there on every machine; polling for the shard from outside, it could finish before the test looked.
HOLD_MID_WRITE = """
import sys, time
from gqaify.conversion.checkpoint import ShardWriter
done = ShardWriter._done
def done_then_hold(self, name):
    done(self, name)
    while True:
        time.sleep(0.01)
ShardWriter._done = done_then_hold
if sys.argv[1:]:
    from gqaify.entry.cli import main
    sys.exit(main(sys.argv[1:]))
"""


# accelerate's --cpu starts one process unless MPI is set up; ACCELERATE_USE_CPU with torchrun gives gloo
CPU_PROCESSES = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}


def accelerate_launch(module: str, config_file: Path | None = None, processes: int = 2) -> list[str]:
    """`accelerate launch` of `processes` processes running `python -m MODULE` (run with env=CPU_PROCESSES), in
    full precision: with the accelerate config `config_file`, or as plain data parallelism."""
    plain = ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"]
    how = ["--config_file", str(config_file)] if config_file else plain
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *how,
        "--num_processes",
        str(processes),
        "--mixed_precision",
        "no",
        "-m",
        module,
    ]


def kill_every_process(launcher: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process it started, at once (torch's agent starts them in sessions of their
    own, so a process group would miss them), and wait until they are gone."""
    import psutil

    launched = psutil.Process(launcher.pid)
    everyone = [launched, *launched.children(recursive=True)]
    for p in everyone:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(everyone, timeout=60)


def one_line(err: str) -> str:
    """The one line of a refusal (stderr holds it alone, starting with "gqaify")."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gqaify"), err
    return lines[0]


def one_line_refusal(capsys, *argv, within: float = QUICK) -> str:
    """Run the CLI; it must exit 2 with one line on stderr, within `within` seconds."""
    start = time.monotonic()
    code, err = run_cli(capsys, *argv)
    elapsed = time.monotonic() - start
    assert code == 2 and err.count("\n") == 1 and err.startswith("gqaify: error: "), err
    assert elapsed < within, f"{elapsed:.1f} s: {err}"
    return err


class FakeHub:
    """huggingface_hub.HfApi, recording the calls and what the folder held when it was uploaded."""

    calls: list = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs.get("exist_ok")))

    def upload_folder(self, repo_id, folder_path, **kwargs):
        files = sorted(p.name for p in Path(folder_path).iterdir())
        self.calls.append(("upload_folder", repo_id, str(folder_path), files, kwargs["commit_message"]))
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")


def uptrain_args(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """Command-line settings for a short run on the `tiny` models: 16-token blocks, 2 x 2 per step."""
    return [
        "--model",
        str(tiny["converted"]),
        "--output_dir",
        str(out),
        "--data",
        str(tiny["train"]),
        "--seq_len",
        "16",
        "--micro_batch_size",
        "2",
        "--grad_accum",
        "2",
        "--max_tokens",
        "1280",
        "--lr",
        "1e-3",
        "--save_every",
        "0",
        "--no_progress",
        *extra,
    ]
