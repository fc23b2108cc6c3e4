"""What several test modules share: running the command line (in this process or in a fresh one), reading its
one-line refusals, a recording stand-in for the hub's API, the settings of a short uptraining run, several
processes launched on this CPU (and killed all at once), and the KL to the parent written from its definitions."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gqaify.entry.cli import main
from gqaify.testing import duplicate_kv_heads

NOT_CACHED = "gqaify-tests/not-cached:none"  # a hub dataset no machine has in its cache


def run_cli(capsys, *argv) -> tuple[int, str]:
    """`gqaify ARGV` in this process: its exit status and what it wrote to stderr."""
    capsys.readouterr()  # drop what the test itself printed
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def calibrated_on(text) -> list[str]:
    """convert's options for a smaller MLA cache fitted on the tiny models' calibration `text`: windows of 64, the
    first 2,048 tokens (what the MLA tests' assertions hold at)."""
    return ["--calib-data", str(text), "--calib-seq-len", "64", "--calib-tokens", "2048"]


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


def launch_port() -> int:
    """The rendezvous port of this test process's launches: one per pytest-xdist worker (gw0, gw1, ...), so that two
    workers' launches never meet on torch's default 29500; a worker runs its launches one after another."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return 29500 + 10 * int(worker.removeprefix("gw"))


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
        "--main_process_port",
        str(launch_port()),
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


def one_line_error(done) -> str:
    """The one line of a refusal by a process run to its end (a `subprocess.CompletedProcess`): exit 2, one line."""
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def one_line_refusal(capsys, *argv) -> str:
    """Run the CLI; it must exit 2 with one line on stderr (no retry warnings, no traceback before it)."""
    code, err = run_cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("gqaify: error: "), err
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


# -- the paths, models and hashes the tests share ----------------------------------------------------------

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO.parent / "shared" / "assets"
MODELS = ASSETS / "models"

needs_assets = pytest.mark.skipif(
    not MODELS.is_dir(), reason=f"real test models not found at {MODELS} (../shared/assets beside the checkout)"
)
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is absent: pip install 'gqaify[serving]'"
)


def llama_cpp_kv_cache(path: Path, cells: int = 32768) -> tuple[float, float | None]:
    """llama.cpp's KV cache for `cells` tokens of the GGUF `path`, as the engine reports allocating it, in MiB: its
    size in all, and the values' part of it (None where the report does not split it). Read from a child process's
    log, which llama.cpp writes itself."""
    code = (
        "import sys; from llama_cpp import Llama; "
        "Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=1, verbose=True).close()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), str(cells)], capture_output=True, text=True, check=True
    )
    found = re.search(
        r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells(?:.*V \(\w+\): +([\d.]+) MiB)?", done.stderr
    )
    assert found is not None and int(found[2]) == cells, done.stderr[-2000:]
    return float(found[1]), None if found[3] is None else float(found[3])


def load(directory: Path) -> torch.nn.Module:
    """The model in `directory`; a shipped modeling file (gpt2, gpt_neox, opt) is trusted."""
    return AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32, trust_remote_code=True
    ).eval()


def sample_ids(vocab_size: int, length: int = 24, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


def reference_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) per token times T², from the definition: sum_v p (log p - log q), in float64."""
    p = torch.softmax(teacher.double() / temperature, -1)
    q = torch.softmax(student.double() / temperature, -1)
    return (p * (p.log() - q.log())).sum(-1).mean() * temperature**2


def reference_coarsened_kl(student: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL between the parent and student distributions over k + 1 outcomes (each stored token, and all others
    together), built outcome by outcome in float64 from the definition."""
    q = torch.softmax(student.double(), -1)
    q_kept = q.gather(-1, ids)
    p_kept = logprobs.double().exp()
    p = torch.cat([p_kept, (1 - p_kept.sum(-1, keepdim=True)).clamp_min(0)], -1)
    q = torch.cat([q_kept, 1 - q_kept.sum(-1, keepdim=True)], -1)
    return torch.special.xlogy(p, p).sub(torch.special.xlogy(p, q)).sum(-1).mean()


def rotated_twin(model, pairs: str, seed: int = 0) -> torch.nn.Module:
    """The MHA twin of a GQA model whose every query/key head pair is turned by its own random rotation.

    Head h's query and key rows are both multiplied by R_h, which turns each RoPE pair of dimensions by an
    angle (RoPE turns that pair too, so they commute) and the dimensions RoPE leaves alone by any orthogonal
    matrix: every attention score is unchanged. `pairs` says which dimensions RoPE pairs: "half" (j, j + r/2)
    or "interleaved" (2j, 2j + 1). With the wrong one the twin computes something else, which its test sees.
    """
    twin = duplicate_kv_heads(model)
    config = twin.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    rotary = int(head_dim * (rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", 1.0)))
    half = rotary // 2
    if pairs == "half":
        first, second = range(half), range(half, rotary)
    else:
        first, second = range(0, rotary, 2), range(1, rotary, 2)
    generator = torch.Generator().manual_seed(seed)

    def rotation() -> torch.Tensor:
        r = torch.zeros(head_dim, head_dim)
        angle = torch.rand(half, generator=generator) * 6.28
        for j, (a, b) in enumerate(zip(first, second, strict=True)):
            r[a, a], r[a, b], r[b, a], r[b, b] = angle[j].cos(), -angle[j].sin(), angle[j].sin(), angle[j].cos()
        if rotary < head_dim:
            rest = torch.linalg.qr(torch.randn(head_dim - rotary, head_dim - rotary, generator=generator))[0]
            r[rotary:, rotary:] = rest
        return r

    state = twin.state_dict()
    layers = sorted({name.rsplit(".", 2)[0] for name in state if re.search(r"\.(k_proj|qkv_proj)\.weight$", name)})
    for attention in layers:
        rotations = torch.stack([rotation() for _ in range(heads)])  # (H, d, d)

        def turn(t, rotations=rotations):  # (H*d, ...) rows of every head turned by its rotation
            return torch.einsum("hij,hj...->hi...", rotations, t.unflatten(0, (heads, head_dim))).flatten(0, 1)

        for suffix in ("weight", "bias"):
            fused = f"{attention}.qkv_proj.{suffix}"
            if fused in state:  # [Q | K | V]: the twin has as many K heads as Q heads
                q, k, v = state[fused].split([heads * head_dim, heads * head_dim, heads * head_dim])
                state[fused] = torch.cat([turn(q), turn(k), v])
            for name in (f"{attention}.q_proj.{suffix}", f"{attention}.k_proj.{suffix}"):
                if name in state:
                    state[name] = turn(state[name])
    twin.load_state_dict(state)
    return twin.eval()


def tree_hashes(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under `directory` (to show a source was not touched)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def losses(out: Path) -> list[float]:
    """The training losses an uptraining run in `out` logged, step by step."""
    from gqaify.uptrain.metrics import read_metrics

    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def llama_cpp_greedy(path: Path, prompt_ids: list[int], tokens: int) -> list[int]:
    """Up to `tokens` new tokens by top-1 in llama.cpp, the end-of-text token included where it comes."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False)
    out = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
        out.append(int(token))
        if len(out) == tokens or token == llm.token_eos():
            break
    llm.close()
    return out
