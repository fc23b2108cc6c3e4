"""Distillation from the parent: the KL between its next-token distribution and the student's, in chunks.

    KL(parent || student) per token = sum_v p_parent(v) * (log p_parent(v) - log p_student(v))

The logits of a batch are tokens x vocabulary: 16 x 1,024 tokens of SmolLM2's 49,152-word vocabulary are 3.2 GB
in float32 per copy. A plain implementation holds, besides both models' logits, a float32 log-softmax of each
and the KL's elementwise product, all kept for the backward pass. Here the tokens are taken `chunk` at a time,
in the forward pass and again in the backward pass, which writes the gradient (T/N)(q - p) directly: nothing
but the logits is kept between them (benchmarks/distill_memory.py measures the difference).

Where the parent's top-k log-probabilities were stored with the text it wrote (`gqaify generate --top-logprobs
K`), `stored_kl` needs no teacher at all: the KL over the k stored tokens and one "any other token" outcome.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gqaify.eval.perplexity import KL_CHUNK_TOKENS, kl_sums, log_softmax_chunks


def distillation_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, chunk: int = KL_CHUNK_TOKENS
) -> torch.Tensor:
    """KL(teacher || student) per token, averaged over tokens, of the temperature-softened next-token
    distributions, times temperature² (Hinton et al.) so its gradients keep their scale as T changes.

    Args:
        student_logits, teacher_logits: (..., vocab), the same shape; only the student's carry gradients.
        chunk: tokens per chunk (the result does not depend on it, only the memory does).
    """
    return _ChunkedKL.apply(student_logits, teacher_logits.detach(), temperature, chunk)


class _ChunkedKL(torch.autograd.Function):
    """The KL and its gradient, a chunk of tokens at a time, with nothing kept between the passes but the logits.

    With p = softmax(teacher / T) and q = softmax(student / T), the loss T² / N · Σ_tokens Σ_v p (log p − log q)
    has the gradient T / N · (q − p) with respect to the student's logits (Σ_v p = 1), written chunk by chunk
    into one tensor the size of the logits: the one full-size tensor a gradient needs. (Slicing a tensor that
    carries gradients would make autograd build a full-size zero tensor per chunk in the backward pass.)
    """

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
        ctx.save_for_backward(student, teacher)
        ctx.temperature, ctx.chunk = temperature, chunk
        total = torch.zeros((), dtype=_dtype(student), device=student.device)
        for chunk_sum in kl_sums(student, teacher, temperature, chunk):  # eval's KL, the one implementation
            total += chunk_sum
        return total / _tokens(student) * temperature**2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        student, teacher = ctx.saved_tensors
        temperature, scale = ctx.temperature, ctx.temperature / _tokens(student)
        out = torch.empty_like(student).reshape(-1, student.shape[-1])  # (tokens, vocab)
        begin = 0
        for log_q, log_p in log_softmax_chunks(student, teacher, temperature, ctx.chunk):  # as the forward's
            out[begin : begin + len(log_q)] = ((log_q.exp() - log_p.exp()) * (scale * grad)).to(out.dtype)
            begin += len(log_q)
        return out.view(student.shape), None, None, None


def stored_kl(
    student_logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor, chunk: int = KL_CHUNK_TOKENS
) -> torch.Tensor:
    """KL(parent || student) per token, averaged over tokens, from the parent's k most likely next tokens and their
    log-probabilities stored with the text (`gqaify generate --top-logprobs K`): no teacher runs.

    Both distributions are seen through the same k + 1 outcomes: each of the parent's k tokens, and "any other
    token", which holds the parent's remaining mass 1 - Σ p_k and the student's own mass off those tokens. This is
    the exact KL between the two coarsened distributions: 0 only when the student gives each stored token the
    parent's probability, never more than the full KL, and equal to it when k is the whole vocabulary. Its
    gradient is q - p̃, where p̃ is the parent on the k tokens and, off them, the parent's remaining mass shared
    out as the student shares its own.

    Args:
        student_logits: (..., vocab), carrying gradients.
        top_ids: (..., k) the parent's k most likely next tokens at each position (int).
        top_logprobs: (..., k) their log-probabilities under the parent (temperature 1).
        chunk: tokens per chunk (the result does not depend on it, only the memory does).
    """
    return _StoredKL.apply(student_logits, top_ids, top_logprobs.detach(), chunk)


class _StoredKL(torch.autograd.Function):
    """`stored_kl` and its gradient a chunk of tokens at a time, as `_ChunkedKL` does for the full KL."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, chunk: int) -> torch.Tensor:
        ctx.save_for_backward(student, ids, logprobs)
        ctx.chunk = chunk
        total = torch.zeros((), dtype=_dtype(student), device=student.device)
        for s, i, lp in _chunks(student, chunk, ids, logprobs):
            total += stored_kl_sum(F.log_softmax(s.to(_dtype(s)), dim=-1), i, lp)
        return total / _tokens(student)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        student, ids, logprobs = ctx.saved_tensors
        scale = grad / _tokens(student)
        out = torch.empty_like(student).reshape(-1, student.shape[-1])  # (tokens, vocab)
        begin = 0
        for s, i, lp in _chunks(student, ctx.chunk, ids, logprobs):
            g = stored_kl_gradient(F.log_softmax(s.to(_dtype(s)), dim=-1), i, lp)
            out[begin : begin + len(s)] = (g * scale).to(out.dtype)
            begin += len(s)
        return out.view(student.shape), None, None, None


def stored_kl_sum(log_q: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Σ over a chunk's tokens of the KL between the parent's stored top-k and the student (`log_q`: its log-softmax,
    (chunk, vocab)) seen through the k + 1 outcomes (`stored_kl`)."""
    p, rest, log_q_rest = _coarsened(log_q, ids, logprobs)
    kept = (p * (logprobs.to(log_q.dtype) - log_q.gather(-1, ids))).sum()
    return kept + torch.where(rest > 0, rest * (rest.log() - log_q_rest), 0.0).sum()


def stored_kl_gradient(log_q: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """The gradient of `stored_kl_sum` with respect to the chunk's logits, q - p̃ (`stored_kl`), (chunk, vocab)."""
    p, rest, log_q_rest = _coarsened(log_q, ids, logprobs)
    q = log_q.exp()
    # off the k tokens: q - rest * q / q_rest; on them: q - p
    off = torch.where(rest > 0, rest * torch.exp(-log_q_rest), 0.0)
    return (q * (1 - off.unsqueeze(-1))).scatter_(-1, ids, q.gather(-1, ids) - p)


def _coarsened(log_q: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor):
    """(the parent's probabilities of its k tokens, its mass off them, log of the student's mass off them)."""
    p = logprobs.to(log_q.dtype).exp()
    log_q_rest = log_q.scatter(-1, ids, -math.inf).logsumexp(-1)  # not 1 - Σ q: no cancellation when it is small
    # no other token when k is the vocabulary (-inf), whatever float noise leaves of 1 - Σ p
    rest = torch.where(log_q_rest > -math.inf, (1 - p.sum(-1)).clamp_min(0), 0.0)
    return p, rest, log_q_rest


def _chunks(first: torch.Tensor, chunk: int, *others: torch.Tensor):
    """Chunks of `chunk` tokens of `first` and of `others` side by side (each viewed as (tokens, last dim))."""
    tensors = [t.reshape(-1, t.shape[-1]) for t in (first, *others)]  # (tokens, vocab or k), views
    for begin in range(0, tensors[0].shape[0], chunk):
        yield tuple(t[begin : begin + chunk] for t in tensors)


def _dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _tokens(logits: torch.Tensor) -> int:
    return logits.numel() // logits.shape[-1]
