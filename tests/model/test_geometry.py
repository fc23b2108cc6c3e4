"""What a model's config says of it, read from a transformers config or from config.json's dict alike."""

from __future__ import annotations

from gqaify.model.geometry import float16_asked


def test_the_dtype_a_config_stores_is_read_without_transformers_deprecated_alias(monkeypatch):
    """`gqaify demo` printed "[transformers] `torch_dtype` is deprecated! Use `dtype` instead!" between its lines: a
    config that stores no dtype (a GGUF's) was asked its torch_dtype, transformers' deprecated alias of dtype. A
    config object is asked its dtype alone; config.json's older key is still read where a dict holds it."""
    from transformers import LlamaConfig, PretrainedConfig

    asked = []
    monkeypatch.setattr(PretrainedConfig, "torch_dtype", property(lambda self: asked.append(self) or self.dtype))
    assert float16_asked("auto", LlamaConfig(), "its config's") is None
    assert float16_asked("auto", LlamaConfig(dtype="float16"), "its config's") == "its config's float16 (--dtype auto)"
    assert float16_asked("auto", {"torch_dtype": "float16"}, "the source's") == "the source's float16 (--dtype auto)"
    assert float16_asked("auto", {"dtype": "bfloat16"}, "the source's") is None
    assert float16_asked("float16", LlamaConfig(), "its config's") == "--dtype float16"
    assert asked == []
