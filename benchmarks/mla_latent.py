"""How uptraining should train an MLA rewrite: the `smollm2-135m-mla` recipe's converted start (its output_dir's
`converted`, which `recipe_goals.py --recipe smollm2-135m-mla` leaves) trained the same tokens in several ways with
the recipe's data and settings (the latent's down-projection held as converted, as uptraining holds it), each then
judged on the recipe's two eval texts as the run logs them and, unless --no-panel, on recipe_goals' five-text panel:

    held          the start as converted
    balanced      the start with kv_b_proj's columns at the query projection's RMS and the latent norm's weight
                  rescaled inversely (`_rescaled`: the same function; AdamW moves each weight by about its learning
                  rate, and as the fit leaves it kv_b_proj's entries are about 20 times smaller than the query's)
    pca           the start with kv_b_proj's columns at 1/sqrt(rows), an orthonormal column's RMS
    ARM:X         the same at learning rate X (the recipe's otherwise)

    python benchmarks/mla_latent.py --no-panel                      # 24,576 tokens each, ~12 minutes an arm, 2 cores
    python benchmarks/mla_latent.py --arms balanced,balanced:3e-4 --tokens 98304   # the recipe's tokens

Writes OUT/mla_latent.json and .md (every arm trained so far in OUT). Training the down-projection too, at its
latent rows' scale, was an arm at commit 9dbe761 (`--arms held,trained`), where uptraining could.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import yaml

from panel_recovery import final_eval
from recipe_goals import REPO, _continued, _texts

STARTS = ("held", "balanced", "pca")  # the arms' starts: as converted, or kv_b_proj rescaled (`_rescaled`)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="smollm2-135m-mla", help="a packaged MLA recipe whose start was converted")
    parser.add_argument("--arms", default="held,balanced", help="comma-separated arms (see above)")
    parser.add_argument("--tokens", type=int, default=24576, help="tokens each arm trains")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "mla-latent")
    parser.add_argument("--texts", type=Path, help="the panel's texts as write_texts wrote them (else written here)")
    parser.add_argument("--no-panel", action="store_true", help="judge on the runs' own eval texts alone")
    args = parser.parse_args()
    if unknown := [arm for arm in args.arms.split(",") if arm.partition(":")[0] not in STARTS]:
        parser.error(f"no arm {', '.join(unknown)}: arms are {', '.join(STARTS)}, each with an optional :LR")
    from commands import write_texts
    from gqaify.entry.demo import fetch_default_model

    recipe_file = REPO / "recipes" / f"{args.recipe}.yaml"
    converted = REPO / yaml.safe_load(recipe_file.read_text())["output_dir"] / "converted"
    line = recipe_file.read_text().splitlines()[0].removeprefix("# ")
    for arm in args.arms.split(","):
        folder = args.out / _folder(arm)
        if (_run(folder, args.tokens) / "final").is_dir():
            continue
        how, _, lr = arm.partition(":")
        start = converted if how == "held" else _rescaled(converted, how, args.out)
        folder.mkdir(parents=True, exist_ok=True)
        _continued(line, start, args.tokens, folder, "--eval_points 2" + (f" --lr {lr}" if lr else ""))
        (folder / "arm.json").write_text(json.dumps({"arm": arm}) + "\n")
    arms = [json.loads(path.read_text())["arm"] for path in sorted(args.out.glob("*/arm.json"))]
    logged = {arm: _logged(_run(args.out / _folder(arm), args.tokens)) for arm in arms}
    if args.no_panel:
        results = {"recipe": args.recipe, "tokens": args.tokens, "logged": logged}
        (args.out / "mla_latent.json").write_text(json.dumps(results, indent=2) + "\n")
        lines = ["| arm | " + " | ".join(f"mean KL at {t:,}" for t in next(iter(logged.values()))) + " |"]
        lines += ["|---" * (len(next(iter(logged.values()))) + 1) + "|"]
        lines += [f"| {arm} | " + " | ".join(f"{kl:.4f}" for kl in kls.values()) + " |" for arm, kls in logged.items()]
        print("\n".join(lines))
        return
    texts = _texts(args.texts) if args.texts else write_texts(args.out / "texts")
    models = [converted, *(_run(args.out / _folder(arm), args.tokens) / "final" for arm in arms)]
    report = final_eval(fetch_default_model(), models, texts, args.out / "-".join(map(_folder, arms)), False)
    rows = []
    for name, model in zip(("parent", "converted", *arms), report["models"], strict=True):
        panel = model["panel"] or {}
        kls = {t["text"]: t.get("kl_to_parent") for t in model["texts"]}
        row = {"model": name, "mean_kl": panel.get("mean_kl_to_parent"), "worst": panel.get("worst_ratio_to_parent")}
        rows.append(row | {"worst_text": panel.get("worst_text"), "kl": kls})
    results = {"recipe": args.recipe, "tokens": args.tokens, "rows": rows, "logged": logged}
    (args.out / "mla_latent.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"{args.recipe}'s converted start, {args.tokens:,} tokens each", "", "| arm | mean KL | worst × parent |"]
    lines += ["|---|---|---|"] + [
        f"| {r['model']} | {r['mean_kl']:.3f} | {r['worst']:.2f}× ({r['worst_text']}) |" for r in rows[1:]
    ]
    (args.out / "mla_latent.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _folder(arm: str) -> str:
    return arm.replace(":", "-lr")


def _run(folder: Path, tokens: int) -> Path:
    """Where `recipe_goals._continued` trains an arm of `tokens` tokens in its folder."""
    return folder / f"tokens-{tokens}" / "run"


def _logged(run: Path) -> dict[int, float]:
    """The run's own evaluations: mean KL to the parent over its eval texts, by tokens trained."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["tokens"]: row["eval_kl_mean"] for row in rows if "eval_kl_mean" in row}


def _rescaled(converted: Path, how: str, out: Path) -> Path:
    """The converted start with kv_b_proj's columns rescaled (`balanced`: to the query's RMS; `pca`: to an
    orthonormal column's), the same function, saved once into OUT/start-HOW."""
    import torch

    from gqaify.model.loading import load_model

    folder = out / f"start-{how}"
    if not (folder / "model.safetensors").exists():
        shutil.copytree(converted, folder, dirs_exist_ok=True)
        model, _ = load_model(str(converted), dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                up, norm = attn.kv_b_proj.weight, attn.kv_a_layernorm.weight
                rms = attn.q_proj.weight.pow(2).mean().sqrt() if how == "balanced" else up.shape[0] ** -0.5
                factor = rms / up.pow(2).mean(dim=0).sqrt()  # per column; the norm's weight takes the inverse
                up.mul_(factor)
                norm.div_(factor)
        model.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    main()
