"""The recovery curve a run draws: where its evaluations fall, the trend of the mean KL to the parent, and how many
more tokens that trend says a KL target needs.

    evaluations   at the start and at `eval_points` steps spaced evenly in log(tokens): 1, 2, 4, 9, 19, 40 ...
    the trend     log KL = log KL(t̄) - b (log t - log t̄), fitted by least squares to the points after the
                  highest of the first half of them (the first steps often disturb the converted model before it
                  recovers: that rise is not the trend; a rise later on is, and stays in)
                  (a power law, KL ∝ t^-b: a straight line on log-log axes, as recovery curves are drawn)
    the forecast  tokens where the line meets the target KL; its range where the line's band of ± 2 standard
                  errors (of the line at that point: its level and its slope both uncertain) meets it. A slope whose
                  band reaches 0 is a trend that has flattened: no number of tokens is promised.

This is an extrapolation of the points so far, not a guarantee: a run with other training tokens, schedule or data
draws another curve. benchmarks/curve_forecast.py measures how well the first half of a run predicts its end.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gqaify.errors import UserError
from gqaify.records import from_json, record_text
from gqaify.summary import printable

FORECAST_FILE = "recovery.json"
REPORT_FILE = "recovery.md"
PLOT_FILE = "recovery.png"
SPREAD = 2.0  # standard errors either side of the fitted line: the forecast's range
REACH = 1000  # a forecast past this many times the tokens seen is no forecast: "beyond reach"
MIN_POINTS = 3  # points (t > 0) a trend is fitted to: two always lie on a line


def eval_steps(steps: int, points: int) -> list[int]:
    """The optimizer steps at which a run of `steps` evaluates: `points` of them spaced evenly in log(step), the
    last always `steps` (steps that round alike are merged; the start, step 0, is evaluated besides); with no
    points, the end alone."""
    if steps <= 0:
        return []
    if points <= 0:
        return [steps]
    found = {max(1, round(steps ** (k / points))) for k in range(1, points + 1)}
    return sorted(found | {steps})


@dataclass(frozen=True)
class CurvePoint:
    """One evaluation of a run: the training tokens and seconds it came after, and what it measured."""

    tokens: int
    seconds: float  # training wall-clock (evaluations left out), summed over resumptions
    mean_kl: float | None  # nats per token, over the eval texts (None without a teacher)
    worst_ratio: float | None  # the worst text's perplexity / the parent's (None without the parent's)
    perplexities: dict[str, float]  # each eval text's

    @classmethod
    def of(cls, row: dict) -> CurvePoint | None:
        """The point a metrics.jsonl row holds, or None for a row with no evaluation."""
        if "eval_perplexity" not in row:
            return None
        texts = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("eval_perplexity/")}
        return cls(
            tokens=row["tokens"],
            seconds=row.get("train_seconds", 0.0),
            mean_kl=row.get("eval_kl_mean", row.get("eval_kl")),
            worst_ratio=row.get("eval_ratio_worst", row.get("eval_ratio")),
            perplexities=texts or {"eval": row["eval_perplexity"]},
        )


@dataclass(frozen=True)
class PowerLaw:
    """log KL = log_kl_at_pivot - exponent · (log tokens - log_pivot): a least-squares line on log-log axes."""

    exponent: float  # b: KL falls by a factor 2^b for each doubling of the tokens
    exponent_se: float  # its standard error (0 where the points lie on the line)
    log_pivot: float  # mean log tokens of the points: where the line is best known
    log_kl_at_pivot: float
    points: int
    residual_sd: float  # of log KL about the line
    spread: float  # Σ (log t - log_pivot)²: how far apart the points lie

    def log_kl_se(self, tokens: float) -> float:
        """The standard error of the line's log KL at `tokens`: σ √(1/n + (log t - pivot)² / Σ (log tᵢ - pivot)²)."""
        return self.residual_sd * math.sqrt(1 / self.points + (math.log(tokens) - self.log_pivot) ** 2 / self.spread)

    def at(self, tokens: float, exponent: float | None = None) -> float:
        b = self.exponent if exponent is None else exponent
        return math.exp(self.log_kl_at_pivot - b * (math.log(tokens) - self.log_pivot))

    def log_tokens_for(self, kl: float) -> float:
        """log(tokens) where the line reaches `kl` (the line falls: exponent > 0)."""
        return self.log_pivot + (self.log_kl_at_pivot - math.log(kl)) / self.exponent

    def tokens_for(self, kl: float) -> float:
        """Tokens where the line reaches `kl`."""
        return math.exp(self.log_tokens_for(kl))


def fit_power_law(tokens: list[float], kls: list[float]) -> PowerLaw | None:
    """The least-squares power law through the points with tokens > 0 and KL > 0, or None with fewer than
    MIN_POINTS of them (or all at one number of tokens)."""
    pairs = [(math.log(t), math.log(k)) for t, k in zip(tokens, kls, strict=True) if t > 0 and k > 0]
    n = len(pairs)
    if n < MIN_POINTS:
        return None
    x_mean = sum(x for x, _ in pairs) / n
    y_mean = sum(y for _, y in pairs) / n
    sxx = sum((x - x_mean) ** 2 for x, _ in pairs)
    if sxx == 0:
        return None
    slope = sum((x - x_mean) * (y - y_mean) for x, y in pairs) / sxx
    residual = sum((y - y_mean - slope * (x - x_mean)) ** 2 for x, y in pairs)
    sd = math.sqrt(residual / (n - 2)) if n > 2 else 0.0
    return PowerLaw(-slope, sd / math.sqrt(sxx), x_mean, y_mean, n, sd, sxx)


def _crossing(law: PowerLaw, kl: float, after: float, side: float) -> float | None:
    """The tokens past `after` where the line's band edge (side +1: upper, -1: lower, SPREAD standard errors out)
    first falls to `kl`, or None if it does not within REACH times `after`. Past the points' pivot each edge is
    monotone wherever it falls at all, so bisection finds the crossing."""

    def above(x: float) -> bool:
        t = math.exp(x)
        return math.log(law.at(t)) + side * SPREAD * law.log_kl_se(t) > math.log(kl)

    low, high = math.log(after), math.log(after * REACH)
    if not above(low):
        return after
    if above(high):
        return None
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if above(middle) else (low, middle)
    return math.exp(high)


Status = Literal["reached", "on track", "beyond reach", "flattened", "moved away", "too few points", "no teacher"]


@dataclass(frozen=True)
class Forecast:
    """What the points so far say about reaching `target_kl`: the run's recovery.json."""

    target_kl: float
    status: Status
    tokens_seen: int
    mean_kl: float | None  # the last point's
    tokens_to_target: int | None  # more tokens than tokens_seen, by the fitted line (status "on track")
    tokens_to_target_low: int | None  # where the line's band, SPREAD standard errors below it, reaches the target
    tokens_to_target_high: int | None  # where the band above it does (None: not within REACH x tokens_seen)
    law: PowerLaw | None
    points: list[CurvePoint]

    def sentence(self) -> str:
        """The forecast in one line, for the log and the report."""
        target = f"mean KL {self.target_kl:g}"
        if self.status == "no teacher":
            return "no recovery forecast: the mean KL needs a teacher (distill_from or parent) and eval_data"
        if self.status == "too few points":
            return (
                f"no recovery forecast yet: {MIN_POINTS} evaluations after the early disturbance (the highest of "
                "the first half of the points) are needed to fit a trend"
            )
        if self.status == "reached":
            return f"mean KL {self.mean_kl:.3f} after {self.tokens_seen:,} tokens: the target {target} is reached"
        if self.status == "moved away":
            start = self.points[0].mean_kl
            return (
                f"mean KL {self.mean_kl:.3f} after {self.tokens_seen:,} tokens, {self.mean_kl / start:.1f}x the "
                f"{start:.3f} the run started from: training moved the model away from its parent, so no forecast "
                "is made; try a lower lr"
            )
        law = self.law
        trend = f"KL ∝ tokens^{-law.exponent:.3f} (± {law.exponent_se:.3f}) over {law.points} points"
        if self.status == "flattened":
            return (
                f"mean KL {self.mean_kl:.3f} after {self.tokens_seen:,} tokens; the trend has flattened ({trend}): "
                f"more tokens of this recipe are not seen to reach {target}"
            )
        if self.status == "beyond reach":
            return (
                f"mean KL {self.mean_kl:.3f} after {self.tokens_seen:,} tokens; at this trend ({trend}) {target} lies "
                f"beyond {REACH:,} times the tokens seen: more tokens of this recipe alone are not seen to get there"
            )
        high = (
            f"more than {REACH:,}x the tokens seen"
            if self.tokens_to_target_high is None
            else f"{significant(self.tokens_to_target_high):,}"
        )
        about, low = significant(self.tokens_to_target), significant(self.tokens_to_target_low)
        return (
            f"mean KL {self.mean_kl:.3f} after {self.tokens_seen:,} tokens; about {about:,} more tokens to reach "
            f"{target} (range {low:,} to {high}; an extrapolation of {trend})"
        )


def forecast(points: list[CurvePoint], target_kl: float) -> Forecast:
    """The forecast of `points` (a run's evaluations, in order) for `target_kl`."""
    seen = points[-1].tokens if points else 0
    last = points[-1].mean_kl if points else None
    kls = [(p.tokens, p.mean_kl) for p in points if p.mean_kl is not None]

    def made(status: Status, law: PowerLaw | None = None, central=None, low=None, high=None) -> Forecast:
        return Forecast(target_kl, status, seen, last, central, low, high, law, points)

    if not kls:
        return made("no teacher")
    if last is not None and last <= target_kl:
        return made("reached")
    trained = [(t, k) for t, k in kls if t > 0]
    early = (len(trained) + 1) // 2  # the first half of the points: the first steps' disturbance, if any, is there
    peak = max(range(early), key=lambda i: trained[i][1], default=-1)
    falling = trained[peak + 1 :]  # the recovery after it (a later rise is the trend's noise, and stays in)
    law = fit_power_law([t for t, _ in falling], [k for _, k in falling])
    if law is None:
        return made("too few points")
    if kls[0][0] == 0 and kls[0][1] > 0 and last > kls[0][1]:  # past the early disturbance, still further away
        return made("moved away")
    if law.exponent - SPREAD * law.exponent_se <= 0:
        return made("flattened", law)

    def more(tokens: float | None) -> int | None:
        return None if tokens is None else max(0, math.ceil(tokens - seen))

    if law.log_tokens_for(target_kl) > math.log(seen * REACH):
        return made("beyond reach", law)
    central = more(law.tokens_for(target_kl))
    return made(
        "on track", law, central, more(_crossing(law, target_kl, seen, -1)), more(_crossing(law, target_kl, seen, +1))
    )


def write_forecast(out: Path, found: Forecast) -> None:
    """recovery.json (the forecast, typed as `Forecast`: `read_forecast` reads it back) and recovery.md (the same for
    a reader) in `out`. A number that is not finite (a diverged evaluation's) is written as Python's NaN or Infinity,
    which Python reads back as it was."""
    (out / FORECAST_FILE).write_text(record_text(found))
    (out / REPORT_FILE).write_text(_report(found))


def read_forecast(out: Path) -> Forecast | None:
    """The forecast the run folder `out` holds (its recovery.json, as `write_forecast` wrote it), read back typed and
    equal to the forecast written; None where it holds none.

    Raises:
        UserError: one line naming recovery.json: it cannot be read, is not JSON, or is not a forecast this gqaify
            reads (damaged, or of another version: the problem names the field).
    """
    file = Path(out) / FORECAST_FILE
    if not file.is_file():
        return None
    try:
        found = from_json(Forecast, json.loads(file.read_text()))
        if found.status not in typing.get_args(Status):
            raise ValueError(f"status {found.status!r} is not one of {', '.join(typing.get_args(Status))}")
    except (OSError, ValueError) as exc:  # ValueError: not JSON (or not UTF-8), or not a Forecast
        problem = exc.strerror if isinstance(exc, OSError) else exc
        raise UserError(
            f"{printable(file)} is not a recovery forecast this gqaify reads ({problem}); delete it: a run draws it "
            "anew from its metrics.jsonl at each evaluation"
        ) from None
    return found


def _report(found: Forecast) -> str:
    names = sorted({name for p in found.points for name in p.perplexities})
    head = ["tokens", "seconds", "mean KL", "worst × parent", *(f"{n} perplexity" for n in names)]
    rows = [
        [
            f"{p.tokens:,}",
            f"{p.seconds:.0f}",
            _number(p.mean_kl, ".3f"),
            _number(p.worst_ratio, ".2f"),
            *(_number(p.perplexities.get(n), ".2f") for n in names),
        ]
        for p in found.points
    ]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    return (
        "# Recovery\n\n"
        + "\n".join(table)
        + f"\n\n{found.sentence()}.\n\nThe forecast extrapolates a straight line on log-log axes through the points "
        "so far; a run with other training tokens, schedule or data draws another curve. The plot is recovery.png.\n"
    )


def _number(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def draw_curve(out: Path, target_kl: float, parent_perplexities: dict[str, float] | None, title: str) -> Forecast:
    """The run in `out` as its metrics.jsonl stands: its forecast written (recovery.json, recovery.md) and its
    curve drawn (recovery.png)."""
    from gqaify.uptrain.metrics import METRICS, read_metrics

    points = [p for p in map(CurvePoint.of, read_metrics(out / METRICS)) if p is not None]
    found = forecast(points, target_kl)
    write_forecast(out, found)
    if any(p.tokens > 0 for p in points):  # a curve needs a point after the start
        plot_curve(found, parent_perplexities, out / PLOT_FILE, title)
    return found


def significant(tokens: int, digits: int = 2) -> int:
    """`tokens` to `digits` significant figures: a forecast from a few points is not known to seven (312,336 is
    said 310,000)."""
    return int(round(tokens, digits - len(str(abs(int(tokens)))))) if tokens else 0


# How far past the measured KL a target is still drawn, as a factor either way: a target further off (`--target-kl
# 1e300`) would stretch the log axis until the points are one line, and overflow matplotlib's transforms.
TARGET_DRAWN_WITHIN = 1e3


def _on_the_plot(target: float, kls: list[float]) -> bool:
    return min(kls) / TARGET_DRAWN_WITHIN <= target <= max(kls) * TARGET_DRAWN_WITHIN


def plot_curve(found: Forecast, parent_perplexities: dict[str, float] | None, path: Path, title: str) -> None:
    """recovery.png: mean KL against tokens (with the fitted line, its extrapolation and the target) and against
    seconds, and each text's perplexity ratio to the parent (or perplexity, where a text has no parent's) against
    tokens. The start (0 tokens, 0 seconds) is drawn too, where each x axis turns from linear to log."""
    from gqaify.figures import figure, log_scale

    points = found.points
    with figure(path, size=(14, 4.2), dpi=100, save_dpi=120, ncols=3) as (by_tokens, by_seconds, texts):
        kl = [(p.tokens, p.seconds, p.mean_kl) for p in points if p.mean_kl is not None]
        if kl:
            by_tokens.plot([t for t, _, _ in kl], [k for _, _, k in kl], marker="o", label="mean KL")
            by_seconds.plot([s for _, s, _ in kl], [k for _, _, k in kl], marker="o", label="mean KL")
        if (law := found.law) is not None:
            further = found.tokens_to_target_high or found.tokens_to_target or 0  # the range's far end, where known
            end = min(found.tokens_seen + further, found.tokens_seen * TARGET_DRAWN_WITHIN) * 1.05  # within the plot
            first = math.log(min(p.tokens for p in points if p.tokens > 0))
            xs = [math.exp(first + i / 40 * (math.log(end) - first)) for i in range(41)]  # even in log(tokens)
            by_tokens.plot(xs, [law.at(x) for x in xs], "--", color="gray", label="trend (extrapolated)")
            edges = [[law.at(x) * math.exp(side * min(SPREAD * law.log_kl_se(x), 50)) for x in xs] for side in (-1, 1)]
            by_tokens.fill_between(xs, *edges, color="gray", alpha=0.15, linewidth=0, label="forecast range")
        if kl and _on_the_plot(found.target_kl, [k for _, _, k in kl]):  # a far target would squash the points
            by_tokens.axhline(found.target_kl, color="black", linestyle=":", label=f"target {found.target_kl:g}")
        for ax, label, xs in (
            (by_tokens, "training tokens", [p.tokens for p in points]),
            (by_seconds, "training seconds", [p.seconds for p in points]),
        ):
            if kl:
                _from_the_start(ax, xs)
                log_scale(ax, "y")
            else:  # axes of nothing: no ticks, and why
                ax.set(xticks=[], yticks=[])
                ax.text(
                    0.5,
                    0.5,
                    "no mean KL: it needs a teacher\n(distill_from or parent)",
                    ha="center",
                    transform=ax.transAxes,
                )
            ax.set_xlabel(label)
            ax.set_ylabel("mean KL to the parent (nats/token)")
            ax.grid(True, which="both", alpha=0.3)
            _legend(ax, fontsize=8)
        _plot_texts(texts, points, parent_perplexities)
        by_tokens.figure.suptitle(title)  # over the three panels: a long model name and shape fit above them


def _from_the_start(ax, xs: list[float]) -> None:
    """The x axis of `ax` on a log scale (plain round numbers) holding `xs`: linear from 0 to the smallest positive
    of them where the start (0) is among them, so that the start is drawn."""
    from gqaify.figures import log_scale

    positive = [x for x in xs if x > 0]
    if not positive:
        return
    start = min(positive) if min(xs) <= 0 else None
    log_scale(ax, "x", start)
    if start:
        ax.set_xlim(left=-start / 4)  # room for the start's marker, no more: the axis below 0 means nothing


def _plot_texts(ax, points: list[CurvePoint], parents: dict[str, float] | None) -> None:
    """Each eval text's perplexity against tokens, one colour each: as a ratio to the parent's where every text has
    the parent's (with several texts, their worst drawn beneath them as a wide grey band), else as measured; the
    y axis says which."""
    from gqaify.figures import distinct_colors, log_scale

    names = sorted({n for p in points for n in p.perplexities})
    bases = _parents_of(names, parents)
    for name, color in zip(names, distinct_colors(len(names)), strict=True):
        base = bases[name] if bases else 1.0
        ys = [(p.tokens, p.perplexities[name] / base) for p in points if name in p.perplexities]
        shown = next(iter(parents)) if bases and name not in parents else name  # one text: logged as "eval"
        ax.plot([t for t, _ in ys], [y for _, y in ys], marker="o", markersize=3, color=color, label=shown, zorder=3)
    worst = [(p.tokens, p.worst_ratio) for p in points if p.worst_ratio is not None]
    if bases and len(names) > 1 and worst:
        ax.plot([t for t, _ in worst], [w for _, w in worst], color="black", linewidth=6, alpha=0.2, label="worst")
    _from_the_start(ax, [p.tokens for p in points])
    log_scale(ax, "y")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("perplexity × the parent's" if bases else "eval perplexity")
    ax.grid(True, which="both", alpha=0.3)
    if len(names) > 1:  # beside the axes: a legend of many texts inside would cover their lines
        _legend(ax, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), ncol=1 + (len(names) > 10))
    else:
        _legend(ax, fontsize=7)


def _parents_of(names: list[str], parents: dict[str, float] | None) -> dict[str, float] | None:
    """The parent's perplexity on each of the texts `names`, or None where one has none. A run of one eval text logs
    its perplexity under no text's name ("eval", `CurvePoint.of`): the parent's one perplexity is that text's."""
    if not parents:
        return None
    if names == ["eval"] and len(parents) == 1:
        return {"eval": next(iter(parents.values()))}
    return {n: parents[n] for n in names} if all(n in parents for n in names) else None


def _legend(ax, **options) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**options)
