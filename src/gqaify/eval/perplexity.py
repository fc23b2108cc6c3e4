"""Perplexity over strided sliding windows: the one implementation (eval and uptraining both use it).

The convention is transformers' ("Perplexity of fixed-length models"): windows of `seq_len` tokens start
every `stride` tokens; a window scores only the tokens the previous window did not reach, using the tokens
before them in the window as context. A token is scored once at most; the first token of the text has no
context and is never scored.

    tokens       0 1 2 3 4 5 6 7 8 9            seq_len 6, stride 3
    window 1     c s s s s s                    c: context only (token 0 has none before it)
    window 2           c c c s s s              s: scored
    window 3                 c c c s            (ends at the last token)

With `stride == seq_len` the windows do not overlap (GPTQ-style chunks): the first token of every chunk
has no context in its window and is not scored.

With a parent, the KL from its next-token distribution on the same tokens too, chunk by chunk (`kl.kl_sums`, the
one definition the distillation loss trains on as well).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import torch
import torch.nn.functional as F

from gqaify.eval.results import Perplexity
from gqaify.kl import kl_sums
from gqaify.progress import progress_bar


@dataclass(frozen=True)
class Window:
    begin: int  # first token fed to the model
    end: int  # one past the last token fed
    scored_from: int  # tokens [scored_from, end) are scored

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def scored(self) -> int:
        return self.end - self.scored_from


def sliding_windows(num_tokens: int, seq_len: int, stride: int) -> list[Window]:
    """The windows over `num_tokens` tokens, as in the module docstring."""
    if not 0 < stride <= seq_len:
        raise ValueError(f"need 0 < stride <= seq_len, got stride {stride}, seq_len {seq_len}")
    windows, reached = [], 0
    for begin in range(0, max(num_tokens - 1, 1), stride):
        end = min(begin + seq_len, num_tokens)
        scored_from = max(reached, begin + 1)
        if end > scored_from:
            windows.append(Window(begin, end, scored_from))
        reached = end
        if end == num_tokens:
            break
    return windows


@torch.no_grad()
def perplexity(
    model,
    ids: torch.Tensor,
    seq_len: int,
    stride: int,
    batch_size: int = 1,
    progress: bool = True,
    desc: str = "perplexity",
    parent=None,
) -> Perplexity:
    """Token-weighted perplexity of `model` on the token ids `ids` (1-D), over sliding windows; with `parent` (a
    model of the same vocabulary), also the KL from the parent's next-token distribution on the same tokens.

    Windows of the same shape run together in batches of `batch_size`. Only the logits that score a token
    are computed (`logits_to_keep` with their positions), and log-probabilities are taken in float32. Runs under
    no_grad, not inference_mode: uptraining evaluates between optimizer steps, and tensors made under inference
    mode (FSDP's gathered parameters among them) could not take part in the backward passes that follow.
    """
    device = next(model.parameters()).device
    windows = sliding_windows(len(ids), seq_len, stride)
    nll_sum, kl_sum, scored = 0.0, 0.0, 0
    with progress_bar(total=sum(w.scored for w in windows), unit="tok", desc=desc, shown=progress) as bar:
        for (length, n_scored), same_shape in groupby(windows, key=lambda w: (w.length, w.scored)):
            same_shape = list(same_shape)
            for i in range(0, len(same_shape), batch_size):
                batch = same_shape[i : i + batch_size]
                inputs = torch.stack([ids[w.begin : w.end] for w in batch]).to(device)  # (B, length)
                # the logits at positions length-n_scored-1 .. length-2 predict the scored tokens
                keep = torch.arange(length - n_scored - 1, length - 1, device=device)
                logits = model(inputs, use_cache=False, logits_to_keep=keep).logits  # (B, n_scored, vocab)
                targets = inputs[:, length - n_scored :]  # (B, n_scored)
                nll_sum += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").item()
                if parent is not None:
                    reference = parent(
                        inputs.to(parent.device), use_cache=False, logits_to_keep=keep.to(parent.device)
                    ).logits
                    kl_sum += sum(s.item() for s in kl_sums(logits, reference.to(logits.device)))
                scored += targets.numel()
                bar.update(targets.numel())
    return Perplexity(nll_sum, scored, kl_sum if parent is not None else None)
