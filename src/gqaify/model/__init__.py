"""What a model is to gqaify: its architecture's facts as data (`archs`), what a name names (`locations`), its
loading and weights (`loading`), the hub (`hub`), its KV cache in bytes (`kvcache`), a GGUF's header
(`gguf_header`), the dtype names (`dtypes`)."""
