"""What `gqaify eval` found: one `ModelReport` per model and the `Report` around them (report.json's schema:
`Report.write` writes it, `Report.read` reads it back typed)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gqaify._version import __version__
from gqaify.errors import UserError
from gqaify.eval.caches.results import Frontier
from gqaify.records import TOOL, as_json, from_json
from gqaify.summary import printable
from gqaify.text.loading import is_text_file

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Diagnostics:
    """A model against the parent on the first `tokens` tokens (`diagnostics.compare`)."""

    tokens: int
    attention_relative_error: list[float]  # per layer
    kl_nats_per_token: float


@dataclass(frozen=True)
class TaskScore:
    """One metric of one task (or group) for one model, as the harness reports it (`tasks.Harness`)."""

    task: str
    metric: str  # "acc", "acc_norm", "exact_match", ...
    filter: str  # the harness's filter ("none" for most multiple-choice tasks)
    value: float
    stderr: float | None  # None where the harness gives none
    n: int | None  # items scored (None for a group)

    @property
    def name(self) -> str:
        """ "hellaswag/acc_norm": the task and metric (and the filter after a comma, where it is not "none")."""
        return f"{self.task}/{self.metric}" + ("" if self.filter == "none" else f",{self.filter}")


@dataclass(frozen=True)
class Generation:
    """A model's greedy continuation of one prompt (`--generate`)."""

    prompt: str
    text: str


def exp_or_inf(nll: float) -> float:
    """e ** `nll`, a perplexity, or inf where it is too large for a float (a diverged model's: math.exp raised
    OverflowError past 709.78 nats, which stopped a training run at its evaluation)."""
    try:
        return math.exp(nll)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class Perplexity:
    """A model's negative log-likelihood over the tokens it scored (`perplexity.perplexity`), and its KL to the
    parent's next-token distribution on them where given the parent."""

    nll_sum: float  # natural-log negative log-likelihood summed over scored tokens
    tokens_scored: int
    kl_sum: float | None = None  # KL(parent || model) summed over the same tokens (None: no parent given)

    @property
    def nll(self) -> float:
        return self.nll_sum / self.tokens_scored

    @property
    def perplexity(self) -> float:
        return exp_or_inf(self.nll)

    @property
    def kl(self) -> float | None:
        """KL(parent || model) in nats per scored token: how far the model's next-token distribution is from its
        parent's (0: the parent's own), or None without a parent."""
        return None if self.kl_sum is None else self.kl_sum / self.tokens_scored


@dataclass
class TextInfo:
    """One text of the panel, as read: report.json's `data` holds one per text."""

    name: str
    source: str
    split: str
    text_column: str
    rows: int
    characters: int

    @property
    def described(self) -> str:
        """Where the text was read, as report.md says it: a text file by its length (read whole: no split, no
        column); a dataset by its split, column and rows."""
        if is_text_file(self.source):
            return f"a text file of {self.characters:,} characters"
        return f"{self.split}, column `{self.text_column}`, {self.rows:,} rows"


@dataclass
class TextScore:
    """One model on one text of the panel (the parent's `ratio_to_parent` and `kl_to_parent` are None, as are a
    model's whose tokenizer is not the parent's: their tokens differ, so compare word perplexity)."""

    text: str  # the name of its `TextInfo`
    tokens_scored: int
    nll: float  # nats per scored token
    perplexity: float
    word_perplexity: float
    bits_per_byte: float
    words: int  # words and UTF-8 bytes of the span scored: the same for every model
    text_bytes: int
    ratio_to_parent: float | None = None  # perplexity / the parent's, on the same tokens
    kl_to_parent: float | None = None  # KL(parent || model), nats per scored token

    @classmethod
    def of(cls, text: str, found: Perplexity, words: int, text_bytes: int, parent_perplexity: float | None = None):
        """The score of `found` (`perplexity.perplexity`, with its KL where it was given the parent) on the span of
        `words` words and `text_bytes` bytes, with its ratio to `parent_perplexity` (the parent's on the same
        tokens) where given: eval's panel and uptraining's evaluations build their scores here."""
        return cls(
            text,
            found.tokens_scored,
            found.nll,
            found.perplexity,
            exp_or_inf(found.nll_sum / words),
            found.nll_sum / (text_bytes * math.log(2)),
            words,
            text_bytes,
            None if parent_perplexity is None else found.perplexity / parent_perplexity,
            found.kl,
        )


def words_and_bytes(span: str) -> tuple[int, int]:
    """The words and UTF-8 bytes of the span of text a score covers (at least 1 each): what word perplexity and bits
    per byte divide by."""
    return max(len(span.split()), 1), max(len(span.encode()), 1)


@dataclass(frozen=True)
class EvalText:
    """One text as a tokenizer read it for scoring (eval's panel, uptraining's eval_data): its tokens, and the
    words and bytes of the span they cover (`words_and_bytes`), which `TextScore.of` divides by."""

    ids: torch.Tensor  # (N,) token ids
    words: int
    text_bytes: int

    @classmethod
    def of(cls, ids: torch.Tensor, span: str) -> EvalText:
        """`ids`, the tokens of `span`, with the words and bytes of `span`."""
        return cls(ids, *words_and_bytes(span))


@dataclass
class PanelSummary:
    """A model over every text of the panel, against its parent: what a user reads to know whether it is back."""

    mean_ratio_to_parent: float  # the arithmetic mean over the texts of perplexity / the parent's
    worst_ratio_to_parent: float
    worst_text: str  # the text of the worst ratio
    mean_kl_to_parent: float | None  # None where a score has no KL (an uptraining evaluated without the parent)
    worst_kl_to_parent: float | None

    @classmethod
    def of(cls, scores: list[TextScore]) -> PanelSummary | None:
        """The summary of a model's scores, or None where they have no ratios (the parent, another tokenizer)."""
        if not scores or any(t.ratio_to_parent is None for t in scores):
            return None
        worst = max(scores, key=lambda t: t.ratio_to_parent)
        ratios, kls = [t.ratio_to_parent for t in scores], [t.kl_to_parent for t in scores]
        if None in kls:
            return cls(sum(ratios) / len(ratios), worst.ratio_to_parent, worst.text, None, None)
        return cls(sum(ratios) / len(ratios), worst.ratio_to_parent, worst.text, sum(kls) / len(kls), max(kls))


@dataclass(frozen=True)
class Spread:
    """A throughput over timed runs, in tokens per second: every run in the order timed, the slowest, the median
    and the fastest (`speed.timed_in_turns`)."""

    runs: list[float]
    low: float
    median: float
    high: float

    @classmethod
    def of(cls, runs: list[float]) -> Spread:
        return cls(list(runs), min(runs), statistics.median(runs), max(runs))

    def resolved_from(self, other: Spread) -> bool:
        """The two are told apart: they do not overlap (every run of one faster than every run of the other). Where
        they overlap, the difference between their medians is within what the runs themselves varied."""
        return self.low > other.high or self.high < other.low


@dataclass
class ModelReport:
    model: str
    model_type: str
    num_attention_heads: int
    num_key_value_heads: int
    dtype: str
    parameters: int
    tokenizer: str  # fingerprint: models with equal fingerprints saw identical token ids
    # the first text of the panel (`texts[0]`), where one-text reports have always had it
    tokens_scored: int
    nll: float
    perplexity: float
    word_perplexity: float
    bits_per_byte: float
    delta_perplexity: float | None
    kv_cache_bytes_per_token: float
    kv_cache_bytes_analytic: int
    kv_cache_bytes_measured: int
    kv_cache_tokens: int
    kv_ratio_to_parent: float
    weights_bytes: int
    max_context_at_budget: int | None  # what the cache would hold beside the weights (None: bounded, all slide)
    max_positions: int | None  # the model's max_position_embeddings
    usable_context: int | None  # the two above, whichever binds
    context_bound_by: str  # "memory", "positions" or "nothing"
    max_batch_at_seq_len: int
    words: int  # words and UTF-8 bytes of the text scored: the same span for every model
    text_bytes: int
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    decode_tokens_per_s_batched: float | None = None
    decode_spread: Spread | None = None  # batch-1 decode's runs (the parent's: its turns beside every model)
    prefill_spread: Spread | None = None  # batch-1 prefill's runs
    batched_decode_spread: Spread | None = None  # --decode-batch decode's runs
    parent_decode_spread: Spread | None = None  # the parent's batch-1 decode, timed in turns with this model's
    diagnostics: Diagnostics | None = None
    tasks: list[TaskScore] | None = None  # one row per task and metric, with --tasks
    generations: list[Generation] | None = None  # one per prompt, with --generate
    texts: list[TextScore] = field(default_factory=list)  # one per text of the panel, in its order
    panel: PanelSummary | None = None  # over `texts`, against the parent (None: the parent, another tokenizer)
    # where the model's attention shape caches other than whole K/V heads: the values a token caches per layer, and
    # what the shape calls such a cache (`conversion.shapes.cache_label`); None: whole K/V heads
    cached_values: int | None = None
    cache_label: str | None = None

    @property
    def attention(self) -> str:
        """How the report names the model's cache: "G=2" (K/V heads), or its shape's label and the values a token
        caches per layer."""
        if self.cached_values is None:
            return f"G={self.num_key_value_heads}"
        return f"{self.cache_label} {self.cached_values}"


REPORT_FILE = "report.json"
_HEADER = ("tool", "version")  # what report.json opens with besides the report's fields: who wrote it


@dataclass
class Report:
    """What `gqaify eval` found, and its report.json: `write` writes it, `read` reads it back typed, equal to the
    report written. JSON has no NaN or infinity: a number that was not finite (a diverged model's perplexity) is null
    in the file and reads back as NaN (as None where its field may be None)."""

    data: list[TextInfo]
    settings: dict
    models: list[ModelReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    frontier: Frontier | None = None  # each model under each --kv-cache format (None: f16 alone was asked)
    memory_budget: str | None = (
        None  # the memory the capacity columns fill, as said ("23.4 GiB, this machine's memory")
    )

    def to_dict(self) -> dict:
        """report.json's value: who wrote it (`_HEADER`), then the report's fields, every NaN and infinity null."""
        return _finite({"tool": TOOL, "version": __version__, **as_json(self)})

    def write(self, path: Path) -> None:
        """Write report.json (`to_dict`) as the file `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def read(cls, path: Path) -> Report:
        """The report in `path` (a report.json gqaify eval wrote, or the folder holding it), read back typed: every
        model, text and score as the dataclass it was written from, a null where a float that may not be None is
        wanted read as NaN.

        Raises:
            UserError: one line naming the file: it cannot be read, is not JSON, or is not a report this gqaify
                reads (damaged, or of a later version: the problem names the field).
        """
        file = Path(path) / REPORT_FILE if Path(path).is_dir() else Path(path)
        where = printable(file)
        try:
            value = json.loads(file.read_text())
        except OSError as exc:
            raise UserError(
                f"cannot read {where} ({exc.strerror or exc}); name a report.json gqaify eval wrote"
            ) from None
        except ValueError as exc:  # not JSON, or not UTF-8
            raise UserError(
                f"{where} is not JSON ({exc}): not a report gqaify eval wrote whole; evaluate again"
            ) from None
        if not isinstance(value, dict) or value.get("tool") != TOOL:
            raise UserError(f'{where} is not a report gqaify eval wrote (no "tool": "{TOOL}")')
        try:
            return from_json(cls, {k: v for k, v in value.items() if k not in _HEADER}, nan_for_null=True)
        except ValueError as exc:
            raise UserError(
                f"{where} (gqaify {value.get('version')}) is not a report gqaify {__version__} reads: {exc}; "
                "evaluate again to write it anew"
            ) from None


def _finite(value):
    """`value` with every NaN and infinity null: report.json is JSON, which has no NaN (a model that diverged
    has a NaN perplexity; report.md shows it as nan)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def labels_of(report: Report) -> list[str]:
    """How the report's tables and plots name each of its models (`model_labels`): up1/final and up2/final, not
    final twice."""
    return model_labels([m.model for m in report.models])


def model_labels(names: list[str]) -> list[str]:
    """How tables and plots name each of the models `names` (paths, hub ids, .gguf files): the shortest ending of its
    path that no other model's path shares, so that runs/up1/final and runs/up2/final read up1/final and up2/final,
    and a model alone, or alone with its folder's name, reads as that name. A name given twice is shown whole."""
    paths = [Path(name).parts or (name,) for name in names]
    labels = []
    for i, parts in enumerate(paths):
        others = paths[:i] + paths[i + 1 :]
        k = next((k for k in range(1, len(parts) + 1) if all(p[-k:] != parts[-k:] for p in others)), None)
        labels.append(names[i] if k is None else str(Path(*parts[-k:])))
    return labels
