"""Bad input: exit status 2, one line naming the problem and the fix, nothing written, the source untouched."""

import json
import shutil
import signal
import sys

import pytest
from transformers import GPTJConfig, GPTJForCausalLM

from gqaify.errors import Interrupted, ResourceError, UserError
from gqaify.model.archs import ARCHITECTURES
from gqaify.testing import build_model, save
from helpers import run_cli, tree_hashes


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A GQA-4 llama (8 query heads) in several shards."""
    directory = tmp_path_factory.mktemp("src") / "model"
    return save(build_model("llama", num_kv_heads=4, num_attention_heads=8, head_dim=8), directory, "30KB")


def assert_refused(capsys, src, out, *args, expect):
    before = tree_hashes(src) if src.is_dir() else None
    code, err = run_cli(capsys, "convert", src, out, *args)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("gqaify"), err
    assert expect in err, err
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.gqaify-*"))
    if before is not None:
        assert tree_hashes(src) == before


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--kv-heads", "3"], "--kv-heads 3 does not divide the 4 K/V heads of LlamaForCausalLM; choose one of 1, 2,"),
        (["--kv-heads", "8"], "--kv-heads 8 exceeds the 4 K/V heads"),
        (["--kv-heads", "0"], "--kv-heads 0 must be a whole number of at least 1"),
        (["--kv-heads", "-2"], "--kv-heads -2 must be a whole number of at least 1"),
        (["--kv-heads", "two"], "argument --kv-heads/--kv_heads: invalid int value: 'two'"),
        (["--kv-heads", "2", "--method", "median"], "argument --method: invalid choice: 'median'"),
        (["--kv-heads", "2", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (
            ["--kv-heads", "2", "--attention", "gqa2"],
            "argument --attention: invalid choice: 'gqa2' (choose from 'gqa',",
        ),
        (["--kv-heads", "2", "--max-shard-size", "lots"], "--max-shard-size 'lots' is not a size"),
        (["--kv-heads", "2", "--revision", "main"], "--revision applies to hub ids"),
    ],
)
def test_bad_options(capsys, source, tmp_path, args, expect):
    assert_refused(capsys, source, tmp_path / "out", *args, expect=expect)


def test_several_problems_reported_together(capsys, source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code, err = run_cli(capsys, "convert", source, out, "--kv-heads", "0", "--max-shard-size", "x")
    assert code == 2 and err.count("\n") == 1
    assert "--kv-heads 0" in err and "--max-shard-size" in err and "already exists; pass --force" in err
    assert not any(out.iterdir())


def test_unsupported_architecture_lists_supported_ones(capsys, tmp_path):
    config = GPTJConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, rotary_dim=8)
    src = save(GPTJForCausalLM(config), tmp_path / "gptj")
    assert_refused(
        capsys,
        src,
        tmp_path / "out",
        "--kv-heads",
        "1",
        expect=f"unsupported architecture 'gptj' (GPTJForCausalLM); gqaify converts {len(ARCHITECTURES)} model types, "
        "listed by `python -m gqaify.conversion.coverage`",
    )


def test_missing_shard(capsys, source, tmp_path):
    src = tmp_path / "copy"
    shutil.copytree(source, src)
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    assert_refused(capsys, src, tmp_path / "out", "--kv-heads", "2", expect=f"shard {victim.name} named in")


def test_corrupt_shard(capsys, source, tmp_path):
    src = tmp_path / "copy"
    shutil.copytree(source, src)
    victim = sorted(src.glob("model-*.safetensors"))[2]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated download
    assert_refused(capsys, src, tmp_path / "out", "--kv-heads", "2", expect=f"corrupt shard {victim}")


def test_weights_that_disagree_with_config(capsys, source, tmp_path):
    src = tmp_path / "copy"
    shutil.copytree(source, src)
    config = (src / "config.json").read_text().replace('"num_key_value_heads": 4', '"num_key_value_heads": 2')
    (src / "config.json").write_text(config)
    expect = "imply 'model.layers.0.self_attn.k_proj.weight' of shape [16, 64], but its shape is [32, 64]"
    assert_refused(capsys, src, tmp_path / "out", "--kv-heads", "1", expect=expect)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "bitsandbytes"])
def test_quantized_sources_are_refused(capsys, source, tmp_path, method):
    """Quantized weights are not matrices to pool: refused before anything is read or written."""
    src = tmp_path / "copy"
    shutil.copytree(source, src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(
        capsys,
        src,
        tmp_path / "out",
        "--kv-heads",
        "2",
        expect=f"SRC is quantized (quantization_config: {method}); gqaify pools full-precision weights: "
        "convert the unquantized checkpoint, or dequantize it first",
    )


def test_source_not_found(capsys, tmp_path):
    assert_refused(capsys, tmp_path / "nowhere", tmp_path / "out", "--kv-heads", "1", expect="SRC not found")
    assert_refused(capsys, tmp_path / "m.gguf", tmp_path / "out", "--kv-heads", "1", expect="SRC not found")


def test_folder_without_config(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(capsys, tmp_path / "empty", tmp_path / "out", "--kv-heads", "1", expect="has no config.json")


def test_unwritable_output(capsys, source, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    code, err = run_cli(capsys, "convert", source, tmp_path / "file" / "out", "--kv-heads", "2")
    assert code == 2 and err.count("\n") == 1 and "cannot write" in err
    assert (tmp_path / "file").read_text() == "not a folder"


def test_existing_output_is_refused_without_force(capsys, source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_cli(capsys, "convert", source, out, "--kv-heads", "2")
    assert code == 2 and "already exists; pass --force" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_output_inside_source_is_refused(capsys, source, tmp_path):
    src = tmp_path / "copy"
    shutil.copytree(source, src)
    assert_refused(capsys, src, src / "converted", "--kv-heads", "2", expect="overlaps the source folder")


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_output_that_is_the_source_is_named_as_the_source(capsys, source, tmp_path, force):
    src = tmp_path / "copy"
    shutil.copytree(source, src)
    before = tree_hashes(src)
    code, err = run_cli(capsys, "convert", src, src, "--kv-heads", "2", *force)
    assert code == 2 and err.count("\n") == 1 and "is the source folder itself" in err and "--force" not in err
    assert tree_hashes(src) == before


def test_internal_error_exits_1(capsys, source, tmp_path, monkeypatch):
    from gqaify.conversion import methods

    def broken(heads, num_groups, ctx):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(methods.METHODS, "mean", methods.Method(broken, methods.METHOD_INFO["mean"]))
    code, err = run_cli(capsys, "convert", source, tmp_path / "out", "--kv-heads", "2")
    assert code == 1 and "ZeroDivisionError" in err and "internal error" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.gqaify-*"))


class _Writes:
    """A stderr that keeps each write apart, as an unbuffered stream (PYTHONUNBUFFERED) sends each to the fd."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (lambda: UserError("bad"), "gqaify: error: bad\n"),
        (lambda: ResourceError("full"), "gqaify: error: full\n"),
        (lambda: Interrupted("kept x", signal.SIGTERM), "gqaify: stopped by SIGTERM; kept x\n"),
    ],
    ids=["bad input", "out of a resource", "stopped"],
)
def test_the_one_line_is_one_write_with_its_newline(monkeypatch, error, line):
    """Every process of an FSDP launch refuses FSDP1 on CPUs; with stderr unbuffered, `print` wrote the line and
    its newline apart, and the two processes' lines ran into one."""
    from gqaify.command import run_command

    def command():
        raise error()

    stderr = _Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    run_command(command)
    assert stderr.writes == [line]


# gloo's error in a process whose peer was killed, word for word (torch 2.13 on CPU processes)
GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:48313: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
    "Check the logs of the remote worker before reporting an error. GLHF!"
)


def test_a_peer_is_lost_where_gloo_says_its_connection_ended():
    from gqaify.errors import peer_lost

    closed = GLOO_PEER_GONE.replace(
        "Read error [127.0.0.1]:48313: Connection reset by peer", "Connection closed by peer"
    )
    assert peer_lost(RuntimeError(GLOO_PEER_GONE)) and peer_lost(RuntimeError(closed))
    try:
        try:
            raise RuntimeError(GLOO_PEER_GONE)
        except RuntimeError:
            raise Interrupted(signum=signal.SIGTERM)  # noqa: B904 (as the launcher's SIGTERM raises it while unwinding)
    except Interrupted as stop:
        assert peer_lost(stop)
    assert not peer_lost(ResourceError("the line a stage says"))
    assert not peer_lost(RuntimeError(GLOO_PEER_GONE.replace("Connection reset by peer", "Read timeout")))
    assert not peer_lost(RuntimeError("Connection reset by peer"))  # not gloo's: a download, a hub
    assert not peer_lost(None)


@pytest.mark.parametrize("said_by_the_stage", [False, True])
def test_a_caller_in_the_process_gets_its_sigterm_handler_back_after_a_lost_peer(monkeypatch, said_by_the_stage):
    """SIGTERM stayed ignored after run_command returned once a lost peer was seen: a program calling
    gqaify.uptrain.__main__.main (or gqaify.entry.cli.main) with its argv could no longer be stopped by SIGTERM."""
    import gqaify.uptrain.__main__ as entry

    def command_line(argv, prog):
        try:
            raise RuntimeError(GLOO_PEER_GONE)
        except RuntimeError as exc:
            if said_by_the_stage:
                raise ResourceError("another process of the launch stopped; kept x") from exc
            raise

    def mine(signum, frame):
        raise AssertionError("not called")

    monkeypatch.setattr(entry, "command_line", command_line)
    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert entry.main(["--recipe", "r.yaml"]) == 1
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_corrupt_gguf(capsys, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    before = bad.read_bytes()
    code, err = run_cli(capsys, "convert", bad, tmp_path / "out", "--kv-heads", "1")
    assert code == 2 and err.count("\n") == 1 and "is not a readable GGUF file (GGUF version 0" in err, err
    assert not (tmp_path / "out").exists() and bad.read_bytes() == before
