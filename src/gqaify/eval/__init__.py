"""Perplexity beside the parent, KV-cache savings (analytic and measured), decode speed, diagnostics.

The entry point is `gqaify.evaluate` (`core.evaluate`), its settings `settings.EvalSettings`.
"""
