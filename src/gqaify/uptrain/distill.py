"""Distillation from the parent: the KL between its next-token distribution and the student's, in chunks.

    KL(parent || student) per token = sum_v p_parent(v) * (log p_parent(v) - log p_student(v))

The logits of a batch are tokens x vocabulary: 16 x 1,024 tokens of SmolLM2's 49,152-word vocabulary are 3.2 GB
in float32 per copy. A plain implementation holds, besides both models' logits, a float32 log-softmax of each
and the KL's elementwise product, all kept for the backward pass. Here the tokens are taken `chunk` at a time
and each chunk's loss is checkpointed: only the logits themselves are kept, and one chunk's float32
intermediates are recomputed in the backward pass (benchmarks/distill_memory.py measures the difference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

KL_CHUNK_TOKENS = 1024  # tokens per chunk: 1,024 x 49,152 x 4 bytes = 0.2 GB of float32 per intermediate


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                    chunk: int = KL_CHUNK_TOKENS) -> torch.Tensor:  # fmt: skip
    """KL(teacher || student) per token, averaged over tokens, of the temperature-softened next-token
    distributions, times temperature² (Hinton et al.) so its gradients keep their scale as T changes.

    Args:
        student_logits, teacher_logits: (..., vocab), the same shape; only the student's carry gradients.
        chunk: tokens per chunk (the result does not depend on it, only the memory does).
    """
    vocab = student_logits.shape[-1]
    student = student_logits.reshape(-1, vocab)  # (tokens, vocab), a view
    teacher = teacher_logits.reshape(-1, vocab)
    tokens = student.shape[0]
    total = student.new_zeros((), dtype=torch.float32)
    for begin in range(0, tokens, chunk):
        part = (student[begin : begin + chunk], teacher[begin : begin + chunk], temperature)
        if torch.is_grad_enabled() and student.requires_grad:
            total = total + checkpoint(_kl_sum, *part, use_reentrant=False)
        else:
            total = total + _kl_sum(*part)
    return total / tokens * temperature**2


def _kl_sum(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """The summed KL(teacher || student) of a chunk of rows (tokens, vocab), computed in float32 at least."""
    dtype = torch.promote_types(student.dtype, torch.float32)
    student = F.log_softmax(student.to(dtype) / temperature, dim=-1)
    teacher = F.log_softmax(teacher.to(dtype) / temperature, dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="sum")


@torch.no_grad()
def kl_to_parent(model, parent, ids: torch.Tensor, seq_len: int) -> float:
    """Mean KL(parent || model) in nats per token over `ids` (1-D) cut into windows of `seq_len` tokens: how far the
    model's next-token distribution is from its parent's on held-out text (0: the parent's own)."""
    total, tokens = 0.0, 0
    for begin in range(0, len(ids) - 1, seq_len):
        window = ids[begin : begin + seq_len].unsqueeze(0)
        if window.shape[1] < 2:
            break
        student = model(input_ids=window.to(model.device), use_cache=False).logits
        teacher = parent(input_ids=window.to(parent.device), use_cache=False).logits.to(student.device)
        total += distillation_kl(student, teacher).item() * window.shape[1]
        tokens += window.shape[1]
    return total / tokens
