"""Distillation from the parent: the KL between its next-token distribution and the student's, in chunks.

    KL(parent || student) per token = sum_v p_parent(v) * (log p_parent(v) - log p_student(v))

The logits of a batch are tokens x vocabulary: 16 x 1,024 tokens of SmolLM2's 49,152-word vocabulary are 3.2 GB
in float32 per copy. A plain implementation holds, besides both models' logits, a float32 log-softmax of each
and the KL's elementwise product, all kept for the backward pass. Here the tokens are taken `chunk` at a time,
in the forward pass and again in the backward pass, which writes the gradient (T/N)(q - p) directly: nothing
but the logits is kept between them (benchmarks/distill_memory.py measures the difference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gqaify.eval.perplexity import sliding_windows

KL_CHUNK_TOKENS = 1024  # tokens per chunk: 1,024 x 49,152 x 4 bytes = 0.2 GB of float32 per intermediate


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                    chunk: int = KL_CHUNK_TOKENS) -> torch.Tensor:  # fmt: skip
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
        for s, t in _chunks(student, teacher, chunk):
            log_q, log_p = _log_softmaxes(s, t, temperature)  # (chunk, vocab) each
            total += (log_p.exp() * (log_p - log_q)).sum()
        return total / _tokens(student) * temperature**2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        student, teacher = ctx.saved_tensors
        temperature, scale = ctx.temperature, ctx.temperature / _tokens(student)
        out = torch.empty_like(student).reshape(-1, student.shape[-1])  # (tokens, vocab)
        begin = 0
        for s, t in _chunks(student, teacher, ctx.chunk):
            log_q, log_p = _log_softmaxes(s, t, temperature)
            out[begin : begin + len(s)] = ((log_q.exp() - log_p.exp()) * (scale * grad)).to(out.dtype)
            begin += len(s)
        return out.view(student.shape), None, None, None


def _chunks(student: torch.Tensor, teacher: torch.Tensor, chunk: int):
    vocab = student.shape[-1]
    student, teacher = student.reshape(-1, vocab), teacher.reshape(-1, vocab)  # (tokens, vocab), views
    for begin in range(0, student.shape[0], chunk):
        yield student[begin : begin + chunk], teacher[begin : begin + chunk]


def _log_softmaxes(student: torch.Tensor, teacher: torch.Tensor, temperature: float):
    """(log q, log p) of a chunk, in float32 at least."""
    dtype = _dtype(student)
    return (F.log_softmax(student.to(dtype) / temperature, dim=-1),
            F.log_softmax(teacher.to(dtype) / temperature, dim=-1))  # fmt: skip


def _dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _tokens(logits: torch.Tensor) -> int:
    return logits.numel() // logits.shape[-1]


@torch.no_grad()
def kl_to_parent(model, parent, ids: torch.Tensor, seq_len: int) -> float:
    """Mean KL(parent || model) in nats per token over `ids` (1-D) cut into windows of `seq_len` tokens: how far the
    model's next-token distribution is from its parent's on held-out text (0: the parent's own)."""
    total, tokens = 0.0, 0
    for w in sliding_windows(len(ids), seq_len, seq_len):  # perplexity's windows, so both read the same text
        window = ids[w.begin : w.end].unsqueeze(0)
        student = model(input_ids=window.to(model.device), use_cache=False).logits
        teacher = parent(input_ids=window.to(parent.device), use_cache=False).logits.to(student.device)
        total += distillation_kl(student, teacher).item() * window.shape[1]
        tokens += window.shape[1]
    return total / tokens
