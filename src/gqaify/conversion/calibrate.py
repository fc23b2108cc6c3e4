"""Calibration statistics: the second moment of each layer's attention input over some text.

The parent model reads `tokens` tokens of the calibration text in windows of `seq_len`, once. A forward
pre-hook on every layer's K projection (whose input q, k and v share: the normed hidden state) adds
Σ [x; 1][x; 1]ᵀ in float64 as the pass goes, so memory holds one (hidden + 1)² matrix per layer and never
an activation. The constant 1 lets a fit treat a projection's bias as one more input column. Everything
that methods and similarity grouping fit is a function of these matrices (see `fit.py`).

Calibrate on text other than the text you evaluate on; the benchmarks here do.
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from gqaify.archs import ArchSpec, Geometry
from gqaify.conversion.options import Calibration
from gqaify.data import load_text
from gqaify.errors import UserError

LOG = logging.getLogger(__name__)

_CHARS_PER_TOKEN = 12  # read at most this many characters per wanted token (English BPE needs about 4)


def calibration_ids(calibration: Calibration, tokenizer) -> torch.Tensor:
    """The first `calibration.tokens` token ids of the calibration text (fewer, with a warning, if short).

    Raises:
        UserError: the data cannot be read or gives fewer than 2 tokens.
    """
    c = calibration
    text = load_text(c.data, c.split, c.text_column, "--calib-data", max_chars=c.tokens * _CHARS_PER_TOKEN).text
    ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"][: c.tokens])
    if len(ids) < 2:
        raise UserError(f"--calib-data {c.data} gives {len(ids)} token(s); give it more text")
    if len(ids) < c.tokens:
        LOG.warning("--calib-data %s holds %d tokens, fewer than --calib-tokens %d", c.data, len(ids), c.tokens)
    return ids


@torch.inference_mode()
def second_moments(
    model, spec: ArchSpec, geometry: Geometry, ids: torch.Tensor, seq_len: int, progress: bool = True
) -> list[torch.Tensor]:
    """E[[x; 1][x; 1]ᵀ] of every attention layer's input x over the tokens `ids`: (hidden + 1)² float64 each."""
    device = next(model.parameters()).device
    size = geometry.hidden_size + 1
    sums = [torch.zeros(size, size, dtype=torch.float64, device=device) for _ in range(geometry.num_layers)]

    def hook(layer: int):
        def add(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            x = torch.cat([x, x.new_ones(len(x), 1)], dim=1)
            sums[layer].addmm_(x.T, x)

        return add

    projection = spec.k_proj or spec.qkv_proj
    modules = dict(model.named_modules())
    handles = [
        modules[spec.module(layer, projection)].register_forward_pre_hook(hook(layer))
        for layer in range(geometry.num_layers)
    ]
    try:
        windows = ids.split(seq_len)
        for window in tqdm(windows, desc="calibrating", unit="window", disable=not progress or None):
            model.base_model(input_ids=window[None].to(device), use_cache=False)  # no LM head: not needed
    finally:
        for handle in handles:
            handle.remove()
    return [(s / len(ids)).cpu() for s in sums]
