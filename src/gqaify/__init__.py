"""gqaify: turn multi-head-attention checkpoints into grouped-query (GQA) or multi-query (MQA) attention.

    gqaify.convert(src, out, kv_heads=G)   rewrite a checkpoint's K/V projections from KV heads to G
    gqaify.convert(src, out, G, method="lsq", calibration=gqaify.Calibration("text.txt"))   fitted on text
    gqaify.evaluate([parent, converted], data, out)   perplexity, KV cache and speed beside the parent
    gqaify.uptrain(gqaify.UptrainSettings(...))       recover quality with a short run (accelerate)

The functions `gqaify.convert` and `gqaify.uptrain` are the public entry points; their implementations live
in the subpackages of the same names (import their modules as `from gqaify.convert import methods`).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gqaify")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

from gqaify.convert import Calibration, convert  # noqa: E402  (after __version__, which convert records)
from gqaify.eval import EvalSettings, evaluate  # noqa: E402
from gqaify.uptrain import UptrainSettings, uptrain  # noqa: E402

__all__ = ["Calibration", "EvalSettings", "UptrainSettings", "__version__", "convert", "evaluate", "uptrain"]
