"""Latent attention (MLA) beside GQA at equal KV bytes, with no training: mean KL to the parent over four kinds of
text, and the worst text's perplexity ratio.

    python benchmarks/mla.py                            # ref-mha-6L and SmolLM2-135M-Instruct
    python benchmarks/mla.py --models ref-mha-6L        # one model
    python benchmarks/mla.py --no-from-gqa --quick       # what convert does: the split --kv-cut chooses, fitted
    python benchmarks/mla.py --no-turn                   # the rotary key chosen head by head, not turned
    python benchmarks/mla.py --ladder --quick --no-from-gqa   # the split chosen for a GGUF (llama.cpp's one ladder)

Each row caches the same number of values per token and layer:
    GQA lsq           `gqaify.convert(..., method="lsq", refine_steps=64)` on the calibration mixture (the best GQA)
    MLA exact of it   that GQA model rewritten as DeepSeek-V3's dense MLA (`rewrite_as_mla`, no shape given)
    MLA from parent   the parent rewritten at the budget directly: each frequency's pairs turned across the K/V
                      heads and the components kept by their score (--no-turn: the heads' own pairs), a joint latent
                      of what they leave of the keys and the values (balanced K/V, PCA on calibration inputs);
                      "PCA" as it comes, "fitted" then brought back to the parent layer by layer (`fit_mla`: o_proj
                      refitted, 64 Adam steps a layer on the calibration windows)
    split chosen      the parent at the budget with the split `--kv-cut` chooses alone (`ranked_splits` then
                      `fit_ranked`: the PCA starts of six splits judged on held-out calibration windows, the two
                      closest fitted, the closer after its fit kept); --ladder: as `--kv-cut` chooses it for
                      OUT.gguf, one ladder of distinct frequencies (turned: one slot per frequency, its best
                      component), the only rows run
    MLA from GQA      the next larger GQA lsq model compressed to the budget the same way, then fitted

Panel: WikiText-2 test, TinyStories validation, tiny-shakespeare's second half and Python's LICENSE.txt, the first
4,096 tokens of each, windows of 512. Calibration: the benchmarks' mixture (`commands.mixture`: WikiText-2
validation, tiny-shakespeare's first half, the TinyStories sample), 16,384 tokens in equal shares, read and cut into
interleaved windows by gqaify's own calibration reader, as `gqaify convert --calib-data A B C` reads them; none of it
a panel text, and the licence no kind it holds. `--calib wikitext` calibrates on WikiText-2 validation alone.
Writes OUT/mla.json and OUT/mla.md (OUT: --out, default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from commands import MODELS, REPO, TEXT, mixture, panel_contents, write_texts

CALIB_TOKENS = 16_384
PANEL_TOKENS, WINDOW = 4096, 512
REFINE_STEPS = 64

# model -> (budgets in values per token and layer, {budget: rotary pairs kept of each of the parent's K/V heads})
SETUPS = {
    "ref-mha-6L": ([64, 128, 256], {64: 3, 128: 6, 256: 12}),
    "SmolLM2-135M-Instruct": ([128, 256], {128: 8, 256: 16}),
}


# the four texts of the panel (`commands.PANEL`) read here, the code left out: name in mla.json -> name in the panel
PANEL_TEXTS = {
    "wikitext": "wikitext",
    "tinystories": "tinystories",
    "shakespeare-2": "shakespeare",
    "licence": "licence",
}


def panel_texts() -> dict[str, str]:
    texts = panel_contents(PANEL_TEXTS.values())
    return {ours: texts[theirs] for ours, theirs in PANEL_TEXTS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SETUPS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--no-from-gqa", action="store_true", help="skip the rows that compress a larger GQA model")
    parser.add_argument("--quick", action="store_true", help="fit the chosen split only (the fixed one unfitted)")
    parser.add_argument("--calib", choices=["mixture", "wikitext"], default="mixture", help="the calibration text")
    parser.add_argument(
        "--no-turn", action="store_true", help="choose the rotary key head by head, its pairs not turned across heads"
    )
    parser.add_argument("--ladder", action="store_true", help="the split chosen as for a GGUF (and the GQA rows)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calib = calibration_files(args.calib, args.out / "texts")
    results = {}
    for name in args.models.split(","):
        work = args.out / "mla" / (name if args.calib == "mixture" else f"{name}-{args.calib}")
        results[name] = measure(
            name, work, calib, not args.no_from_gqa, args.quick, across=not args.no_turn, ladder=args.ladder
        )
        (args.out / "mla.json").write_text(json.dumps(results, indent=2))
    table = "\n\n".join(format_table(name, rows) for name, rows in results.items())
    (args.out / "mla.md").write_text(table + "\n")
    print(table)


def calibration_files(which: str, texts: Path) -> list[str]:
    if which == "wikitext":
        return [str(TEXT / "wikitext-2-valid-tokenized.txt")]
    return [str(path) for path in mixture(write_texts(texts)).values()]


def calibration_windows(files: list[str], tokenizer) -> list[torch.Tensor]:
    """The calibration windows `gqaify convert --calib-data FILES --calib-tokens 16384 --calib-seq-len 512` fits on."""
    from gqaify.conversion.calibrate import read_calibration
    from gqaify.conversion.settings import Calibration

    calibration = Calibration(files, CALIB_TOKENS, "train", "text", WINDOW, "sequential", REFINE_STEPS, 1e-3, True)
    return [w for w in read_calibration(calibration, tokenizer).windows(WINDOW) if len(w) > 1]


def measure(
    name: str, work: Path, calib_files: list[str], from_gqa: bool = True, quick: bool = False, across: bool = True,
    ladder: bool = False,
) -> list[dict]:  # fmt: skip
    import gqaify
    from gqaify.conversion.mla.fit import fit_mla
    from gqaify.conversion.mla.layer import rewrite_as_mla
    from gqaify.conversion.mla.split import fit_ranked, ranked_splits
    from gqaify.entry.demo import fetch_default_model
    from gqaify.eval.perplexity import perplexity
    from gqaify.model.loading import load_model

    source = str(MODELS / name) if (MODELS / name).is_dir() else str(fetch_default_model())
    parent, tokenizer = load_model(source, dtype=torch.float32)
    texts = {k: tokenizer(v, return_tensors="pt").input_ids[0][:PANEL_TOKENS] for k, v in panel_texts().items()}
    windows = calibration_windows(calib_files, tokenizer)
    calib = torch.cat(windows)  # the ids the MLA rewrite's statistics and split choice read, as `convert` gives them
    parent_ppl = {k: perplexity(parent, ids, WINDOW, WINDOW, progress=False).perplexity for k, ids in texts.items()}
    config = parent.config
    H, G = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // H
    budgets, pairs = SETUPS[name]
    how = "" if across or G == 1 else ", head by head"  # --no-turn: the rotary key chosen without turning
    how += ", for llama.cpp" if ladder else ""  # --ladder: one slot per frequency
    rows: list[dict] = []

    def score(label: str, budget: int, model, seconds: float) -> None:
        kls, ratios = {}, {}
        for key, ids in texts.items():
            p = perplexity(model, ids, WINDOW, WINDOW, progress=False, parent=parent)
            kls[key] = p.kl_sum / p.tokens_scored
            ratios[key] = p.perplexity / parent_ppl[key]
        row = {
            "model": name,
            "variant": label,
            "values": budget,
            "mean_kl": sum(kls.values()) / len(kls),
            "worst_ratio": max(ratios.values()),
            "kl": kls,
            "seconds": round(seconds, 1),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)

    gqa_models = {}
    for budget in budgets:
        kv_heads = budget // (2 * d)
        if kv_heads < 1 or G % kv_heads or budget % (2 * d) or kv_heads == G:
            continue
        out = work / f"gqa-{kv_heads}"
        start = time.perf_counter()
        if not out.is_dir():
            gqaify.convert(
                source, out, kv_heads, method="lsq", calib_data=calib_files, calib_tokens=CALIB_TOKENS,
                refine_steps=REFINE_STEPS, calib_seq_len=WINDOW, progress=False,
            )  # fmt: skip
        gqa, _ = load_model(str(out), dtype=torch.float32)
        score(f"GQA-{kv_heads} lsq", budget, gqa, time.perf_counter() - start)
        if name == "ref-mha-6L":  # the rewrite's exactness, measured once on the panel (its tests check it)
            start = time.perf_counter()
            score(f"MLA exact of GQA-{kv_heads} lsq", budget, rewrite_as_mla(gqa), time.perf_counter() - start)
        gqa_models[budget] = gqa
    for budget in budgets:
        p = pairs[budget]
        rope = 2 * p * G
        start = time.perf_counter()
        if not ladder:
            mla = rewrite_as_mla(parent, kv_rank=budget - rope, rope_dim=rope, ids=calib, across=across)
            label = f"MLA from parent ({p} pairs a head, latent {budget - rope}{how})"
            score(f"{label}, PCA", budget, mla, time.perf_counter() - start)
            if not quick:
                fit_mla(mla, parent, windows, REFINE_STEPS, progress=False)
                score(f"{label}, fitted", budget, mla, time.perf_counter() - start)
            start = time.perf_counter()
        plans, trials = ranked_splits(parent, budget, calib, ladder, across=across)  # what --kv-cut alone does
        mla, plan, trials, _ = fit_ranked(parent, parent, plans, trials, windows, REFINE_STEPS, 1e-3)
        split = f"latent {plan.shape.kv_rank} + rotary {plan.shape.rope_dim}{how}"
        label = f"MLA from parent, split chosen ({split}), fitted"
        score(label, budget, mla, time.perf_counter() - start)
        print(json.dumps({"budget": budget, "splits tried": [vars(t) for t in trials]}), flush=True)
        larger = [b for b in gqa_models if b > budget]
        if larger and from_gqa:
            gqa = gqa_models[min(larger)]
            g = gqa.config.num_key_value_heads
            p_g = min(d // 2, max(1, round(p * G / g)))
            rope = 2 * p_g * g
            start = time.perf_counter()
            mla = rewrite_as_mla(gqa, kv_rank=budget - rope, rope_dim=rope, ids=calib, across=across)
            fit_mla(mla, parent, windows, REFINE_STEPS, progress=False)
            label = f"MLA from GQA-{g} lsq ({p_g} pairs a head, latent {budget - rope}{how}), fitted"
            score(label, budget, mla, time.perf_counter() - start)
    return rows


def format_table(name: str, rows: list[dict]) -> str:
    lines = [
        f"**{name}** (no training; mean KL to the parent over four texts, worst perplexity ratio)",
        "",
        "| values / token / layer | variant | mean KL | worst ratio |",
        "|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: r["values"]):
        lines.append(f"| {row['values']} | {row['variant']} | {row['mean_kl']:.4f} | {row['worst_ratio']:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
