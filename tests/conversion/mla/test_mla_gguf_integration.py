"""An MLA conversion's GGUF file in llama.cpp's deepseek2, where llama-cpp-python is installed: greedy tokens as
transformers decodes the folder, its cache of the latent and the rotary key per token, and a turned rotary ladder
computed as transformers computes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import test_mla_gguf
from gqaify.entry.cli import main
from gqaify.testing import build_model, save
from helpers import MODELS, llama_cpp_greedy, llama_cpp_kv_cache, needs_assets, needs_llama_cpp

# test_mla_gguf.py's fixtures, shared: pytest finds a fixture by its name in this module
mla_mqa = test_mla_gguf.mla_mqa
turned_ladder = test_mla_gguf.turned_ladder


@needs_assets
@needs_llama_cpp
@pytest.mark.parametrize("out_type", ["f32"])  # f16: the logits below (greedy tokens meet a near tie of 1.5e-3)
def test_llama_cpp_decodes_the_mla_gguf_as_transformers_decodes_the_folder(mla_mqa, out_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(mla_mqa["folder"])
    model = AutoModelForCausalLM.from_pretrained(mla_mqa["folder"], dtype=torch.float32).eval()
    for prompt in ["Once upon a time", "The little dog", "Lily and Tom went to the park"]:
        ids = tokenizer(prompt)["input_ids"]
        expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
        assert llama_cpp_greedy(mla_mqa[out_type], ids, 32) == expected, prompt


@needs_assets
@needs_llama_cpp
def test_llama_cpp_computes_the_f16_mla_gguf_as_transformers_computes_the_folder(mla_mqa):
    """The f16 file, llama.cpp's default f16 cache, every position's logits within 1e-2 of their scale, batched and
    token by token. Greedy tokens are too fine a check here: "The little dog" meets a top-2 gap of 1.5e-3 of the scale,
    about what f16 moves the logits by, and f16 or f32 up-projections (equally close) break it differently."""
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(mla_mqa["folder"])
    model = AutoModelForCausalLM.from_pretrained(mla_mqa["folder"], dtype=torch.float32).eval()
    ids = tokenizer("The little dog ran to the park and saw a big red ball")["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    for batched in (True, False):
        llm = Llama(str(mla_mqa["f16"]), n_ctx=64, n_threads=1, verbose=False, logits_all=True)
        try:
            for chunk in [ids] if batched else [[token] for token in ids]:
                llm.eval(chunk)
            got = torch.tensor(np.array(llm.scores[: len(ids)]))
        finally:
            llm.close()
        assert (got - expected).abs().max() <= 1e-2 * expected.abs().max(), batched


@needs_assets
@needs_llama_cpp
@pytest.mark.parametrize("made", ["mla_mqa", "turned_ladder"])
def test_llama_cpp_caches_the_latent_and_the_rotary_key_per_token(made, request):
    """(kv_rank + rope_dims) values per token and layer in f16, no values apart: as llama.cpp reports allocating it;
    8 + 8 for MQA's exact rewrite and for 4 K/V heads compressed to a latent of 8 and a turned rotary key of 8."""
    gguf_file = request.getfixturevalue(made)["f32" if made == "mla_mqa" else "gguf"]
    cells = 32768
    size, values = llama_cpp_kv_cache(gguf_file, cells)
    assert size == (8 + 8) * 5 * 2 * cells / 2**20 and values == 0


@needs_assets
@needs_llama_cpp
def test_llama_cpp_computes_the_turned_mla_gguf_as_transformers_computes_the_folder(turned_ladder):
    """The logits of every position, llama.cpp's (its cache in f32) against transformers', within 1e-4 of their
    scale: a compressed model's near ties make greedy tokens a weaker check than the exact rewrite's."""
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(turned_ladder["folder"])
    model = AutoModelForCausalLM.from_pretrained(turned_ladder["folder"], dtype=torch.float32).eval()
    f32 = 0  # GGML_TYPE_F32: llama.cpp's default cache, f16, rounds the latent to 1e-3
    llm = Llama(
        str(turned_ladder["gguf"]), n_ctx=256, n_threads=1, verbose=False, logits_all=True, type_k=f32, type_v=f32
    )
    try:
        for prompt in ["Once upon a time", "The little dog ran to the park and saw a big red ball"]:
            ids = tokenizer(prompt)["input_ids"]
            llm.reset()
            llm.eval(ids)
            got = torch.tensor(np.array(llm.scores[: len(ids)]))
            with torch.no_grad():
                expected = model(torch.tensor([ids])).logits[0]
            assert (got - expected).abs().max() <= 1e-4 * expected.abs().max(), prompt
    finally:
        llm.close()


@needs_assets
@needs_llama_cpp
def test_llama_cpp_computes_an_f16_mla_gguf_of_a_wide_latent_as_transformers_computes_the_folder(tmp_path):
    """A random Llama of heads of 32 (SmolLM2's are 64) made MQA and rewritten exactly, written in the default f16:
    a latent of 32 values, where llama.cpp's CPU turned an f16 attn_v_b into garbage (SmolLM2's logits off by 45 at a
    scale of 32). Every position's logits within 1e-2 of their scale (f16 matrices; f32 cache)."""
    import shutil

    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    tokenizer = MODELS / "stories260K-mha"  # a Llama tokenizer GGUF output writes, 512 tokens
    model = build_model("llama", num_kv_heads=2, head_dim=32, hidden_size=128, intermediate_size=256, vocab_size=512)
    parent = save(model, tmp_path / "parent")
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, parent / name)
    mla = ["--kv-heads", "1", "--attention", "mla", "--dtype", "float32", "-q"]
    assert main(["convert", str(parent), str(tmp_path / "mla"), *mla]) == 0
    assert main(["convert", str(parent), str(tmp_path / "mla.gguf"), *mla]) == 0  # --gguf-type f16, the default
    ids = list(range(3, 51))
    folder = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = folder(torch.tensor([ids])).logits[0]
    f32 = 0  # GGML_TYPE_F32
    llm = Llama(
        str(tmp_path / "mla.gguf"), n_ctx=64, n_threads=1, verbose=False, logits_all=True, type_k=f32, type_v=f32
    )
    try:
        llm.eval(ids)
        got = torch.tensor(np.array(llm.scores[: len(ids)]))
    finally:
        llm.close()
    assert (got - expected).abs().max() <= 1e-2 * expected.abs().max()
