"""`gqaify eval --kv-cache`: each model served with its KV cache in the formats asked, in the engine that serves
them (one room per engine behind `engine.CacheEngine`), set side by side as a frontier of bytes against closeness to
the parent, with a verdict per budget.

    formats.py               the formats as data: names, engines, bits per value (light)
    results.py               the rows, the front and the verdicts (report.json's `frontier`; light)
    engine.py                what eval asks of an engine (`CacheEngine`, `CacheRunner`), the rooms (`ROOMS`)
    values.py                the keys and values one token caches, from a model's config
    transformers_engine.py   transformers' own caches, `QuantizedCache` prefilled in chunks
    llama_cpp_engine.py      llama.cpp itself, through llama-cpp-python
    measure.py               every model x format on the panel against the parent's f16 cache
    retrieval.py             a pass key planted at depths and asked for
"""
