"""gqaify: turn multi-head-attention checkpoints into grouped-query (GQA), multi-query (MQA) or another attention
shape with a smaller KV cache (`gqaify convert --help` lists them under --attention).

    gqaify.convert(src, out, kv_heads=G)                   rewrite a checkpoint's K/V heads from KV to G
    gqaify.convert(src, out, kv_cut=4, attention=SHAPE, calib_data="text.txt")   a cache 1/4 the source's, in SHAPE
    gqaify.convert(src, out, G, method="lsq", calib_data="text.txt")    fitted on calibration text
    gqaify.evaluate([parent, converted], data, out)        perplexity, KV cache and speed beside the parent

Every stage has one entry of one shape, `run(settings) -> result`:

    gqaify.conversion.run(gqaify.ConvertSettings(...))     -> ConversionResult   (also gqaify.convert_with)
    gqaify.eval.run(gqaify.EvalSettings(...))              -> Report
    gqaify.generation.run(gqaify.GenerateSettings(...))    -> Corpus
    gqaify.uptrain.run(gqaify.UptrainSettings(...))        -> UptrainResult (under accelerate launch, or not)

Each stage's settings are one dataclass (ConvertSettings, EvalSettings, UptrainSettings): its fields are the
keyword arguments here, the command line's options and the keys of a --config file.

Functions are verbs and modules are nouns, so no name here is both: the conversion lives in the package
`gqaify.conversion`, evaluation in `gqaify.eval`, and uptraining in the module `gqaify.uptrain` (the one you
launch: `accelerate launch -m gqaify.uptrain`). Everything is imported on first use, so `import gqaify`
and the command line's `--help` do not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gqaify._version import __version__
from gqaify.entry.stages import STAGES
from gqaify.records import CONVERSION, UPTRAINED, declare_types
from gqaify.settings.registry import declare

# Declared here, where every import of gqaify passes first: every command that runs a stage, known to every settings
# parser (`settings.registry`); the record types declared above gqaify.records, so that `read_record` reads every
# kind whatever else was imported (each imported on first use)
declare(STAGES)
declare_types(
    {
        CONVERSION: ("gqaify.conversion.record:ConversionRecord",),
        UPTRAINED: ("gqaify.conversion.record:ConversionRecord",),
    }
)

# public name -> the module that defines it
_EXPORTS = {
    "convert": "gqaify.conversion.core",
    "ConversionResult": "gqaify.conversion.core",
    "convert_with": "gqaify.conversion.core",
    "ConvertSettings": "gqaify.conversion.settings",
    "evaluate": "gqaify.eval.core",
    "EvalSettings": "gqaify.eval.settings",
    "UptrainSettings": "gqaify.uptrain.settings",
    "GenerateSettings": "gqaify.generation.settings",
}
_SUBMODULES = ("conversion", "eval", "generation", "uptrain")

__all__ = [
    "ConversionResult",
    "ConvertSettings",
    "EvalSettings",
    "GenerateSettings",
    "UptrainSettings",
    "__version__",
    "conversion",
    "convert",
    "convert_with",
    "eval",
    "evaluate",
    "generation",
    "uptrain",
]

if TYPE_CHECKING:
    from gqaify import conversion, eval, generation, uptrain  # noqa: A004 (gqaify.eval is a package, not the builtin)
    from gqaify.conversion.core import ConversionResult, convert, convert_with
    from gqaify.conversion.settings import ConvertSettings
    from gqaify.eval.core import evaluate
    from gqaify.eval.settings import EvalSettings
    from gqaify.generation.settings import GenerateSettings
    from gqaify.uptrain.settings import UptrainSettings


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
