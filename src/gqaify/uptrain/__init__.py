"""Uptraining: recover a converted model's quality with a short run under `accelerate launch`.

    accelerate launch -m gqaify.uptrain --recipe recipes/smollm2-135m-mqa.yaml
    gqaify uptrain --recipe recipes/smollm2-135m-mqa.yaml                  (one process)
    gqaify.uptrain.run(gqaify.uptrain.parse(["--recipe", path, "--lr", "1e-4"]))      (Python)
    gqaify.uptrain.run(gqaify.UptrainSettings(model=..., output_dir=..., data=..., max_tokens=100_000))

Names are imported on first use, so that `-m gqaify.uptrain --help` answers without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "UptrainSettings": "gqaify.uptrain.settings",
    "parse": "gqaify.uptrain.settings",
    "run": "gqaify.uptrain.train",
    "UptrainResult": "gqaify.uptrain.train",
}
__all__ = ["UptrainResult", "UptrainSettings", "parse", "run"]

if TYPE_CHECKING:
    from gqaify.uptrain.settings import UptrainSettings, parse
    from gqaify.uptrain.train import UptrainResult, run


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
