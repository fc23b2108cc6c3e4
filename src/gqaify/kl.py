"""The KL from a parent's next-token distribution to a model's, defined once: eval's KL to the parent
(`eval.perplexity`, `eval.diagnostics`), a shape's held-out fit (its folder's `fit`), the distillation loss on whole
logits (`uptrain.distill`) and the fused head and loss (`uptrain.head_loss`) all compute it here, a chunk of tokens
at a time where the vocabulary is wide.

    KL(parent || model) per token = Σ_v p(v) (log p(v) - log q(v)),   p = softmax(parent / T), q = softmax(model / T)

`stored_kl_sum` is the same KL where the parent's text was stored with only its k most likely next tokens and their
log-probabilities (`gqaify generate --top-logprobs K`): both distributions seen through k + 1 outcomes.

Each is a plain function of one chunk's log-probabilities (`log_probs`, in float32 at least), whose gradient autograd
takes: the callers choose the chunks (`token_chunks`), so that no vocabulary-wide tensor of a whole batch exists.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

KL_CHUNK_TOKENS = 1024  # tokens per chunk: 1,024 x 49,152 x 4 bytes = 0.2 GB of float32 per intermediate


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) over the last dimension, in float32 at least: the distributions the KL compares."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1)


def kl_sum(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Σ over the tokens of KL(p || q) = Σ_v p (log p - log q), a 0-d tensor.

    Args:
        log_q, log_p: (tokens, vocab) the model's and the parent's log-probabilities (`log_probs`, at the same
            temperature); gradients flow to `log_q` where it carries them.
    """
    return F.kl_div(log_q, log_p, log_target=True, reduction="sum")


def stored_kl_sum(log_q: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor:
    """Σ over the tokens of the KL from the parent's stored top-k to the model's distribution, a 0-d tensor.

    Both distributions are seen through the same k + 1 outcomes: each of the parent's k tokens, and "any other
    token", which holds the parent's remaining mass 1 - Σ p_k and the model's own mass off those tokens. This is the
    exact KL between the two coarsened distributions: 0 only when the model gives each stored token the parent's
    probability, never more than the full KL, and equal to it when k is the whole vocabulary. Its gradient with
    respect to the logits is q - p̃, where p̃ is the parent on the k tokens and, off them, the parent's remaining
    mass shared out as the model shares its own.

    Args:
        log_q: (tokens, vocab) the model's log-probabilities (`log_probs`), at temperature 1 as the stored ones are.
        top_ids: (tokens, k) the parent's k most likely next tokens at each position, distinct (int).
        top_logprobs: (tokens, k) their log-probabilities under the parent.
    """
    logprobs = top_logprobs.to(log_q.dtype)
    p = logprobs.exp()  # (tokens, k)
    kept = (p * (logprobs - log_q.gather(-1, top_ids))).sum()
    if top_ids.shape[-1] == log_q.shape[-1]:  # k is the vocabulary: no other token, whatever noise leaves of 1 - Σ p
        return kept
    rest = (1 - p.sum(-1)).clamp_min(0)  # (tokens,) the parent's mass off its k tokens
    log_q_rest = log_q.scatter(-1, top_ids, -math.inf).logsumexp(-1)  # not log(1 - Σ q): no cancellation when small
    return kept + (torch.special.xlogy(rest, rest) - rest * log_q_rest).sum()


def kl_sums(
    logits: torch.Tensor, parent_logits: torch.Tensor, temperature: float = 1.0, chunk: int = KL_CHUNK_TOKENS
) -> Iterator[torch.Tensor]:
    """Σ over each chunk of `chunk` tokens of KL(softmax(parent_logits / T) || softmax(logits / T)) (`kl_sum`), chunk
    after chunk, as 0-d tensors in float32 at least: the full-vocabulary intermediates exist for one chunk at a time.
    The caller adds them up (eval as Python floats).

    Args:
        logits, parent_logits: (..., vocab), the same shape (every leading dimension counts as tokens).
        temperature: T, dividing both logits before the softmax (1: the distributions themselves).
        chunk: tokens per chunk (the sum over chunks does not depend on it, only the memory does).
    """
    for student, parent in token_chunks(chunk, logits, parent_logits):
        yield kl_sum(log_probs(student, temperature), log_probs(parent, temperature))


def token_chunks(chunk: int, *tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Chunks of `chunk` tokens of each of `tensors` side by side, each viewed as (tokens, its last dimension)."""
    flat = [t.reshape(-1, t.shape[-1]) for t in tensors]  # (tokens, vocab or k), views
    for begin in range(0, flat[0].shape[0], chunk):
        yield tuple(t[begin : begin + chunk] for t in flat)
