"""Perplexity beside the parent, KV-cache savings and decode speed (not built yet: see the eval issue)."""
