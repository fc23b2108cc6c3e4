"""The cache frontier's committed rows keep the schema the benchmark page and its readers rely on: each row a
(model, cache) point of one engine, its bytes per token, its mean KL and worst ratio, and per text its KL and ratio
to the parent; every figure a number, the parent's f16 reference at zero."""

import json
import math

import pytest

from helpers import REPO

RESULTS = REPO / "benchmarks" / "results"
ROW = {"model", "cache", "engine", "bytes_per_token", "mean_kl", "worst_ratio", "texts"}


@pytest.mark.parametrize("name", ["cache_frontier.json", "cache_frontier_long.json", "cache_frontier_retrieval.json"])
def test_each_row_of_the_frontier_has_the_pages_fields(name):
    found = json.loads((RESULTS / name).read_text())
    assert set(found) <= {"llama.cpp", "transformers"} and found
    for engine, rows in found.items():
        assert rows and len({(r["model"], r["cache"]) for r in rows}) == len(rows), engine  # a point once
        for row in rows:
            assert set(row) >= ROW and row["engine"] == engine, row  # kept under the engine that ran it
            assert row["bytes_per_token"] > 0 and math.isfinite(row["mean_kl"]) and row["worst_ratio"] > 0
            assert row["texts"] and all(set(t) == {"kl_to_parent", "ratio_to_parent"} for t in row["texts"].values())
            mean = sum(t["kl_to_parent"] for t in row["texts"].values()) / len(row["texts"])
            assert math.isclose(row["mean_kl"], mean, rel_tol=1e-3, abs_tol=1e-4), row
        parents = [r for r in rows if r["model"] == "parent" and r["cache"] == "f16"]
        assert all(p["mean_kl"] == 0 and p["worst_ratio"] == 1 for p in parents)  # the reference, where measured
