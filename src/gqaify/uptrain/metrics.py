"""What an uptraining run writes beside its checkpoints: metrics.jsonl (and .csv) as accelerate trackers,
and the recovery plot (eval perplexity against training tokens, the parent as a line)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
from pathlib import Path

from accelerate.tracking import GeneralTracker, on_main_process

from gqaify.figures import figure, log_scale

METRICS = "metrics.jsonl"
METRICS_CSV = "metrics.csv"


class JsonlTracker(GeneralTracker):
    """metrics.jsonl: one JSON object per logged step, {"step": ..., "tokens": ..., "loss": ..., ...}."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.path = Path(path)

    @property
    def tracker(self):
        return self.path

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        with _appending(self.path) as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


class CsvTracker(GeneralTracker):
    """metrics.csv, a row per logged step with fixed `columns`, for spreadsheets (log_to: csv)."""

    name = "csv"
    requires_logging_directory = False

    def __init__(self, path: str | os.PathLike, columns: tuple[str, ...]):
        super().__init__()
        self.path, self.columns = Path(path), ("step", *columns)

    @property
    def tracker(self):
        return self.path

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        new = not self.path.exists()
        with _appending(self.path) as f:
            writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow({"step": step, **values})


@contextlib.contextmanager
def _appending(path: Path):
    """`path` opened to append a row; if the row cannot be written whole (a full disk), the file is cut back to
    what it held, so that no half row is left for a resumed run to read."""
    size = path.stat().st_size if path.exists() else None
    try:
        with open(path, "a", newline="") as f:
            yield f
    except BaseException:
        if size is None:
            path.unlink(missing_ok=True)
        else:
            os.truncate(path, size)
        raise


def truncate_metrics(out: Path, step: int) -> None:
    """Drop the metrics logged after `step` (-1: all of them), from metrics.jsonl and metrics.csv.

    A resumed run logged those steps after its last checkpoint and lost them with the process; without
    them the files read as one uninterrupted run.
    """
    jsonl, table = out / METRICS, out / METRICS_CSV
    if jsonl.exists():
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in read_metrics(jsonl) if r["step"] <= step))
    if table.exists():
        with open(table, newline="") as f:
            reader = csv.DictReader(f)
            rows, columns = [r for r in reader if int(r["step"]) <= step], reader.fieldnames
        with open(table, "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_curve(rows: list[dict]) -> tuple[list[int], list[float]]:
    """(training tokens, eval perplexity) at every evaluation in `rows`."""
    points = [(r["tokens"], r["eval_perplexity"]) for r in rows if "eval_perplexity" in r]
    return [t for t, _ in points], [p for _, p in points]


def plot_recovery(curves: dict[str, tuple[list[int], list[float]]], parent: float | None, path, title: str) -> None:
    """Eval perplexity (log scale) against training tokens, one line per curve, the parent dashed."""
    with figure(path, size=(7, 4.5), dpi=100, save_dpi=120) as ax:  # laid out at 100 dpi, as it always was
        for label, (tokens, ppl) in curves.items():
            ax.plot(tokens, ppl, marker="o", markersize=3, label=label)
        if parent is not None:
            ax.axhline(parent, color="black", linestyle="--", linewidth=1, label=f"parent ({parent:.1f})")
        log_scale(ax, "y")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("eval perplexity")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
