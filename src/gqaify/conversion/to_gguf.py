"""A converted checkpoint as one GGUF file that llama.cpp serves, written tensor by tensor.

    converted folder (safetensors, Hugging Face names)          OUT.gguf (llama.cpp's names and metadata)
        model.layers.3.self_attn.k_proj.weight   (G*d, hidden)  ->  blk.3.attn_k.weight   head_count_kv = G
        model.embed_tokens.weight                (vocab, hidden) -> token_embd.weight
        tokenizer.json / the source GGUF's tokenizer            ->  tokenizer.ggml.*

The tensor index (names, shapes, types) is written first from the safetensors headers; then each tensor is read,
re-laid out where llama.cpp wants it (its rotary embedding pairs a head's dimensions i and i + d/2 as neighbours,
so Q and K rows are permuted within each head, exactly as llama.cpp's own converter does), cast or quantized,
and written: memory holds one tensor at a time. The file is written beside OUT and renamed into place whole.

What llama.cpp needs to know per architecture is data (`ArchSpec.gguf` in archs.py); an architecture without it,
a vocabulary llama.cpp would read wrongly, and a rotary scaling it would not reproduce are refused with the reason.
A shape that rewrites the G-head model lays it out for llama.cpp itself (`Shape.write_gguf`, which
`sinks.GgufSink.finish` asks).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import gqaify.model.gguf_header as gguf_header
from gqaify.errors import UserError
from gqaify.logs import muted
from gqaify.model.archs import ARCHITECTURES, GgufArchitecture

OUT_TYPES = ("f32", "f16", "bf16", "q8_0")  # the types llama.cpp's converter writes, by their names there


RECORD_KEY = "gqaify.record"  # the conversion's record (gqaify.json) inside the file: its provenance
# the SHA-256 of the file's tensor infos as gqaify wrote them (`gguf_header.tensor_info_bytes`): a copy that carries
# the record but whose tensors were re-quantized (say, by llama.cpp) is no file of gqaify's to replace with --force
TENSORS_KEY = "gqaify.tensors_sha256"


def is_gguf_out(out: str | os.PathLike | None) -> bool:
    """Whether OUT names a GGUF file (what `gqaify convert SRC OUT.gguf` writes) rather than a folder."""
    return out is not None and os.fspath(out).lower().endswith(".gguf")


def destination_problem(out: Path, force: bool) -> str | None:
    if not out.exists() and not out.is_symlink():
        writable = os.access(_existing_parent(out), os.W_OK)
        return None if writable else f"cannot write {out}: its folder is not writable; choose another OUT"
    if not out.is_file():
        return f"OUT {out} exists and is not a file; name a new .gguf file"
    if not force:
        return f"OUT {out} already exists; pass --force to replace it (only a GGUF gqaify wrote), or choose another"
    if not _written_by_gqaify(out):
        return f"OUT {out} is not a GGUF gqaify wrote, so --force does not replace it; choose another OUT"
    recorded, actual = _tensor_digests(out)
    if recorded is None:
        return (
            f"OUT {out} carries a gqaify record but no digest of its tensors ({TENSORS_KEY}: written by an earlier "
            "gqaify, which recorded none, or copied by another tool), so --force cannot tell it is gqaify's own file; "
            "remove it yourself, or choose another OUT"
        )
    if recorded != actual:
        return (
            f"OUT {out} carries a gqaify record but is not the file gqaify wrote (its tensors changed since); "
            "--force replaces only gqaify's own files: choose another OUT"
        )
    return None


def _existing_parent(path: Path) -> Path:
    return next(p for p in path.parents if p.exists())


def _written_by_gqaify(path: Path) -> bool:
    return gguf_header.has_key(path, RECORD_KEY)  # bounded: a damaged file is no GGUF gqaify wrote


def _tensor_digests(path: Path) -> tuple[str | None, str | None]:
    """The digest of its tensor infos that `path` records (`TENSORS_KEY`), and the one of those it holds (None for
    a file that is no readable GGUF): equal only in a file whose tensors are as gqaify wrote them."""
    try:
        header = gguf_header.read(path, tensors=True)
    except (gguf_header.HeaderError, OSError):
        return None, None
    recorded = header.fields.get(TENSORS_KEY)
    return (recorded if isinstance(recorded, str) else None), header.tensors_sha256


def type_problem(out_type: str | None) -> str | None:
    if out_type is None or out_type in OUT_TYPES:
        return None
    return f"--gguf-type {out_type} is not one of {', '.join(OUT_TYPES)}"


def gguf_problem(config: dict) -> str | None:
    """Why a checkpoint with `config` cannot be written as GGUF, or None."""
    model_type = config.get("model_type")
    if _gguf_architecture(model_type) is None:
        written = sorted(t for t, spec in ARCHITECTURES.items() if spec.gguf is not None)
        return (
            f"GGUF output is written for {', '.join(written)} models, not {model_type}; "
            "write safetensors (OUT without .gguf) and use llama.cpp's convert_hf_to_gguf.py"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        return (
            f"GGUF output writes the plain rotary embedding, and this model's is {rope['rope_type']}; write "
            "safetensors (OUT without .gguf) and use llama.cpp's convert_hf_to_gguf.py"
        )
    return None


def _gguf_architecture(model_type: str | None) -> GgufArchitecture | None:
    """llama.cpp's name for `model_type` and its Q/K layout (`ArchSpec.gguf`), or None where GGUF is not written."""
    spec = ARCHITECTURES.get(model_type)
    return None if spec is None else spec.gguf


def write_gguf(
    folder: Path, out: Path, out_type: str = "f16", tokenizer_gguf: Path | None = None, record: str | None = None
) -> None:
    """Write the converted checkpoint in `folder` as the GGUF file `out` (`sinks.GgufSink.finish` gives it a temporary
    name, renamed into place when whole).

    Args:
        out_type: f32, f16, bf16 or q8_0 for the matrices (norms stay f32, as llama.cpp's converter keeps them;
            a matrix whose rows are not whole q8_0 blocks of 32 is written f16, as there too).
        tokenizer_gguf: a GGUF file whose tokenizer is copied (the source, when it was one); else the tokenizer
            is written from `folder`'s tokenizer.json, as llama.cpp's converter writes a Llama one.
        record: the conversion's gqaify.json, kept in the file under `RECORD_KEY`.

    Raises:
        UserError: the architecture, rotary scaling or vocabulary is one this writer cannot express.
    """
    import gguf

    config = json.loads((folder / "config.json").read_text())
    if problem := gguf_problem(config):
        raise UserError(problem)
    arch = _gguf_architecture(config["model_type"])
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch.name]])
    _write_hyperparameters(writer, config, out.stem, out_type)
    add_tokenizer(writer, folder, tokenizer_gguf)
    layout = _Layout(config, arch, gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.name], config["num_hidden_layers"]))
    plan = [(shard, name, matrix_type(shape, out_type)) for shard, name, shape in folder_tensors(folder)]
    for (_, name, qtype), (_, _, shape) in zip(plan, folder_tensors(folder), strict=True):
        add_tensor_info(writer, layout.gguf_name(name), shape, qtype)
    write_header(writer, out, record)
    _write_data(writer, folder, plan, layout)
    writer.close()


def write_header(writer, out: Path, record: str | None) -> None:
    """`record` (the conversion's gqaify.json, under `RECORD_KEY`) and the digest of the tensor infos added so far
    (`TENSORS_KEY`), then the header, metadata and tensor infos to `out`: the tensors' data follows."""
    if record is not None:
        writer.add_string(RECORD_KEY, record)
        writer.add_string(TENSORS_KEY, _tensors_sha256(writer))
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()


def _tensors_sha256(writer) -> str:
    """The SHA-256 of the tensor infos `writer` will write (`gguf_header.tensor_info_bytes`), as it lays them out."""
    import hashlib

    import gguf

    if len(writer.tensors) != 1:
        raise AssertionError("gqaify writes one GGUF file, not a split one")
    digest, offset = hashlib.sha256(), 0
    for name, info in writer.tensors[0].items():
        digest.update(gguf_header.tensor_info_bytes(name, tuple(reversed(info.shape)), int(info.dtype), offset))
        offset += gguf.GGUFWriter.ggml_pad(info.nbytes, writer.data_alignment)
    return digest.hexdigest()


# -- metadata -------------------------------------------------------------------------------------------------


def _write_hyperparameters(writer, config: dict, name: str, out_type: str) -> None:
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    rope = config.get("rope_parameters") or {}
    write_body_hyperparameters(writer, config, name, out_type)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def write_body_hyperparameters(writer, config: dict, name: str, out_type: str) -> None:
    """What every architecture's GGUF says of the model outside its attention's cache, and of the file."""
    import gguf

    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    file_type = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}[out_type]
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_tokenizer(writer, folder: Path, tokenizer_gguf: Path | None) -> None:
    """The tokenizer of the GGUF file `tokenizer_gguf` (the source, when it was one) as it is there, else `folder`'s
    written as llama.cpp's converter writes a Llama one."""
    if tokenizer_gguf is not None:
        _copy_tokenizer(writer, tokenizer_gguf)
    else:
        _write_tokenizer(writer, folder)


def _copy_tokenizer(writer, source: Path) -> None:
    """Every tokenizer.* key of the GGUF file `source`, as it is there."""
    import gguf

    for key, field in gguf.GGUFReader(source).fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)


def vocabulary_problem(folder: Path) -> str | None:
    """Why the vocabulary in `folder` cannot be written for llama.cpp (`_llama_vocabulary`), or None: asked of the
    source before the conversion's work."""
    try:
        _llama_vocabulary(folder)
    except UserError as exc:
        return str(exc)
    return None


def _llama_vocabulary(folder: Path):
    """The vocabulary in `folder` as llama.cpp's converter reads a Llama one: from the SentencePiece model
    (tokenizer.model) where there is one, whose scores order the merges; else from tokenizer.json, a
    byte-fallback BPE one.

    Raises:
        UserError: no tokenizer at all; another kind of vocabulary: llama.cpp reads a byte-level BPE one only
            with a pre-tokenizer it recognises by a hash of how it splits text, a table only llama.cpp's converter
            keeps; or tokenizer.model without the sentencepiece package.
    """
    import gguf

    if not (folder / "tokenizer.model").is_file() and not (folder / "tokenizer.json").is_file():
        raise UserError(f"{folder} has no tokenizer (tokenizer.json); copy the parent's tokenizer files into it")
    try:
        return gguf.SentencePieceVocab(folder) if (folder / "tokenizer.model").is_file() else gguf.LlamaHfVocab(folder)
    except RuntimeError as exc:  # gguf's words for "sentencepiece is not installed"
        raise UserError(
            f"{folder}'s vocabulary is a SentencePiece model, which needs the sentencepiece package to write: "
            "pip install sentencepiece"
        ) from exc
    except (FileNotFoundError, TypeError) as exc:
        raise UserError(
            f"{folder}'s vocabulary is not a Llama (SentencePiece-style) one, and llama.cpp reads a byte-level BPE "
            "vocabulary only with a pre-tokenizer it recognises; write safetensors (OUT without .gguf) and use "
            "llama.cpp's convert_hf_to_gguf.py, which knows them"
        ) from exc


def _write_tokenizer(writer, folder: Path) -> None:
    """A Llama vocabulary (`_llama_vocabulary`) as llama.cpp's converter writes it."""
    import gguf

    vocab = _llama_vocabulary(folder)
    tokens, scores, types = zip(*vocab.all_tokens(), strict=True)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    # gguf parses tokenizer.json's post-processor to learn which special tokens to add, and warns of any it does not
    # expect: a Llama tokenizer's pair template "<s> $A <s> $B" has BOS between the sequences ("Unknown separator
    # token '<s>'"). That is how a Llama tokenizer is, nothing the user can fix, so the warning is not theirs to see.
    with muted("gguf.vocab"):
        gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)


# -- tensors --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    config: dict
    arch: GgufArchitecture
    names: object  # gguf.TensorNameMap

    def gguf_name(self, name: str) -> str:
        mapped = self.names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise UserError(f"{name} has no place in llama.cpp's {self.arch.name.lower()} layout; nothing written")
        return mapped

    def prepared(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` laid out as llama.cpp reads it: Q and K rows paired for its rotary embedding."""
        if not self.arch.permute_qk:
            return tensor
        heads = self.config["num_attention_heads"]
        if name.endswith("q_proj.weight"):
            return permute_rotary(tensor, heads)
        if name.endswith("k_proj.weight"):
            return permute_rotary(tensor, self.config.get("num_key_value_heads", heads))
        return tensor


def permute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from (first halves, second halves) to interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def folder_tensors(folder: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """(shard file, tensor name, shape) of every tensor, shard by shard, in the order the shards list them."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    shards = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    listed = []
    for shard in shards:
        with safe_open(folder / shard, "pt") as f:
            listed += [(shard, name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]  # noqa: SIM118
    return listed


def matrix_type(shape: tuple[int, ...], out_type: str):
    """The type a tensor of `shape` is written as in a file of `out_type`: norms f32, matrices `out_type` (q8_0 where
    the rows are whole blocks of 32, else f16)."""
    import gguf

    types = gguf.GGMLQuantizationType
    if len(shape) == 1 or out_type == "f32":
        return types.F32
    if out_type == "q8_0" and shape[-1] % gguf.GGML_QUANT_SIZES[types.Q8_0][0]:
        return types.F16
    return {"f16": types.F16, "bf16": types.BF16, "q8_0": types.Q8_0}[out_type]


def add_tensor_info(writer, name: str, shape: tuple[int, ...], qtype) -> None:
    """The index entry of the tensor `name` of `shape` (Hugging Face's order), stored as `qtype`."""
    nbytes, stored = _stored_shape(shape, qtype)
    writer.add_tensor_info(name, stored, _numpy_dtype(qtype), nbytes, raw_dtype=qtype)


def _stored_shape(shape: tuple[int, ...], qtype) -> tuple[int, tuple[int, ...]]:
    """(bytes, the shape the writer is given) of a tensor of `shape` stored as `qtype`."""
    import gguf

    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return int(np.prod(shape)) * (4 if qtype == gguf.GGMLQuantizationType.F32 else 2), shape
    stored = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    return int(np.prod(stored)), stored


def _numpy_dtype(qtype):
    import gguf

    return {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}.get(qtype, np.uint8)


def _write_data(writer, folder: Path, plan, layout: _Layout) -> None:
    from safetensors import safe_open

    for shard, tensors in itertools.groupby(plan, key=lambda entry: entry[0]):  # the plan lists shard by shard
        with safe_open(folder / shard, "pt") as f:
            for _, name, qtype in tensors:
                writer.write_tensor_data(tensor_data(layout.prepared(name, f.get_tensor(name)), qtype))


def tensor_data(values: torch.Tensor, qtype) -> np.ndarray:
    """`values` as the bytes of `qtype` the file holds."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.F16:  # torch casts as numpy does, several times faster
        return values.to(torch.float16).numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return values.float().numpy()
    return gguf.quants.quantize(values.float().numpy(), qtype)
