"""`gqaify convert --attention mla` (`shape.MLA` calls it): what a request cannot be, the note before a long rewrite,
and the G-head checkpoint the stream wrote, rewritten as MLA in its folder before the folder is committed.

The G-head model is the conversion gqaify would write with the same settings (any method, calibrated or not; G
the source's own makes it the source), so an MLA conversion is at least as close to its parent as that GQA one at
the same cache (the exact rewrite), or smaller (`--kv-rank`, `--rope-dims`), fitted on the same calibration text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gqaify.auto import AUTO
from gqaify.conversion.calibrate import read_beyond
from gqaify.conversion.mla.budget import cut_values
from gqaify.conversion.mla.fit import fit_mla, held_out, held_out_kls
from gqaify.conversion.mla.layer import STAT_WINDOW, build_mla, mla_problem, plan_mla, shape_for
from gqaify.conversion.mla.record import MlaRecord, StartTrial
from gqaify.conversion.mla.split import FITTED, candidate_splits, fit_ranked, ranked_splits
from gqaify.conversion.mla.written import FLOAT16
from gqaify.conversion.shape_contract import Rewritten, float16_problem
from gqaify.conversion.to_gguf import is_gguf_out
from gqaify.model.dtypes import torch_dtype
from gqaify.model.geometry import Geometry, attention_kind, float16_asked
from gqaify.model.loading import resolve_device
from gqaify.sizes import parse_size

LOG = logging.getLogger(__name__)


JUDGE_TOKENS = 16_384  # at most, of calibration text past what the conversion read, judge the two starts


class Clock(dict):
    """Seconds spent in each step of a rewrite, by name, added up as the steps run (`clock.of("fits")`)."""

    @contextlib.contextmanager
    def of(self, step: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self[step] = round(self.get(step, 0.0) + time.perf_counter() - started, 1)


def problems(s, config: dict, out_is_gguf: bool) -> list[str]:
    """What an `--attention mla` request cannot be, from the settings and the source's config.json."""
    if s.attention != "mla":
        return []
    problems = []
    if (problem := mla_problem(config)) is not None:
        problems.append(problem)
    several = s.kv_heads is not None and s.kv_heads > 1
    if out_is_gguf and several and not s.widths_given:  # the rest only the rewrite tells (`mla.gguf`)
        problems.append(
            f"an MLA conversion of {s.kv_heads} K/V heads at their own cache gives each its own block of the rotary "
            "key, whose frequencies then repeat, which llama.cpp's deepseek2 cannot rotate; convert with --kv-heads "
            "1, or ask a smaller cache (--kv-cut), or name OUT without .gguf (a folder that transformers serves)"
        )
    shape, shape_problems = shape_for(config, s.kv_heads, s.kv_rank, s.rope_dims)
    if out_is_gguf and several and shape is not None and s.rope_dims is not None and s.rope_dims > shape.head_dim:
        problems.append(
            f"--rope-dims {s.rope_dims} from {s.kv_heads} K/V heads would repeat rotary frequencies in a GGUF "
            f"(llama.cpp's deepseek2 turns one ladder of distinct ones, {shape.head_dim // 2} pairs); ask at most "
            f"--rope-dims {shape.head_dim}, or name OUT without .gguf"
        )
    if s.widths_given and not s.calib_data:
        problems.append(
            "--kv-cut, --kv-rank and --rope-dims fit a smaller MLA cache on calibration text; add --calib-data TEXT "
            "(text other than your eval text)"
        )
    problems += shape_problems
    if problem := float16_problem(
        FLOAT16, float16_asked(s.dtype, config, "the source's"), "use --dtype bfloat16 or float32"
    ):
        problems.append(problem)
    return problems


@dataclass(frozen=True)
class _Route:
    """What the rewrite of a request does, decided once from its settings and the source's geometry (`_route`)."""

    budget: int | None  # the values per token and layer --kv-cut asks (None: no --kv-cut)
    held: int  # what the G-head model caches
    split_free: bool  # neither --kv-rank nor --rope-dims: the split is the rewrite's to choose

    @property
    def compressed(self) -> bool:
        """The parent compressed below the G-head model's cache, its split chosen (`_compressed`)."""
        return self.budget is not None and self.budget < self.held and self.split_free

    @property
    def exact(self) -> bool:
        """The G-head model rewritten exactly: nothing fitted (at a cut whole heads make, a start to judge)."""
        return self.split_free and (self.budget is None or self.budget >= self.held)


@dataclass(frozen=True)
class _Work:
    """What every step of one rewrite reads: the request `s`, the calibration ids (the split's statistics) and
    windows (the fits'), the parent (loaded when first asked, once) and the clock each step adds its time to."""

    s: object
    ids: torch.Tensor | None
    windows: list[torch.Tensor] | None
    parent: Callable[[], object]
    clock: Clock


def _route(s, source: Geometry) -> _Route:
    """What the rewrite of `s` does from a source of geometry `source`."""
    budget = None if s.kv_cut is None else cut_values(source, s.kv_cut)
    held = source.with_kv_heads(s.kv_heads).cached_per_token
    return _Route(budget, held, s.kv_rank is None and s.rope_dims is None)


def _two_starts(r: _Route, s, source: Geometry) -> bool:
    """A cut whole K/V heads make, from fewer than the source's: the G-head model's exact rewrite and the parent
    compressed to the same cache are both tried (`_closer_start`)."""
    return r.split_free and r.budget == r.held and s.kv_heads < source.num_kv_heads


def cost_note(s, source: Geometry) -> str | None:
    """What the rewrite will do after the G-head conversion, where it fits (said before the conversion begins: the
    fits are most of its time, SmolLM2-135M's `--kv-cut 3` at 16,384 tokens and 64 steps took 27.7 minutes on 2
    CPU cores where its MQA conversion alone takes about 5); None where it only rewrites (exact)."""
    r = _route(s, source)
    budget = r.budget
    if r.exact and not _two_starts(r, s, source):
        return None  # the exact rewrite of the G-head model: no fit
    fits = s.repair or s.refine_steps
    windows = max(s.calib_tokens // s.calib_seq_len, 1)
    fit = f"{source.num_layers} layers, {s.refine_steps} refinement steps each, on {windows:,} windows"
    if not r.split_free:
        work = f"one layer-by-layer fit ({fit})" if fits else "its PCA start, not fitted"
    else:
        ladder = is_gguf_out(s.out)
        splits = len(candidate_splits(source.num_heads, source.num_kv_heads, source.head_dim, budget, ladder))
        closest = "the closest fitted" if min(FITTED, splits) == 1 else f"the {FITTED} closest each fitted"
        fitted = f", {closest} layer by layer ({fit})" if fits else ", unfitted"
        work = f"{splits} split{'s' * (splits != 1)} of the parent's cache judged{fitted}"
        if _two_starts(r, s, source):
            judged = min(s.calib_tokens, JUDGE_TOKENS)
            work += (
                f", then that start and {attention_kind(s.kv_heads)}'s exact rewrite judged on up to {judged:,} "
                "unseen calibration tokens"
            )
    widths = (s.kv_rank, s.rope_dims)
    values = budget if budget is not None else sum(widths) if None not in widths else None  # one width: the other's
    at = "" if values is None else f" at {values} values per token and layer"
    return (
        f"MLA{at}, after the G-head conversion: {work}. The fits take several times the G-head conversion's time; "
        "each shows its bar."
    )


def rewrite(folder: Path, s, text, load_parent: Callable[[], object], source: Geometry) -> Rewritten:
    """The G-head checkpoint in `folder` rewritten as MLA in place: its weights and config.json replaced, its
    tokenizer and other files kept. A smaller cache is fitted on the calibration `text` (a `CalibrationText`):
    its rotary pairs and latent chosen (with `--kv-cut` alone, its split too: `mla.split`), then brought back to
    the parent (`load_parent()`, of geometry `source`) layer by layer (`mla.fit`, with s.repair and
    s.refine_steps as a GQA conversion reads them). At a cut whole K/V heads make (`mla.budget.whole_heads`), the
    G-head model's exact rewrite and the parent compressed are both tried, the closer kept (`_closer_start`)."""
    from transformers import AutoModelForCausalLM

    config = json.loads((folder / "config.json").read_text())
    dtype = _written_dtype(s, config)
    device = resolve_device(AUTO)  # where calibration runs: the statistics, the fits and the judging there
    LOG.info("rewriting the %d-K/V-head model as MLA", config.get("num_key_value_heads", 0))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    # the sources' windows interleaved: the split's held-out end (`mla.split`) holds more than the last source
    ids = torch.cat(text.windows(STAT_WINDOW)) if text is not None else None
    windows = None if text is None else [w for w in text.windows(s.calib_seq_len) if len(w) > 1]
    parent = functools.cache(lambda: load_parent().to(device))
    r = _route(s, source)
    clock = Clock()
    work = _Work(s, ids, windows, parent, clock)
    if r.compressed:
        mla, record = _compressed(model, r.budget, work)
    else:
        with clock.of("splits"):
            plan = plan_mla(model, s.kv_rank, s.rope_dims, ids, ladder=is_gguf_out(s.out), progress=s.progress)
            mla, fitted = build_mla(model, plan), None
        if not plan.exact and (s.repair or s.refine_steps):
            with clock.of("fits"):
                fitted = fit_mla(mla, parent(), windows, s.refine_steps, s.refine_lr, s.progress)
        record = MlaRecord.of(plan, fitted=fitted)
    del model
    if _two_starts(r, s, source) and text is not None:
        unseen = _unseen_windows(s, text, folder)
        mla, record = _closer_start(mla, record, r.budget, work, unseen)
    record = dataclasses.replace(record, seconds=dict(clock) if not record.exact or record.starts else None)
    for old in [*folder.glob("model*.safetensors"), *folder.glob("model.safetensors.index.json")]:
        old.unlink()
    mla.to("cpu", dtype).save_pretrained(folder, max_shard_size=parse_size(s.max_shard_size))
    shards = sorted(folder.glob("model*.safetensors"))
    return Rewritten(record, len(shards), sum(path.stat().st_size for path in shards))


def _compressed(model, budget: int, work: _Work):
    """(`model` compressed to `budget` values per token and layer, the split chosen and fitted to the parent
    (`mla.split`); its record), the time of each step added to the work's clock."""
    s = work.s
    with work.clock.of("splits"):
        plans, splits = ranked_splits(model, budget, work.ids, is_gguf_out(s.out), s.progress)
    if not (s.repair or s.refine_steps):
        return build_mla(model, plans[0]), MlaRecord.of(plans[0], splits)
    with work.clock.of("fits"):
        mla, plan, splits, fitted = fit_ranked(
            model, work.parent(), plans, splits, work.windows, s.refine_steps, s.refine_lr, s.progress
        )
    return mla, MlaRecord.of(plan, splits, fitted)


def _unseen_windows(s, text, folder: Path) -> dict[str, list[torch.Tensor]] | None:
    """Windows of the calibration sources past what the conversion read (`calibrate.read_beyond`: as many tokens
    again, at most `JUDGE_TOKENS`), by source, which no statistic or fit of either start has read; None where the
    sources hold no more. Both starts read every calibration window somewhere (GQA's fit its second moments, MLA's its
    covariance), so the fits' held-out windows favour whichever leans on its statistics more: on SmolLM2 at MQA's
    cache they put MQA's rewrite closer (0.369 against 0.457 nats/token), where 16,384 unseen tokens put the
    parent's start closer (0.672 against 0.790), as the panel does."""
    from gqaify.model.loading import load_tokenizer

    tokens = min(text.tokens, JUDGE_TOKENS)
    beyond = read_beyond(s.calibration(), text, load_tokenizer(str(folder)), tokens)
    if beyond is None:
        return None
    by_source = {}
    for part, source in zip(beyond.parts, beyond.sources, strict=True):
        windows = [w for w in part.split(s.calib_seq_len) if len(w) > 1]
        if windows:  # two sources of one name (two files of one stem) are judged as one
            by_source.setdefault(source.name, []).extend(windows)
    return by_source or None


def _closer_start(mla, record: MlaRecord, budget: int, work: _Work, unseen: dict | None):
    """At a cut whole K/V heads make, the closer to the parent of two starts: `mla`, the exact rewrite of the G-head
    conversion, and the parent compressed to the same cache (`_compressed`), judged on the `unseen` windows of
    calibration text (`_unseen_windows`), or where there are none on the fits' held-out windows. The record says
    both. For llama.cpp, G heads > 1 repeat their frequencies, so the parent's start is written, with a warning
    where the G-head model (which llama.cpp serves as GQA) was closer."""
    s, parent = work.s, work.parent
    LOG.info("trying the parent compressed to the same %d values per token and layer", budget)
    compressed, compressed_record = _compressed(parent(), budget, work)
    judged_on = None if unseen is None else sum(len(w) for ws in unseen.values() for w in ws)
    with work.clock.of("starts"):
        starts = _judged(
            {attention_kind(s.kv_heads): mla, "parent": compressed}, parent(), unseen or {"": held_out(work.windows)}
        )
    on = "the fits' held-out windows" if judged_on is None else f"{judged_on:,} unseen calibration tokens"
    LOG.info("KL to the parent on %s: %s", on, StartTrial.listed(starts))
    for_llama_cpp = is_gguf_out(s.out) and s.kv_heads > 1  # the G heads' rotary blocks would repeat frequencies
    if for_llama_cpp and starts[0].kl < starts[1].kl:
        LOG.warning(
            "for llama.cpp, the %s model at this cache was closer to the parent than MLA on calibration text no "
            "fit read (KL %.3f against %.3f nats/token): llama.cpp's MLA turns one slot per frequency, which %d "
            "K/V heads' rotary keys outgrow; --attention gqa --kv-heads %d writes that model",
            starts[0].start, starts[0].kl, starts[1].kl, s.kv_heads, s.kv_heads,
        )  # fmt: skip
    if for_llama_cpp or starts[1].kl < starts[0].kl:
        return compressed, dataclasses.replace(compressed_record, starts=starts, from_parent=True, judged_on=judged_on)
    return mla, dataclasses.replace(record, splits=compressed_record.splits, starts=starts, judged_on=judged_on)


def _judged(starts: dict[str, object], parent, windows: dict[str, list[torch.Tensor]]) -> list[StartTrial]:
    """How far each of the `starts` (name: model) is from `parent` on the `windows` of each calibration source (one
    source "": the fits' held-out windows), and over all of them, each token weighted alike; by source where there
    are several. The parent's distribution is computed once a window for both (`held_out_kls`)."""
    by_source = {name: held_out_kls(parent, list(starts.values()), ws) for name, ws in windows.items()}
    tokens = {name: sum(len(w) for w in ws) for name, ws in windows.items()}
    trials = []
    for i, start in enumerate(starts):
        kls = {name: found[i] for name, found in by_source.items()}
        kl = sum(kls[name] * tokens[name] for name in windows) / sum(tokens.values())
        trials.append(StartTrial(start, kl, kls if len(kls) > 1 else None))
    return trials


def weight_bytes(s, config: dict) -> int:
    """The bytes of the weights the rewrite of a source of `config` (config.json's) writes, at most: the model
    `mla.budget.planned_config` plans (what calibration chooses counted at its widest), built on the meta device.
    Its query projection is wider than the source's (each query head's non-rotary and rotary parts), so the G-head
    model's plan can count short."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gqaify.conversion.mla.budget import planned_config, resolve_cut
    from gqaify.model.archs import ARCHITECTURES

    geometry = Geometry.from_config(ARCHITECTURES[config["model_type"]], config)
    s = s if s.kv_cut is None else resolve_cut(s, geometry)[0]  # its problems are the request's, raised before
    source = AutoConfig.for_model(**{**config, "num_key_value_heads": s.kv_heads})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(planned_config(s, source, geometry))
    return sum(p.numel() for p in model.parameters()) * _written_dtype(s, config).itemsize


def _written_dtype(s, config: dict) -> torch.dtype:
    """The dtype the rewrite writes: --dtype, else the source's (float32 where it names none)."""
    return torch_dtype(s.dtype) or torch_dtype(config.get("dtype") or config.get("torch_dtype") or "float32")
