"""Uptraining: recover a converted model's quality with a short run under `accelerate launch`.

accelerate launch -m gqaify.uptrain --recipe recipes/smollm2-135m-mqa.yaml
gqaify uptrain --recipe recipes/smollm2-135m-mqa.yaml          (one process)
gqaify.uptrain(UptrainSettings(...))                          (Python)
"""

from gqaify.uptrain.settings import UptrainSettings, parse
from gqaify.uptrain.train import UptrainResult, uptrain

__all__ = ["UptrainResult", "UptrainSettings", "parse", "uptrain"]
