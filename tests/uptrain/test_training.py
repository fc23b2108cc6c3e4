"""Uptraining's loop: packed data and its order, the run's outputs (a plain checkpoint, metrics, the plot), resume,
distillation (live and stored), trainable subsets, evaluation panels and mixtures, checkpoint rotation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageStat
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gqaify.errors import UserError
from gqaify.eval.results import PanelSummary, TextScore
from gqaify.testing import CORPUS, build_model
from gqaify.uptrain import parse
from gqaify.uptrain import run as uptrain
from gqaify.uptrain.data import EpochSampler, packed_blocks
from gqaify.uptrain.distill import distillation_kl
from gqaify.uptrain.metrics import read_metrics
from helpers import (
    FakeHub,
    losses,
)
from helpers import uptrain_args as args

# -- data ----------------------------------------------------------------------------------------------------


def test_blocks_pack_documents_with_eos_and_no_padding(tiny, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny["converted"])
    docs = ["the quick brown fox", "jumps over the lazy dog", "perplexity measures surprise"]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    blocks = packed_blocks(str(tmp_path / "d.jsonl"), "train", "text", tokenizer, seq_len=4)
    stream = [t for d in docs for t in [*tokenizer(d)["input_ids"], tokenizer.eos_token_id]]
    expected = torch.tensor(stream[: len(stream) // 4 * 4]).view(-1, 4)
    assert torch.equal(torch.stack([b["input_ids"] for b in blocks]), expected)


def test_epoch_order_is_a_function_of_seed_and_epoch():
    sampler = EpochSampler(10, seed=3, multiple=4)
    first = list(sampler)
    assert len(first) == 8 and len(set(first)) == 8  # a whole number of steps, no repeats
    assert list(EpochSampler(10, seed=3, multiple=4)) == first
    sampler.set_epoch(1)
    assert list(sampler) != first


# -- the loop ------------------------------------------------------------------------------------------------


def test_run_writes_a_plain_checkpoint_metrics_and_plot(tiny, tmp_path):
    out = tmp_path / "run"
    result = uptrain(
        parse(
            args(
                tiny,
                out,
                "--eval_data",
                str(tiny["eval"]),
                "--eval_every",
                "5",
                "--eval_points",
                "0",
                "--parent",
                str(tiny["parent"]),
                "--log_to",
                "csv",
            )
        )
    )
    assert result.steps == 20 and result.tokens == 1280  # 1280 tokens / (2 x 2 x 16) per step
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_key_value_heads == 2 and model.dtype == torch.float32
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 21))
    assert [r["step"] for r in rows if "eval_perplexity" in r] == [0, 5, 10, 15, 20]
    assert result.eval_perplexity < rows[0]["eval_perplexity"]  # it learned something
    assert result.parent_perplexity is not None
    with Image.open(out / "recovery.png") as image:
        image.load()  # decodes every pixel: a truncated or corrupt file raises here
        assert (image.format, image.size) == ("PNG", (1680, 504))  # 14 x 4.2 inches at 120 dpi
        assert ImageStat.Stat(image.convert("L")).stddev[0] > 10, "recovery.png is blank"
    assert (out / "metrics.csv").read_text().splitlines()[0] == "step,tokens,loss,lr,eval_perplexity"
    provenance = json.loads((out / "final" / "gqaify.json").read_text())
    assert provenance["kv_heads"] == 2 and provenance["uptrain"]["tokens"] == 1280
    assert json.loads((out / "run.json").read_text())["settings"]["mixed_precision"] == "no"  # resolved, not null
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "final" / "README.md")  # the conversion's card, with the uptraining added
    assert card.data.tags == ["gqaify", "gqa"] and "## Uptraining" in card.text
    assert f"{rows[0]['eval_perplexity']:.2f} before, **{result.eval_perplexity:.2f} after**" in card.text
    assert "(recovery.png)" in card.text
    assert (out / "final" / "recovery.png").read_bytes() == (out / "recovery.png").read_bytes()


def test_rerun_of_a_finished_run_does_nothing(tiny, tmp_path):
    out = tmp_path / "run"
    first = uptrain(parse(args(tiny, out)))
    stamp = (out / "final" / "model.safetensors").stat().st_mtime_ns
    again = uptrain(parse(args(tiny, out)))
    assert again == first and (out / "final" / "model.safetensors").stat().st_mtime_ns == stamp


def test_push_to_hub_uploads_final_once_complete(tiny, tmp_path, monkeypatch):
    """final/ (card and provenance included) in one commit after the run; a bad repository id is refused before
    anything is written; a finished run rerun with push_to_hub pushes without training again."""
    import huggingface_hub

    FakeHub.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    out = tmp_path / "run"
    with pytest.raises(UserError, match="push_to_hub 'not a/repo' is not a hub repository id"):
        parse(args(tiny, out, "--push_to_hub", "not a/repo"))
    result = uptrain(parse(args(tiny, out, "--push_to_hub", "you/tiny-gqa2-uptrained")))
    (create, upload) = FakeHub.calls
    assert create == ("create_repo", "you/tiny-gqa2-uptrained", True)
    assert upload[:3] == ("upload_folder", "you/tiny-gqa2-uptrained", str(out / "final"))
    assert upload[3] == sorted(p.name for p in (out / "final").iterdir())
    assert {"README.md", "gqaify.json", "config.json", "model.safetensors"} <= set(upload[3])
    assert upload[4].startswith("uptrained by gqaify") and f"{result.tokens:,} tokens" in upload[4]

    FakeHub.calls = []
    stamp = (out / "final" / "model.safetensors").stat().st_mtime_ns
    assert uptrain(parse(args(tiny, out, "--push_to_hub", "you/other"))) == result  # push_to_hub is resumable
    assert [c[:2] for c in FakeHub.calls] == [("create_repo", "you/other"), ("upload_folder", "you/other")]
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns == stamp


def test_distillation_lowers_kl_to_the_parent(tiny, tmp_path):
    parent = AutoModelForCausalLM.from_pretrained(tiny["parent"]).eval()
    ids = AutoTokenizer.from_pretrained(tiny["parent"])(CORPUS, return_tensors="pt").input_ids[:, :256]

    def kl(model_dir) -> float:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():
            return distillation_kl(model(ids).logits, parent(ids).logits, 1.0).item()

    distilled = uptrain(
        parse(args(tiny, tmp_path / "kd", "--distill_from", str(tiny["parent"]), "--distill_weight", "1"))
    )
    plain = uptrain(parse(args(tiny, tmp_path / "lm")))
    assert kl(distilled.final) < 0.8 * kl(tiny["converted"]) and kl(distilled.final) < kl(plain.final)


def test_distillation_from_stored_top_k_needs_no_teacher_and_does_as_well_as_one(tiny, tmp_path):
    from gqaify.entry.cli import main

    corpus = tmp_path / "corpus"
    assert (
        main(
            [
                "generate",
                str(tiny["parent"]),
                str(corpus),
                "--tokens",
                "4000",
                "--length",
                "40",
                "--top-logprobs",
                "16",
                "-q",
            ]
        )
        == 0
    )
    parent = AutoModelForCausalLM.from_pretrained(tiny["parent"]).eval()
    rows = [json.loads(line) for line in (corpus / "data" / "train-00000.jsonl").read_text().splitlines()]
    ids = torch.tensor([[i for row in rows for i in row["input_ids"]][:256]])  # text the parent wrote

    def kl(model_dir) -> float:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():
            return distillation_kl(model(ids).logits, parent(ids).logits, 1.0).item()

    def run(name: str, *teacher: str):
        # the budget is what the comparison below measures: it held at 2,000 tokens and failed at 1,200
        extra = ["--data", str(corpus), "--max_tokens", "4000", "--distill_weight", "1", *teacher]
        return uptrain(parse([*args(tiny, tmp_path / name), *extra]))

    stored = run("stored", "--distill_from_data")
    live = run("live", "--distill_from", str(tiny["parent"]))
    assert kl(stored.final) < 0.9 * kl(tiny["converted"]) and kl(stored.final) < kl(live.final)


def test_stored_blocks_pack_ids_and_top_k_side_by_side(tmp_path):
    from gqaify.uptrain.data import packed_stored_blocks

    rows = [
        {
            "text": "",
            "input_ids": list(range(n)),
            "top_ids": [[i, i + 1] for i in range(n)],
            "top_logprobs": [[-0.1 * i, -1.0 - i] for i in range(n)],
        }
        for n in (5, 9, 7)
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    blocks = packed_stored_blocks(str(tmp_path / "c.jsonl"), "train", seq_len=4)
    stream = [i for n in (5, 9, 7) for i in range(n)]
    assert len(blocks) == len(stream) // 4
    for b, block in enumerate(blocks):
        expected = torch.tensor(stream[4 * b : 4 * b + 4])
        assert torch.equal(block["input_ids"], expected)
        assert torch.equal(block["top_ids"], torch.stack([expected, expected + 1], -1))
        torch.testing.assert_close(block["top_logprobs"][:, 1], -1.0 - expected.float())


def test_distillation_kl_is_the_kl_divergence():
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    p, q = F.softmax(teacher / 2, -1), F.softmax(student / 2, -1)
    expected = (p * (p.log() - q.log())).sum(-1).mean() * 4
    assert distillation_kl(student, teacher, 2.0).item() == pytest.approx(expected.item(), rel=1e-5)
    assert distillation_kl(teacher, teacher, 1.0).item() == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("trainable", ["attention", "kv-only"])
def test_trainable_subset_leaves_other_weights_bit_identical(tiny, tmp_path, trainable):
    result = uptrain(parse(args(tiny, tmp_path / trainable, "--trainable", trainable)))
    before, after = load_file(tiny["converted"] / "model.safetensors"), load_file(result.final / "model.safetensors")
    moves = {"attention": ("self_attn.",), "kv-only": ("self_attn.k_proj.", "self_attn.v_proj.")}[trainable]
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(any(m in k for m in moves) for k in changed)
    assert all(any(m in k for k in changed) for m in moves)


def test_an_epoch_that_ends_inside_an_accumulation_window_counts_only_its_tokens(tiny, tmp_path):
    """Streaming 3 micro-batches per epoch with grad_accum 2: steps of 2, 1, 2, 1 micro-batches."""
    tokenizer = AutoTokenizer.from_pretrained(tiny["converted"])
    text = CORPUS * 3
    ids = tokenizer(text)["input_ids"]
    cut = tokenizer.decode(ids[: 6 * 16 - 1])  # with its EOS: 6 blocks of 16 tokens = 3 micro-batches of 2
    (tmp_path / "six.txt").write_text(cut)
    blocks = packed_blocks(str(tmp_path / "six.txt"), "train", "text", tokenizer, seq_len=16)
    assert len(blocks) == 6
    result = uptrain(
        parse(
            args(
                tiny, tmp_path / "run", "--streaming", "--data", str(tmp_path / "six.txt"), "--max_tokens", str(4 * 64)
            )
        )
    )
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["tokens"] for r in rows] == [64, 96, 160, 192]
    assert result.steps == 4 and result.tokens == 192


def test_evaluation_runs_without_inference_mode():
    """Tensors made under inference_mode cannot enter a later backward pass (FSDP gathers parameters there)."""
    from gqaify.eval.perplexity import perplexity

    model = build_model("llama")
    seen = []
    model.register_forward_hook(lambda *a: seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled())))
    perplexity(model, torch.arange(20) % 96, 8, 8, progress=False)
    assert seen and set(seen) == {(False, False)}


def test_processes_wait_for_each_other_as_long_as_dist_timeout(tiny, tmp_path):
    from gqaify.uptrain.train import make_accelerator

    accelerator = make_accelerator(parse(args(tiny, tmp_path / "run", "--dist_timeout", "7200")), tmp_path / "run")
    assert accelerator.init_handler.timeout.total_seconds() == 7200


@pytest.mark.parametrize(
    ("launched", "setting", "expected"),
    [("bf16", None, "bf16"), ("bf16", "no", "no"), (None, None, "no"), (None, "bf16", "bf16")],
)
def test_mixed_precision_is_the_launchers_unless_the_settings_name_one(
    tiny, tmp_path, monkeypatch, launched, setting, expected
):
    """`accelerate launch --config_file single-gpu.yaml` (mixed_precision: bf16) must train in bf16: a default in
    the settings would override the launcher's choice without a word."""
    from accelerate.state import AcceleratorState

    from gqaify.uptrain.train import make_accelerator

    if launched:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)  # what accelerate launch passes on
    else:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    extra = ("--mixed_precision", setting) if setting else ()
    AcceleratorState._reset_state(reset_partial_state=True)  # the state is a process-wide singleton
    try:
        accelerator = make_accelerator(parse(args(tiny, tmp_path / "run", *extra)), tmp_path / "run")
        assert accelerator.mixed_precision == expected
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_streaming_data_trains_for_the_whole_budget(tiny, tmp_path):
    result = uptrain(parse(args(tiny, tmp_path / "run", "--streaming", "--max_tokens", "6400")))
    curve = losses(tmp_path / "run")
    assert result.steps == 100 and len(curve) == 100  # several passes over the text
    assert sum(curve[-10:]) < sum(curve[:10])


def test_a_calibrated_method_without_calib_data_is_fitted_on_the_training_data(tiny, tmp_path):
    extra = ("--model", str(tiny["parent"]), "--kv_heads", "2", "--method", "lsq", "--calib_tokens", "1024")
    uptrain(parse(args(tiny, tmp_path / "run", *extra, "--max_tokens", "320")))
    record = (tmp_path / "run" / "converted" / "gqaify.json").read_text()
    assert '"method": "lsq"' in record and str(tiny["train"]) in record  # calibrated on the training text


def test_lora_trains_only_attention_and_its_merged_model_equals_the_adapted_one(tiny, tmp_path):
    """The adapters change only attention projections, and final/ (merged, plain) computes what the peft model does."""
    from peft import PeftModel

    from gqaify.uptrain.lora import merged, with_adapters

    result = uptrain(parse(args(tiny, tmp_path / "lora", "--trainable", "lora", "--lora_rank", "4")))
    before, after = load_file(tiny["converted"] / "model.safetensors"), load_file(result.final / "model.safetensors")
    assert set(before) == set(after)  # no adapter tensors: a plain checkpoint
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("self_attn." in k and k.endswith("proj.weight") for k in changed)

    base = AutoModelForCausalLM.from_pretrained(tiny["converted"]).eval()
    adapted = with_adapters(base, 4, 8.0)
    for name, param in adapted.named_parameters():  # B = 0 at the start: give the adapters weights to merge
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        expected = adapted(ids).logits
        assert isinstance(adapted, PeftModel)
        plain = merged(adapted)
        assert not isinstance(plain, PeftModel) and type(plain) is type(base)
        torch.testing.assert_close(plain(ids).logits, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(expected, AutoModelForCausalLM.from_pretrained(tiny["converted"])(ids).logits)


def test_eval_data_as_a_panel_logs_each_text_and_the_first_as_before(tiny, tmp_path):
    """Two texts: each text's perplexity and KL logged, the first's also as eval_perplexity/eval_kl, the mean KL
    and the worst ratio to the parent's perplexity; each equal to eval's perplexity on the same tokens."""
    from transformers import AutoTokenizer

    from gqaify.eval.perplexity import perplexity

    other = tmp_path / "other.txt"
    other.write_text(" ".join(reversed(CORPUS.split())))
    out = tmp_path / "run"
    uptrain(
        parse(
            args(
                tiny,
                out,
                "--eval_data",
                f"first={tiny['eval']}",
                str(other),
                "--distill_from",
                str(tiny["parent"]),
                "--max_tokens",
                "128",
            )
        )
    )
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "eval_perplexity" in r]
    record = json.loads((out / "run.json").read_text())
    parents = record["parent_perplexities"]
    assert list(parents) == ["first", "other"] and record["parent_perplexity"] == parents["first"]
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    teacher = AutoModelForCausalLM.from_pretrained(tiny["parent"])
    tokenizer = AutoTokenizer.from_pretrained(tiny["parent"])
    last = rows[-1]
    for name, path in (("first", tiny["eval"]), ("other", other)):
        ids = torch.tensor(tokenizer(path.read_text())["input_ids"][:16384])
        found = perplexity(final, ids, 16, 16, progress=False, parent=teacher)
        assert last[f"eval_perplexity/{name}"] == pytest.approx(found.perplexity, rel=1e-4)
        assert last[f"eval_kl/{name}"] == pytest.approx(found.kl, rel=1e-3, abs=1e-6)
    assert last["eval_perplexity"] == last["eval_perplexity/first"] and last["eval_kl"] == last["eval_kl/first"]
    assert last["eval_kl_mean"] == pytest.approx((last["eval_kl/first"] + last["eval_kl/other"]) / 2)
    assert last["eval_ratio_worst"] == pytest.approx(max(last[f"eval_perplexity/{n}"] / parents[n] for n in parents))
    for row in rows:  # every evaluation's summary is eval's PanelSummary of the scores it logged, bit for bit
        ppl = {n: row[f"eval_perplexity/{n}"] for n in parents}
        scores = [TextScore(n, 1, 0, ppl[n], 0, 0, 1, 1, ppl[n] / parents[n], row[f"eval_kl/{n}"]) for n in parents]
        summary = PanelSummary.of(scores)
        assert (row["eval_kl_mean"], row["eval_ratio_worst"]) == (
            summary.mean_kl_to_parent,
            summary.worst_ratio_to_parent,
        )


def previous_panel_row(scores: dict, teacher: bool, parents: dict | None) -> dict:
    """metrics.jsonl's eval keys as uptraining wrote them before it built them from eval's `PanelSummary`: from each
    text's `Perplexity`, by name."""
    first = next(iter(scores.values()))
    row = {"eval_perplexity": first.perplexity} | ({"eval_kl": first.kl} if teacher else {})
    if len(scores) == 1:
        if parents:
            row["eval_ratio_worst"] = first.perplexity / next(iter(parents.values()))
        return row
    for name, found in scores.items():
        row[f"eval_perplexity/{name}"] = found.perplexity
        if teacher:
            row[f"eval_kl/{name}"] = found.kl
    if teacher:
        row["eval_kl_mean"] = sum(found.kl for found in scores.values()) / len(scores)
    if parents:
        row["eval_ratio_worst"] = max(found.perplexity / parents[name] for name, found in scores.items())
    return row


@pytest.mark.parametrize("names", [["first", "other"], ["first"]])
@pytest.mark.parametrize(("teacher", "with_parents"), [(True, True), (False, True), (False, False)])
def test_an_evaluations_row_is_the_one_it_was_key_for_key_and_bit_for_bit(tiny, names, teacher, with_parents):
    """The panel row built from `TextScore`s and their `PanelSummary`: the same keys, in the same order, with the same
    floats as before, with and without a teacher and the parent's perplexities, for a panel and for one text."""
    from gqaify.eval.perplexity import perplexity
    from gqaify.eval.results import EvalText
    from gqaify.uptrain.evaluation import panel_row

    model = AutoModelForCausalLM.from_pretrained(tiny["converted"])
    parent = AutoModelForCausalLM.from_pretrained(tiny["parent"])
    ids = torch.tensor(AutoTokenizer.from_pretrained(tiny["parent"])(CORPUS)["input_ids"][:160])
    texts = {name: EvalText(ids[i * 80 : (i + 1) * 80], 20, 100) for i, name in enumerate(names)}
    parents = {n: perplexity(parent, t.ids, 16, 16, progress=False).perplexity for n, t in texts.items()}
    parents = parents if with_parents else None
    reference = parent if teacher else None
    scores = {n: perplexity(model, t.ids, 16, 16, progress=False, parent=reference) for n, t in texts.items()}
    row = panel_row(model, reference, texts, 16, parents)
    expected = previous_panel_row(scores, teacher, parents)
    assert list(row) == list(expected) and json.dumps(row) == json.dumps(expected)


def test_a_mixture_of_sources_keeps_every_block_in_its_share():
    """datasets' interleave_datasets, seeded, until every source is exhausted: each block of each source appears,
    the small source repeated to its share, in the same order every time."""
    import datasets

    from gqaify.uptrain.data import mixed

    large = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(300)]}).with_format("torch")
    small = datasets.Dataset.from_dict({"input_ids": [[1000 + i, 0] for i in range(20)]}).with_format("torch")
    together, counts = mixed([large, small], [3.0, 1.0], seed=5)
    firsts = [int(b["input_ids"][0]) for b in together]
    assert counts == [sum(f < 1000 for f in firsts), sum(f >= 1000 for f in firsts)]
    assert set(firsts) == set(range(300)) | set(range(1000, 1020))  # no block left out
    assert counts[0] == 300 and 80 <= counts[1] <= 120  # the small source repeated to about a quarter
    again, _ = mixed([large, small], [3.0, 1.0], seed=5)
    assert [int(b["input_ids"][0]) for b in again] == firsts


def test_a_streamed_mixture_of_two_local_texts_trains(tiny, tmp_path):
    """interleave_datasets cannot infer features from torch tensors: the sources are mixed as python values."""
    other = tmp_path / "other.txt"
    other.write_text(" ".join(reversed((CORPUS * 3).split())))
    out = tmp_path / "run"
    result = uptrain(parse(args(tiny, out, "--streaming", "--data", str(tiny["train"]), f"rev={other}")))
    assert result.steps == 20 and (out / "final" / "model.safetensors").is_file()


def test_a_tiny_mixture_weight_costs_only_the_blocks_the_budget_reads(tiny, tmp_path):
    """Until every source is exhausted, a weight of 1e-6 would repeat the other source a million times."""
    import datasets

    from gqaify.uptrain.data import mixed

    large = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(300)]}).with_format("torch")
    small = datasets.Dataset.from_dict({"input_ids": [[1000 + i, 0] for i in range(20)]}).with_format("torch")
    together, counts = mixed([large, small], [1.0, 1e-6], seed=5, limit=64)
    assert len(together) == 64 and counts == [64, 0]  # 64 blocks drawn in all, none repeated for the tiny weight
    firsts = [int(b["input_ids"][0]) for b in together]
    assert len(set(firsts)) == 64 and max(firsts) > 64  # drawn from the whole of the source, not its first blocks
    assert [int(b["input_ids"][0]) for b in mixed([large, small], [1.0, 1e-6], seed=5, limit=64)[0]] == firsts
    # a mixture that ends before the limit is the whole epoch, as without one
    assert mixed([large, small], [3.0, 1.0], seed=5, limit=10_000)[1] == mixed([large, small], [3.0, 1.0], seed=5)[1]
    other = tmp_path / "other.txt"
    other.write_text(" ".join(reversed((CORPUS * 3).split())))
    for streaming in ([], ["--streaming"]):
        out = tmp_path / f"run{len(streaming)}"
        weights = ["--data", str(tiny["train"]), f"rev={other}", "--data_weights", "1", "1e-6"]
        result = uptrain(parse(args(tiny, out, *streaming, *weights, "--max_tokens", "2048")))
        assert result.steps == 32 and (out / "final" / "model.safetensors").is_file()


def test_checkpoint_rotation_removes_only_what_gqaify_wrote(tiny, tmp_path):
    """A file of the user's put inside checkpoints/step-N/ used to be deleted with the checkpoint it sat in."""
    from gqaify.records import read_run
    from gqaify.uptrain.checkpoint_files import WRITTEN_FILE, Checkpoints, rotate

    out = tmp_path / "run"
    uptrain(parse(args(tiny, out, "--save_every", "5", "--save_total_limit", "3")))
    root, made = out / "checkpoints", read_run(out).checkpoints
    kept = Checkpoints.of(root, made).ours
    assert len(kept) == 3
    listed = set(json.loads((kept[0] / WRITTEN_FILE).read_text())["files"])
    assert listed == {p.relative_to(kept[0]).as_posix() for p in kept[0].rglob("*") if p.is_file()}
    (kept[0] / "notes.txt").write_text("mine")
    removed = rotate(root, 1, made)
    assert removed == [kept[0].name, kept[1].name]
    made = [name for name in made if name not in removed]  # as the run unlists them
    assert [p.name for p in Checkpoints.of(root, made).ours] == [kept[-1].name] and not kept[1].exists()
    assert [p.name for p in kept[0].iterdir()] == ["notes.txt"]  # only the user's file is left
    assert (kept[0] / "notes.txt").read_text() == "mine"


def test_a_run_recorded_when_data_was_one_text_resumes(tiny, tmp_path):
    """run.json written before data, eval_data and calib_data became lists holds them as text: the same run, not
    another run's checkpoints."""
    out = tmp_path / "run"
    settings = parse(args(tiny, out, "--save_every", "10", "--max_tokens", "640"))
    uptrain(settings)
    record = json.loads((out / "run.json").read_text())
    record["settings"]["data"] = record["settings"]["data"][0]  # as an older gqaify wrote it
    record["settings"]["eval_data"] = None
    (out / "run.json").write_text(json.dumps(record))
    assert uptrain(settings).steps == 10  # finished: read back, not refused


def test_compile_finds_every_decoder_layer_and_refuses_a_model_that_names_none():
    from gqaify.uptrain.student import compile_layers

    model = build_model("llama", num_kv_heads=2, vocab_size=320)
    assert compile_layers(model) == model.config.num_hidden_layers
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)  # compiled on first call
    assert model.lm_head._compiled_call_impl is None and model.model.embed_tokens._compiled_call_impl is None
    model._no_split_modules = None
    with pytest.raises(UserError, match="names no decoder layer class"):
        compile_layers(model)
