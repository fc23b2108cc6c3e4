"""`trainable: lora`: low-rank adapters on every attention projection, through peft, merged away at the end.

    W x  ->  W x + (alpha / r) B A x        A: (r, in), B: (out, r), B = 0 at the start (the model is unchanged)

The adapters sit on the projections the architecture table names (q, k, v, o, or a fused qkv; for a class a shape
writes, those its registry entry names: `ShapeInfo.writes`) in every layer, so the converted attention (the merged
K/V heads and the readers' compensation) is what adapts; the rest of the model is frozen. The final model has the
adapters merged into its weights: a plain checkpoint of the converted class, which loads without peft.
"""

from __future__ import annotations

import re

import torch

from gqaify.conversion.shapes import trained_attention


def target_pattern(model_type: str) -> str:
    """peft's `target_modules` as a regular expression over full module names: each layer's attention projections.

    Raises:
        UserError: the architecture is not in gqaify's table (where its attention lives is unknown).
    """
    trained = trained_attention(model_type, "trainable lora")
    return rf"(.*\.)?{trained.pattern}\.({'|'.join(re.escape(n) for n in trained.projections)})"


def with_adapters(model, rank: int, alpha: float) -> torch.nn.Module:
    """`model` wrapped by peft with LoRA adapters of rank `rank` on its attention projections; only they train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=target_pattern(model.config.model_type)
    )
    return get_peft_model(model, config)


def is_adapted(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def merged(model) -> torch.nn.Module:
    """The plain model with the adapters folded into its weights (`W + alpha/r B A`); `model` itself if it has none.
    The adapted model is consumed: call it once training is over."""
    return model.merge_and_unload() if is_adapted(model) else model
