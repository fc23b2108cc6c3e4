"""Perplexity beside the parent, KV-cache savings (analytic and measured), decode speed, diagnostics."""

from gqaify.eval.core import EvalSettings, ModelReport, Report, evaluate

__all__ = ["EvalSettings", "ModelReport", "Report", "evaluate"]
