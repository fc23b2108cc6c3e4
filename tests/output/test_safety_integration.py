"""Nothing lost when runs are stopped, killed or race: SIGTERM and SIGKILL mid-conversion and what they leave,
two conversions to one OUT, a claim's rival, a real full disk, stops that say what is left. Each case: the exit
status, one line, and the files that exist (or not) afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gqaify
import test_safety
from gqaify.entry.cli import main
from gqaify.testing import build_model, save, save_with_tokenizer
from helpers import ASSETS, HOLD_MID_WRITE, MODELS, needs_assets, one_line, run_cli, tree_hashes
from test_safety import leftovers, run_eval

# test_safety.py's fixtures, shared: pytest finds a fixture by its name in this module
source = test_safety.source
text = test_safety.text


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    """An MHA llama that takes a second or two to convert into small shards: time to send it a signal."""
    model = build_model(
        "llama",
        num_kv_heads=8,
        num_attention_heads=8,
        head_dim=32,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=16,
        vocab_size=320,
    )
    directory = tmp_path_factory.mktemp("big") / "model"
    save_with_tokenizer(model, directory)
    for f in directory.glob("model*.safetensors*"):  # re-save in 2 MB shards
        f.unlink()
    return save(model, directory, max_shard_size="2MB")


# -- signals and what killed runs leave ------------------------------------------------------------------------


def _start_convert(src: Path, out: Path, *extra: str, hold: bool = False) -> subprocess.Popen:
    """`gqaify convert SRC OUT --kv-heads 1 ...` in a fresh process; with `hold`, one that waits once the first
    tensor is in a shard (`HOLD_MID_WRITE`) until it is stopped."""
    argv = [
        sys.executable,
        *(["-c", HOLD_MID_WRITE] if hold else ["-m", "gqaify"]),
        "convert",
        str(src),
        str(out),
        "--kv-heads",
        "1",
        "--max-shard-size",
        "200KB",
        "-q",
        *extra,
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(pattern: str, folder: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list(folder.glob(pattern)):
        assert process.poll() is None, f"the process ended before {pattern} appeared: {process.communicate()}"
        assert time.monotonic() < deadline, f"{pattern} never appeared"
        time.sleep(0.005)


def test_sigterm_mid_conversion_cleans_up_and_exits_143(big_source, tmp_path):
    out = tmp_path / "out"
    process = _start_convert(big_source, out, hold=True)
    _wait_for(".out.gqaify-*/model-*.safetensors", tmp_path, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    assert "stopped by SIGTERM; nothing was written" in one_line(err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("signum", "status", "said"), [(signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_stop_that_a_library_turns_into_its_own_error_is_still_a_stop(capsys, monkeypatch, signum, status, said):
    """torch, inside safetensors' loader, once turned SIGTERM's exception into a ValueError: exit 1 and "a bug in
    gqaify" for a run the user stopped. The recorded signal makes it a stop; an error without one stays a bug."""
    import os

    import gqaify.conversion.entry as entry

    def a_library_call(argv, prog):
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises here
        except KeyboardInterrupt as exc:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from exc

    monkeypatch.setattr(entry, "command_line", a_library_call)  # what `gqaify convert` runs (gqaify.entry.stages)
    # as in a terminal: a job started in the background (CI's, say) begins with SIGINT ignored, and gqaify keeps that
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["convert", "src", "out", "--kv-heads", "1"]) == status
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert f"gqaify: {said}; nothing was written" in err and "internal error" not in err

    def a_bug(argv, prog):
        raise ValueError("a bug")

    monkeypatch.setattr(entry, "command_line", a_bug)
    assert main(["convert", "src", "out", "--kv-heads", "1"]) == 1  # the earlier command's signal is forgotten
    assert "internal error" in capsys.readouterr().err


def test_a_run_after_sigkill_removes_the_killed_runs_staging_and_says_so(big_source, tmp_path):
    out = tmp_path / "out"
    process = _start_convert(big_source, out, hold=True)
    _wait_for(".out.gqaify-*/model-*.safetensors", tmp_path, process)
    process.kill()
    process.wait()
    left = leftovers(tmp_path)
    assert len(left) == 1 and not out.exists()
    done = subprocess.run(
        [sys.executable, "-m", "gqaify", "convert", str(big_source), str(out), "--kv-heads", "1", "-q"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"removed {tmp_path / left[0]}" in done.stderr and "left by a run that was killed" in done.stderr
    assert leftovers(tmp_path) == [] and (out / "gqaify.json").is_file()


def test_an_old_output_set_aside_by_a_killed_replacement_is_put_back(source, tmp_path):
    """Killed between moving the old OUT aside and renaming the new one in: the next run restores the old one."""
    from gqaify.output.leftovers import remove_leftovers

    gqaify.convert(source, tmp_path / "out", kv_heads=2, progress=False)
    before = tree_hashes(tmp_path / "out")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has ended
    aside = tmp_path / f".out.gqaify-old-{_host()}-{pid}-12345-abc123"
    aside.mkdir()
    (tmp_path / "out").rename(aside / "out")
    messages = remove_leftovers(tmp_path / "out")
    assert tree_hashes(tmp_path / "out") == before and not aside.exists()
    assert "put back" in messages[0]


def _host() -> str:
    from gqaify.output.leftovers import host_hash

    return host_hash()


def test_two_conversions_to_one_out_without_force(big_source, tmp_path):
    """Started together: one writes OUT, the other is told OUT exists (exit 2) and touches nothing."""
    out = tmp_path / "out"
    first, second = _start_convert(big_source, out), _start_convert(big_source, out)
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in (first, second)]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "already exists" in one_line(refused)
    assert leftovers(tmp_path) == [] and (out / "gqaify.json").is_file()


def test_a_claim_refuses_a_rival_until_its_holder_ends_however_it_ends(tmp_path):
    """`claims.claimed`: one holder of an OUT at a time (in this process too); the kernel drops a SIGKILLed
    holder's lock, so the claim file it leaves is taken over, and the holder's end removes the file."""
    from gqaify.errors import UserError
    from gqaify.output.claims import claimed

    out = tmp_path / "out"
    holder = f"""
import pathlib, time
from gqaify.output.claims import claimed
with claimed(pathlib.Path({str(out)!r}), "gqaify generate"):
    print("held", flush=True)
    time.sleep(300)
"""
    process = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "held\n"
        refused = rf"is being written by another gqaify generate \(pid {process.pid}\)"
        with pytest.raises(UserError, match=refused), claimed(out, "gqaify convert"):
            pass
    finally:
        process.kill()
        process.wait()
    assert (tmp_path / ".out.gqaify.claim").is_file() and not out.exists()  # what SIGKILL left
    out.mkdir()
    (tmp_path / "link").symlink_to(out)
    refused = rf"another gqaify convert \(pid {os.getpid()}\); wait for it"
    with claimed(out, "gqaify convert"), pytest.raises(UserError, match=refused), claimed(tmp_path / "link", "x"):
        pass  # another name of the same folder is the same claim
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out"]


# -- a full disk ------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A 5 MB tmpfs (needs root; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_real_full_disk(capsys, big_source, tiny_disk, monkeypatch):
    """On a real 5 MB filesystem: a 30 MB conversion is refused up front; a small one that something else
    squeezes mid-write gets the kernel's ENOSPC, reported on one line, and leaves nothing."""
    code, err = run_cli(capsys, "convert", big_source, tiny_disk / "big", "--kv-heads", "1")
    assert code == 2 and "not enough disk space" in one_line(err) and "tmpfs" in err
    assert list(tiny_disk.iterdir()) == []

    small = save(build_model("llama", num_kv_heads=4), tiny_disk.parent / "small")
    from gqaify.conversion import core

    stream = core.stream_tensors

    def stream_on_a_filling_disk(*args, **kwargs):
        free = shutil.disk_usage(tiny_disk).free
        (tiny_disk / "someone-else").write_bytes(b"x" * (free - 4096))
        stream(*args, **kwargs)

    monkeypatch.setattr(core, "stream_tensors", stream_on_a_filling_disk)
    code, err = run_cli(capsys, "convert", small, tiny_disk / "out", "--kv-heads", "2")
    assert code == 1 and "no space left on tmpfs" in one_line(err)
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["someone-else"]


# -- eval's --out: the rules of convert's OUT ------------------------------------------------------------------


def test_eval_on_a_full_disk(capsys, source, text, tiny_disk, monkeypatch):
    """It used to end in a 48-line ENOSPC traceback from plotting, and leave an empty folder. A disk too full for
    the report is refused before the evaluation; one that fills up meanwhile gets convert's one line."""
    filler = tiny_disk / "someone-else"
    filler.write_bytes(b"x" * (shutil.disk_usage(tiny_disk).free - 4096))
    code, err = run_eval(capsys, source, text, tiny_disk / "report")
    assert code == 2 and "not enough disk space for" in one_line(err) and "tmpfs" in err
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["someone-else"]

    filler.unlink()
    from gqaify.eval import core

    perplexity = core.perplexity

    def perplexity_on_a_filling_disk(*args, **kwargs):
        filler.write_bytes(b"x" * (shutil.disk_usage(tiny_disk).free - 16384))  # room for report.json, not a plot
        return perplexity(*args, **kwargs)

    monkeypatch.setattr(core, "perplexity", perplexity_on_a_filling_disk)
    code, err = run_eval(capsys, source, text, tiny_disk / "report")
    line = one_line(err)
    assert code == 1 and line.startswith("gqaify: error: no space left on tmpfs") and "Traceback" not in err
    assert "nothing was left behind" in line and sorted(p.name for p in tiny_disk.iterdir()) == ["someone-else"]


# -- stops that say what is left --------------------------------------------------------------------------------


def _cli_with(patch: str, *argv) -> subprocess.Popen:
    """`gqaify ARGV` in a process of its own, after the Python lines `patch` ran (to observe or slow a step)."""
    script = f"import sys\n{patch}\nfrom gqaify.entry.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@needs_assets
def test_sigterm_while_generating_stops_the_generation(tmp_path):
    """It took 18 s: the 50,000-token prompt it was given (now refused, as past the model's positions) is one
    forward pass, and Python acts on a signal only between torch's operations. A prompt that fits is stopped while
    it generates: here the generation never ends of itself, so the run ends only if the signal stops it."""
    said = """
import gqaify.eval.core as core
continuations = core.continuations
def said(*args):
    print("generating", flush=True)
    while True:  # generating for as long as a large model would: the signal must find it at work
        continuations(*args)
core.continuations = said
"""
    process = _cli_with(
        said,
        "eval",
        MODELS / "stories260K",
        "--data",
        ASSETS / "text" / "tinyshakespeare.txt",
        "--out",
        tmp_path / "r",
        "--seq-len",
        "256",
        "--max-tokens",
        "512",
        "--no-speed",
        "-q",
        "--generate",
        "Once upon a time " * 20,
        "--generate-tokens",
        "400",
    )
    assert process.stdout.readline() == "generating\n", process.communicate()
    time.sleep(1)
    process.send_signal(signal.SIGTERM)
    said = next(line for line in process.stderr if line.startswith("gqaify"))
    assert said == "gqaify: stopped by SIGTERM; nothing was written\n", said
    process.communicate(timeout=60)
    assert process.returncode == 143 and list(tmp_path.iterdir()) == []


def test_a_stopped_demo_says_what_it_completed(source, tmp_path):
    """Stopped during its lsq conversion, it said "nothing was written" beside the complete mean conversion."""
    slow_lsq = """
import time
import gqaify.conversion.core as core
convert = core.convert
def slow_lsq(src, out, **settings):
    if settings.get("method") == "lsq":  # stopped here: a long step, running Python as a conversion does (one
        for _ in range(1200):            # 120 s sleep would not wake for a signal delivered to another thread)
            time.sleep(0.1)
    return convert(src, out, **settings)
core.convert = slow_lsq
"""
    work = tmp_path / "demo"
    process = _cli_with(slow_lsq, "demo", "--model", source, "--workdir", work)
    _wait_for("model-mqa-mean/gqaify.json", work, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    mean = work / "model-mqa-mean"
    assert process.returncode == 143, err
    said = err.strip().splitlines()[-1]
    assert said == (
        f"gqaify: stopped by SIGTERM; this run of the demo completed, and kept, {mean}; the step it was "
        "on left nothing; gqaify demo keeps them and runs the rest"
    )
    assert sorted(p.name for p in work.iterdir()) == ["model-mqa-mean", "texts"] and (mean / "gqaify.json").is_file()
