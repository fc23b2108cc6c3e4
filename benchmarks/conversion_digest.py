"""The bytes of every test model's conversion, as SHA-256 digests: run it before and after a change that must not
change what a conversion writes, and compare (`--compare BEFORE.json` exits 1 naming every file that differs).

    python benchmarks/conversion_digest.py --out runs/digest-before.json
    python benchmarks/conversion_digest.py --out runs/digest-after.json --compare runs/digest-before.json

Covered: every architecture of the test suite's tiny models (`gqaify.testing`) with `mean` and, where it applies,
`lsq` calibrated on random tokens' text; ref-mha-6L and stories260K-mha (../shared/assets/models) with every method,
calibrated sequentially (repaired, refined 4 steps) and in parallel, contiguous and similarity grouping. gqaify.json
is compared without the fields that name the moment (`created`), the temporary folder replaced by `<tmp>`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO.parent / "shared" / "assets" / "models"
TEXT = REPO.parent / "shared" / "assets" / "text"
VOLATILE = {"created", "seconds", "gqaify_version"}


def digest(folder: Path, tmp: Path) -> dict[str, str]:
    """{file: sha256} of a converted folder; in its text files the temporary folder reads <tmp>, and gqaify.json
    goes without the fields that name the moment."""
    digests = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix in (".md", ".json"):
            data = data.replace(str(tmp).encode(), b"<tmp>")
        if path.name == "gqaify.json":
            data = json.dumps(_stable(json.loads(data)), sort_keys=True).encode()
        digests[str(path.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return digests


def _stable(value):
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def cases(tmp: Path):
    """(label, source folder, convert keyword arguments) for every conversion covered."""
    from gqaify.conversion.methods import METHOD_INFO
    from gqaify.testing import ARCH_CONFIGS, QK_NORMS, build_model, save, save_with_tokenizer

    calib = tmp / "calib.txt"
    calib.write_text((TEXT / "wikitext-2-valid-tokenized.txt").read_text()[:60_000])
    for model_type in sorted(ARCH_CONFIGS):
        folder = tmp / "src" / model_type
        model = build_model(model_type, num_kv_heads=4)
        try:  # a tokenizer for the calibration text, where the tiny vocabulary holds one
            save_with_tokenizer(model, folder)
            tokenizer = True
        except AssertionError:
            save(model, folder)
            tokenizer = False
        yield f"{model_type}/mean", folder, dict(kv_heads=2)
        if tokenizer and model_type not in QK_NORMS:
            yield (
                f"{model_type}/lsq",
                folder,
                dict(kv_heads=1, method="lsq", calib_data=str(calib), calib_tokens=512, calib_seq_len=64),
            )
    calibrated = dict(calib_data=str(calib), calib_tokens=2048, calib_seq_len=256)
    for name, kv in (("ref-mha-6L", 2), ("stories260K-mha", 2)):
        folder = MODELS / name
        if not folder.is_dir():
            print(f"skipping {name}: {folder} is absent", file=sys.stderr)
            continue
        for method, info in METHOD_INFO.items():
            calibration = calibrated if info.calibrated else {}
            yield f"{name}/{method}", folder, dict(kv_heads=kv, method=method, **calibration)
        yield f"{name}/lsq-refined", folder, dict(kv_heads=1, method="lsq", refine_steps=4, **calibrated)
        yield f"{name}/lsq-parallel", folder, dict(kv_heads=1, method="lsq", calib_mode="parallel", **calibrated)
        yield f"{name}/lsq-norepair", folder, dict(kv_heads=1, method="lsq", repair=False, **calibrated)
        yield f"{name}/mean-similarity", folder, dict(kv_heads=1, grouping="similarity", **calibrated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write {conversion: {file: sha256}} as JSON")
    parser.add_argument("--compare", help="an earlier --out file: exit 1 if any conversion differs from it")
    args = parser.parse_args()
    import gqaify

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for label, src, kwargs in cases(tmp):
            out = tmp / "out" / label
            gqaify.convert(src, out, progress=False, **kwargs)
            results[label] = digest(out, tmp)
            print(label, hashlib.sha256(json.dumps(results[label]).encode()).hexdigest()[:12], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        differ = [
            f"{label}: {file}"
            for label in sorted(set(before) | set(results))
            for file in sorted(set(before.get(label, {})) | set(results.get(label, {})))
            if before.get(label, {}).get(file) != results.get(label, {}).get(file)
        ]
        print("\n".join(differ) or f"all {len(results)} conversions byte-identical")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
