"""GGUF output: the file's metadata and tensors against the safetensors it was written from, eval reading it, the
record inside it, what --force may replace, and a GGUF source or OUT refused in one line where it cannot be."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from gqaify.entry.cli import main
from gqaify.testing import build_model, save, save_with_tokenizer
from helpers import MODELS, needs_assets, one_line, run_cli, tree_hashes

STORIES_MHA = MODELS / "stories260K-mha"


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory) -> dict[str, Path]:
    """stories260K's MHA twin converted to GQA-2 and MQA, as safetensors and as f32 GGUF, and GQA-2 in the others."""
    if not STORIES_MHA.is_dir():
        pytest.skip(f"needs {STORIES_MHA}")
    root = tmp_path_factory.mktemp("gguf")
    made = {}
    for name, kv in (("gqa2", "2"), ("mqa", "1")):
        assert main(["convert", str(STORIES_MHA), str(root / name), "--kv-heads", kv, "-q"]) == 0
        assert (
            main(
                ["convert", str(STORIES_MHA), str(root / f"{name}.gguf"), "--kv-heads", kv, "--gguf-type", "f32", "-q"]
            )
            == 0
        )
        made[name], made[f"{name}.gguf"] = root / name, root / f"{name}.gguf"
    for out_type in ("f16", "bf16", "q8_0"):
        path = root / f"gqa2-{out_type}.gguf"
        assert main(["convert", str(STORIES_MHA), str(path), "--kv-heads", "2", "--gguf-type", out_type, "-q"]) == 0
        made[f"gqa2-{out_type}.gguf"] = path
    return made


@needs_assets
def test_a_grouped_folder_at_its_own_kv_heads_becomes_the_same_gguf(stories_gguf, tmp_path):
    """How uptrain's final/ (a folder already at G heads) is served: converted at its own G, the identity."""
    import gguf

    again = tmp_path / "final.gguf"
    assert main(["convert", str(stories_gguf["mqa"]), str(again), "--kv-heads", "1", "--gguf-type", "f32", "-q"]) == 0
    first, second = (gguf.GGUFReader(path) for path in (stories_gguf["mqa.gguf"], again))
    assert [t.name for t in first.tensors] == [t.name for t in second.tensors]
    for a, b in zip(first.tensors, second.tensors, strict=True):
        np.testing.assert_array_equal(np.array(a.data), np.array(b.data), err_msg=a.name)


@needs_assets
def test_a_folder_made_from_a_gguf_takes_that_files_tokenizer_back_into_gguf(stories_gguf, tmp_path, monkeypatch):
    """An uptrained final/ of a GGUF parent is a folder whose record names that GGUF: written as GGUF again, it takes
    the file's tokenizer as it is there (a byte-level BPE one, SmolLM2's, cannot be written anew for llama.cpp), while
    that file is unchanged; once it has changed, the folder's own tokenizer is written."""
    import shutil

    import gguf

    import gqaify.conversion.to_gguf as to_gguf

    source, folder = tmp_path / "parent.gguf", tmp_path / "final"
    shutil.copyfile(stories_gguf["mqa.gguf"], source)
    assert main(["convert", str(source), str(folder), "--kv-heads", "1", "-q"]) == 0
    written, write = [], to_gguf._write_tokenizer
    monkeypatch.setattr(to_gguf, "_write_tokenizer", lambda writer, f: written.append(f) or write(writer, f))
    assert main(["convert", str(folder), str(tmp_path / "a.gguf"), "--kv-heads", "1", "-q"]) == 0
    assert written == []

    def tokenizer(path: Path) -> dict:
        fields = gguf.GGUFReader(path).fields
        return {k: [bytes(p) for p in f.parts] for k, f in fields.items() if k.startswith("tokenizer.")}

    assert tokenizer(tmp_path / "a.gguf") == tokenizer(source)
    with open(source, "ab") as f:  # the parent's file changed since: its tokenizer is no longer the folder's to take
        f.write(b"\0" * 32)
    assert main(["convert", str(folder), str(tmp_path / "b.gguf"), "--kv-heads", "1", "-q"]) == 0
    assert len(written) == 1  # the converted folder's tokenizer, written as llama.cpp's converter writes it


@needs_assets
@pytest.mark.parametrize(("out_type", "tolerance"), [("f16", 1e-3), ("bf16", 1e-2), ("q8_0", 2e-2)])
def test_gguf_types_hold_the_values_to_their_precision(stories_gguf, out_type, tolerance):
    import gguf

    f32 = {t.name: np.array(t.data) for t in gguf.GGUFReader(stories_gguf["gqa2.gguf"]).tensors}
    for t in gguf.GGUFReader(stories_gguf[f"gqa2-{out_type}.gguf"]).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(f32[t.name].shape)
        scale = np.abs(f32[t.name]).max()
        assert np.abs(values - f32[t.name]).max() <= tolerance * scale, t.name
        expected = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[out_type]
        if t.name.endswith("norm.weight"):
            assert t.tensor_type.name == "F32"  # norms stay f32, as llama.cpp's converter keeps them
        elif out_type != "q8_0" or t.shape[0] % 32 == 0:
            assert t.tensor_type.name == expected, t.name


def test_a_type_whose_arch_entry_has_no_gguf_is_refused_naming_those_that_have_one(capsys, tmp_path):
    """GGUF output is written for the model types whose `ArchSpec` names llama.cpp's architecture (`gguf`); another
    is refused in one line naming them, exit 2, nothing written."""
    src = save(build_model("mistral", num_kv_heads=4), tmp_path / "src")
    code, err = run_cli(capsys, "convert", src, tmp_path / "out.gguf", "--kv-heads", "2", "-q")
    assert code == 2 and "GGUF output is written for llama models, not mistral;" in one_line(err)
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


def test_the_vocabulary_is_refused_before_the_conversion_runs(tmp_path, monkeypatch, capsys):
    """A long calibrated conversion would be wasted: the source's vocabulary is asked first."""
    import gqaify.conversion.core as core

    if not (MODELS / "ref-mha-6L").is_dir():
        pytest.skip("needs ../shared/assets/models/ref-mha-6L")

    def never(*args, **kwargs):
        raise AssertionError("the conversion ran")

    monkeypatch.setattr(core, "stream_tensors", never)
    monkeypatch.setattr(core, "calibrate", never)
    code, err = run_cli(capsys, "convert", MODELS / "ref-mha-6L", tmp_path / "ref.gguf", "--kv-heads", "2")
    assert code == 2 and "pre-tokenizer" in one_line(err)
    assert list(tmp_path.iterdir()) == []


@needs_assets
def test_eval_reads_the_gguf_as_the_safetensors(stories_gguf, tmp_path):
    from gqaify.eval.perplexity import perplexity
    from gqaify.model.loading import load_model

    text = (MODELS.parent / "text" / "tinystories-valid-head.txt").read_text()[:6000]
    scores = []
    for model_path in (stories_gguf["gqa2"], stories_gguf["gqa2.gguf"]):
        model, tokenizer = load_model(str(model_path), "float32")
        ids = tokenizer(text, return_tensors="pt").input_ids[0, :1024]
        scores.append((ids, perplexity(model, ids, 256, 256, progress=False).perplexity))
    assert torch.equal(scores[0][0], scores[1][0])  # the same tokens, read from the GGUF's own vocabulary
    assert scores[1][1] == pytest.approx(scores[0][1], rel=1e-5)


@needs_assets
def test_an_existing_file_is_replaced_only_with_force_and_only_if_gqaify_wrote_it(stories_gguf, tmp_path):
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"a user's file")
    argv = ["convert", str(STORIES_MHA), str(mine), "--kv-heads", "2", "-q"]
    assert main(argv) == 2 and main([*argv, "--force"]) == 2
    assert mine.read_bytes() == b"a user's file"
    ours = tmp_path / "ours.gguf"
    ours.write_bytes(stories_gguf["mqa.gguf"].read_bytes())  # a GGUF gqaify wrote (MQA, f32)
    assert main(["convert", str(STORIES_MHA), str(ours), "--kv-heads", "2", "--force", "-q"]) == 0
    assert ours.read_bytes() != stories_gguf["mqa.gguf"].read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.gguf", "ours.gguf"]  # no work folder left


def _copied_gguf(src: Path, dst: Path, retype: str | None = None, keep: tuple[str, ...] = ()) -> None:
    """`src` rewritten by gguf's writer as a user's tool would: every metadata key copied (gqaify's record included),
    the tensor `retype` stored as f16 (a re-quantized copy), and gqaify's keys other than its record only if `keep`
    names them."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key.startswith("gqaify.") and key != "gqaify.record" and key not in keep:
            continue
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1] if kind == 9 else None)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        writer.add_tensor(tensor.name, data.astype(np.float16) if tensor.name == retype else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@needs_assets
@pytest.mark.parametrize(
    ("copy", "expect"),
    [
        (
            {"retype": "blk.0.attn_k.weight", "keep": ("gqaify.tensors_sha256",)},
            "carries a gqaify record but is not the file gqaify wrote (its tensors changed since); --force replaces "
            "only gqaify's own files: choose another OUT",
        ),
        (
            {},  # written before gqaify recorded the digest, or copied without it
            "carries a gqaify record but no digest of its tensors (gqaify.tensors_sha256: written by an earlier "
            "gqaify, which recorded none, or copied by another tool), so --force cannot tell it is gqaify's own "
            "file; remove it yourself, or choose another OUT",
        ),
    ],
    ids=["re-typed", "no digest"],
)
def test_force_does_not_replace_a_copy_that_merely_carries_gqaifys_record(capsys, stories_gguf, tmp_path, copy, expect):
    """A GGUF re-quantized by another tool keeps the metadata it copied, gqaify's record among it: --force took it
    for gqaify's own file and replaced it."""
    theirs = tmp_path / "theirs.gguf"
    _copied_gguf(stories_gguf["mqa.gguf"], theirs, **copy)
    before = tree_hashes(tmp_path)
    code, err = run_cli(capsys, "convert", STORIES_MHA, theirs, "--kv-heads", "2", "--force", "-q")
    assert code == 2 and one_line(err) == f"gqaify: error: OUT {theirs} {expect}", err
    assert tree_hashes(tmp_path) == before


@needs_assets
def test_force_replaces_a_copy_of_gqaifys_gguf_whose_tensors_are_as_written(capsys, stories_gguf, tmp_path):
    """The digest is of the tensor infos, so a copy rewritten with the same tensors (its metadata edited) is still
    gqaify's file; the gguf written for the tests is replaced as it is."""
    ours = tmp_path / "ours.gguf"
    _copied_gguf(stories_gguf["mqa.gguf"], ours, keep=("gqaify.tensors_sha256",))
    code, err = run_cli(capsys, "convert", STORIES_MHA, ours, "--kv-heads", "2", "--force", "-q")
    assert code == 0, err
    assert ours.read_bytes() != stories_gguf["mqa.gguf"].read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.gguf"]


@needs_assets
def test_gguf_type_without_a_gguf_out_is_refused(tmp_path):
    assert main(["convert", str(STORIES_MHA), str(tmp_path / "folder"), "--kv-heads", "2", "--gguf-type", "q8_0"]) == 2
    assert list(tmp_path.iterdir()) == []


@needs_assets
@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_a_gguf_out_that_is_the_gguf_source_is_named_as_the_source(capsys, stories_gguf, tmp_path, force):
    """A GGUF gqaify wrote, converted onto itself: told it is the source (not to pass --force), and left as it was."""
    src = tmp_path / "gqa2.gguf"
    src.write_bytes(stories_gguf["gqa2.gguf"].read_bytes())
    code, err = run_cli(capsys, "convert", src, src, "--kv-heads", "1", *force)
    line = one_line(err)
    assert code == 2 and f"OUT {src} is the source; name another file to write" in line and "--force" not in line
    assert src.read_bytes() == stories_gguf["gqa2.gguf"].read_bytes() and [p.name for p in tmp_path.iterdir()] == [
        "gqa2.gguf"
    ]


@needs_assets
@pytest.mark.parametrize("link", ["symlink", "folder-symlink", "hardlink"])
def test_a_gguf_source_named_through_a_link_is_never_its_own_out(capsys, stories_gguf, tmp_path, link):
    """SRC a link to OUT (or OUT reached through a linked folder): refused as the source, OUT untouched; the
    conversion used to overwrite its own source with --force."""
    real = tmp_path / "real"
    real.mkdir()
    out = real / "a.gguf"
    out.write_bytes(stories_gguf["gqa2.gguf"].read_bytes())
    if link == "symlink":
        src = tmp_path / "latest.gguf"
        src.symlink_to(out)
    elif link == "folder-symlink":
        (tmp_path / "alias").symlink_to(real, target_is_directory=True)
        src = tmp_path / "alias" / "a.gguf"
    else:
        src = tmp_path / "copy.gguf"
        os.link(out, src)
    before = out.read_bytes()
    code, err = run_cli(capsys, "convert", src, out, "--kv-heads", "1", "--force")
    assert code == 2 and "is the source; name another file to write" in one_line(err)
    assert out.read_bytes() == before and sorted(p.name for p in real.iterdir()) == ["a.gguf"]


@needs_assets
def test_a_users_tmp_file_and_folder_beside_a_gguf_out_are_never_touched(capsys, tmp_path):
    """.OUT.gguf.tmp was the name every conversion to OUT.gguf wrote into, deleting whatever the user kept there."""
    (tmp_path / ".r.gguf.tmp").mkdir()
    (tmp_path / ".r.gguf.tmp" / "notes.txt").write_text("mine")
    code, err = run_cli(capsys, "convert", MODELS / "stories260K-mha", tmp_path / "r.gguf", "--kv-heads", "2", "-q")
    assert code == 0, err
    assert (tmp_path / ".r.gguf.tmp" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.gguf.tmp", "r.gguf"]


@needs_assets
@pytest.mark.parametrize("force", [False, True])
def test_a_rival_gguf_written_meanwhile_is_refused_or_replaced_whole(
    capsys, stories_gguf, tmp_path, monkeypatch, force
):
    """Two conversions to one OUT.gguf: the one that finishes second is refused without --force (the rival's file
    kept whole), and with --force replaces it whole; they used to share one partial file and mix their tensors."""
    from gguf import GGUFReader

    from gqaify.conversion import to_gguf

    out, rival = tmp_path / "r.gguf", stories_gguf["gqa2.gguf"].read_bytes()
    write = to_gguf.write_gguf

    def write_then_a_rival_finishes(*args, **kwargs):
        write(*args, **kwargs)
        out.write_bytes(rival)  # the other run's rename, while this one was writing

    monkeypatch.setattr(to_gguf, "write_gguf", write_then_a_rival_finishes)
    code, err = run_cli(
        capsys, "convert", MODELS / "stories260K-mha", out, "--kv-heads", "1", "-q", *(["--force"] if force else [])
    )
    heads = GGUFReader(out).fields["llama.attention.head_count_kv"].parts[-1][0]
    if force:
        assert code == 0 and heads == 1, err
    else:
        assert code == 2 and "appeared while this run was writing" in one_line(err) and out.read_bytes() == rival
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.gguf"]


@needs_assets
def test_the_record_inside_a_gguf_names_it_and_reruns_its_conversion(capsys, tmp_path):
    """The record used to name the deleted work folder as OUT and gguf_type null: a rerun from it wrote a folder
    into the next run's work folder. It also named the source as typed, which the rerun (from the record's absolute
    path) named otherwise: where the models were reached through a link, the rerun's file differed from the first
    in the record's length. The source is reached through a link here, so that every run meets that case."""
    from gguf import GGUFReader

    from gqaify.conversion.to_gguf import RECORD_KEY

    def record_in(path: Path) -> dict:
        field = GGUFReader(path).fields[RECORD_KEY]
        return json.loads(bytes(field.parts[field.data[0]]).decode())

    (tmp_path / "models").symlink_to(MODELS, target_is_directory=True)
    out = tmp_path / "q8.gguf"
    argv = ["convert", tmp_path / "models" / "stories260K-mha", out, "--kv-heads", "2", "--gguf-type", "q8_0", "-q"]
    assert run_cli(capsys, *argv)[0] == 0
    record = record_in(out)
    assert record["settings"]["out"] == str(out) and record["settings"]["gguf_type"] == "q8_0"
    assert "files" not in record and record["kv_heads"] == 2
    src = str((MODELS / "stories260K-mha").resolve())
    assert record["source"]["name"] == record["settings"]["src"] == src  # however the source was reached
    (tmp_path / "rec.json").write_text(json.dumps(record))
    first = out.read_bytes()
    code, err = run_cli(capsys, "convert", "--config", tmp_path / "rec.json", "--force", "-q")
    assert code == 0, err
    assert record_in(out) == record  # what differs, named, before the bytes are compared
    assert out.read_bytes() == first  # the same conversion, the same file, in the same place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "q8.gguf", "rec.json"]


def _gguf(*entries: bytes, tensors: int = 0, version: int = 3) -> bytes:
    """A GGUF header with these metadata entries (each key, type and value already packed)."""
    return b"GGUF" + struct.pack("<IQQ", version, tensors, len(entries)) + b"".join(entries)


def _text(value: str) -> bytes:
    return struct.pack("<Q", len(value.encode())) + value.encode()


def _entry(key: str, value: str) -> bytes:
    return _text(key) + struct.pack("<I", 8) + _text(value)


DAMAGED = {
    "cut short": lambda whole: whole[:100],
    "2^62 tensors": lambda whole: whole[:8] + struct.pack("<Q", 1 << 62) + whole[16:],
    "an array of 2^40": lambda _: _gguf(_text("a") + struct.pack("<IIQ", 9, 0, 1 << 40)),
    "a key of 2^40 bytes": lambda _: _gguf(struct.pack("<Q", 1 << 40) + b"k"),
    "strings cut short": lambda _: _gguf(_text("t") + struct.pack("<IIQ", 9, 8, 5) + _text("one")),
    "no hyperparameters": lambda _: _gguf(_entry("general.architecture", "llama")),
}


def refuse_the_readers(monkeypatch) -> list[str]:
    """gguf's own reader and every transformers model, each refused and named in the list returned where a command
    reaches it: a damaged file is refused by gqaify's bounded header reader before either (gguf's looped and grew
    without bound, transformers built its 6 GB default model first)."""
    import gguf
    import transformers

    reached = []

    def refused(name: str):
        def init(self, *args, **kwargs):
            reached.append(name)
            raise RuntimeError(f"{name} reached")

        return init

    monkeypatch.setattr(gguf.GGUFReader, "__init__", refused("gguf.GGUFReader"))
    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", refused("a transformers model"))
    return reached


@needs_assets
@pytest.mark.parametrize("damage", DAMAGED, ids=list(DAMAGED))
@pytest.mark.parametrize("command", ["convert", "eval"])
def test_a_damaged_gguf_source_is_one_line_at_once(capsys, monkeypatch, stories_gguf, tmp_path, damage, command):
    """Each was a traceback (exit 1), an unbounded loop, or a 6 GB default model built before failing: now refused
    before gguf's reader or any model is reached."""
    src = tmp_path / "bad.gguf"
    src.write_bytes(DAMAGED[damage](stories_gguf["gqa2.gguf"].read_bytes()))
    args = {
        "convert": [src, tmp_path / "out", "--kv-heads", "1"],
        "eval": [src, "--data", MODELS.parent / "text" / "tinystories-valid-head.txt", "--out", tmp_path / "out"],
    }
    reached = refuse_the_readers(monkeypatch)
    code, err = run_cli(capsys, command, *args[command])
    assert code == 2 and reached == [], err
    line = one_line(err)
    assert f"{src}" in line and ("is not a readable GGUF file" in line or "lacks llama.block_count" in line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_a_malformed_gguf_as_out_is_refused_with_force_at_once(capsys, monkeypatch, tmp_path):
    """A 132-byte GGUF whose array claims 2^40 items sent gguf's reader into a loop that grew ~150 MB/s: now refused
    before gguf's reader is reached."""
    src = save_with_tokenizer(build_model("llama", num_kv_heads=2, vocab_size=320), tmp_path / "src")
    out = tmp_path / "r.gguf"
    out.write_bytes(DAMAGED["an array of 2^40"](b""))
    before = out.read_bytes()
    reached = refuse_the_readers(monkeypatch)
    code, err = run_cli(capsys, "convert", src, out, "--kv-heads", "1", "--force")
    assert code == 2 and reached == [] and "is not a GGUF gqaify wrote" in one_line(err)
    assert out.read_bytes() == before


def test_a_folder_without_a_tokenizer_is_said_to_have_none(capsys, tmp_path):
    """It was described as a byte-level BPE vocabulary llama.cpp would misread."""
    src = tmp_path / "src"
    build_model("llama", num_kv_heads=2, vocab_size=320).save_pretrained(src)
    code, err = run_cli(capsys, "convert", src, tmp_path / "r.gguf", "--kv-heads", "1")
    line = one_line(err)
    fix = "has no tokenizer (tokenizer.json); copy the parent's tokenizer files into it"
    assert code == 2 and line.endswith(f"{src} {fix}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@needs_assets
def test_a_gguf_out_in_a_read_only_folder_is_named_as_out(capsys, read_only, tmp_path):
    """The refusals named the work folder checked in OUT's place (.OUT.gguf.gqaify-work), which the user never named."""
    out = read_only / "r.gguf"
    code, err = run_cli(capsys, "convert", STORIES_MHA, out, "--kv-heads", "2", "-q")
    line = one_line(err)
    assert code == 2 and f"cannot write {out}: its parent is not a writable folder" in line, line
    assert ".gqaify-work" not in line and line.count("writable") == 1
    assert list(read_only.iterdir()) == []
    code, err = run_cli(capsys, "convert", STORIES_MHA, STORIES_MHA / "r.gguf", "--kv-heads", "2", "-q")
    line = one_line(err)
    assert code == 2 and f"OUT {STORIES_MHA / 'r.gguf'} overlaps the source folder" in line, line


@needs_assets
@pytest.mark.parametrize("command", ["convert", "eval"])
def test_a_gguf_source_with_text_that_is_not_utf8_is_not_called_a_json_file(capsys, stories_gguf, tmp_path, command):
    """transformers' words for it were "the config file ... is not a valid JSON file"."""
    whole = bytearray(stories_gguf["gqa2.gguf"].read_bytes())
    whole[whole.find(b'"tool"') + 1] = 0xFF  # inside the record gqaify writes into the file, a string value
    src = tmp_path / "bad.gguf"
    src.write_bytes(bytes(whole))
    args = {
        "convert": [src, tmp_path / "out", "--kv-heads", "1"],
        "eval": [src, "--data", MODELS.parent / "text" / "tinystories-valid-head.txt", "--out", tmp_path / "out"],
    }
    code, err = run_cli(capsys, command, *args[command])
    line = one_line(err)
    assert code == 2 and f"{src} is not a readable GGUF file (gqaify.record is not UTF-8 text (byte " in line, line
    assert "JSON" not in line and sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


@needs_assets
def test_a_gguf_under_a_llama_cpp_cache_without_llama_cpp_is_refused_naming_the_extra(
    stories_gguf, tmp_path, capsys, monkeypatch
):
    """llama.cpp's cache formats run in llama-cpp-python (the `serving` extra): without it, one line naming the extra,
    exit 2, before any model is loaded, and no report folder."""
    import importlib.util

    import gqaify.eval.core as core

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else found(name, *a))

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(core, "load_model", loaded)
    text = MODELS.parent / "text" / "tinystories-valid-head.txt"
    models = [str(stories_gguf["gqa2.gguf"]), str(stories_gguf["mqa.gguf"])]
    code, err = run_cli(capsys, "eval", *models, "--data", text, "--out", tmp_path / "r", "--kv-cache", "f16", "q8_0")
    said = one_line(err)  # every problem at once: stories260K's heads of 8 values cannot hold q8_0's blocks either
    assert (
        code == 2
        and "llama.cpp's cache formats run in llama-cpp-python, which is not installed; pip install 'gqaify[serving]'"
        in said
        and "stores blocks of 32 values, which do not divide the 8-value heads" in said
    )
    assert not (tmp_path / "r").exists()
