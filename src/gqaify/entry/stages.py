"""Every command that runs a stage, in one place, lowest stage first: `gqaify` builds a command of each, and every
settings parser knows them all (`settings.registry`, declared by gqaify/__init__.py). A new stage is one entry
here: its settings (`Stage`) and its `command_line(argv, prog)`, named, not imported, so that this list is read
before any stage is loaded."""

from __future__ import annotations

from gqaify.settings.registry import StageEntry

STAGES = (
    StageEntry(
        "convert",
        "rewrite a checkpoint's K/V heads from H to G, or as latent attention (MLA)",
        "gqaify.conversion.settings:CONVERT",
        "gqaify.conversion.entry:command_line",
    ),
    StageEntry(
        "eval",
        "perplexity, KV cache and decode speed of models beside the first (the parent)",
        "gqaify.eval.settings:EVAL",
        "gqaify.eval.entry:command_line",
    ),
    StageEntry(
        "generate",
        "sample a corpus from a model (the parent's own text) for calibration and uptraining",
        "gqaify.generation.settings:GENERATE",
        "gqaify.generation.entry:command_line",
    ),
    StageEntry(
        "uptrain",
        "uptrain a converted model to recover quality (one process; accelerate launch -m gqaify.uptrain for more)",
        "gqaify.uptrain.settings:UPTRAIN",
        "gqaify.uptrain.entry:command_line",
    ),
)
