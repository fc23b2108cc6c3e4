"""The output head and the loss fused: the logits made a chunk of tokens at a time, never the whole batch.

A step that asks transformers for the logits holds batch x sequence x vocabulary floats per model: 16 x 1,024
tokens of SmolLM2's 49,152-word vocabulary are 3.2 GB in float32 for the student and again for the teacher, and
the softmaxes, the loss's intermediates and the logits' gradient as much again. Here the models return their last
hidden states (hidden-size wide, 85x narrower for SmolLM2) and the head is applied `chunk` tokens at a time: each
chunk's logits, the student's and the teacher's, give that chunk's loss and, at once, the loss's gradient with
respect to the hidden states and the head's weight (as Liger-Kernel's fused linear cross-entropy does). Nothing
vocabulary-wide outlives its chunk, and the backward pass only scales the gradients already made.

The loss is the one `student.student_loss` trains on, term for term:

    (1 - w) · LM loss + w · T² · KL(softmax(teacher / T) || softmax(student / T))

the LM loss transformers' (the mean cross-entropy of each next token), the KL averaged over every position
(`distill.distillation_kl`), or over the k + 1 outcomes of the parent's stored top-k (`distill.stored_kl`).

A model's head is fused only where the model returns its head's output as its logits untouched
(`returns_head_output`): a model that scales or soft-caps its logits after the head trains on the plain loss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gqaify.uptrain.distill import stored_kl_gradient, stored_kl_sum

# Vocabulary-wide values per chunk, by device type: a chunk is this many over the vocabulary's size in tokens. On a
# CPU 2^24 (64 MiB of float32 per intermediate: 341 tokens of SmolLM2's 49,152-word vocabulary), which keeps a
# chunk's few intermediates well below the activations; on a GPU 4x more, so that each chunk's matrix products are
# large enough to keep it busy (a chunk's kernels are launched one by one).
HEAD_CHUNK_ELEMENTS = {"cpu": 2**24, "cuda": 2**26}
IGNORE = -100  # transformers' label for a position the LM loss leaves out


@dataclass(frozen=True)
class Teacher:
    """What the KL compares the student with, per position: the teacher's last hidden states and its head's
    weight (`live`), or the parent's stored top-k ids and log-probabilities (`stored`)."""

    hidden: torch.Tensor | None = None  # (tokens, hidden)
    weight: torch.Tensor | None = None  # (vocab, hidden)
    top_ids: torch.Tensor | None = None  # (tokens, k)
    top_logprobs: torch.Tensor | None = None  # (tokens, k)


def returns_head_output(model) -> bool:
    """Whether `model` (a transformers causal LM) returns its output head's result as its logits, untouched: its head
    a plain `nn.Linear` without bias, and its forward pass, its decoder stood in for by one of two zero hidden
    states, handing back the very tensor the head made. A model that scales or soft-caps its logits after the head
    (Gemma 2's softcapping, Cohere's logit scale) makes a new tensor, and is trained on the plain loss. It compares
    objects, not values, and runs no decoder layer: the memory plan asks it of models on the meta device too."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # inside peft's wrapper
    decoder = getattr(causal_lm, "base_model", causal_lm)
    if type(head) is not torch.nn.Linear or head.bias is not None or decoder is causal_lm:
        return False
    hidden = torch.zeros((1, 2, head.in_features), dtype=head.weight.dtype, device=head.weight.device)
    made = []
    handle = head.register_forward_hook(lambda module, args, output: made.append(output))
    decoder.forward = lambda *args, **kwargs: _DecoderOutput(hidden)
    try:
        with torch.no_grad():
            ids = torch.zeros((1, 2), dtype=torch.long, device=head.weight.device)
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        handle.remove()
        del decoder.forward
    return len(made) == 1 and logits is made[0]


class _DecoderOutput:
    """What `returns_head_output`'s stand-in decoder returns: the hidden states, and None for any other output the
    model reads (a mixture of experts' router logits, the cache)."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name: str):
        return None

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]


@contextlib.contextmanager
def head_skipped(model):
    """Within the block, `model`'s output head hands back its input: the model's "logits" are its last hidden
    states. (Set on the instance, so that a wrapper's forward, DDP's, runs as it always does.)"""
    head = model.get_output_embeddings()
    head.forward = _identity
    try:
        yield head
    finally:
        del head.forward


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def fused_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    teacher: Teacher | None,
    distill_weight: float,
    temperature: float = 1.0,
    compute_dtype: torch.dtype | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to train on, the LM loss alone, detached), from the student's last hidden states and head weight.

    Args:
        hidden: (..., hidden) the student's last hidden states, carrying gradients.
        weight: (vocab, hidden) its head's weight (gradients where it trains).
        labels: (...) each position's next token, `IGNORE` where there is none (the LM loss leaves it out).
        teacher: the parent, live or stored; None: the LM loss alone.
        distill_weight: w, the KL's share of the loss (0 without a teacher).
        compute_dtype: the dtype the head's matrix products run in (mixed precision's); None: the weight's.
        chunk: tokens per chunk (the result does not depend on it, only the memory does); None: `chunk_tokens`.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk or chunk_tokens(weight.shape[0], weight.device)
    return _FusedHeadLoss.apply(
        flat, weight, labels.reshape(-1), teacher, distill_weight, temperature, compute_dtype, chunk
    )


def chunk_tokens(vocab: int, device: torch.device) -> int:
    """Tokens per chunk for a vocabulary of `vocab` on `device` (`HEAD_CHUNK_ELEMENTS`)."""
    elements = HEAD_CHUNK_ELEMENTS.get(device.type, HEAD_CHUNK_ELEMENTS["cpu"])
    return max(1, elements // vocab)


class _FusedHeadLoss(torch.autograd.Function):
    """`fused_loss` and its gradients, made in the forward pass chunk by chunk; the backward pass scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher, w, temperature, compute_dtype, chunk):
        dtype = compute_dtype or weight.dtype
        weight_c = weight.detach().to(dtype)
        live = teacher is not None and teacher.hidden is not None
        teacher_weight = teacher.weight.detach().to(dtype) if live else None
        kl_on = teacher is not None and w > 0
        lm_tokens = (labels != IGNORE).sum().clamp_min(1)  # a tensor: no host sync (and none on fake tensors)
        lm_scale, kl_scale = (1 - w) / lm_tokens, w * temperature / len(hidden)  # d loss / d logits, per term
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if not ctx.needs_input_grad[1]:
            grad_weight = None
        sums = torch.zeros(2, dtype=torch.float32, device=hidden.device)  # (Σ cross-entropy, Σ KL)
        for begin in range(0, len(hidden), chunk):
            rows = slice(begin, begin + chunk)
            h = hidden[rows].detach().to(dtype)
            grad = _chunk_gradient(h, weight_c, labels[rows], teacher if kl_on else None, rows, teacher_weight,
                                   temperature, lm_scale if w < 1 else None, kl_scale, sums).to(dtype)  # fmt: skip
            if grad_hidden is not None:
                grad_hidden[rows] = (grad @ weight_c).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad.T @ h).float()
            del grad
        ctx.save_for_backward(grad_hidden, grad_weight)
        lm = sums[0] / lm_tokens
        kl = sums[1] / len(hidden) * (temperature**2 if live else 1.0)  # stored top-k: at temperature 1
        loss = (1 - w) * lm + w * kl if kl_on else lm.clone()
        ctx.mark_non_differentiable(lm)
        return loss, lm

    @staticmethod
    def backward(ctx, grad_loss, grad_lm):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype),
            None if grad_weight is None else grad_weight * grad_loss,
            *([None] * 6),
        )


def _chunk_gradient(h, weight, labels, teacher, rows, teacher_weight, temperature, lm_scale, kl_scale, sums):
    """One chunk's losses added to `sums` (Σ cross-entropy, Σ KL), and their gradient with respect to its logits:
    lm_scale (q - one-hot) + kl_scale (q_T - p_T) (None: a term that is not trained on). Each step works in place
    where it can, so that at most four vocabulary-wide tensors live at once (a temperature other than 1, a fifth)."""
    log_q = F.linear(h, weight).float()  # the logits, made the log-softmax in place
    log_q_t = log_q / temperature if teacher is not None and teacher.hidden is not None and temperature != 1 else None
    log_q = log_q.sub_(log_q.logsumexp(-1, keepdim=True))
    kept = labels != IGNORE
    target = labels.clamp_min(0).unsqueeze(-1)
    sums[0] -= (log_q.gather(-1, target).squeeze(-1) * kept).sum()
    if teacher is not None and teacher.hidden is None:  # the stored top-k: its own, less frequent, path
        grad = _lm_gradient(log_q, target, kept, lm_scale)
        _stored_chunk(log_q, teacher, rows, kl_scale / temperature, grad, sums)
        return grad
    if teacher is None:
        return _lm_gradient(log_q, target, kept, lm_scale)
    log_p = F.linear(teacher.hidden[rows].to(teacher_weight.dtype), teacher_weight).float()
    if temperature != 1:
        log_p.div_(temperature)
        log_q_t = log_q_t.sub_(log_q_t.logsumexp(-1, keepdim=True))
    log_p = log_p.sub_(log_p.logsumexp(-1, keepdim=True))
    p = log_p.exp()
    student = log_q if log_q_t is None else log_q_t
    sums[1] += torch.dot(p.flatten(), log_p.sub_(student).flatten())  # Σ p (log p - log q): no product kept
    del log_p
    if log_q_t is None and lm_scale is not None:  # T = 1: one softmax serves both terms
        grad = log_q.exp_().mul_((lm_scale * kept).unsqueeze(-1) + kl_scale)  # a position without a label: KL only
        grad.add_(p.mul_(-kl_scale))
        grad.scatter_add_(-1, target, (-lm_scale * kept).unsqueeze(-1).to(grad.dtype))
        return grad
    grad = student.exp().sub_(p).mul_(kl_scale)  # T (q_T - p_T) / N, the scale's T included
    if lm_scale is not None:
        grad.add_(_lm_gradient(log_q, target, kept, lm_scale))
    return grad


def _lm_gradient(log_q: torch.Tensor, target: torch.Tensor, kept: torch.Tensor, scale) -> torch.Tensor:
    """The cross-entropy's gradient with respect to the logits, times `scale`: softmax - one-hot where a label is, 0
    where it is `IGNORE` (all 0 where `scale` is None: the LM loss is only reported)."""
    if scale is None:
        return torch.zeros_like(log_q)
    grad = log_q.exp()
    grad.scatter_add_(-1, target, -torch.ones_like(target, dtype=grad.dtype))
    return grad.mul_((kept * scale).unsqueeze(-1))


def _stored_chunk(log_q, teacher: Teacher, rows, scale, grad, sums) -> None:
    """The chunk's KL to the parent's stored top-k added to sums[1], its gradient q - p̃ (times `scale`) to `grad`
    (`distill.stored_kl`'s, whose stored log-probabilities are at temperature 1)."""
    ids, logprobs = teacher.top_ids[rows], teacher.top_logprobs[rows]
    sums[1] += stored_kl_sum(log_q, ids, logprobs)
    grad += stored_kl_gradient(log_q, ids, logprobs).mul_(scale)
