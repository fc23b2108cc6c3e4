"""What an MLA rewrite records in gqaify.json (`ConversionRecord.rewrite`), and how the summary and the model card
say it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gqaify.conversion.mla.split import SplitTrial
from gqaify.conversion.papers import cited
from gqaify.conversion.shape_contract import ShapeRecord
from gqaify.model.geometry import attention_kind
from gqaify.records import optional

if TYPE_CHECKING:
    from gqaify.conversion.mla.layer import MlaPlan


@dataclass(frozen=True)
class StartTrial:
    """One start of an MLA model at a cut whole K/V heads make, and how far it was from the parent on calibration
    text no fit read (`MlaRecord.judged_on`; next-token KL, nats per token): "GQA-2" (that conversion rewritten
    exactly) or "parent" (the parent compressed to the same cache and fitted)."""

    start: str
    kl: float  # over every token judged: what decides
    # on each calibration source's tokens (None: one source, the fits' held-out windows, or an earlier record). Said,
    # not decisive: keeping the parent's start only where it was closer on every source was measured, and on SmolLM2
    # at 16,384 tokens kept MQA (further on two sources) where the parent's start is closer on all five panel texts
    by_source: dict[str, float] | None = optional()

    @staticmethod
    def listed(starts: list[StartTrial]) -> str:
        """The starts and their KLs as the log, the summary and the card list them (`MlaRecord.starts_tried`):
        "GQA-2 2.900, parent 0.983", every KL to the same decimals, so that they read as the comparison they are."""
        return ", ".join(f"{trial.start} {trial.kl:.3f}" for trial in starts)


@dataclass(frozen=True)
class MlaRecord(ShapeRecord):
    """The MLA layer a conversion wrote (the same in every layer)."""

    kv_rank: int  # the latent's values per token and layer
    rope_dims: int  # the shared rotary key's
    nope_dims: int  # each query head's key dimensions read from the latent
    # per layer, per K/V head of the G-head model (turned: per component of the heads' pairs), its rotary pairs kept
    rotary_pairs: list[list[list[int]]]
    rope_type: str  # DeepSeek-V3's rope_parameters: default (one base's ladder) or longrope (a factor per pair)
    exact: bool  # the G-head model's function, to float precision
    # --kv-cut with neither width given: every split tried, the one kept the closest (`mla.split`)
    splits: list[SplitTrial] | None = optional()
    # a smaller cache: whether the layer-by-layer fit was kept (False: it took the model further from its parent on
    # the held-out calibration windows, so the PCA start is written); None: nothing was fitted
    fitted: bool | None = optional()
    # each frequency's pairs turned across the K/V heads before the rotary key's were chosen (`mla.rotary`)
    turned: bool = optional(False)
    # a cut whole K/V heads make: both starts tried (`StartTrial`); the closer kept, from the parent where it was
    starts: list[StartTrial] | None = optional()
    from_parent: bool = optional(False)
    # the tokens of calibration text past what the conversion read that the starts were judged on (None: the fits'
    # held-out windows, where the sources held no more)
    judged_on: int | None = optional()
    # where the rewrite's time went, seconds by step (`Clock`): "splits" (statistics, each split built and judged),
    # "fits" (layer by layer), "starts" (the two starts judged); None in a record of an earlier gqaify
    seconds: dict[str, float] | None = optional()

    @property
    def cached_per_token(self) -> int:
        return self.kv_rank + self.rope_dims

    @property
    def starts_tried(self) -> str:
        """The starts tried and their KLs (`StartTrial.listed`; "" where none was)."""
        return StartTrial.listed(self.starts or [])

    @property
    def judge_text(self) -> str:
        """What the two starts were judged on, for the summary and the card."""
        if self.judged_on is None:
            return "held-out calibration text"
        return f"{self.judged_on:,} tokens of calibration text no fit read"

    def attention(self, kind: str) -> str:
        """ "MLA (latent 64 + rotary key 32, from GQA-2)", "MLA (latent 62 + rotary key 66, from the parent)" (the
        start kept at a whole-head cut)."""
        start = "the parent" if self.from_parent else kind
        return f"MLA (latent {self.kv_rank} + rotary key {self.rope_dims}, from {start})"

    def heads(self, source_kv_heads: int, num_heads: int) -> str | None:
        """Where the parent compressed was kept, the G-head conversion was a start tried and not kept: its lines go."""
        if not self.from_parent:
            return None
        return f"{source_kv_heads}, the parent's, compressed into the latent ({num_heads} query heads)"

    def summary_lines(self) -> list[str]:
        """What the rewrite did (the fit lines of the summary are the G-head conversion's)."""
        how = "exact (the G-head model's function)" if self.exact else "fitted on the calibration text, layer by layer"
        if self.fitted is False:
            how = "its PCA start (the layer-by-layer fit took it further from the parent, and was undone)"
        elif not self.exact and self.fitted is None:
            how = "its PCA start on the calibration text (not fitted)"
        lines = [
            f"  MLA             latent {self.kv_rank} + rotary key {self.rope_dims} values per token and layer, {how}"
        ]
        if self.starts:
            kept = "the parent compressed" if self.from_parent else f"the exact rewrite of {self.starts[0].start}"
            why = f"the closer on {self.judge_text}"
            if self.from_parent and self.starts[0].kl < self.starts[1].kl:  # a GGUF: llama.cpp cannot turn the heads
                why = f"as llama.cpp needs, though {self.starts[0].start} was closer on {self.judge_text}"
            lines.append(f"  MLA start       {kept}, {why} (KL {self.starts_tried} nats/token)")
        if self.seconds:  # where the rewrite's time went: its fits are most of a conversion's
            steps = ", ".join(f"{step} {seconds:.1f}" for step, seconds in self.seconds.items())
            lines.append(f"  MLA rewrite     {sum(self.seconds.values()):.1f} s ({steps})")
        return lines

    def card_line(self, record) -> str:
        g = record.output_geometry
        how = "exactly (the same function to float precision)" if self.exact else "fitted on the calibration text"
        if self.from_parent:
            how = "instead from the parent, compressed and fitted on the calibration text,"
        text = (
            f"- Then rewritten {how} as latent attention: transformers' DeepSeek-V3 class with every layer dense (no "
            f"remote code). Each token caches a latent of {self.kv_rank} values and one rotary key of "
            f"{self.rope_dims} that every query head shares, {g.cached_per_token} values per layer where "
            f"{attention_kind(record.kv_heads)} caches {2 * record.kv_heads * g.head_dim}; transformers' cache holds "
            "the latent."
        )
        text += f" The latent layer is DeepSeek-V2's ({cited('2405.04434')})."
        if self.starts:
            text += (
                f" Two starts were tried at this cache and the closer to the parent on {self.judge_text} kept "
                f"(KL per token: {self.starts_tried})."
            )
        return text

    @classmethod
    def of(cls, plan: MlaPlan, splits: list[SplitTrial] | None = None, fitted: bool | None = None) -> MlaRecord:
        """The record of the rewrite `plan` describes (`splits`: the splits tried; `fitted`: whether the fit was
        kept, None where none ran)."""
        shape = plan.shape
        pairs = plan.layout.per_layer(shape.kv_groups)
        rope = plan.rope["rope_type"]
        turned = plan.layout.mixing is not None
        return cls(shape.kv_rank, shape.rope_dim, plan.nope_dim, pairs, rope, plan.exact, splits, fitted, turned)
