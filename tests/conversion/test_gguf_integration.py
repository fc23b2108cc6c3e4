"""GGUF output as llama.cpp reads it: the converted tensors under llama.cpp's names, every GGUF architecture of
the table one llama.cpp knows, and llama.cpp serving the file (greedy tokens equal to transformers', its own KV cache
H/G smaller, its converter writing the same file) where llama-cpp-python is installed; a GGUF conversion in a
process of its own, refused or stopped late."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import test_gguf
from gqaify.entry.cli import main
from helpers import MODELS, llama_cpp_greedy, llama_cpp_kv_cache, needs_assets, needs_llama_cpp, one_line, run_cli
from test_gguf import STORIES_MHA

# test_gguf.py's fixture, shared: pytest finds a fixture by its name in this module
stories_gguf = test_gguf.stories_gguf


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaved rotary pairs back to Hugging Face's halves (written independently of gqaify's)."""
    d = weight.shape[0] // heads
    out = np.empty_like(weight)
    for h in range(heads):
        rows = weight[h * d : (h + 1) * d]
        out[h * d : h * d + d // 2] = rows[0::2]
        out[h * d + d // 2 : (h + 1) * d] = rows[1::2]
    return out


@needs_assets
@pytest.mark.parametrize("name", ["gqa2", "mqa"])
def test_gguf_holds_the_converted_tensors_under_llama_cpp_names(stories_gguf, name):
    import gguf

    reader = gguf.GGUFReader(stories_gguf[f"{name}.gguf"])
    config = json.loads((stories_gguf[name] / "config.json").read_text())
    kv = config["num_key_value_heads"]
    assert reader.fields["llama.attention.head_count_kv"].contents() == kv
    assert reader.fields["llama.attention.head_count"].contents() == 8
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    weights = {k: v.numpy() for k, v in load_file(stories_gguf[name] / "model.safetensors").items()}
    assert len(tensors) == len(weights)
    for layer in range(config["num_hidden_layers"]):
        hf, blk = f"model.layers.{layer}.self_attn.", f"blk.{layer}.attn_"
        np.testing.assert_array_equal(unpermute(tensors[blk + "q.weight"], 8), weights[hf + "q_proj.weight"])
        np.testing.assert_array_equal(unpermute(tensors[blk + "k.weight"], kv), weights[hf + "k_proj.weight"])
        np.testing.assert_array_equal(tensors[blk + "v.weight"], weights[hf + "v_proj.weight"])
        assert tensors[blk + "k.weight"].shape == (kv * 8, 64)
    np.testing.assert_array_equal(tensors["token_embd.weight"], weights["model.embed_tokens.weight"])


def test_a_vocabulary_llama_cpp_would_misread_is_refused_and_nothing_written(tmp_path):
    if not (MODELS / "ref-mha-6L").is_dir():
        pytest.skip("needs ../shared/assets/models/ref-mha-6L")
    out = tmp_path / "ref.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "gqaify", "convert", str(MODELS / "ref-mha-6L"), str(out), "--kv-heads", "2", "-q"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "convert_hf_to_gguf.py" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_every_gguf_architecture_in_the_table_is_one_llama_cpp_knows():
    """Each `ArchSpec.gguf` names a member of gguf's MODEL_ARCH whose tensor names cover the attention projections."""
    import gguf

    from gqaify.model.archs import ARCHITECTURES

    written = {t: spec.gguf for t, spec in ARCHITECTURES.items() if spec.gguf is not None}
    assert written.keys() == {"llama"} and written["llama"].permute_qk
    for model_type, arch in written.items():
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.name], 2)
        spec = ARCHITECTURES[model_type]
        for part in (spec.q_proj, spec.k_proj, spec.v_proj, spec.o_proj):
            name = f"{spec.attention.format(layer=1)}.{part}.weight"
            assert names.get_name(name, try_suffixes=(".weight",)) is not None, name


# -- in llama.cpp ---------------------------------------------------------------------------------------------


def transformers_greedy(folder: Path, prompt_ids: list[int], tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = model.generate(torch.tensor([prompt_ids]), max_new_tokens=tokens, do_sample=False)
    return ids[0, len(prompt_ids) :].tolist()


PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]


@needs_assets
@needs_llama_cpp
@pytest.mark.parametrize("name", ["gqa2", "mqa"])
def test_llama_cpp_decodes_the_gguf_as_transformers_decodes_the_safetensors(stories_gguf, name):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stories_gguf[name])
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        expected = transformers_greedy(stories_gguf[name], ids, 32)
        assert llama_cpp_greedy(stories_gguf[f"{name}.gguf"], ids, 32) == expected


@needs_assets
@needs_llama_cpp
def test_llama_cpp_kv_cache_is_h_over_g_smaller(stories_gguf, tmp_path):
    mha = tmp_path / "mha.gguf"  # the parent itself, 8 K/V heads
    assert main(["convert", str(STORIES_MHA), str(mha), "--kv-heads", "8", "--gguf-type", "f32", "-q"]) == 0
    sizes = {
        name: llama_cpp_kv_cache(path)[0]
        for name, path in (("mha", mha), ("gqa2", stories_gguf["gqa2.gguf"]), ("mqa", stories_gguf["mqa.gguf"]))
    }
    assert sizes["mha"] == 4 * sizes["gqa2"] == 8 * sizes["mqa"] > 0


@pytest.mark.slow
@needs_llama_cpp
@pytest.mark.usefixtures("smollm2_read_once")
def test_smollm2_mqa_gguf_decodes_in_llama_cpp_as_in_transformers(smollm2_gguf, tmp_path):
    """And the folder made from the GGUF (what uptrain's final/ of it is) written as GGUF again, SmolLM2's byte-level
    BPE vocabulary taken from the GGUF its record names: it was refused, naming llama.cpp's own converter."""
    from transformers import AutoTokenizer

    folder, gguf_out, again = tmp_path / "mqa", tmp_path / "mqa.gguf", tmp_path / "again.gguf"
    assert main(["convert", str(smollm2_gguf), str(folder), "--kv-heads", "1", "--dtype", "float32", "-q"]) == 0
    assert main(["convert", str(smollm2_gguf), str(gguf_out), "--kv-heads", "1", "--gguf-type", "f32", "-q"]) == 0
    assert main(["convert", str(folder), str(again), "--kv-heads", "1", "--gguf-type", "f32", "-q"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for prompt in ["The capital of France is", "def fibonacci(n):"]:
        ids = tokenizer(prompt)["input_ids"]
        expected = transformers_greedy(folder, ids, 32)
        assert llama_cpp_greedy(gguf_out, ids, 32) == expected and llama_cpp_greedy(again, ids, 32) == expected


@pytest.fixture(scope="session")
def llama_cpp_converter() -> Path:
    """llama.cpp's own convert_hf_to_gguf.py, from the source distribution of the llama-cpp-python installed
    (fetched from PyPI once into the gqaify cache)."""
    import tarfile

    import llama_cpp

    cache = Path.home() / ".cache" / "gqaify" / f"llama-cpp-python-{llama_cpp.__version__}"
    script = cache / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        fetched = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={llama_cpp.__version__}",
                "-d",
                str(cache),
            ],
            capture_output=True,
            text=True,
        )
        if fetched.returncode != 0:
            pytest.skip(f"llama.cpp's converter could not be fetched: {fetched.stderr.strip()[-300:]}")
        (sdist,) = cache.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
            members = [
                m
                for m in tar.getmembers()
                if "/vendor/llama.cpp/" in m.name and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(keep)
            ]
            for member in members:
                member.name = "llama.cpp/" + member.name.split("/vendor/llama.cpp/", 1)[1]
            tar.extractall(cache, members=members, filter="data")
        sdist.unlink()
    return script


@needs_assets
@needs_llama_cpp
def test_llama_cpp_converter_makes_the_same_gguf_from_the_safetensors(stories_gguf, llama_cpp_converter, tmp_path):
    import gguf

    theirs = tmp_path / "theirs.gguf"
    subprocess.run(
        [
            sys.executable,
            str(llama_cpp_converter),
            str(stories_gguf["mqa"]),
            "--outfile",
            str(theirs),
            "--outtype",
            "f32",
        ],
        check=True,
        capture_output=True,
    )
    ours, reference = gguf.GGUFReader(stories_gguf["mqa.gguf"]), gguf.GGUFReader(theirs)
    assert {t.name: (t.tensor_type, np.array(t.data).tobytes()) for t in ours.tensors} == {
        t.name: (t.tensor_type, np.array(t.data).tobytes()) for t in reference.tensors
    }
    for key in [k for k in reference.fields if k.startswith(("llama.", "tokenizer."))]:
        assert ours.fields[key].contents() == reference.fields[key].contents(), key
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(stories_gguf["mqa"])("Once upon a time")["input_ids"]
    assert llama_cpp_greedy(theirs, ids, 32) == llama_cpp_greedy(stories_gguf["mqa.gguf"], ids, 32)


@needs_assets
@pytest.mark.parametrize("ending", ["refused", "stopped"])
def test_a_gguf_out_refused_or_stopped_late_leaves_no_parent_folders_it_made(capsys, tmp_path, monkeypatch, ending):
    """a/b/c were made for the work folder beside a/b/c/out.gguf and left behind by a run that said "nothing was
    written" (a refusal while the GGUF was written, or SIGTERM)."""
    import signal

    from gqaify.conversion import to_gguf
    from gqaify.errors import UserError

    (tmp_path / "kept").mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    def write_fails(folder, out, *args, **kwargs):
        out.write_bytes(b"half a GGUF")
        if ending == "refused":
            raise UserError("this writer cannot express it")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here

    monkeypatch.setattr(to_gguf, "write_gguf", write_fails)
    out = tmp_path / "kept" / "a" / "b" / "c" / "out.gguf"
    code, err = run_cli(capsys, "convert", MODELS / "stories260K-mha", out, "--kv-heads", "2", "-q")
    if ending == "refused":
        assert code == 2 and one_line(err) == "gqaify: error: this writer cannot express it", err
    else:
        assert code == 143 and "stopped by SIGTERM; nothing was written" in one_line(err), err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@needs_assets
def test_a_gguf_conversion_that_succeeds_says_no_warning(tmp_path):
    """gguf's SpecialVocab warned "Unknown separator token '<s>'" of every Llama tokenizer's pair template. (To 4
    K/V heads: the MHA twin's duplicated heads pooled back lose nothing, so the conversion has nothing to warn of.)"""
    out = tmp_path / "r.gguf"
    argv = [sys.executable, "-m", "gqaify", "convert", str(STORIES_MHA), str(out), "--kv-heads", "4", "-q"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert out.is_file()
