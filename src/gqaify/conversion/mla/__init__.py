"""Latent attention (MLA), one attention shape (`conversion.shapes`): what a conversion asks of it and writes.

    layer.py    the G-head model's layer rewritten as DeepSeek-V3's dense MLA layer: its shape, plan and weights
    rotary.py   which rotary pairs the shared rotary key keeps, turned across the K/V heads
    latent.py   the latent: the leading components of the keys and values, in the layer's metric
    split.py    how a cache of a given size is split between the latent and the rotary key
    fit.py      the MLA model brought back to its parent layer by layer
    gguf.py     the MLA model as llama.cpp's deepseek2 loads it
    output.py   the shape's entry: what a request cannot be, the rewrite of the G-head folder, its record

The shape (`conversion.shape_contract.Shape`) is `shape.MLA`, its own settings `settings.LatentSettings`. This
package imports nothing, so that reading the settings loads no torch.
"""
