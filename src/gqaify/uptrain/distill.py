"""Distillation from the parent on whole logits: the KL between its next-token distribution and the student's, in
chunks (`gqaify.kl` defines it; the fused head and loss, `head_loss`, computes the same without whole logits).

The logits of a batch are tokens x vocabulary: 16 x 1,024 tokens of SmolLM2's 49,152-word vocabulary are 3.2 GB
in float32 per copy. A plain implementation holds, besides both models' logits, a float32 log-softmax of each
and the KL's elementwise product, all kept for the backward pass. Here the tokens are taken `chunk` at a time,
in the forward pass and again in the backward pass, which makes each chunk's KL again and asks autograd for its
gradient: nothing but the logits is kept between them (benchmarks/distill_memory.py measures the difference).

Where the parent's top-k log-probabilities were stored with the text it wrote (`gqaify generate --top-logprobs
K`), `stored_kl` needs no teacher at all: the KL over the k stored tokens and one "any other token" outcome.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from gqaify.kl import KL_CHUNK_TOKENS, kl_sum, log_probs, stored_kl_sum, token_chunks


def distillation_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, chunk: int = KL_CHUNK_TOKENS
) -> torch.Tensor:
    """KL(teacher || student) per token (`kl.kl_sum`), averaged over tokens, of the temperature-softened next-token
    distributions, times temperature² (Hinton et al.) so its gradients keep their scale as T changes.

    Args:
        student_logits, teacher_logits: (..., vocab), the same shape; only the student's carry gradients.
        chunk: tokens per chunk (the result does not depend on it, only the memory does).
    """
    kl = functools.partial(_kl_sum, temperature=temperature)
    total = _ChunkedSum.apply(student_logits, kl, chunk, teacher_logits.detach())
    return total / _tokens(student_logits) * temperature**2


def stored_kl(
    student_logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor, chunk: int = KL_CHUNK_TOKENS
) -> torch.Tensor:
    """KL(parent || student) per token (`kl.stored_kl_sum`), averaged over tokens, from the parent's k most likely next
    tokens and their log-probabilities stored with the text (`gqaify generate --top-logprobs K`): no teacher runs.

    Args:
        student_logits: (..., vocab), carrying gradients.
        top_ids: (..., k) the parent's k most likely next tokens at each position (int).
        top_logprobs: (..., k) their log-probabilities under the parent (temperature 1).
        chunk: tokens per chunk (the result does not depend on it, only the memory does).
    """
    total = _ChunkedSum.apply(student_logits, _stored_kl_sum, chunk, top_ids, top_logprobs.detach())
    return total / _tokens(student_logits)


def _kl_sum(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    return kl_sum(log_probs(student, temperature), log_probs(teacher, temperature))


def _stored_kl_sum(student: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor:
    return stored_kl_sum(log_probs(student), top_ids, top_logprobs)


class _ChunkedSum(torch.autograd.Function):
    """Σ over chunks of `chunk` tokens of `loss(logits' chunk, others' chunks...)`, and its gradient with respect to
    the logits, with nothing kept between the passes but the inputs: the backward pass makes each chunk's loss again
    and asks autograd for its gradient, written chunk by chunk into one tensor the size of the logits, the one
    full-size tensor a gradient needs. (Slicing a tensor that carries gradients would make autograd build a
    full-size zero tensor per chunk in the backward pass.)"""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, loss: Callable, chunk: int, *others: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, *others)
        ctx.loss, ctx.chunk = loss, chunk
        total = torch.zeros((), dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
        for pieces in token_chunks(chunk, logits, *others):
            total += loss(*pieces)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, *others = ctx.saved_tensors
        out = torch.empty_like(logits).reshape(-1, logits.shape[-1])  # (tokens, vocab)
        begin = 0
        for piece, *other_pieces in token_chunks(ctx.chunk, logits, *others):
            piece = piece.detach().requires_grad_()
            with torch.enable_grad():
                (piece_grad,) = torch.autograd.grad(ctx.loss(piece, *other_pieces), piece, grad)
            out[begin : begin + len(piece)] = piece_grad
            begin += len(piece)
        return out.view(logits.shape), None, None, *([None] * len(others))


def _tokens(logits: torch.Tensor) -> int:
    return logits.numel() // logits.shape[-1]
