"""`gqaify eval --kv-cache`: each model under each cache format, the frontier and its verdict. The formats' bytes
against the engines' own tables, the front and the verdict against a hand computation, a folder's f16 row against
today's eval, a quantized cache's KL against the bits it keeps, and every refusal before any model is loaded."""

import json

import pytest

import gqaify
from gqaify.entry.cli import main
from gqaify.eval.caches import retrieval
from gqaify.eval.caches.formats import cache_format, format_problem
from gqaify.eval.caches.results import CacheRow, CacheText, front_of, position_bins, verdicts
from gqaify.eval.results import Report
from gqaify.eval.settings import EvalSettings
from gqaify.testing import CORPUS, build_model, save_with_tokenizer
from helpers import one_line

FAST = EvalSettings(seq_len=64, speed=False, progress=False)


def test_each_format_costs_its_engines_bytes_per_value_scales_counted():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    # a llama.cpp type: its block's bytes over its values, from gguf's table (q8_0: 32 values in 34 bytes)
    for name, (values, block) in {"q8_0": (32, 34), "q5_1": (32, 24), "q5_0": (32, 22), "q4_1": (32, 20),
                                  "q4_0": (32, 18)}.items():  # fmt: skip
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]] == (values, block)
        assert cache_format(name).key_bits == cache_format(name).value_bits == 8 * block / values
    assert cache_format("f16").bytes_per_token(1536, 1536) == 6144
    # K and V apart: 100 keys at 8.5 bits and 100 values at 4.5
    assert cache_format("q8_0/q4_0").bytes_per_token(100, 100) == (100 * 8.5 + 100 * 4.5) / 8
    # transformers' group-wise caches: the bits, and a 16-bit scale and zero point per 64 values
    assert cache_format("quanto4").key_bits == 4 + 32 / 64 and cache_format("quanto2").value_bits == 2 + 32 / 64
    assert cache_format("fp8").key_bits == 8


@pytest.mark.parametrize(
    "names, expect",
    [
        (["q9"], "'q9': not a cache format"),
        (["q8_0", "q8_0"], "names a format twice"),
        (["q8_0", "quanto4"], "mixes llama.cpp's formats (q8_0) with transformers' (quanto4)"),
        (["q8_0/q4_0/q4_0"], "not a cache format"),
    ],
)
def test_a_wrong_format_list_is_one_line_naming_what_exists(names, expect):
    problem = format_problem(names, "--kv-cache")
    assert expect in problem and "\n" not in problem
    assert format_problem(["f16", "q8_0", "q4_0/q8_0"], "--kv-cache") is None


def _row(label, cache, times, mean_kl, worst):
    texts = [CacheText("a", 10, 1.0, worst, mean_kl), CacheText("b", 10, 1.0, 1.0, mean_kl)]
    return CacheRow.of(texts, model=label, label=label, cache=cache, engine="llama.cpp", bytes_per_token=1000 / times,
                       bytes_per_token_measured=None, times_smaller=times, kl_by_position=[])  # fmt: skip


def test_the_front_and_the_verdict_pick_what_a_hand_computation_picks():
    rows = [
        _row("parent", "f16", 1.0, 0.0, 1.0),
        _row("parent", "q8_0", 1.88, 0.004, 1.01),
        _row("parent", "q4_0", 3.56, 0.056, 1.30),  # closest at 3x on the mean...
        _row("mqa", "f16", 3.0, 0.69, 1.20),  # ...but not on the worst text, where the MQA model is
        _row("mqa", "q8_0", 5.65, 0.70, 1.21),
        _row("mqa", "q4_0", 10.7, 0.80, 1.50),
        _row("parent", "q2", 6.0, 0.90, 3.00),  # at 6x, worse than the stack on both
    ]
    # By hand, the front (no other point as small and closer): mqa · f16 is off it (parent · q4_0 is smaller and
    # closer), and so is parent · q2 (mqa · q4_0 is smaller and closer); the other five are on it.
    assert front_of(rows) == ["parent · f16", "parent · q8_0", "parent · q4_0", "mqa · q8_0", "mqa · q4_0"]
    by_budget = {v.budget: (v.closest_mean, v.closest_worst) for v in verdicts(rows)}
    assert by_budget == {
        "2x": ("parent · q4_0", "mqa · f16"),  # 1.88x is short of 2x
        "3x": ("parent · q4_0", "mqa · f16"),  # mqa f16 at exactly 3x counts
        "4x": ("mqa · q8_0", "mqa · q8_0"),
        "6x": ("mqa · q4_0", "mqa · q4_0"),  # 5.65x is short of 6x; q2 is 6x but further
        "10x": ("mqa · q4_0", "mqa · q4_0"),
    }
    none = verdicts(rows[:2])[-1]
    assert none.closest_mean is None and none.closest_mean_kl is None


def test_position_bins_follow_the_windows():
    assert position_bins(8192) == [(0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]
    assert position_bins(700) == [(0, 512), (512, 700)]
    assert position_bins(64) == [(0, 64)]


def test_a_retrieval_prompt_holds_its_key_at_its_depth_within_its_length(tmp_path):
    from transformers import AutoTokenizer

    folder = save_with_tokenizer(build_model("llama", vocab_size=320), tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = retrieval.prompts(tokenizer, [400, 900])
    assert len(prompts) == 2 * len(retrieval.DEPTHS) * retrieval.TRIALS
    filler = len(tokenizer(retrieval.FILLER, add_special_tokens=False)["input_ids"])
    for p in prompts:
        assert p.length - filler < len(p.ids) <= p.length
        text = tokenizer.decode(p.ids, skip_special_tokens=True)
        needle = f" The pass key is {p.key}. Remember it. {p.key} is the pass key."
        before = text.index(needle) - len(retrieval.INSTRUCTION)  # the filler's characters before the key
        filler_chars = len(text) - len(retrieval.INSTRUCTION) - len(needle) - len(retrieval.QUESTION)
        assert abs(before / filler_chars - p.depth) < 0.02 and text.endswith(retrieval.QUESTION)
    assert len({p.key for p in prompts}) > 1 and prompts[0].key == retrieval.prompts(tokenizer, [400])[0].key
    assert retrieval.found(" 12345. Remember", "12345") and not retrieval.found(" 1234 5", "12345")


@pytest.fixture(scope="module")
def pair(tiny):
    """`tiny`'s llama with 4 K/V heads and its GQA-2 conversion, and two texts."""
    root = tiny["root"]
    (root / "a.txt").write_text(CORPUS)
    (root / "b.txt").write_text(CORPUS[::-1])
    return root, [str(tiny["parent"]), str(tiny["converted"])], [f"a={root / 'a.txt'}", f"b={root / 'b.txt'}"]


@pytest.fixture(scope="module")
def frontier(pair):
    root, models, data = pair
    settings = EvalSettings(**{**FAST.__dict__, "kv_cache": ["f16", "quanto4", "quanto2", "fp8"]})
    return gqaify.evaluate(models, data, root / "r", settings), root / "r"


def test_a_folders_f16_row_is_todays_eval(frontier):
    report, _ = frontier
    rows = {(r.label, r.cache): r for r in report.frontier.rows}
    for model, label in zip(report.models, ["parent", "gqa2"], strict=True):
        row = rows[label, "f16"]
        for text, score in zip(row.texts, model.texts, strict=True):
            assert text.perplexity == pytest.approx(score.perplexity, rel=1e-5)
            assert text.kl_to_parent == pytest.approx(score.kl_to_parent or 0.0, abs=1e-6)
    assert rows["parent", "f16"].mean_kl == 0.0 and rows["parent", "f16"].worst_ratio == 1.0


def test_a_quantized_cache_is_read_back_and_costs_more_as_its_bits_fall(frontier):
    report, _ = frontier
    rows = {(r.label, r.cache): r for r in report.frontier.rows}
    for label in ("parent", "gqa2"):
        four, two = rows[label, "quanto4"].mean_kl, rows[label, "quanto2"].mean_kl
        assert rows[label, "f16"].mean_kl < four < two, (four, two)
    assert rows["parent", "fp8"].mean_kl > 0  # a far-off model's noise may land either side of its f16 figure
    # the bytes per token: 2 layers x 4 heads x 16 values, keys and values, at each format's bits
    config = json.loads((frontier[1].parent / "parent" / "config.json").read_text())
    values = config["num_hidden_layers"] * 4 * config["hidden_size"] // config["num_attention_heads"]
    assert rows["parent", "f16"].bytes_per_token == 2 * values * 2
    assert rows["parent", "quanto4"].bytes_per_token == 2 * values * 4.5 / 8
    assert rows["gqa2", "quanto2"].times_smaller == pytest.approx(2 * 16 / 2.5)


def test_the_frontier_is_written_read_back_and_drawn(frontier):
    report, out = frontier
    assert Report.read(out) == report
    text = (out / "report.md").read_text()
    assert "## The cache frontier" in text and "frontier.png" in text and "| 10x |" in text
    from PIL import Image

    with Image.open(out / "frontier.png") as image:
        assert image.size[0] > 1000


def test_the_verdict_is_printed_after_the_table(pair, tmp_path, capsys):
    _, models, data = pair
    code = main(["eval", *models, "--data", *data, "--out", str(tmp_path / "r"), "--seq-len", "64", "--no-speed",
                 "-q", "--kv-cache", "f16", "fp8"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "cache frontier in transformers" in out and "closest on the mean KL" in out


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--kv-cache", "q8_0"], "llama.cpp's formats run .gguf files"),
        (["--kv-cache", "q4_0", "hqq4"], "not a cache format"),
        (["--retrieval", "100000"], "leaves no room for an answer"),
        (["--retrieval", "70"], "is too short"),
    ],
)
def test_what_the_models_cannot_run_is_refused_before_any_work(pair, tmp_path, capsys, args, expect):
    _, models, data = pair
    code = main(["eval", *models, "--data", *data, "--out", str(tmp_path / "r"), *args])
    err = capsys.readouterr().err
    assert code == 2 and expect in one_line(err) and not (tmp_path / "r").exists()


def test_a_missing_backend_is_named_with_its_install(pair, tmp_path, capsys, monkeypatch):
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optimum" else found(name, *a))
    _, models, data = pair
    code = main(["eval", *models, "--data", *data, "--out", str(tmp_path / "r"), "--kv-cache", "quanto4"])
    assert code == 2 and "pip install 'gqaify[cache]'" in capsys.readouterr().err


def test_the_verdict_at_your_memory_is_what_fits_the_parents_weights_and_whole_context(frontier):
    import psutil

    report, _ = frontier
    parent, mine = report.models[0], report.frontier.verdicts[-1]
    whole = report.frontier.rows[0].bytes_per_token  # the parent's f16 cache per token
    room = psutil.virtual_memory().total - parent.weights_bytes
    assert mine.budget == f"{psutil.virtual_memory().total / 2**30:.1f} GiB at {parent.max_positions:,} tokens"
    assert mine.times_smaller == pytest.approx(whole * parent.max_positions / room)


def test_every_gguf_is_tried_in_a_process_of_its_own_before_any_work(monkeypatch):
    """llama.cpp crashes or aborts the process on what a build cannot run (this machine's build on any quantized
    weights; 0.3.36's keys-only path on most cache types): each .gguf is run first in a child process, the keys-only
    ones with every format asked, the others with one."""
    import gqaify.eval.caches.llama_cpp_engine as engine

    tried = []
    monkeypatch.setattr(engine, "gguf_architecture", lambda name: "deepseek2" if "mla" in name else "llama")
    monkeypatch.setattr(engine, "probe_problem", lambda name, f: tried.append((name, f.name)))
    monkeypatch.setattr(engine, "_is_gguf", lambda name: name.endswith(".gguf"))
    s = EvalSettings(models=["p.gguf", "mla.gguf", "folder"], kv_cache=["f16", "q8_0", "q4_0"])
    assert engine._probe_problems(s) == []
    assert tried == [("p.gguf", "q4_0"), ("mla.gguf", "f16"), ("mla.gguf", "q8_0"), ("mla.gguf", "q4_0")]


@pytest.mark.parametrize(
    ("code", "stderr", "expect"),
    [
        (-6, "llama.cpp:123: GGML_ASSERT(v_trans) failed", "q8_0 cache (GGML_ASSERT(v_trans) failed); leave q8_0"),
        (-11, "", "crashed (signal 11) running q.gguf"),
        (1, "", "(exit status 1); leave q8_0 out of --kv-cache"),
    ],
)
def test_what_llamas_process_died_of_is_told_apart(monkeypatch, code, stderr, expect):
    """An assertion llama.cpp states (it aborts: signal 6) names the cache type to leave out; a crash with nothing
    said names the file and the way out."""
    import subprocess

    from gqaify.eval.caches.llama_cpp_engine import probe_problem

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess([], code, "", stderr))
    assert expect in probe_problem("q.gguf", cache_format("q8_0"))
