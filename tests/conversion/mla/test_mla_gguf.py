"""An MLA conversion as a GGUF file for llama.cpp's deepseek2: its tensors against the folder of the same conversion,
and the rotary frequencies llama.cpp cannot rotate refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gqaify.conversion import to_gguf
from gqaify.conversion.mla.gguf import mla_gguf_problem, write_mla_gguf
from gqaify.conversion.mla.layer import rewrite_as_mla, rope_parameters
from gqaify.entry.cli import main
from gqaify.errors import UserError
from gqaify.testing import build_model, save, save_with_tokenizer
from helpers import MODELS, needs_assets, one_line, run_cli

STORIES_MHA = MODELS / "stories260K-mha"  # a Llama tokenizer, which GGUF output writes (a byte-level BPE one is not)
MLA = ["--kv-heads", "1", "--attention", "mla", "-q"]


@pytest.fixture(scope="module")
def mla_mqa(tmp_path_factory) -> dict[str, Path]:
    """stories260K's MHA twin converted to MQA and rewritten exactly as MLA: a folder, and GGUF files f32 and f16."""
    if not STORIES_MHA.is_dir():
        pytest.skip(f"needs {STORIES_MHA}")
    root = tmp_path_factory.mktemp("mla-gguf")
    made = {"folder": root / "mla"}
    assert main(["convert", str(STORIES_MHA), str(made["folder"]), *MLA]) == 0
    for out_type in ("f32", "f16"):
        made[out_type] = root / f"mla-{out_type}.gguf"
        assert main(["convert", str(STORIES_MHA), str(made[out_type]), *MLA, "--gguf-type", out_type]) == 0
    return made


def deepseek2_attention(x: np.ndarray, tensors: dict, fields: dict, layer: int) -> np.ndarray:
    """One layer's attention as llama.cpp's deepseek2 computes it with the latent absorbed (no query low-rank), from
    the GGUF's own tensors and keys alone: the independent reference for the file. `x`: (T, hidden), the input of
    the layer's attention at positions 0..T-1; returns its output, (T, hidden).

        q = W_q x, split per head into q_nope and q_pe;  [c; k_pe] = W_kv_a x;  c = rms_norm(c) * attn_kv_a_norm
        q_pe, k_pe rotated in adjacent pairs (2i, 2i+1) (rope type NORM) at freq_base^(-2i/rope);
        score = (q_nope W_k_b) . c + q_pe . k_pe, scaled by 1/sqrt(key_length_mla), causal softmax;
        each head's output W_v_b (softmax . c), all heads through attn_output
    """
    key = "deepseek2.attention."
    rank, rope = fields[key + "kv_lora_rank"], fields["deepseek2.rope.dimension_count"]
    heads, k_len = fields["deepseek2.attention.head_count"], fields[key + "key_length_mla"]
    eps, base = fields[key + "layer_norm_rms_epsilon"], fields["deepseek2.rope.freq_base"]
    blk = lambda name: tensors[f"blk.{layer}.{name}.weight"].astype(np.float64)  # noqa: E731
    x = x.astype(np.float64)
    T = len(x)
    q = (x @ blk("attn_q").T).reshape(T, heads, k_len)  # (T, H, nope + rope)
    q_nope, q_pe = q[..., : k_len - rope], q[..., k_len - rope :]
    kv = x @ blk("attn_kv_a_mqa").T  # (T, rank + rope)
    c, k_pe = kv[:, :rank], kv[:, rank:]
    c = c / np.sqrt((c**2).mean(-1, keepdims=True) + eps) * blk("attn_kv_a_norm")

    def rotate(v: np.ndarray) -> np.ndarray:  # v: (T, ..., rope), pairs (2i, 2i+1)
        angle = np.arange(T)[:, None] * base ** (-np.arange(0, rope, 2) / rope)[None]  # (T, rope/2)
        angle = angle.reshape(T, *([1] * (v.ndim - 2)), rope // 2)
        even, odd = v[..., 0::2], v[..., 1::2]
        out = np.empty_like(v)
        out[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
        out[..., 1::2] = even * np.sin(angle) + odd * np.cos(angle)
        return out

    q_pe, k_pe = rotate(q_pe), rotate(k_pe)
    q_absorbed = np.einsum("thn,hrn->thr", q_nope, blk("attn_k_b"))  # (T, H, rank)
    scores = np.einsum("thr,sr->hts", q_absorbed, c) + np.einsum("thp,sp->hts", q_pe, k_pe)
    scores = scores / math.sqrt(k_len) + np.triu(np.full((T, T), -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    per_head = np.einsum("hvr,hts,sr->thv", blk("attn_v_b"), weights, c)  # (T, H, v)
    return per_head.reshape(T, -1) @ blk("attn_output").T


@needs_assets
def test_the_gguf_computes_the_folders_attention_as_llama_cpps_deepseek2_reads_it(mla_mqa):
    """Each layer's attention, computed from the GGUF's tensors and keys as llama.cpp's deepseek2 computes it,
    equals the folder's (transformers' DeepseekV3 on the same input); the latent stays float32 in an f16 file."""
    import gguf
    from transformers import AutoModelForCausalLM

    reader = gguf.GGUFReader(mla_mqa["f32"])
    fields = {key: field.contents() for key, field in reader.fields.items() if key.startswith("deepseek2.")}
    assert fields["deepseek2.attention.head_count_kv"] == 1 and fields["deepseek2.attention.q_lora_rank"] == 0
    assert to_gguf.RECORD_KEY in reader.fields
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    model = AutoModelForCausalLM.from_pretrained(mla_mqa["folder"], dtype=torch.float32)
    seen = {}

    def keep(layer: int):
        def hook(module, args, kwargs, output):
            seen[layer] = (kwargs["hidden_states"][0].numpy(), output[0][0].numpy())

        return hook

    for layer, block in enumerate(model.model.layers):
        block.self_attn.register_forward_hook(keep(layer), with_kwargs=True)
    with torch.no_grad():
        model(torch.arange(1, 25)[None] % model.config.vocab_size)
    assert sorted(seen) == list(range(5))
    for layer, (x, folder) in seen.items():
        np.testing.assert_allclose(deepseek2_attention(x, tensors, fields, layer), folder, rtol=1e-4, atol=1e-5)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(mla_mqa["f16"]).tensors}
    assert types["blk.0.attn_kv_a_mqa.weight"] == "F32" and types["blk.0.attn_q.weight"] == "F16"  # latent ~1e-8
    assert types["blk.0.attn_k_b.weight"] == types["blk.0.attn_v_b.weight"] == "F32"  # llama.cpp's CPU: f16 is wrong


def test_llama_cpp_rotates_one_ladder_of_frequencies_in_any_order_and_nothing_else():
    base, pairs = 10000.0, 8
    ladder = base ** (-torch.arange(0, 2 * pairs, 2, dtype=torch.float64) / (2 * pairs))

    def config(frequencies: torch.Tensor) -> dict:
        rope = rope_parameters(frequencies, base, 512)  # as the rewrite writes them
        return dict(
            model_type="deepseek_v3",
            q_lora_rank=None,
            num_hidden_layers=2,
            first_k_dense_replace=2,
            rope_interleave=False,
            qk_rope_head_dim=2 * len(frequencies),
            rope_parameters=rope,
        )

    assert mla_gguf_problem(config(ladder)) is None
    assert mla_gguf_problem(config(ladder[[3, 0, 2, 1]])) is None  # the first pairs, kept in another order
    assert mla_gguf_problem(config(ladder[[0, 2, 4]])) is None  # every other pair: a ladder too
    assert "convert with --kv-heads 1" in mla_gguf_problem(config(ladder.repeat(2)))  # two K/V heads' copies
    assert "no --rope-dims" in mla_gguf_problem(config(ladder[[1, 2]]))  # no frequency 1
    assert "no --rope-dims" in mla_gguf_problem(config(ladder[[0, 1, 3]]))


def test_an_mla_gguf_of_several_kv_heads_is_refused_at_once_and_writes_nothing(tmp_path, capsys):
    """At their own cache, several K/V heads repeat their frequencies; smaller, a rotary key of more slots than a
    head has frequencies would."""
    src = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), tmp_path / "src")
    code, err = run_cli(capsys, "convert", src, tmp_path / "out.gguf", "--kv-heads", "2", "--attention", "mla")
    assert code == 2 and "convert with --kv-heads 1" in one_line(err)
    too_wide = ["--kv-rank", "8", "--rope-dims", "24", "--calib-data", str(tmp_path / "src" / "config.json")]
    code, err = run_cli(
        capsys, "convert", src, tmp_path / "out.gguf", "--kv-heads", "2", "--attention", "mla", *too_wide
    )
    assert code == 2 and "ask at most --rope-dims 16" in one_line(err)  # head_dim 16: 8 distinct frequencies
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


@pytest.fixture(scope="module")
def turned_ladder(tmp_path_factory) -> dict[str, object]:
    """stories260K (4 K/V heads of 8) at a smaller cache for llama.cpp: each frequency turned across the heads, one
    slot per frequency of the ladder (`plan_mla(..., ladder=True)`), as a folder and as a GGUF file (f32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gqaify.conversion.mla.layer import build_mla, plan_mla

    source = MODELS / "stories260K"
    if not source.is_dir():
        pytest.skip(f"needs {source}")
    root = tmp_path_factory.mktemp("turned-ladder")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = torch.tensor(
        tokenizer((MODELS.parent / "text" / "tinystories-train-sample.txt").read_text()[:40_000])["input_ids"]
    )
    plan = plan_mla(model, 8, 8, ids[:4096], ladder=True)
    folder = root / "mla"
    build_mla(model, plan).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_mla_gguf(folder, root / "mla.gguf", "f32")
    return {"plan": plan, "folder": folder, "gguf": root / "mla.gguf"}


@needs_assets
def test_a_turned_rotary_key_for_llama_cpp_keeps_one_ladder_of_distinct_frequencies(turned_ladder):
    """Four K/V heads, a rotary key of 4 slots: every frequency of a head once (never one twice, as four heads'
    own blocks would), each slot the component that scores most at its frequency in its layer."""
    plan = turned_ladder["plan"]
    assert plan.layout.mixing is not None and plan.layout.pairs.tolist() == [0, 1, 2, 3]
    assert plan.rope["rope_type"] == "default"
    assert mla_gguf_problem(json.loads((turned_ladder["folder"] / "config.json").read_text())) is None


@needs_assets
def test_an_mla_gguf_at_a_cut_of_whole_heads_from_several_is_the_parent_turned_for_llama_cpp(
    tmp_path, monkeypatch, caplog, capsys
):
    """stories260K (4 K/V heads) cut in two for llama.cpp: two heads' exact rewrite would repeat frequencies, so the
    parent compressed to the same cache is written, its rotary key one slot per frequency, even where the GQA-2
    model is the closer (here the judge is told so), which a warning then names with the command that writes it."""
    import gguf

    import gqaify.conversion.mla.output as mla_output

    told = iter([0.25, 0.5])  # the GQA-2 model's, then the parent's
    monkeypatch.setattr(mla_output, "held_out_kls", lambda reference, models, windows: [next(told) for _ in models])
    out = tmp_path / "mla.gguf"
    text = MODELS.parent / "text" / "tinystories-train-sample.txt"
    argv = ["convert", MODELS / "stories260K", out, "--kv-cut", "2", "--attention", "mla", "--calib-data", text]
    assert main([*map(str, argv), "--calib-tokens", "4096"]) == 0
    assert "--attention gqa --kv-heads 2 writes that model" in caplog.text
    assert "the parent compressed, as llama.cpp needs, though GQA-2 was closer" in capsys.readouterr().out
    field = gguf.GGUFReader(out).fields[to_gguf.RECORD_KEY]
    mla = json.loads(bytes(field.parts[field.data[0]]).decode())["mla"]
    assert mla["starts"] == [{"start": "GQA-2", "kl": 0.25}, {"start": "parent", "kl": 0.5}]
    assert mla["from_parent"] and mla["turned"] and mla["kv_rank"] + mla["rope_dims"] == 32
    for layer in mla["rotary_pairs"]:  # per component, its frequencies: each frequency once over the components
        kept = [pair for component in layer for pair in component]
        assert len(kept) == mla["rope_dims"] // 2 == len(set(kept))


def test_writing_an_mla_folder_llama_cpp_cannot_rotate_raises_and_writes_nothing(tmp_path):
    """What only the rewrite tells (the frequencies) is checked when the folder is written as GGUF."""
    folder = save(rewrite_as_mla(build_model("llama", num_kv_heads=2)), tmp_path / "mla")
    with pytest.raises(UserError, match="convert with --kv-heads 1"):
        write_mla_gguf(folder, tmp_path / "out.gguf", "f16")
    assert not (tmp_path / "out.gguf").exists()
