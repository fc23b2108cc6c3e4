"""Every model of an evaluation under every cache format asked (`--kv-cache`), in one engine, against the parent's
f16 cache in that engine: the frontier's points (`results.CacheRow`), its front and its verdicts.

Models are opened one at a time beside the parent, and for each window of each text the parent's reference logits
are computed once and every format of the model is scored against them: a format added costs one pass of each
model over the panel, the parent's reference none. The scores use eval's windows (`perplexity.sliding_windows`) and
its one KL (`perplexity.kl_sums`), so a folder's f16 row is eval's own figure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gqaify.eval.caches.engine import CacheRunner
from gqaify.eval.caches.formats import FULL, CacheFormat, cache_format
from gqaify.eval.caches.results import (
    CacheRow,
    CacheText,
    Frontier,
    PositionKL,
    Retrieval,
    front_of,
    position_bins,
    verdicts,
)
from gqaify.eval.caches.retrieval import ANSWER_TOKENS, Prompt, found
from gqaify.eval.perplexity import Window, kl_sums, sliding_windows
from gqaify.eval.results import exp_or_inf
from gqaify.progress import progress_bar

LOG = logging.getLogger(__name__)
WHOLE = cache_format(FULL)


@dataclass(frozen=True)
class CacheModel:
    """A model to put on the frontier: its name, label, and the keys and values one token caches over every layer."""

    name: str
    label: str
    key_values: int
    value_values: int


@dataclass(frozen=True)
class Panel:
    """What every model is scored on: each text's name and tokens, the windows' length and stride."""

    texts: list[tuple[str, torch.Tensor]]
    seq_len: int
    stride: int
    retrieval: list[Prompt] = field(default_factory=list)  # the retrieval check's prompts (none: no check)
    decode: Callable[[list[int]], str] | None = None  # token ids to text, to read a retrieval's answer

    def windows(self) -> list[tuple[int, Window]]:
        """(the text's index, a window of it), over every text."""
        return [
            (i, w)
            for i, (_, ids) in enumerate(self.texts)
            for w in sliding_windows(len(ids), self.seq_len, self.stride)
        ]


@dataclass
class _Sums:
    """A model in one format, summed over the tokens it scored: per text its NLL and KL, per position bin its KL."""

    nll: dict[int, float] = field(default_factory=dict)
    kl: dict[int, float] = field(default_factory=dict)
    scored: dict[int, int] = field(default_factory=dict)
    bins: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # bin -> [KL sum, tokens]

    def add(self, text: int, window: Window, ids: torch.Tensor, logits: torch.Tensor, reference: torch.Tensor, bins):
        """The tokens `window` scores, of `ids` (the window's tokens), by `logits` against `reference` (the window's
        logits of the model and of the parent, row i predicting token i + 1)."""
        first = window.scored_from - window.begin  # the first scored token's place in the window
        rows = slice(first - 1, window.length - 1)
        targets = ids[first:].to(logits.device)
        nll = F.cross_entropy(logits[rows], targets, reduction="sum").item()
        self.nll[text] = self.nll.get(text, 0.0) + nll
        self.scored[text] = self.scored.get(text, 0) + len(targets)
        for begin, end in bins:  # token t of the window is at position t; its logits are row t - 1
            lo, hi = max(begin, first), min(end, window.length)
            if lo >= hi:
                continue
            kl = sum(s.item() for s in kl_sums(logits[lo - 1 : hi - 1], reference[lo - 1 : hi - 1]))
            self.kl[text] = self.kl.get(text, 0.0) + kl
            total = self.bins.setdefault((begin, end), [0.0, 0])
            total[0] += kl
            total[1] += hi - lo


def measure(
    engine: str,
    models: list[CacheModel],
    formats: list[CacheFormat],
    panel: Panel,
    opener: Callable[[str], CacheRunner],
    shown: bool,
) -> list[CacheRow]:
    """The rows of every model of `models` (the first is the parent) under every format of `formats`, on `panel`
    (and its retrieval prompts), each model opened by `opener` in `engine`."""
    parent, rows, parent_nll = opener(models[0].name), [], None
    windows, bins = panel.windows(), position_bins(panel.seq_len)
    tokens = sum(w.scored for _, w in windows)
    total = len(models) * len(formats) * (tokens + len(panel.retrieval) * ANSWER_TOKENS)
    with progress_bar(total=total, unit="tok", desc="cache formats", shown=shown) as bar:
        for i, model in enumerate(models):
            runner = parent if i == 0 else opener(model.name)
            sums = {f.name: _Sums() for f in formats}
            for text, window in windows:
                ids = panel.texts[text][1][window.begin : window.end]
                reference = parent.logits(ids.tolist(), WHOLE)
                for f in formats:
                    logits = reference if i == 0 and f.whole else runner.logits(ids.tolist(), f)
                    sums[f.name].add(text, window, ids, logits, reference, bins)
                    bar.update(window.scored)
            if i == 0:
                parent_nll = sums[FULL] if FULL in sums else _parent_sums(parent, panel, bins)
            for f in formats:
                row = _row(engine, model, f, sums[f.name], parent_nll, panel, models[0], runner)
                if panel.retrieval:
                    row.retrieval = _retrieve(runner, f, panel, bar)
                rows.append(row)
            if i > 0:
                runner.close()
        parent.close()
    return rows


def _parent_sums(parent: CacheRunner, panel: Panel, bins) -> _Sums:
    """The parent's own scores at f16 (the perplexities every ratio divides by), where f16 is not a format asked."""
    sums = _Sums()
    for text, window in panel.windows():
        ids = panel.texts[text][1][window.begin : window.end]
        logits = parent.logits(ids.tolist(), WHOLE)
        sums.add(text, window, ids, logits, logits, bins)
    return sums


def _row(engine, model: CacheModel, f: CacheFormat, sums: _Sums, parent: _Sums, panel: Panel, first, runner):
    texts = []
    for i, (name, _) in enumerate(panel.texts):
        ppl, parent_ppl = (exp_or_inf(s.nll[i] / s.scored[i]) for s in (sums, parent))
        texts.append(CacheText(name, sums.scored[i], ppl, ppl / parent_ppl, sums.kl[i] / sums.scored[i]))
    counted = f.bytes_per_token(model.key_values, model.value_values)
    parent_whole = WHOLE.bytes_per_token(first.key_values, first.value_values)
    by_position = [PositionKL(b, e, int(n), kl / n) for (b, e), (kl, n) in sums.bins.items() if n]
    return CacheRow.of(
        texts,
        model=model.name,
        label=model.label,
        cache=f.name,
        engine=engine,
        bytes_per_token=counted,
        bytes_per_token_measured=runner.measured_bytes_per_token(f),
        times_smaller=parent_whole / counted,
        kl_by_position=by_position,
    )


def _retrieve(runner: CacheRunner, f: CacheFormat, panel: Panel, bar) -> list[Retrieval]:
    """`runner`'s exact matches on the retrieval prompts of `panel` with its cache in `f`, per length and depth."""
    tally: dict[tuple[int, float], list[int]] = {}
    for p in panel.retrieval:
        answer = runner.greedy(p.ids, f, ANSWER_TOKENS)
        count = tally.setdefault((p.length, p.depth), [0, 0])
        count[0] += 1
        count[1] += found(panel.decode(answer), p.key)
        bar.update(ANSWER_TOKENS)
    return [Retrieval(length, depth, tried, hits) for (length, depth), (tried, hits) in tally.items()]


def frontier(engine: str, rows: list[CacheRow], method: str, memory: tuple[str, float] | None) -> Frontier:
    """The frontier of `rows`: its front and its verdict at each budget (and at `memory`, the user's own)."""
    reference = f"the parent ({rows[0].label}) with its whole (f16) cache, in {engine}"
    return Frontier(engine, reference, method, rows, front_of(rows), verdicts(rows, memory))
