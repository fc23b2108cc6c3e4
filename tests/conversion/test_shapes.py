"""A third attention shape is one folder and one registry entry: a toy shape, registered here and nowhere else, that
writes a model class of its own, is converted, recorded, described, counted in the architecture table, evaluated
and given its trainable attention, by the pipeline as it is; and no generic module names a shape."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import gqaify
from gqaify.conversion import coverage
from gqaify.conversion.gqa import GQA
from gqaify.conversion.record import ConversionRecord
from gqaify.conversion.registry import ATTENTION_INFO, ShapeInfo
from gqaify.conversion.shape_contract import Rewritten, Shape, ShapeRecord
from gqaify.conversion.shapes import held_parameters, shape, trained_attention
from gqaify.errors import UserError
from gqaify.eval.settings import EvalSettings
from gqaify.model.archs import LAYER, TrainedAttention
from gqaify.summary import format_summary
from gqaify.testing import CORPUS, build_model, save_with_tokenizer
from helpers import one_line, run_cli

SCALE = 2.0  # the toy rewrite doubles every v_proj and halves every o_proj: the same function, other weights


@dataclasses.dataclass(frozen=True)
class ToyRecord(ShapeRecord):
    scale: float
    values: int  # what a token caches per layer: the G heads' keys and values, as the stream wrote them

    @property
    def cached_per_token(self) -> int:
        return self.values

    def attention(self, kind: str) -> str:
        return f"TOY ({kind})"

    def summary_lines(self) -> list[str]:
        return [f"  toy             v_proj x {self.scale:g}, o_proj / {self.scale:g}"]

    def card_line(self, record) -> str:
        return f"- Then rescaled by the toy shape (v_proj x {self.scale:g})."


TOY_TYPE = "toy_llama"  # the model class the toy writes: Llama's, under a model type gqaify converts from none
# where that class's attention trains (the toy's `ShapeInfo.writes`): the toy keeps k_proj as converted
TOY_WRITTEN = {
    TOY_TYPE: TrainedAttention.at(f"model.layers.{LAYER}.self_attn", ("q_proj", "v_proj", "o_proj"), ("v_proj",))
}


def toy_class():
    """The toy's model class, registered with transformers' Auto classes (as a shape's folder would ship it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    class ToyConfig(LlamaConfig):
        model_type = TOY_TYPE

    class ToyForCausalLM(LlamaForCausalLM):
        config_class = ToyConfig

    AutoConfig.register(TOY_TYPE, ToyConfig, exist_ok=True)
    AutoModelForCausalLM.register(ToyConfig, ToyForCausalLM, exist_ok=True)
    return ToyForCausalLM


class ToyShape:
    """A shape that rewrites the G-head folder into the same function with other weights, in a model class of its
    own, and says so in its config.json; what it does not do itself it asks GQA."""

    float16 = "a toy's weights are kept in float32 by the toy's own rule"

    def __getattr__(self, name):  # resolve_cut, run_name, planned_config, write_gguf ...: GQA's
        return getattr(GQA, name)

    def reads_text(self, s) -> bool:
        return False

    def covers(self, spec) -> str:
        return "toy" if spec.model_type == "llama" else "no"

    def rewrite(self, folder: Path, s, text, load_parent, source) -> Rewritten:
        shards = sorted(folder.glob("model*.safetensors"))
        for shard in shards:
            tensors = load_file(shard)
            for name in tensors:
                factor = SCALE if ".v_proj." in name else 1 / SCALE if ".o_proj." in name else 1
                tensors[name] = tensors[name] * factor
            save_file(tensors, shard, metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        written = {"model_type": TOY_TYPE, "architectures": ["ToyForCausalLM"], "toy_scaled": True}
        (folder / "config.json").write_text(json.dumps({**config, **written}))
        values = source.with_kv_heads(s.kv_heads).cached_per_token
        return Rewritten(ToyRecord(scale=SCALE, values=values), len(shards), sum(p.stat().st_size for p in shards))

    def weight_bytes(self, s, config: dict) -> int:
        return 0  # it rewrites the stream's shards in place, no larger

    def wrote(self, config) -> bool:
        return bool(config.get("toy_scaled") if isinstance(config, dict) else getattr(config, "toy_scaled", False))

    def held(self, model) -> list[str]:
        return ["model.layers.0.self_attn.k_proj.weight"]

    def cost_note(self, s, source) -> str:
        return "toy: every v_proj doubled"

    def problems(self, s, config: dict, out_is_gguf: bool) -> list[str]:
        return ["a toy writes no GGUF; name OUT without .gguf"] if out_is_gguf else []


@pytest.fixture
def toy(monkeypatch):
    """The toy shape registered for one test: its module, and its entry in ATTENTION_INFO."""
    module = types.ModuleType("toy_shape")
    module.TOY, module.ToyRecord, module.WRITTEN = ToyShape(), ToyRecord, TOY_WRITTEN
    monkeypatch.setitem(sys.modules, "toy_shape", module)
    toy_class()
    entry = ShapeInfo(
        "a toy: the same function, rescaled",
        "toy",
        "TOY",
        "toy_shape:TOY",
        record="toy_shape:ToyRecord",
        writes="toy_shape:WRITTEN",
    )
    monkeypatch.setitem(ATTENTION_INFO, "toy", entry)
    shape.cache_clear()
    yield module.TOY
    shape.cache_clear()


def test_a_toy_shape_registered_in_the_test_is_converted_recorded_described_and_evaluated(toy, tmp_path, capsys):
    assert isinstance(toy, Shape)
    src = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), tmp_path / "src")
    plain = gqaify.convert(src, tmp_path / "gqa", kv_heads=2, progress=False)
    result = gqaify.convert(src, tmp_path / "toy", kv_heads=2, attention="toy", progress=False)

    # converted: the rewrite ran on the stream's G-head output, and the function is the G-head model's
    from transformers import AutoModelForCausalLM

    rewritten = AutoModelForCausalLM.from_pretrained(tmp_path / "toy", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "gqa", dtype=torch.float32)
    assert rewritten.config.model_type == TOY_TYPE and type(rewritten).__name__ == "ToyForCausalLM"
    v = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(rewritten.state_dict()[v], SCALE * reference.state_dict()[v])
    ids = torch.arange(3, 27)[None] % reference.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(rewritten(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)

    # recorded: gqaify.json keeps the toy's record under its name, read back as the toy's own type
    stored = json.loads((tmp_path / "toy" / "gqaify.json").read_text())
    assert stored["toy"] == {"scale": SCALE, "values": 2 * 2 * reference.config.head_dim}
    record = ConversionRecord.read(tmp_path / "toy")
    assert isinstance(record.rewrite, ToyRecord) and record.attention == "TOY (GQA-2)"
    assert (
        record.output_geometry.cached_per_token
        == ConversionRecord.read(tmp_path / "gqa").output_geometry.cached_per_token
    )

    # described: the summary, the card and the architecture table say what the shape says
    summary = format_summary(result)
    assert "converted llama to TOY (GQA-2)" in summary and "  toy             v_proj x 2, o_proj / 2" in summary
    card = (tmp_path / "toy" / "README.md").read_text()
    assert "- Then rescaled by the toy shape (v_proj x 2)." in card and "- toy" in card.split("---")[1]
    assert "TOY" not in format_summary(plain) and "`--attention toy` |" in coverage.markdown().splitlines()[0]

    # evaluated: eval counts its cache, and asks its shape what float16 can hold (a one-line refusal, nothing written)
    text = tmp_path / "text.txt"
    text.write_text(CORPUS)
    settings = EvalSettings(seq_len=32, speed=False, progress=False)
    report = gqaify.evaluate([str(tmp_path / "gqa"), str(tmp_path / "toy")], str(text), tmp_path / "report", settings)
    parent, converted = report.models
    assert converted.kv_cache_bytes_per_token == parent.kv_cache_bytes_per_token
    assert converted.nll == pytest.approx(parent.nll, rel=1e-5)
    code, err = run_cli(
        capsys, "eval", tmp_path / "toy", "--data", text, "--out", tmp_path / "r16", "--dtype", "float16"
    )
    assert code == 2 and "a toy's weights are kept in float32 by the toy's own rule, which --dtype float16" in one_line(
        err
    )
    assert not (tmp_path / "r16").exists()
    # trained: uptraining finds where the class the toy writes trains in the toy's entry, and keeps what it holds
    assert held_parameters(rewritten) == ["model.layers.0.self_attn.k_proj.weight"]  # asked of the model's shape
    from gqaify.uptrain.lora import target_pattern

    adapted = [n for n, _ in rewritten.named_modules() if re.fullmatch(target_pattern(TOY_TYPE), n)]
    assert adapted == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj", "o_proj")]

    # refused as the shape says, before anything is written
    code, err = run_cli(capsys, "convert", src, tmp_path / "toy.gguf", "--kv-heads", "2", "--attention", "toy")
    assert code == 2 and "a toy writes no GGUF" in one_line(err) and not (tmp_path / "toy.gguf").exists()


def test_a_shape_that_misses_part_of_the_contract_is_named_for_it(monkeypatch):
    module = types.ModuleType("half_shape")
    module.HALF = types.SimpleNamespace(float16=None, reads_text=lambda s: False)
    monkeypatch.setitem(sys.modules, "half_shape", module)
    monkeypatch.setitem(ATTENTION_INFO, "half", ShapeInfo("half a shape", "half", "HALF", "half_shape:HALF"))
    shape.cache_clear()
    try:
        with pytest.raises(TypeError, match="half_shape:HALF is not a Shape: it lacks cached, cost_note, covers, held"):
            shape("half")
    finally:
        shape.cache_clear()


def test_a_class_a_shape_writes_trains_only_where_its_entry_names_it():
    """Without the toy's entry, the class it writes is one gqaify knows nothing of: uptraining refuses to guess where
    its attention is (the entry's `writes` is the only place that says)."""
    with pytest.raises(UserError, match=f"trainable lora: gqaify does not know where attention lives in {TOY_TYPE}"):
        trained_attention(TOY_TYPE, "trainable lora")


SRC = Path(__file__).resolve().parents[2] / "src" / "gqaify"
# The generic modules that may name a shape, each a data table or a citation, and why: at most five (four today)
MAY_NAME_A_SHAPE = {
    "conversion/registry.py": "the shapes' entries",
    "conversion/papers.py": "the papers the shapes cite",
    "model/archs.py": "the architectures refused for caching no K/V heads (a latent), with their reason",
    "packaged.py": "the recipes' registry, whose recipes convert to the shapes",
}


def test_no_generic_module_names_a_shape_but_its_entry_and_the_data_tables():
    """A shape lives in its folder and its registry entry: no other module names it (its registry name, its label,
    the words of its title that the stream's shape does not share: "mla", "latent"), so that nothing outside the
    folder and the entry changes when a shape is added, but the data tables and citations listed above."""
    assert len(MAY_NAME_A_SHAPE) <= 5
    naming = {}
    for name, info in ATTENTION_INFO.items():
        if name == "gqa":  # the shape the stream writes: gqaify's own name
            continue
        stream = set(re.findall(r"[a-z]+", ATTENTION_INFO["gqa"].title.lower()))
        words = {name, info.label.lower(), *(set(re.findall(r"[a-z]+", info.title.lower())) - stream)}
        folder = SRC.joinpath(*info.shape.split(":")[0].split(".")[1:]).parent
        pattern = re.compile(rf"\b({'|'.join(map(re.escape, sorted(words)))})\b", re.IGNORECASE)
        for path in SRC.rglob("*.py"):
            if folder not in path.parents and pattern.search(path.read_text()):
                naming.setdefault(path.relative_to(SRC).as_posix(), set()).add(name)
    assert set(naming) <= set(MAY_NAME_A_SHAPE), {m: naming[m] for m in set(naming) - set(MAY_NAME_A_SHAPE)}
