"""Which start `gqaify convert --kv-cut 3 --attention mla` keeps on SmolLM2-135M-Instruct (MQA's cache: a cut whole
K/V heads make), and how far what it writes is from the parent beside MQA `lsq` on the five-text panel, with no
training.

    python benchmarks/mla_start.py                       # both settings below
    python benchmarks/mla_start.py --settings short      # one of them
    python benchmarks/mla_start.py --ranking             # the two closest splits ranked after the repair alone
    python benchmarks/mla_start.py --judge               # the starts' judge timed: each alone, against one pass

At a cut whole heads make, `--kv-cut` tries two starts, MQA's conversion rewritten exactly and the parent
compressed to the same 128 values per token and layer, and judges them on calibration text no fit read, source by
source: the parent's start is kept only where it is closer on every source. Each setting converts SmolLM2 twice
with the same calibration (the benchmarks' mixture, `commands.mixture`: WikiText-2 validation, tiny-shakespeare's
first half, the TinyStories sample, in equal shares; windows of 512), MQA `lsq` and MLA `--kv-cut 3`, and scores
both on the panel (`commands.PANEL`: WikiText-2 test, tiny-shakespeare's second half, TinyStories validation,
standard-library code, Python's licence; the first 4,096 tokens of each, windows of 512), none of it calibration
text:

    short   8,192 calibration tokens, 32 refinement steps per layer
    long    16,384 calibration tokens, 64 refinement steps per layer

Where `--kv-cut 3` keeps MQA's exact rewrite, the parent's start alone (`--kv-heads 3 --kv-cut 3`: the source's own
heads, compressed and fitted) is converted too, so that both starts are judged on the panel. Writes
OUT/mla_start.json (OUT: --out, default benchmarks/results): per setting, the start kept, both starts' KL on each
calibration source, where the MLA rewrite's time went, and each start's KL and perplexity ratio to the parent on
each panel text.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from commands import REPO, convert, evaluate, mixture, panel, write_texts

SETTINGS = {"short": (8_192, 32), "long": (16_384, 64)}  # calibration tokens, refinement steps per layer
WINDOW, PANEL_TOKENS = 512, 4_096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help="which of: " + ", ".join(SETTINGS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument(
        "--ranking", action="store_true", help="instead: the two closest splits ranked after the repair alone"
    )
    parser.add_argument(
        "--judge", action="store_true", help="instead: the starts' judge timed, each start alone against one pass"
    )
    args = parser.parse_args()
    if args.ranking:
        return repair_ranking(args.out)
    if args.judge:
        return judge_timing(args.out)
    from gqaify.entry.demo import fetch_default_model

    source = str(fetch_default_model())
    texts = write_texts(args.out / "texts")
    calib = [str(path) for path in mixture(texts).values()]
    found = {}
    results = args.out / "mla_start.json"
    for name in args.settings.split(","):
        tokens, steps = SETTINGS[name]
        work = args.out / "mla_start" / name
        common = dict(method="lsq", calib_data=calib, calib_tokens=tokens, refine_steps=steps, calib_seq_len=WINDOW)
        seconds = {}
        shapes = {"mqa": dict(kv_heads=1), "mla": dict(kv_cut=3, attention="mla")}
        for label, shape in shapes.items():
            seconds[label] = converted(source, work / label, shape | common)
        mla = json.loads((work / "mla" / "gqaify.json").read_text())["mla"]
        kept = "parent" if mla.get("from_parent") else "MQA"
        starts = {"mqa": work / "mqa", "parent": work / "mla"}
        if kept == "MQA":  # the parent's start alone (--kv-heads 3, the source's), to judge it on the panel too
            parent_start = dict(kv_heads=3, kv_cut=3, attention="mla")
            seconds["parent"] = converted(source, work / "parent", parent_start | common)
            starts["parent"] = work / "parent"
        report = work / "eval-panel"
        if not (report / "report.json").is_file():
            subprocess.run(
                evaluate(
                    [source, *starts.values()], data=panel(texts), split="train", max_tokens=PANEL_TOKENS,
                    seq_len=WINDOW, speed=False, out=report, quiet=True,
                ),
                check=True,
            )  # fmt: skip
        models = json.loads((report / "report.json").read_text())["models"][1:]
        found[name] = {
            "calib_tokens": tokens,
            "refine_steps": steps,
            "kept": kept,
            "starts": mla["starts"],
            "mla_seconds": mla.get("seconds"),
            "seconds": seconds,
            "panel": {
                label: {
                    "mean_kl": model["panel"]["mean_kl_to_parent"],
                    "worst_ratio": model["panel"]["worst_ratio_to_parent"],
                    "kl": {t["text"]: t["kl_to_parent"] for t in model["texts"]},
                    "ratio": {t["text"]: t["ratio_to_parent"] for t in model["texts"]},
                }
                for label, model in zip(starts, models, strict=True)
            },
        }
        results.write_text(json.dumps(found, indent=2) + "\n")
        print(json.dumps({name: found[name]}, indent=2), flush=True)


def repair_ranking(out: Path) -> None:
    """The parent compressed at 128 and 256 values per token and layer: the `FITTED` closest splits each built and
    brought back to the parent by the fit's closed-form repair alone (no refinement steps), as the split search
    would rank them on its held-out windows, with the seconds each took (the long setting's calibration). Writes
    OUT/mla_start_ranking.json."""
    import torch

    from gqaify.conversion.calibrate import read_calibration
    from gqaify.conversion.mla.fit import fit_and_judge
    from gqaify.conversion.mla.layer import STAT_WINDOW, build_mla
    from gqaify.conversion.mla.split import FITTED, ranked_splits
    from gqaify.conversion.settings import ConvertSettings
    from gqaify.entry.demo import fetch_default_model
    from gqaify.model.loading import load_model

    tokens, _ = SETTINGS["long"]
    parent, tokenizer = load_model(str(fetch_default_model()), dtype=torch.float32)
    calib = [str(path) for path in mixture(write_texts(out / "texts")).values()]
    settings = ConvertSettings(calib_data=calib, calib_tokens=tokens, calib_seq_len=WINDOW, calib_split="train")
    text = read_calibration(settings.calibration(), tokenizer)
    ids, windows = torch.cat(text.windows(STAT_WINDOW)), [w for w in text.windows(WINDOW) if len(w) > 1]
    found = {}
    for budget in (128, 256):
        plans, trials = ranked_splits(parent, budget, ids)
        found[budget] = {"splits": [vars(t) for t in trials], "repaired": []}
        for plan in plans[:FITTED]:
            started = time.perf_counter()
            _, kl = fit_and_judge(build_mla(parent, plan), parent, windows, 0, progress=False)
            row = {"kv_rank": plan.shape.kv_rank, "rope_dims": plan.shape.rope_dim, "kl": kl}
            found[budget]["repaired"].append(row | {"seconds": round(time.perf_counter() - started, 1)})
            print(json.dumps({budget: row}), flush=True)
        (out / "mla_start_ranking.json").write_text(json.dumps(found, indent=2) + "\n")


def judge_timing(out: Path) -> None:
    """The two starts' judge on SmolLM2, timed: each start judged alone (the parent's distribution computed for
    each, as it was) against one pass for both (`held_out_kls`), on 8,192 tokens of WikiText-2 validation in
    windows of 512, twice each; the long setting's two starts (run the benchmark first)."""
    import torch

    from commands import TEXT
    from gqaify.conversion.mla.fit import held_out_kl, held_out_kls
    from gqaify.entry.demo import fetch_default_model
    from gqaify.model.loading import load_model

    parent, tokenizer = load_model(str(fetch_default_model()), dtype=torch.float32)
    starts = [load_model(str(out / "mla_start" / "long" / name), dtype=torch.float32)[0] for name in ("mqa", "parent")]
    text = (TEXT / "wikitext-2-valid-tokenized.txt").read_text()[:200_000]
    windows = list(tokenizer(text, return_tensors="pt").input_ids[0][:8192].split(WINDOW))
    for _ in range(2):
        started = time.perf_counter()
        alone = [held_out_kl(parent, start, windows) for start in starts]
        each = time.perf_counter() - started
        started = time.perf_counter()
        both = held_out_kls(parent, starts, windows)
        once = time.perf_counter() - started
        print(f"each alone {each:.1f} s, one pass {once:.1f} s ({once / each:.2f}x), the same KLs: {alone == both}")


def converted(source: str, out: Path, settings: dict) -> float | None:
    """`gqaify convert SOURCE OUT` with `settings`, unless OUT holds that conversion already; its seconds (None:
    done before)."""
    if (out / "gqaify.json").is_file():
        return None
    started = time.perf_counter()
    subprocess.run(convert(source, out, **settings, quiet=True), check=True)
    return round(time.perf_counter() - started, 1)


if __name__ == "__main__":
    sys.exit(main())
