"""Code in the mixture: SmolLM2-135M-Instruct converted and uptrained a recipe's way (the MQA recipe's, or with
--recipe another's: its conversion and training settings), on the panel benchmarks' mixture with and without
Python code, at equal tokens, each judged on the five-text panel.

    python benchmarks/code_mixture.py                                      # about 20 minutes on two CPU cores
    python benchmarks/code_mixture.py --tokens 98304 --calib-tokens 32768 --refine-steps 64   # the recipe's budget
    python benchmarks/code_mixture.py --recipe smollm2-135m-mla --out runs/bench/code-mixture-mla   # latent attention

Both arms convert the parent with the recipe's method (`lsq`, layer by layer, sequential, refined against the
parent) on their own mixture, then train from that start with the recipe's training settings (all KL to the parent,
lr 3e-4, cosine, 4 x 256 blocks) on the same mixture, `--tokens` tokens; the mixture is drawn in equal shares:

- without code: WikiText-2 validation, tiny-shakespeare's first half, the TinyStories sample (`commands.mixture`);
- with code: the same and `python-packages-code.txt` (real Python of five PyPI packages: click, attrs, packaging,
  more-itertools, idna; permissively licensed, listed beside it).

The panel's code is the Python standard library (`commands.PANEL`), which neither arm calibrates or trains on. One
`gqaify eval` puts the parent, both starts and both trained models side by side (4,096 tokens a text, windows of
1,024). Writes OUT/code_mixture.md and .json; a rerun reuses what OUT holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import yaml

from commands import REPO, TEXT, convert, mixture, uptrain, write_texts
from gqaify.records import read_run
from panel_recovery import final_eval, panel_table

RECIPES = REPO / "recipes"
CONVERSION_KEYS = ("kv_heads", "kv_cut", "attention", "kv_rank", "rope_dims", "method", "calib_mode")
TRAINING_KEYS = (
    "distill_weight",
    "temperature",
    "trainable",
    "lr",
    "warmup",
    "schedule",
    "seq_len",
    "micro_batch_size",
)
ARMS = ("without code", "with code")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/code-mixture", help="output folder")
    parser.add_argument("--tokens", type=int, default=12_288, help="training tokens per arm")
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--refine-steps", type=int, default=16)
    parser.add_argument("--recipe", default="smollm2-135m-mqa", help="the packaged recipe whose way both arms take")
    args = parser.parse_args()

    from gqaify.entry.demo import fetch_default_model

    gguf = fetch_default_model()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    texts = write_texts(out / "texts")
    recipe = yaml.safe_load((RECIPES / f"{args.recipe}.yaml").read_text())
    training = out / "training.yaml"
    training.write_text(yaml.safe_dump({k: recipe[k] for k in TRAINING_KEYS}, sort_keys=False))
    models = []
    for i, arm in enumerate(ARMS):
        data = {**mixture(texts), **({"code": TEXT / "python-packages-code.txt"} if i else {})}
        converted, run_dir = out / f"converted-{i}", out / f"uptrained-{i}"
        if not converted.is_dir():
            command = convert(
                gguf,
                converted,
                **{k: recipe[k] for k in CONVERSION_KEYS if k in recipe},
                calib_data=data,
                calib_split="train",
                calib_tokens=args.calib_tokens,
                refine_steps=args.refine_steps,
                quiet=True,
            )
            print(f"== {arm}: {' '.join(command[1:])}", flush=True)
            subprocess.run(command, check=True)
        command = uptrain(
            recipe=training,
            model=converted,
            distill_from=gguf,
            output_dir=run_dir,
            max_tokens=args.tokens,
            data=data,
            split="train",
            save_every=0,
            progress=False,
        )
        print(f"== {arm}: {' '.join(command[1:])}", flush=True)
        run = read_run(run_dir)
        if not (run is not None and run.completed):
            subprocess.run(command, check=True)
        models += [converted, run_dir / "final"]
    report = final_eval(gguf, models, texts, out, tasks=False)
    write_results(out, report, args)


def write_results(out: Path, report: dict, args) -> None:
    names = ["parent"] + [f"{arm}, {stage}" for arm in ARMS for stage in ("converted", f"{args.tokens:,} tokens")]
    budget = (
        f"{args.recipe}: calibration {args.calib_tokens:,} tokens, {args.refine_steps} refinement steps; training "
        f"{args.tokens:,}"
    )
    table = f"{budget}\n\n{panel_table(names, report, tasks=False)}"
    (out / "code_mixture.md").write_text(table + "\n")
    (out / "code_mixture.json").write_text(json.dumps({"names": names, "report": report}, indent=2))
    print(table)


if __name__ == "__main__":
    main()
