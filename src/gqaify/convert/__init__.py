"""Streaming conversion of a checkpoint's K/V heads: `convert(src, out, kv_heads)`."""

from gqaify.convert.archs import ARCHITECTURES
from gqaify.convert.calibrate import Calibration
from gqaify.convert.core import ConversionResult, convert
from gqaify.convert.methods import METHODS

__all__ = ["ARCHITECTURES", "METHODS", "Calibration", "ConversionResult", "convert"]
