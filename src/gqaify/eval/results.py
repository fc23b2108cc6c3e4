"""What `gqaify eval` found: one `ModelReport` per model and the `Report` around them (report.json's schema)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gqaify._version import __version__


@dataclass
class ModelReport:
    model: str
    model_type: str
    num_attention_heads: int
    num_key_value_heads: int
    dtype: str
    parameters: int
    tokenizer: str  # fingerprint: models with equal fingerprints saw identical token ids
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
    diagnostics: dict | None = None
    tasks: list[dict] | None = None  # one row per task and metric (eval/tasks.py's TaskScore), with --tasks
    generations: list[dict] | None = None  # {"prompt", "text"} per prompt, with --generate


@dataclass
class Report:
    data: dict
    settings: dict
    models: list[ModelReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"tool": "gqaify", "version": __version__, "data": self.data, "settings": self.settings,
                "models": [asdict(m) for m in self.models], "notes": self.notes}  # fmt: skip
