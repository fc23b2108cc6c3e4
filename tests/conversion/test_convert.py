"""What a conversion writes: tensors against an in-memory reference, shards, config, side files, provenance."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import gqaify
from gqaify.conversion.layout import Attention
from gqaify.conversion.methods import METHODS, MethodContext
from gqaify.testing import build_model, save
from helpers import FakeHub, load, logits, run_cli, sample_ids, tree_hashes


def read_shard(path):
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def read_all(directory):
    return {name: t for path in sorted(directory.glob("*.safetensors")) for name, t in read_shard(path).items()}


@pytest.fixture
def mha_llama(tmp_path):
    """A 4-layer random MHA llama (8 heads, head_dim 8) saved in many small shards."""
    model = build_model("llama", num_kv_heads=8, num_attention_heads=8, head_dim=8, num_hidden_layers=4)
    return model, save(model, tmp_path / "src", max_shard_size="30KB")


def test_streaming_equals_in_memory_reference(mha_llama, tmp_path):
    model, src = mha_llama
    gqaify.convert(src, tmp_path / "out", kv_heads=2, max_shard_size="50KB", progress=False)
    out = read_all(tmp_path / "out")
    reference = model.state_dict()
    assert set(out) == set(reference) - {"lm_head.weight"}  # tied: saved once, as save_pretrained does
    for name, expected in reference.items():
        if name == "lm_head.weight":
            continue
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # (8*8, 64) -> (2, 4, 8, 64) -> mean over 4
            expected = expected.view(2, 4, 8, 64).mean(1).reshape(16, 64)
        assert torch.equal(out[name], expected), name


def test_output_is_sharded_with_an_index(mha_llama, tmp_path):
    _, src = mha_llama
    result = gqaify.convert(src, tmp_path / "out", kv_heads=4, max_shard_size="50KB", progress=False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert result.num_shards == len(shards) > 1
    assert sorted(set(index["weight_map"].values())) == shards
    sizes = [sum(t.nbytes for t in read_shard(tmp_path / "out" / s).values()) for s in shards]
    assert max(sizes) <= 50_000 or len(read_shard(tmp_path / "out" / shards[sizes.index(max(sizes))])) == 1
    assert index["metadata"]["total_size"] == sum(sizes) == result.bytes_written


def test_config_changes_only_kv_heads_and_side_files_are_carried(mha_llama, tmp_path):
    _, src = mha_llama
    (src / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    gqaify.convert(src, tmp_path / "out", kv_heads=1, progress=False)
    before = json.loads((src / "config.json").read_text())
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    assert after.pop("num_key_value_heads") == 1
    before.pop("num_key_value_heads")
    assert after == before
    for name in ("generation_config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()
    assert not list(tmp_path.glob(".out.gqaify-*"))  # no staging folder left behind


def test_provenance_and_model_card(mha_llama, tmp_path):
    _, src = mha_llama
    gqaify.convert(src, tmp_path / "out", kv_heads=2, progress=False)
    record = json.loads((tmp_path / "out" / "gqaify.json").read_text())
    assert record["method"] == "mean" and record["kv_heads"] == 2 and record["version"] == gqaify.__version__
    assert record["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert record["source"]["kind"] == "local"
    hashes = tree_hashes(src)
    assert record["source"]["sha256"] == {n: hashes[n] for n in record["source"]["sha256"]}
    assert set(record["source"]["sha256"]) == {p.name for p in src.glob("*.safetensors")}
    card = (tmp_path / "out" / "README.md").read_text()
    assert "8 → 2" in card and "`mean`" in card


def test_the_card_cites_the_paper_a_method_comes_from_and_every_reference_is_known(mha_llama, tmp_path):
    """Methods and shapes carry their papers as data; the card cites a method's (mean-pooling: the GQA paper) and
    says none for gqaify's own."""
    from gqaify.conversion.papers import PAPERS
    from gqaify.conversion.registry import ATTENTION_INFO, METHOD_INFO

    _, src = mha_llama
    gqaify.convert(src, tmp_path / "mean", kv_heads=2, progress=False)
    card = (tmp_path / "mean" / "README.md").read_text()
    assert "(mean-pool every K/V-indexed tensor over each group (the GQA paper); after Ainslie et al." in card
    assert "Checkpoints (2023), arXiv:2305.13245)" in card
    gqaify.convert(src, tmp_path / "norm", kv_heads=2, method="norm-mean", progress=False)
    assert "arXiv" not in (tmp_path / "norm" / "README.md").read_text()  # gqaify's own
    cited = [info.reference for info in METHOD_INFO.values() if info.reference]
    cited += [paper for info in ATTENTION_INFO.values() for paper in info.references]
    assert cited and set(cited) <= set(PAPERS)
    assert all(key.count(".") == 1 and len(key) == 10 for key in PAPERS)  # arXiv ids: YYMM.NNNNN


def test_model_card_is_one_the_hub_parses_with_base_model_and_licence(mha_llama, tmp_path):
    """A source in the Hugging Face cache has a hub id (base_model); its card's licence is copied to ours."""
    from huggingface_hub import ModelCard

    _, src = mha_llama
    cached = tmp_path / "hub" / "models--someone--tiny-llama" / "snapshots" / ("ab" * 20)
    shutil.copytree(src, cached)
    (cached / "README.md").write_text("---\nlicense: other\nlicense_name: tiny\nlicense_link: LICENSE\n---\n# Tiny\n")
    gqaify.convert(cached, tmp_path / "out", kv_heads=1, progress=False)
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.base_model == "someone/tiny-llama" and card.data.base_model_relation == "finetune"
    assert (card.data.license, card.data.license_name, card.data.license_link) == ("other", "tiny", "LICENSE")
    assert card.data.library_name == "transformers" and card.data.tags == ["gqaify", "gqa", "mqa"]
    assert "8 → 1" in card.text and "`mean`" in card.text

    gqaify.convert(src, tmp_path / "plain", kv_heads=2, progress=False)  # a folder elsewhere: no hub id, no licence
    data = ModelCard.load(tmp_path / "plain" / "README.md").data
    assert data.base_model is None and data.license is None and data.tags == ["gqaify", "gqa"]


def test_dtype_casts_floating_tensors_and_config(mha_llama, tmp_path):
    model, src = mha_llama
    gqaify.convert(src, tmp_path / "out", kv_heads=2, dtype="bfloat16", progress=False)
    assert {t.dtype for t in read_all(tmp_path / "out").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    # pooling runs in float32, then rounds once: the same as rounding the float32 result
    pooled = model.state_dict()["model.layers.0.self_attn.k_proj.weight"].view(2, 4, 8, 64).mean(1).reshape(16, 64)
    assert torch.equal(read_all(tmp_path / "out")["model.layers.0.self_attn.k_proj.weight"], pooled.bfloat16())


def save_bin(model, directory):
    """A two-shard pytorch_model.bin checkpoint, as transformers 4 wrote them (v5 no longer does)."""
    model.config.save_pretrained(directory)
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
    names = list(state)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        filename = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({n: state[n].clone() for n in part}, directory / filename)
        weight_map.update(dict.fromkeys(part, filename))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_bin_source_converts_like_safetensors(mha_llama, tmp_path):
    model, src = mha_llama
    save_bin(model, tmp_path / "bin")
    gqaify.convert(tmp_path / "bin", tmp_path / "from-bin", kv_heads=2, progress=False)
    gqaify.convert(src, tmp_path / "from-st", kv_heads=2, progress=False)
    a, b = read_all(tmp_path / "from-bin"), read_all(tmp_path / "from-st")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_force_replaces_existing_output(mha_llama, tmp_path):
    _, src = mha_llama
    gqaify.convert(src, tmp_path / "out", kv_heads=2, progress=False)
    gqaify.convert(src, tmp_path / "out", kv_heads=1, force=True, progress=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_regrouping_a_gqa_model_to_fewer_heads(tmp_path):
    model = build_model("qwen2", num_kv_heads=2, num_attention_heads=4)
    save(model, tmp_path / "src")
    result = gqaify.convert(tmp_path / "src", tmp_path / "out", kv_heads=1, progress=False)
    assert (result.source_kv_heads, result.kv_heads, result.groups) == (2, 1, [[0, 1]])
    assert result.kv_bytes_per_token_before == 2 * result.kv_bytes_per_token_after
    k = read_all(tmp_path / "out")["model.layers.0.self_attn.k_proj.bias"]
    torch.testing.assert_close(k, model.state_dict()["model.layers.0.self_attn.k_proj.bias"].view(2, 16).mean(0))


def test_first_keeps_the_first_head_of_each_group():
    attn = Attention({"k.weight": torch.arange(6.0).view(6, 1, 1)})
    ctx = MethodContext(torch.Generator().manual_seed(0), 0.02)
    assert METHODS["first"].fn(attn, 2, ctx).kv["k.weight"].flatten().tolist() == [0.0, 3.0]
    assert METHODS["mean"].fn(attn, 2, ctx).kv["k.weight"].flatten().tolist() == [1.0, 4.0]


def test_random_reinitialises_projections_reproducibly(mha_llama, tmp_path):
    model, src = mha_llama
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        gqaify.convert(src, tmp_path / name, kv_heads=2, method="random", seed=seed, progress=False)
    a, b, c = (read_all(tmp_path / n) for n in "abc")
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(a[k], b[k]) and not torch.equal(a[k], c[k])
    assert abs(a[k].std().item() - model.config.initializer_range) < 0.005
    other = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a[other], model.state_dict()[other])
    assert json.loads((tmp_path / "a" / "gqaify.json").read_text())["seed"] == 0


def test_hub_id_is_fetched_with_snapshot_download(mha_llama, tmp_path, monkeypatch):
    """The hub is mocked by a folder (the repository, with a Mistral-style consolidated.safetensors beside the
    transformers shards) and a snapshot_download that copies the files its patterns match into a snapshot."""
    import fnmatch
    import shutil

    model, src = mha_llama
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "remote"
    save(model, repo, max_shard_size="30KB")
    (repo / "consolidated.safetensors").write_bytes((repo / "model-00001-of-00029.safetensors").read_bytes())
    (repo / "params.json").write_text("{}")
    snapshot = tmp_path / "hub" / "snapshots" / commit
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, tuple(allow_patterns)))
        snapshot.mkdir(parents=True, exist_ok=True)
        for path in repo.iterdir():
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in allow_patterns):
                shutil.copyfile(path, snapshot / path.name)
        return str(snapshot)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    gqaify.convert("someone/tiny-llama", tmp_path / "out", kv_heads=2, revision="main", progress=False)
    assert calls[0][:2] == ("someone/tiny-llama", "main") and "*.json" in calls[0][2]
    assert not any("safetensors" in pattern and "*" in pattern for call in calls for pattern in call[2])
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    assert set(calls[1][2]) == set(index["weight_map"].values()) and calls[1][1] == commit
    assert not (snapshot / "consolidated.safetensors").exists()  # never downloaded
    assert not (tmp_path / "out" / "consolidated.safetensors").exists()
    record = json.loads((tmp_path / "out" / "gqaify.json").read_text())
    assert record["source"] | {"sha256": None} == {
        "name": "someone/tiny-llama",
        "kind": "hub",
        "path": None,
        "revision": commit,
        "sha256": None,
    }
    assert "base_model: someone/tiny-llama" in (tmp_path / "out" / "README.md").read_text()
    ids = sample_ids(model.config.vocab_size)
    assert logits(load(tmp_path / "out"), ids).shape == logits(model, ids).shape


def test_local_source_carries_side_files_but_no_other_weights(mha_llama, tmp_path):
    """A local Mistral-style download: consolidated.safetensors (the original weights in another format) must not
    ride along into OUT, where tools that read that format would load the unconverted model."""
    import shutil

    _, src = mha_llama
    folder = tmp_path / "mistral-style"
    shutil.copytree(src, folder)
    (folder / "consolidated.safetensors").write_bytes(b"original weights")
    (folder / "LICENSE").write_text("the licence")
    (folder / "tokenizer.model").write_bytes(b"sentencepiece")
    gqaify.convert(folder, tmp_path / "out", kv_heads=2, progress=False)
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert "consolidated.safetensors" not in names
    assert {"LICENSE", "tokenizer.model", "generation_config.json"} <= names


@pytest.mark.parametrize("refuse", [(), ("copy_file_range",), ("copy_file_range", "sendfile")])
def test_shard_writer_round_trips_every_dtype(tmp_path, monkeypatch, refuse):
    """Tensors written from memory or copied as bytes read back identically; kernel copies may be refused."""
    import errno
    import os

    from safetensors.torch import save_file

    from gqaify.conversion.checkpoint import SafetensorsSource, ShardWriter, TensorMeta

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(5, 3, generator=gen).bfloat16(),
        "b.scalar": torch.tensor(2.5),
        "c.empty": torch.zeros(0, 4),
        "d.int": torch.arange(7, dtype=torch.int64),
        "e.bool": torch.tensor([True, False, True]),
        "f.half": torch.randn(33, generator=gen).half(),
    }
    save_file(tensors, tmp_path / "src.safetensors")
    source = {t.name: t for t in SafetensorsSource([tmp_path / "src.safetensors"]).iter_tensors()}
    for name in refuse:
        monkeypatch.setattr(os, name, lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "refused")))
    plan = {n: TensorMeta(tuple(t.shape), t.dtype) for n, t in tensors.items()}
    (tmp_path / "out").mkdir()
    with ShardWriter(tmp_path / "out", plan, max_shard_size=64) as writer:
        for i, name in enumerate(plan):
            if i % 2:
                writer.write(name, tensors[name])
            else:
                writer.copy(name, source[name].bytes)
        writer.close()
    assert writer.num_shards > 1
    back = read_all(tmp_path / "out")
    assert back.keys() == tensors.keys()
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in tensors.items())


def test_force_restores_the_old_output_if_the_swap_fails(mha_llama, tmp_path, monkeypatch):

    _, src = mha_llama
    gqaify.convert(src, tmp_path / "out", kv_heads=2, progress=False)
    before = tree_hashes(tmp_path / "out")
    rename = Path.rename

    def failing_rename(self, target):
        if self.name.startswith(".out.gqaify-") and Path(target) == tmp_path / "out":
            raise OSError("disk full")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="disk full"):
        gqaify.convert(src, tmp_path / "out", kv_heads=1, force=True, progress=False)
    assert tree_hashes(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_norm_mean_restores_the_groups_mean_row_norm():
    # two orthogonal heads of one row each, norms 3 and 1: the mean has norm sqrt(10)/2, direction (3, 1)
    heads = {"k.weight": torch.tensor([[[3.0, 0.0]], [[0.0, 1.0]]]), "v.weight": torch.ones(2, 1, 2)}
    heads["k.bias"] = torch.tensor([[2.0], [0.0]])
    out = METHODS["norm-mean"].fn(Attention(heads), 1, MethodContext(torch.Generator(), 0.02)).kv
    k = out["k.weight"][0, 0]
    assert k.norm().item() == pytest.approx(2.0)  # the mean of the norms 3 and 1
    assert (k / k.norm()).tolist() == pytest.approx((torch.tensor([3.0, 1.0]) / 10**0.5).tolist())
    assert out["k.bias"].item() == pytest.approx(1.0 * 2.0 / (10**0.5 / 2))  # scaled with its row
    assert torch.equal(out["v.weight"], torch.ones(1, 1, 2))  # identical heads: nothing to restore


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "olmo2"])
def test_norm_mean_on_duplicated_heads_reproduces_the_gqa_model(model_type, tmp_path):
    from gqaify.testing import duplicate_kv_heads

    gqa = build_model(model_type, num_kv_heads=2)
    save(duplicate_kv_heads(gqa), tmp_path / "mha")
    gqaify.convert(tmp_path / "mha", tmp_path / "out", kv_heads=2, method="norm-mean", progress=False)
    ids = sample_ids(gqa.config.vocab_size)
    torch.testing.assert_close(logits(load(tmp_path / "out"), ids), logits(gqa, ids))
    gqaify.convert(tmp_path / "mha", tmp_path / "same", kv_heads=4, method="norm-mean", progress=False)
    assert torch.equal(logits(load(tmp_path / "same"), ids), logits(load(tmp_path / "mha"), ids))


def test_push_to_hub_uploads_the_complete_folder_in_one_commit(mha_llama, tmp_path, monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub import ModelCard

    FakeHub.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    _, src = mha_llama
    out = tmp_path / "out"
    assert run_cli(capsys, "convert", src, out, "--kv-heads", "2", "--push-to-hub", "you/tiny-gqa2", "-q")[0] == 0
    (create, upload) = FakeHub.calls
    assert create == ("create_repo", "you/tiny-gqa2", True)
    assert upload[:3] == ("upload_folder", "you/tiny-gqa2", str(out.resolve()))
    assert upload[3] == sorted(p.name for p in out.iterdir())  # everything, the card included, in one commit
    assert {"README.md", "config.json", "gqaify.json", "model.safetensors"} <= set(upload[3])
    assert upload[4].startswith("GQA-2 of ") and ModelCard.load(out / "README.md").data.tags == ["gqaify", "gqa"]

    FakeHub.calls = []  # a conversion that fails, or a repository id that is not one: nothing is pushed
    code, err = run_cli(capsys, "convert", src, tmp_path / "bad", "--kv-heads", "3", "--push-to-hub", "you/x")
    assert code == 2 and FakeHub.calls == [] and not (tmp_path / "bad").exists()
    code, err = run_cli(capsys, "convert", src, tmp_path / "bad", "--kv-heads", "2", "--push-to-hub", "not a/repo/id")
    assert code == 2 and "owner/name" in err and FakeHub.calls == [] and not (tmp_path / "bad").exists()


def test_a_failed_push_keeps_the_complete_folder_and_says_how_to_push_it(mha_llama, tmp_path, monkeypatch, capsys):
    import httpx2 as httpx
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    class Refusing(FakeHub):
        def create_repo(self, repo_id, **kwargs):
            request = httpx.Request("POST", "https://huggingface.co/api/repos/create")
            raise HfHubHTTPError("401 Client Error: Unauthorized", response=httpx.Response(401, request=request))

    monkeypatch.setattr(huggingface_hub, "HfApi", Refusing)
    _, src = mha_llama
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2", "--push-to-hub", "you/x", "-q")
    assert code == 2 and err.count("\n") == 1 and "hf upload you/x" in err and "Unauthorized" in err, err
    assert load(tmp_path / "out").config.num_key_value_heads == 2  # complete, loadable


def test_a_stop_after_the_conversion_says_it_is_complete_not_that_nothing_was_written(
    mha_llama, tmp_path, capsys, monkeypatch
):
    """A conversion stopped once its OUT was in place (in its summary: a convert whose standard output was closed
    sat there until stopped) said "interrupted; nothing was written" beside the complete OUT. It says OUT is
    complete, and OUT is as an uninterrupted run leaves it."""
    import gqaify.summary

    _, src = mha_llama

    def stopped(result):
        raise KeyboardInterrupt

    monkeypatch.setattr(gqaify.summary, "format_summary", stopped)
    code, err = run_cli(capsys, "convert", src, tmp_path / "out", "--kv-heads", "2", "-q")
    out = tmp_path / "out"
    assert code == 130 and err == f"gqaify: interrupted; {out} is complete: the conversion ended before the stop\n"
    assert (out / "config.json").is_file() and read_all(out)
