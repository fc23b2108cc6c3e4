"""What a conversion can be asked to do: the groupings, the calibration (`Calibration`, and its record),
`MethodSettings` (the method and its calibration, which uptrain shares), `ShapeSettings` (the attention shape and
how small its cache becomes, which uptrain shares too) and `ConvertSettings`.

This module imports nothing heavy, so that the command line can list the choices and check them before torch
is loaded. The methods and shapes offered are the registry's (`conversion.registry`).
"""

from __future__ import annotations

import hashlib
import math
import shlex
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

from gqaify.conversion.registry import ATTENTION_INFO, METHOD_INFO, STREAM_SHAPE
from gqaify.model.locations import exists
from gqaify.records import named_type
from gqaify.settings import (
    QUIET,
    Finite,
    Limit,
    Needs,
    OneOf,
    Positional,
    Range,
    Settings,
    Stage,
    override,
    setting,
)
from gqaify.settings.groups import Dtype, Hub, Output, Progress, Seed
from gqaify.text.loading import NamedText, named_texts
from gqaify.text.pins import Pin, sha256_problem
from gqaify.text.settings import Texts

# What a method that reads no calibration text costs a trained model, and what the calibrated default conversion
# keeps, measured (docs/benchmarks/conversion.md, `python benchmarks/methods.py`: WikiText-2 test perplexity
# straight after conversion): said after every such conversion that changed the heads it replaced
# (`uncalibrated_warning`), unless its caller says why it converts so (the demo's baseline; uptraining measures it).
# Mean-pooling stays the default, the GQA paper's conversion, which needs nothing but the checkpoint; a calibrated
# default would need text the user may not have.
UNCALIBRATED_LOG = "gqaify.conversion.uncalibrated"  # its own logger: a caller that says why itself mutes it alone
UNCALIBRATED_COST = "SmolLM2-135M-Instruct made MQA scored a WikiText-2 perplexity of 28,407, its parent 23.09"
CALIBRATED_SCORE = "81.1"  # the same with --method lsq --calib-data (32,768 tokens of WikiText-2 validation)

GROUPINGS = ("contiguous", "similarity")
CALIB_MODES = ("sequential", "parallel")

MethodName = Literal[tuple(METHOD_INFO)]


GroupingName = Literal[GROUPINGS]
CalibMode = Literal[CALIB_MODES]


# The fits solve for (hidden + 1)-wide rows from the second moment of the layer input: with fewer tokens than
# that it is singular and the fit memorises the calibration text (--calib-tokens 10 scored 0.000 fit error and
# a perplexity of 257 against 148 on ref-mha-6L). Fewer than CALIB_TOKENS_REQUIRED per input dimension are
# refused; fewer than CALIB_TOKENS_ADVISED are warned about. The default 32,768 is 57 per dimension for
# SmolLM2 (hidden 576), 8 for a 7B (hidden 4,096).
CALIB_TOKENS_REQUIRED = 2
CALIB_TOKENS_ADVISED = 8
# Refinement orders its steps with one permutation of them all (`repair.refine`): 8 MB at this bound, where
# --refine-steps 1000000000 drew 8.3 GB, for over a minute, before the first step. README's runs take 64.
REFINE_STEPS_MAX = 1_000_000


# calib_sha256: the calibration text a rerun of a conversion must read
CALIB_PIN = Pin("calib_sha256", "conversion", "the weights would differ", "convert")


@dataclass(frozen=True)
class Calibration:
    """Where calibration text comes from, how much of it to read, and how the layers are fitted on it.

    mode "sequential" walks the layers in order and fits each on the converted model's own activations (what
    the layers below it, already converted, produce), then repairs its output projection against the parent's
    attention output (`repair`, closed form) and, with `refine_steps`, refines its attention by gradient
    steps against the parent layer's output. "parallel" fits every layer on the parent's activations, as
    one pass of the parent would: gqaify's first calibration, kept for comparison.

    Built from the settings by `of` (each field is the setting of its name, or of its name with calib_: the
    settings' fields hold the defaults and declare the values' rules, once, for convert and uptrain).
    """

    data: list[str]  # each a text file or folder, or a hub dataset name[:config]; several make a mixture
    tokens: int
    split: str
    text_column: str
    seq_len: int
    mode: CalibMode
    refine_steps: int  # Adam steps per layer (sequential only), one calibration window each
    refine_lr: float
    repair: bool  # refit o_proj against the parent's attention output (sequential only)
    sha256: str | None = None  # the SHA-256 the text read must have (`text_problem`); None: any text
    weights: list[float] | None = None  # one per source of `data` (None: equal): their shares of `tokens`

    def __post_init__(self) -> None:
        if isinstance(self.data, str):  # one text
            object.__setattr__(self, "data", [self.data])

    @classmethod
    def of(cls, settings: MethodSettings) -> Calibration | None:
        """The calibration `settings` ask for (calib_data, calib_tokens, ..., refine_steps, repair), or None without
        calib_data; calib_sha256 '' (any text) is None."""
        if settings.calib_data is None:
            return None
        values = {}
        for f in fields(cls):
            name = f"calib_{f.name}" if hasattr(settings, f"calib_{f.name}") else f.name
            values[f.name] = getattr(settings, name)
        return cls(**{**values, "sha256": values["sha256"] or None})

    def shares(self) -> list[int]:
        """The tokens read from each source: `tokens` apportioned by weight, whole numbers that sum to it exactly
        (the largest remainders rounded up, ties to the earlier source)."""
        weights = self.weights or [1.0] * len(self.data)
        exact = [self.tokens * w / sum(weights) for w in weights]
        counts = [math.floor(e) for e in exact]
        by_remainder = sorted(range(len(counts)), key=lambda i: counts[i] - exact[i])
        for i in by_remainder[: self.tokens - sum(counts)]:
            counts[i] += 1
        return counts

    def text_problem(self, sha256: str) -> str | None:
        """A problem if the text read (its SHA-256 `sha256`) is not the text `self.sha256` expects.

        Not waived by --force, which says OUT may be replaced: accepting other weights is said on its own.
        """
        return CALIB_PIN.problem(f"--calib-data {' '.join(self.data)}", self.sha256, sha256)

    def size_problem(self, tokens: int, hidden_size: int) -> str | None:
        """A problem if `tokens` calibration tokens are too few to determine a fit of `hidden_size` inputs."""
        needed = CALIB_TOKENS_REQUIRED * (hidden_size + 1)
        if tokens >= needed:
            return None
        return (
            f"--calib-tokens {tokens:,} is too few for a model with hidden size {hidden_size}: the fit needs at "
            f"least {needed:,} ({CALIB_TOKENS_REQUIRED} per input dimension; {CALIB_TOKENS_ADVISED} advised) or "
            "it memorises the text; raise --calib-tokens (or give --calib-data more text)"
        )

    def text_size_problem(self, text, hidden_size: int) -> str | None:
        """A problem if the calibration text read (a `calibrate.CalibrationText`) holds too few tokens for the fit:
        --calib-tokens asked for enough (`size_problem`), so the text is what is short."""
        needed = CALIB_TOKENS_REQUIRED * (hidden_size + 1)
        if text.tokens >= needed:
            return None
        if self.tokens < needed:  # --calib-tokens itself is too few
            return self.size_problem(text.tokens, hidden_size)
        if len(text.sources) == 1:
            holds = f"--calib-data {text.sources[0].data} holds {text.tokens:,} tokens"
        else:
            each = ", ".join(f"{s.data}: {s.tokens:,}" for s in text.sources)
            holds = f"the --calib-data sources hold {text.tokens:,} tokens in all ({each})"
        return f"{holds}, fewer than the fit needs ({needed:,}) for hidden size {hidden_size}: give more text"

    def size_warning(self, tokens: int, hidden_size: int) -> str | None:
        """A warning if `tokens` determine the fit but barely (fewer than advised)."""
        advised = CALIB_TOKENS_ADVISED * (hidden_size + 1)
        if tokens >= advised:
            return None
        return (
            f"{tokens:,} calibration tokens for hidden size {hidden_size}: the fit may follow the text; "
            f"{advised:,} or more are advised"
        )

    def record(self, sources: list[CalibrationSource], sha256: str, device: str, seconds: dict) -> CalibrationRecord:
        """What gqaify.json's "calibration" says: these fields, the tokens read (from each source, and in all), the
        SHA-256 of the text read, and where and how long the calibration ran."""
        asked = {**asdict(self), "tokens": sum(s.tokens for s in sources), "sha256": sha256}
        return CalibrationRecord(
            **asked, tokens_requested=self.tokens, sources=sources, holdout=HOLDOUT_NOTE, device=device, seconds=seconds
        )


@dataclass(frozen=True)
class CalibrationSource:
    """One source of the calibration text as read: gqaify.json's calibration "sources" holds one per source."""

    name: str
    data: str
    weight: float
    tokens_requested: int  # its share of calib_tokens
    tokens: int  # read (fewer where the source holds fewer)
    sha256: str  # of the text read from it


@dataclass(frozen=True, kw_only=True)
class CalibrationRecord(Calibration):
    """gqaify.json's "calibration": the calibration asked for (`Calibration`'s fields, in their order, with
    `tokens` the tokens read, in all, and `sha256` the text read's, `mixture_sha256`: what calib_sha256 pins), and
    how it went."""

    tokens_requested: int
    sources: list[CalibrationSource]
    holdout: str  # what the repair and refinement were judged on
    device: str
    seconds: dict[str, float]  # capturing, fitting, repairing, refining


def uncalibrated_warning(method: str, src: str) -> str:
    """One line after a conversion of `src` by `method`, which read no calibration text and changed the heads it
    replaced: what that costs a trained model, and the conversion that avoids it."""
    shown = shlex.quote(src) if src.isprintable() else repr(src)  # one line, whatever the path holds
    return (
        f"--method {method} read no calibration text: expect a trained model to lose most of its quality "
        f"({UNCALIBRATED_COST}); --method lsq --calib-data TEXT avoids most of that ({CALIBRATED_SCORE} there), and "
        f"with no text at hand the parent writes some: gqaify generate {shown} parent-text"
    )


def mixture_sha256(sources: list[CalibrationSource]) -> str:
    """The SHA-256 that calib_sha256 pins: one source's text's own; for a mixture, of its sources' names, weights
    and SHA-256s, so that a source changed, added, removed or reweighted is seen."""
    if len(sources) == 1:
        return sources[0].sha256
    total = sum(s.weight for s in sources)  # 2 1, [2, 1] and 4 2 are one mixture
    described = "\n".join(f"{s.name}\t{float(s.weight) / total!r}\t{s.sha256}" for s in sources)
    return hashlib.sha256(described.encode()).hexdigest()


# What the repair and refinement are judged on (repair.HOLDOUT_EVERY), said where a reader of gqaify.json sees it.
HOLDOUT_NOTE = (
    "every 8th calibration window, held out of the fits: the same kinds of text as the calibration (a mixture's "
    "windows are interleaved, so each source in its share), so it cannot show that a fit suits those kinds better "
    "than others; calibration text the parent wrote (gqaify generate) is of no one kind"
)


def rerun_problems(record: dict, settings: ConvertSettings) -> list[str]:
    """What a rerun from gqaify.json (`record`: its settings) changed of a calibration mixture that calib_sha256 still
    pins: its sources' names or weights, which the mixture's SHA-256 covers with their texts (`mixture_sha256`).
    Said before anything is read, as what changed: it was refused as "the text changed", which it had not.
    Other sources, or one text (whose SHA-256 is its text's alone), are left to the text read (`text_problem`)."""
    pinned, recorded_data = record.get("calib_sha256"), record.get("calib_data")
    if not pinned or settings.calib_sha256 != pinned or not isinstance(recorded_data, list):
        return []
    before, now = named_texts(recorded_data), named_texts(settings.calib_data or [])
    if len(before) < 2 or len(now) != len(before) or not all(map(_same_source, before, now)):
        return []
    problems, pins = [], "calib_sha256 pins the mixture by its sources' names, weights and texts"
    if [t.name for t in before] != [t.name for t in now]:
        problems.append(
            f"--calib-data names its sources {', '.join(t.name for t in now)} where the recorded conversion named "
            f"them {', '.join(t.name for t in before)}, and {pins}; use the recorded names, or pass --calib-sha256 '' "
            "to convert under the new ones"
        )
    was, given = record.get("calib_weights"), settings.calib_weights
    if _shares_of(was, len(before)) != _shares_of(given, len(now)):
        said = {key: " ".join(f"{w:g}" for w in ws or [1] * len(now)) for key, ws in (("was", was), ("now", given))}
        problems.append(
            f"--calib-weights {said['now']} differs from the recorded conversion's {said['was']}, and {pins}; give "
            f"--calib-weights {said['was']} for the recorded mixture, or pass --calib-sha256 '' to convert with the "
            "new weights"
        )
    return problems


def _same_source(a: NamedText, b: NamedText) -> bool:
    """Whether two calibration sources name one text: one file or folder however spelled, or one hub name."""
    paths = [Path(t.source).expanduser() for t in (a, b)]
    if all(exists(p) for p in paths):
        return paths[0].resolve() == paths[1].resolve()
    return a.source == b.source


def _shares_of(weights: list[float] | None, sources: int) -> list[float]:
    """Each source's share of the mixture as `mixture_sha256` hashes it (None: equal shares)."""
    weights = weights or [1.0] * sources
    return [float(w) / sum(weights) for w in weights]


def _calibrated(method: str) -> bool:
    return METHOD_INFO[method].calibrated


@dataclass(frozen=True)
class MethodSettings(Settings):
    """The conversion method and its calibration (uptrain's too, for the conversion it runs with kv_heads).

    How each group of K/V heads becomes one: the method, which heads are grouped, and the calibration text and
    steps the fitted methods learn from. `ConvertSettings` and `UptrainSettings` are both made of these fields
    (--help lists them under the first line above), so that a recipe's conversion is one `gqaify convert`
    would run, with the same keys, defaults and checks.
    """

    method: MethodName = setting(
        "mean",
        "how each group of heads becomes one: "
        + "; ".join(
            f"{name}: {info.summary}" + (" [needs calib_data]" if info.calibrated else "")
            for name, info in METHOD_INFO.items()
        ),
        check=Needs("calib_data", "is fitted on calibration text (text other than your eval text)", _calibrated),
    )
    grouping: GroupingName = setting(
        "contiguous",
        "which heads share a K/V head: neighbours as repeat_kv (contiguous), or the heads that agree "
        "most on the calibration text (similarity; needs calib_data)",
        check=Needs("calib_data", "compares heads on calibration text", "similarity".__eq__),
    )
    calib_data = Texts(  # calib_data, calib_weights, calib_split, calib_text_column
        "calibration text for aligned, lsq and similarity, and the per-layer fit error (use text other than your "
        "eval text)",
        "a mixture, their windows interleaved",
        weighs="its share of calib_tokens",
        default=None,
    )
    calib_tokens: int = setting(
        32768, "calibration tokens read from calib_data (in all)", check=Range(2, fix="tens of thousands are typical")
    )
    calib_seq_len: int = setting(1024, "calibration window length in tokens", check=Range(2))
    calib_sha256: str | None = setting(
        None,
        "SHA-256 of the calibration text that must be read (gqaify.json records it, so that a rerun refuses "
        "text that changed since); '' accepts any text",
        check=sha256_problem,
    )
    calib_mode: CalibMode = setting(
        "sequential",
        "sequential: layer by layer on the converted model's own activations, each layer repaired "
        "against the parent's outputs; parallel: every layer on the parent's activations (for comparison)",
    )
    refine_steps: int = setting(
        0,
        "Adam steps per layer refining its attention against the parent layer's output (sequential only)",
        check=(
            Range(0, says="a whole number, 0 or more"),
            Limit(REFINE_STEPS_MAX, "each step is one window through one layer; tens to thousands are typical"),
            Needs("calib_mode", "refines each layer on the converted stream", value="sequential"),
        ),
    )
    refine_lr: float = setting(
        1e-3,
        "learning rate of refine_steps",
        check=(Finite("give a positive one (e.g. 1e-3)"), Range(0, low_open=True)),
    )
    repair: bool = setting(True, "refit each layer's o_proj against the parent's attention output (sequential)")

    def calibration(self) -> Calibration | None:
        """The calibration these settings ask for, or None without calib_data (`Calibration.of`)."""
        return Calibration.of(self)


@dataclass(frozen=True)
class AttentionChoice(Settings):
    """The attention shape a conversion writes, and how much smaller its cache is:"""

    kv_heads: int | None = setting(
        None,
        "G, the new number of K/V heads; must divide the source's; 1 = MQA (or give --kv-cut)",
        check=Range(1, says="a whole number of at least 1", fix="1 is MQA"),
    )
    kv_cut: float | None = setting(
        None,
        "the cache becomes 1/X of the source's: gqa keeps the K/V heads that do so (the source's / X); "
        + ", ".join(name for name, info in ATTENTION_INFO.items() if info.any_cut)
        + " any X, its widths chosen on --calib-data unless given",
        check=(Finite("give a number above 1, e.g. 4"), Range(1, says="a number of at least 1")),
    )
    attention: str = setting(
        STREAM_SHAPE,
        "the attention the conversion writes: "
        + "; ".join(f"{name}: {info.summary}" for name, info in ATTENTION_INFO.items()),
        check=OneOf(ATTENTION_INFO),
    )


# the fields of their own the shapes declare (`ShapeInfo.settings`, each imported here: a shape's settings are light)
_OWN_SETTINGS = tuple(named_type(info.settings) for info in ATTENTION_INFO.values() if info.settings)


@dataclass(frozen=True)
class ShapeSettings(*_OWN_SETTINGS, AttentionChoice):
    """The attention shape a conversion writes (`ATTENTION_INFO`) and G, then the fields of its own each shape
    declares (its `ShapeInfo.settings`): a conversion's, and uptraining's for the conversion it runs."""


@dataclass(frozen=True)
class ConvertSettings(MethodSettings, ShapeSettings, Output, Dtype, Seed, Hub, Progress):
    """Everything `gqaify convert` is asked to do: the command line's options, a --config file's keys, and the
    keyword arguments of `gqaify.convert`. gqaify.json records them as resolved (see `resolved_record`)."""

    src: str | None = setting(
        None, "the model to convert: hub id, local model folder, or .gguf file (never modified)", required=True
    )
    max_shard_size: str = setting("5GB", "the largest output shard, e.g. 5GB, 500MiB")
    gguf_type: Literal["f32", "f16", "bf16", "q8_0"] | None = setting(
        None,
        "with OUT ending in .gguf (one file llama.cpp serves): the type of its matrices (default f16; norms stay f32)",
    )
    revision: str | None = setting(None, "hub branch, tag or commit (hub ids only)")
    allow_nonfinite: bool = setting(False, "convert K/V weights that hold NaN or Inf instead of refusing")
    # the shared groups' fields (`gqaify.settings.groups`), worded for a conversion
    out = override(help="the folder to create; written beside it and renamed into place when complete")
    force = override(help="replace OUT if it is empty or a conversion gqaify wrote (nothing else)")
    dtype = override(help="output dtype of floating-point tensors (auto: keep each tensor's)")
    seed = override(help="seed for --method random")

    def problems(self) -> list[str]:
        """Everything wrong with the values, at once (their declarations'); `checks.check_request` adds what the
        files say (SRC, OUT, max_shard_size read as bytes)."""
        problems = CONVERT.declared_problems(self)
        if self.kv_heads is None and self.kv_cut is None:
            problems.append("say how small the cache becomes: --kv-heads G (1 = MQA) or --kv-cut X (1/X of it)")
        return problems


# What a rerun from gqaify.json does not repeat: how the first run went, not what it produced.
NOT_RECORDED = frozenset({"force", "push_to_hub", "progress"})

CONVERT = Stage(
    settings=ConvertSettings,
    description="Convert SRC (hub id, local folder or .gguf file) to G key/value heads, saved as a plain Hugging "
    "Face checkpoint in OUT. Streams tensor by tensor; SRC is never modified; OUT appears only when complete.\n\n"
    "  gqaify convert SRC OUT --kv-heads 2\n"
    "  gqaify convert --config convert.yaml --kv-heads 1     (the file's settings; options given here win)\n"
    "  gqaify convert --config OUT/gqaify.json --out OUT2    (rerun a conversion from its record)",
    positionals=(Positional("src", "SRC"), Positional("out", "OUT")),
    switches=(QUIET,),
    rerun_problems=rerun_problems,
)
