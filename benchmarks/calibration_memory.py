"""Peak memory of a calibrated conversion: does `lsq` stay within about one layer of the parent?

Builds the 1B-shaped fp16 Llama of `convert_speed.py` (16 layers, hidden 2048, 32 MHA heads, random weights,
1.9 GB in 2 shards) with ref-mha-6L's tokenizer beside it (its ids fit the vocabulary), then converts it to
GQA-8 with `--method lsq` on WikiText-2 validation text, in a child process per run, and reports the child's
peak RSS and wall time. 4,100 tokens is the fewest the fit accepts at hidden size 2,048 (2 per input dimension).

    python benchmarks/calibration_memory.py                          # 4,100 calibration tokens
    python benchmarks/calibration_memory.py --tokens 2048 --pythonpath OLD/src --mode ""   # an older gqaify

`--pythonpath` runs the conversion with another gqaify source tree (what the numbers were before); `--mode`
is passed as `calib_mode` (empty: not passed, for versions without it; versions before ConvertSettings take
it through gqaify.Calibration).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "assets"
TOKENIZER = SHARED / "models" / "ref-mha-6L"
CALIB_TEXT = SHARED / "text" / "wikitext-2-valid-tokenized.txt"

_CHILD = """
import json, resource, sys, time
import gqaify
args = json.loads(sys.argv[1])
if hasattr(gqaify, "ConvertSettings"):
    calibration = {"calib_data": args["data"], "calib_tokens": args["tokens"], "calib_seq_len": 1024,
                   **({"calib_mode": args["mode"]} if args["mode"] else {})}
else:  # a gqaify from before ConvertSettings (--pythonpath)
    extra = {"mode": args["mode"]} if args["mode"] else {}
    calibration = {"calibration": gqaify.Calibration(args["data"], tokens=args["tokens"], seq_len=1024, **extra)}
start = time.perf_counter()
gqaify.convert(args["src"], args["out"], 8, method="lsq", progress=False, **calibration)
print(json.dumps({"seconds": time.perf_counter() - start,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4100", help="calibration token counts, comma-separated")
    parser.add_argument("--mode", default="sequential", help="calib_mode; empty to leave it out")
    parser.add_argument("--pythonpath", help="run the conversion with this gqaify source tree")
    parser.add_argument("--workdir", help="where the checkpoint is built (default: a temporary folder)")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from convert_speed import build_checkpoint

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gqaify-calib-mem-"))
    src = work / "src"
    if not src.is_dir():
        build_checkpoint(src, "1b", 1 << 30)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(TOKENIZER / name, src / name)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    env = {**os.environ, **({"PYTHONPATH": args.pythonpath} if args.pythonpath else {})}
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        out = work / f"out-{tokens}"
        shutil.rmtree(out, ignore_errors=True)
        request = {"src": str(src), "out": str(out), "data": str(CALIB_TEXT), "tokens": tokens, "mode": args.mode}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(request)], capture_output=True, text=True, env=env
        )
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        result = {"tokens": tokens, **json.loads(done.stdout.strip().splitlines()[-1])}
        rows.append(result)
        print(
            f"{tokens:,} calibration tokens: peak RSS {result['peak_rss'] / 2**30:.2f} GiB, "
            f"{result['seconds']:.0f} s (checkpoint {size / 1e9:.2f} GB)",
            flush=True,
        )
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(rows))
    if not args.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
