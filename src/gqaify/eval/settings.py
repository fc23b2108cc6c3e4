"""The settings of `gqaify eval` (imports nothing heavy: the command line reads their defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalSettings:
    split: str = "test"
    text_column: str = "text"
    seq_len: int = 2048
    stride: int | None = None  # None: seq_len (non-overlapping windows)
    max_tokens: int | None = None
    batch_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    memory_budget: str = "80GB"
    decode_context: int = 512
    decode_tokens: int = 32
    decode_batch: int = 8
    repeats: int = 3
    diag_tokens: int = 512
    speed: bool = True
    trust_remote_code: bool = False  # load models whose folder carries modeling code (gqaify's GPT-2, GPT-NeoX, OPT)
    progress: bool = True
