"""`gqaify eval --tasks` (lm-evaluation-harness on the loaded models) and `--generate`, offline.

The task is tests/tasks/story_endings (270 four-way items built from TinyStories in ../shared): its scores are
checked against an independent scoring loop, a G = H conversion must score exactly its parent's figures, and
the harness must see the same logits as the perplexity path. lm-evaluation-harness on real models: its set-up
alone takes most of a minute.
"""

import copy
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gqaify import convert, evaluate
from gqaify.eval.continuations import DEFAULT_PROMPTS
from gqaify.eval.perplexity import perplexity
from gqaify.eval.plots import PLOT_TASKS
from gqaify.eval.report import md_cell
from gqaify.eval.settings import EVAL, EvalSettings
from gqaify.eval.tasks import TaskRequest, harness_model
from gqaify.model.loading import load_model
from gqaify.settings import parse
from gqaify.testing import CORPUS, build_model, save_with_tokenizer
from helpers import ASSETS, MODELS, REPO, needs_assets, run_cli

TASKS = REPO / "tests" / "tasks"
TEXT = ASSETS / "text" / "tinystories-valid-head.txt"
# the harness scores 16 of the task's requests per forward pass: each model's 4 x 270 choices in about 68 passes,
# not 1,080 (the independent loop below still scores each choice alone; a choice's log-likelihood in a padded batch
# differs from its own only in the last bits, which TIE allows for)
SETTINGS = dict(seq_len=256, max_tokens=1024, speed=False, progress=False, batch_size=16)


@pytest.fixture(scope="module", autouse=True)
def harness_tasks_indexed_once():
    """lm-eval's TaskManager indexes the 14,000 task YAMLs the harness ships each time one is made (10 s of CPU),
    and four tests here make one. In this module the harness's folder is indexed once and every TaskManager gets a
    deep copy of that index, as a fresh one; the folders a test adds (--include-path) are indexed afresh each time
    and take precedence over the harness's entries, as in TaskIndex.build (which also logs each such override, a
    log gqaify mutes)."""
    try:
        from lm_eval.tasks import manager
        from lm_eval.tasks._index import TaskIndex
    except ImportError:  # a test here says what --tasks answers without the harness
        yield
        return
    own, build, built = Path(manager.__file__).parent, TaskIndex.build, {}

    def build_own_once(paths, *, resolve_includes=True):
        paths = list(paths)
        if not paths or Path(paths[0]) != own:
            return build(paths, resolve_includes=resolve_includes)
        if resolve_includes not in built:
            built[resolve_includes] = build([own], resolve_includes=resolve_includes)
        index = copy.deepcopy(built[resolve_includes])
        index.update(build(paths[1:], resolve_includes=resolve_includes))
        return index

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TaskIndex, "build", staticmethod(build_own_once))
        yield


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """stories260K-mha (8 K/V heads), its G = H and its MQA conversion, scored on story_endings."""
    root = tmp_path_factory.mktemp("tasks")
    parent = MODELS / "stories260K-mha"
    same, mqa = root / "g8", root / "g1"
    convert(parent, same, 8, progress=False)
    convert(parent, mqa, 1, progress=False)
    settings = EvalSettings(tasks=["story_endings"], include_path=str(TASKS), generate=[], **SETTINGS)
    report = evaluate([parent, same, mqa], TEXT, root / "report", settings)
    return root / "report", report


# float32 log-likelihoods summed over a choice's tokens, computed by the harness and here in another order, can
# differ in their last bits; an item whose best two choices are closer than this may be decided either way.
TIE = 1e-4


def reference_scores(name) -> dict[str, tuple[float, float]]:
    """acc and acc_norm of story_endings, scored here without the harness: each choice's log-likelihood after
    the context (the context tokenized alone, the choice as what the whole text adds), the best choice, and the
    best per character. Each with the fraction of items too close to call (`TIE`)."""
    sys.path.insert(0, str(TASKS / "story_endings"))
    try:
        from utils import STORIES, items
    finally:
        sys.path.pop(0)
    model, tokenizer = load_model(str(name))
    rows = items(STORIES.read_text())
    found = {"acc": [0, 0], "acc_norm": [0, 0]}  # metric -> [correct, too close to call]
    for row in rows:
        context = tokenizer(row["context"]).input_ids
        lls = []
        for choice in row["choices"]:
            whole = tokenizer(row["context"] + " " + choice).input_ids
            with torch.no_grad():
                logp = F.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
            lls.append(sum(logp[i - 1, whole[i]].item() for i in range(len(context), len(whole))))
        normed = [ll / len(choice) for ll, choice in zip(lls, row["choices"], strict=True)]
        for metric, values in (("acc", lls), ("acc_norm", normed)):
            best, second = sorted(values, reverse=True)[:2]
            found[metric][0] += values.index(best) == row["label"]
            found[metric][1] += best - second < TIE
    return {metric: (correct / len(rows), close / len(rows)) for metric, (correct, close) in found.items()}


def task_rows(model_entry) -> dict[str, dict]:
    return {row["metric"]: row for row in model_entry["tasks"]}


@needs_assets
def test_task_scores_match_an_independent_scoring_loop(scored):
    out, _ = scored
    models = json.loads((out / "report.json").read_text())["models"]
    for entry in (models[0], models[2]):
        rows = task_rows(entry)
        for metric, (value, too_close) in reference_scores(entry["model"]).items():
            assert abs(rows[metric]["value"] - value) <= too_close + 1e-12, (metric, too_close)
        assert rows["acc"]["n"] == 270 and rows["acc"]["task"] == "story_endings" and rows["acc"]["stderr"] > 0


@needs_assets
def test_g_equals_h_scores_and_writes_exactly_what_its_parent_does(scored):
    out, report = scored
    parent, same, mqa = report.models
    assert same.tasks == parent.tasks
    assert same.generations == parent.generations
    assert [g.prompt for g in parent.generations] == list(DEFAULT_PROMPTS)
    assert all(g.text.strip() for g in parent.generations)
    assert mqa.generations != parent.generations  # a 260K model pooled to one K/V head writes something else


@needs_assets
def test_report_carries_the_task_table_the_plot_and_the_generations(scored):
    out, report = scored
    md = (out / "report.md").read_text()
    parent_acc = task_rows({"tasks": [asdict(t) for t in report.models[0].tasks]})["acc"]
    mqa_acc = task_rows({"tasks": [asdict(t) for t in report.models[2].tasks]})["acc"]
    assert "## Tasks" in md and f"![task scores vs KV bytes per token]({PLOT_TASKS})" in md
    assert f"| story_endings | acc | 270 | {parent_acc['value']:.4f} ± {parent_acc['stderr']:.4f} |" in md
    assert f"{mqa_acc['value']:.4f} ({mqa_acc['value'] - parent_acc['value']:+.4f}) |" in md
    assert (out / PLOT_TASKS).stat().st_size > 10_000
    assert "## Generations" in md and f"| g1 | {md_cell(report.models[2].generations[0].text)} |" in md
    recorded = json.loads((out / "report.json").read_text())["settings"]
    assert recorded["tasks"] == ["story_endings"] and recorded["generate"] == []


def test_the_harness_sees_the_logits_of_the_perplexity_path(tmp_path):
    """The harness's rolling log-likelihood of a text, through gqaify's one wrapper around a loaded model, is
    the perplexity path's on the same tokens (the harness's prefix token first)."""
    folder = save_with_tokenizer(build_model("llama", num_kv_heads=2, vocab_size=300), tmp_path / "m")
    model, tokenizer = load_model(str(folder))
    lm = harness_model(model, tokenizer)
    assert lm.tokenizer.pad_token_id is not None and tokenizer.pad_token_id is None  # the harness padded a copy
    from lm_eval.api.instance import Instance

    text = CORPUS[:90]
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    (harness_ll,) = lm.loglikelihood_rolling([request], disable_tqdm=True)
    ids = torch.tensor([lm.prefix_token_id, *lm.tok_encode(text)])
    assert len(ids) <= model.config.max_position_embeddings  # one window for both
    ours = perplexity(model, ids, len(ids), len(ids), progress=False)
    assert ours.tokens_scored == len(ids) - 1
    assert -harness_ll == pytest.approx(ours.nll_sum, rel=1e-5)


def test_task_names_split_on_commas_and_generate_takes_zero_or_more_prompts():
    s = parse(EVAL, ["P", "--data", "d", "--out", "o", "--tasks", "a,b", "c", "--generate"])
    assert s.task_request().names == ("a", "b", "c") and s.generate == []
    s = parse(EVAL, ["P", "--data", "d", "--out", "o", "--generate", "Hello", "The sky is"])
    assert s.generate == ["Hello", "The sky is"] and s.task_request().names == ()
    assert parse(EVAL, ["P", "--data", "d", "--out", "o"]).generate is None
    assert TaskRequest.of([" a , b,", "c"]).names == ("a", "b", "c")


def test_markdown_cells_escape_pipes_and_show_line_breaks():
    assert md_cell("a | b\nc") == "a \\| b ↵ c"


# -- bad input: exit 2, one line, nothing written -----------------------------------------------------------


def refused(capsys, tmp_path, *options) -> str:
    parent = save_with_tokenizer(build_model("llama", num_kv_heads=2, vocab_size=300), tmp_path / "m")
    (tmp_path / "t.txt").write_text(CORPUS)
    out = tmp_path / "report"
    code, err = run_cli(
        capsys, "eval", parent, "--data", tmp_path / "t.txt", "--out", out, "--no-speed", "--seq-len", "32", *options
    )
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert not out.exists()
    return err


@needs_assets
def test_unknown_task_is_answered_with_the_nearest(capsys, tmp_path):
    err = refused(capsys, tmp_path, "--tasks", "story_ending", "--include-path", TASKS)
    assert "unknown task 'story_ending' (nearest: story_endings" in err


def test_a_task_whose_dataset_needs_the_hub_is_refused_at_once(capsys, tmp_path, hub_unreachable, monkeypatch):
    """Loading the task (where its dataset is fetched) is not half a minute of retries: no request is retried (each
    retry of huggingface_hub's, and of the libraries on it, waits first) while the task loads."""
    from lm_eval.tasks import TaskManager

    waits, loads, load = [], [], TaskManager.load

    def counted(self, *args, **kwargs):
        loads.append(args)
        return load(self, *args, **kwargs)

    monkeypatch.setattr(TaskManager, "load", counted)
    monkeypatch.setattr(time, "sleep", waits.append)  # a retry's wait, recorded instead of waited
    err = refused(capsys, tmp_path, "--tasks", "hellaswag")
    assert loads and waits == [], waits
    assert "task hellaswag needs Rowan/hellaswag from the Hugging Face hub, which could not be reached (" in err
    assert "--include-path" in err


def test_a_task_file_that_does_not_parse_is_named_with_its_error(capsys, tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "badtask.yaml").write_text("task: badtask\ndataset_path: x\n  doc_to_text: [oops\n")
    err = refused(capsys, tmp_path, "--tasks", "badtask", "--include-path", tmp_path / "tasks")
    assert (
        f"unknown task 'badtask'; {tmp_path / 'tasks' / 'badtask.yaml'} in --include-path could not be read "
        "(line 3, column 14: mapping values are not allowed" in err
    ), err


@pytest.mark.parametrize(
    "options, expect",
    [
        (["--tasks", "story_endings", "--limit", "0"], "--limit 0 must be above 0"),
        (["--tasks", "story_endings", "--limit", "nan"], "--limit nan must be above 0"),
        (["--tasks", "story_endings", "--limit", "1.5"], "--limit 1.5 is neither a whole number of items per task nor"),
        (["--tasks", "story_endings", "--limit", "inf"], "--limit inf is neither a whole number"),
        (["--tasks", "story_endings", "--include-path", "nowhere"], "--include-path nowhere is not a folder"),
        (["--limit", "5"], "--limit applies to --tasks"),
        (["--generate", "--generate-tokens", "0"], "--generate-tokens 0 must be at least 1"),
    ],
)
def test_bad_task_settings_are_refused(capsys, tmp_path, options, expect):
    assert expect in refused(capsys, tmp_path, *options)


def test_uptrain_eval_limit_follows_the_same_rule(capsys, tmp_path):
    model = save_with_tokenizer(build_model("llama", num_kv_heads=2, vocab_size=300), tmp_path / "m")
    (tmp_path / "t.txt").write_text(CORPUS)
    out = tmp_path / "run"
    code, err = run_cli(
        capsys,
        "uptrain",
        "--model",
        model,
        "--data",
        tmp_path / "t.txt",
        "--output_dir",
        out,
        "--eval_tasks",
        "story_endings",
        "--eval_limit",
        "2.5",
    )
    assert code == 2 and err.count("\n") == 1 and "eval_limit 2.5 is neither a whole number" in err, err
    assert not out.exists()


def test_tasks_without_the_harness_name_the_extra(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)  # as if lm-eval were not installed
    err = refused(capsys, tmp_path, "--tasks", "hellaswag")
    assert "--tasks needs lm-evaluation-harness, which is not installed; pip install 'gqaify[tasks]'" in err
