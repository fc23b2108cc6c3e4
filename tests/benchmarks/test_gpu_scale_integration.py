"""benchmarks/gpu_scale.py, the script a lent GPU runs first, rehearsed end to end on the CPU at a tiny budget: so
that a window is spent on the run, not on finding out that the script breaks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import MODELS, REPO, needs_assets


@needs_assets
def test_the_device_script_converts_trains_and_appends_a_row_per_evaluation(tmp_path):
    results = tmp_path / "gpu_recovery.json"
    results.write_text(json.dumps([{"recipe": "an earlier row"}]))
    out = tmp_path / "out"
    argv = ["--gguf", MODELS / "stories260K-mha", "--out", out, "--results", results, "--tiny", "--tokens", "2048"]
    done = subprocess.run(
        [sys.executable, REPO / "benchmarks" / "gpu_scale.py", *map(str, argv)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(results.read_text())
    assert rows[0] == {"recipe": "an earlier row"}  # appended, never rewritten
    rows = rows[1:]
    assert len(rows) >= 3 and rows == json.loads((out / "gpu_recovery.json").read_text())
    assert [r["tokens"] for r in rows] == sorted({r["tokens"] for r in rows}) and rows[0]["tokens"] == 0
    assert rows[-1]["tokens"] == 2048
    keys = {"recipe", "tokens", "device", "mean_kl", "worst_ratio", "texts", "tokens_per_s", "mfu",
            "micro_batch_size", "seq_len", "lr", "seconds"}  # fmt: skip
    for row in rows:
        assert set(row) == keys and row["device"] == "cpu" and row["mfu"] is None
        assert set(row["texts"]) == {"wikitext", "shakespeare", "tinystories", "code", "licence"}
        kls = [t["kl_to_parent"] for t in row["texts"].values()]
        assert row["mean_kl"] == pytest.approx(sum(kls) / len(kls))
        ratios = [t["ratio_to_parent"] for t in row["texts"].values()]
        assert row["worst_ratio"] == pytest.approx(max(ratios))
    assert rows[-1]["mean_kl"] < rows[0]["mean_kl"]  # training moved the converted start toward its parent
    summary = json.loads((out / "gpu_scale.json").read_text())
    assert summary["returncode"] == 0 and summary["forecast"]["tokens"] == 2048
