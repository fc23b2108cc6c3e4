"""Writes the records each gqaify artifact holds, as this gqaify writes them, into tests/data/records/VERSION/:
the shapes a later gqaify must still read (tests/settings/test_records.py reads every folder here back typed).

    python tests/data/records/write_fixtures.py          # with each release: its records, kept for the next ones

Each file is one artifact's record: conversion*.json (a converted folder's gqaify.json), corpus.json (gqaify
generate's), report.json (gqaify eval's gqaify.json), run*.json (uptrain's output_dir/run.json) and uptrained*.json
(its final/gqaify.json, of a converted model and of one gqaify did not convert). The tiny models of
gqaify.testing make them in seconds; the paths they name are of a scratch folder, gone since. A version's folder
is written once: the script refuses to replace one (0.1.0's were written before the record layer gave every
record its kind, and must stay so).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRATCH = Path("/tmp/gqaify-records")


def main() -> None:
    import gqaify
    from gqaify.eval.settings import EvalSettings
    from gqaify.generation import run as generate
    from gqaify.generation.settings import GenerateSettings
    from gqaify.testing import CORPUS, build_model, save_with_tokenizer
    from gqaify.uptrain import UptrainSettings
    from gqaify.uptrain import run as uptrain

    out = HERE / gqaify.__version__
    if out.exists():
        sys.exit(
            f"{out} exists: the records of gqaify {gqaify.__version__} are written once; delete it to write them again"
        )
    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    out.mkdir()
    text, prompts = SCRATCH / "train.txt", SCRATCH / "prompts.txt"
    text.write_text(CORPUS * 3)
    prompts.write_text("The quick brown fox\nA grouped-query attention model\n")
    parent = save_with_tokenizer(build_model("llama", num_kv_heads=4, vocab_size=320), SCRATCH / "parent")

    gqaify.convert(parent, SCRATCH / "gqa2", 2, progress=False)
    gqaify.convert(parent, SCRATCH / "lsq", 2, method="lsq", calib_data=str(text), calib_tokens=2048, progress=False)
    generate(
        GenerateSettings(
            model=str(parent),
            out=str(SCRATCH / "corpus"),
            tokens=64,
            length=16,
            batch_size=4,
            prompts=str(prompts),
            top_logprobs=2,
            progress=False,
        )
    )
    fast = EvalSettings(seq_len=32, speed=False, progress=False)
    gqaify.evaluate([str(parent), str(SCRATCH / "gqa2")], str(text), SCRATCH / "report", fast)
    common = dict(
        data=[str(text)],
        seq_len=16,
        micro_batch_size=2,
        grad_accum=2,
        max_tokens=128,
        lr=1e-3,
        save_every=0,
        progress=False,
    )
    uptrain(
        UptrainSettings(
            model=str(SCRATCH / "gqa2"),
            output_dir=str(SCRATCH / "run"),
            eval_data=[str(text)],
            parent=str(parent),
            eval_tokens=64,
            **common,
        )
    )
    uptrain(UptrainSettings(model=str(parent), output_dir=str(SCRATCH / "run-plain"), **common))

    copies = {
        "conversion.json": SCRATCH / "gqa2" / "gqaify.json",
        "conversion-calibrated.json": SCRATCH / "lsq" / "gqaify.json",
        "corpus.json": SCRATCH / "corpus" / "gqaify.json",
        "report.json": SCRATCH / "report" / "gqaify.json",
        "run.json": SCRATCH / "run" / "run.json",
        "uptrained.json": SCRATCH / "run" / "final" / "gqaify.json",
        "run-plain.json": SCRATCH / "run-plain" / "run.json",
        "uptrained-plain.json": SCRATCH / "run-plain" / "final" / "gqaify.json",
    }
    for name, path in copies.items():
        shutil.copyfile(path, out / name)
        print(out / name)


if __name__ == "__main__":
    main()
