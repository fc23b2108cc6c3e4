"""The output head and the loss fused: the logits made a chunk of tokens at a time, never the whole batch.

A step that asks transformers for the logits holds batch x sequence x vocabulary floats per model: 16 x 1,024
tokens of SmolLM2's 49,152-word vocabulary are 3.2 GB in float32 for the student and again for the teacher, and
the softmaxes, the loss's intermediates and the logits' gradient as much again. Here the models return their last
hidden states (hidden-size wide, 85x narrower for SmolLM2) and the head is applied `chunk` tokens at a time: each
chunk's logits, the student's and the teacher's, give that chunk's loss and, at once, autograd's gradient of it with
respect to the hidden states and the head's weight (as Liger-Kernel's chunked losses do). Nothing vocabulary-wide
outlives its chunk, and the backward pass only scales the gradients already made.

The loss is the one `student.student_loss` trains on, term for term, from the same definitions:

    (1 - w) · LM loss + w · T² · KL(softmax(teacher / T) || softmax(student / T))

the LM loss transformers' (the mean cross-entropy of each next token), the KL averaged over every position
(`kl.kl_sum`), or over the k + 1 outcomes of the parent's stored top-k (`kl.stored_kl_sum`, at temperature 1 and
without the T²).

A model's head is fused only where the model returns its head's output as its logits untouched
(`returns_head_output`): a model that scales or soft-caps its logits after the head trains on the plain loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gqaify.kl import kl_sum, log_probs, stored_kl_sum

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

    def rows(self, rows: slice) -> Teacher:
        """The positions `rows` of each per-position tensor, the weight as it is."""
        picked = (None if t is None else t[rows] for t in (self.hidden, self.top_ids, self.top_logprobs))
        hidden, top_ids, top_logprobs = picked
        return Teacher(hidden, self.weight, top_ids, top_logprobs)


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
    mix = _Mix(
        distill_weight if teacher is not None else 0.0,
        temperature,
        compute_dtype or weight.dtype,
        chunk or chunk_tokens(weight.shape[0], weight.device),
    )
    return _FusedHeadLoss.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), teacher, mix)


def chunk_tokens(vocab: int, device: torch.device) -> int:
    """Tokens per chunk for a vocabulary of `vocab` on `device` (`HEAD_CHUNK_ELEMENTS`)."""
    elements = HEAD_CHUNK_ELEMENTS.get(device.type, HEAD_CHUNK_ELEMENTS["cpu"])
    return max(1, elements // vocab)


@dataclass(frozen=True)
class _Mix:
    """What `fused_loss` mixes and how it runs."""

    distill_weight: float  # w, the KL's share (0: the LM loss alone, whatever teacher is given)
    temperature: float
    dtype: torch.dtype  # the head's matrix products'
    chunk: int  # tokens per chunk


class _FusedHeadLoss(torch.autograd.Function):
    """`fused_loss` and its gradients, made in the forward pass chunk by chunk; the backward pass scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher: Teacher | None, mix: _Mix):
        w = mix.distill_weight
        teacher = teacher if w > 0 else None
        live = teacher is not None and teacher.hidden is not None
        if live:
            teacher = dataclasses.replace(teacher, weight=teacher.weight.detach().to(mix.dtype))
        lm_tokens = (labels != IGNORE).sum().clamp_min(1)  # a tensor: no host sync (and none on fake tensors)
        kl_scale = (mix.temperature**2 if live else 1.0) / len(hidden)  # stored top-k: at temperature 1
        # d loss / d Σ term, per term (Σ cross-entropy, Σ KL); None: a term that is not trained on
        shares = ((1 - w) / lm_tokens if w < 1 else None, w * kl_scale if teacher is not None else None)
        weight_c = weight.detach().to(mix.dtype).requires_grad_(ctx.needs_input_grad[1])
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_weight = grad_weight if ctx.needs_input_grad[1] else None
        sums = torch.zeros(2, dtype=torch.float32, device=hidden.device)  # (Σ cross-entropy, Σ KL)
        for begin in range(0, len(hidden), mix.chunk):
            rows = slice(begin, begin + mix.chunk)
            h = hidden[rows].detach().to(mix.dtype).requires_grad_(grad_hidden is not None)
            parent = None if teacher is None else teacher.rows(rows)
            terms, (h_grad, w_grad) = _chunk_gradients(h, weight_c, labels[rows], parent, mix.temperature, shares)
            sums += terms
            if h_grad is not None:
                grad_hidden[rows] = h_grad.to(hidden.dtype)
            if w_grad is not None:
                grad_weight += w_grad.float()
            del h_grad, w_grad  # not held while the next chunk's are made (the weight's is the weight's size)
        ctx.save_for_backward(grad_hidden, grad_weight)
        lm = sums[0] / lm_tokens
        loss = (1 - w) * lm + w * kl_scale * sums[1] if teacher is not None else lm.clone()
        ctx.mark_non_differentiable(lm)
        return loss, lm

    @staticmethod
    def backward(ctx, grad_loss, grad_lm):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype),
            None if grad_weight is None else grad_weight * grad_loss,
            None,
            None,
            None,
        )


def _chunk_gradients(h, weight, labels, teacher: Teacher | None, temperature: float, shares: tuple):
    """One chunk's (Σ cross-entropy, Σ KL), detached, and autograd's gradients of the loss it adds, Σ share · term, with
    respect to `h` and `weight` (None for one that does not require it)."""
    leaves = [t for t in (h, weight) if t.requires_grad]
    with torch.enable_grad():
        terms = _chunk_terms(h, weight, labels, teacher, temperature)
        trained = sum(share * term for share, term in zip(shares, terms, strict=True) if share is not None)
        found = iter(torch.autograd.grad(trained, leaves) if leaves else ())
    grads = tuple(next(found) if t.requires_grad else None for t in (h, weight))
    return torch.stack([term.detach() for term in terms]), grads


def _chunk_terms(h, weight, labels, teacher: Teacher | None, temperature: float):
    """(Σ cross-entropy over the positions with a label, Σ KL to the teacher (0 without one)) of one chunk, its logits
    made from its hidden states `h` in their dtype."""
    log_q = log_probs(F.linear(h, weight))  # (chunk, vocab): the LM loss's, the stored top-k's, the KL's at T = 1
    cross_entropy = F.nll_loss(log_q, labels, ignore_index=IGNORE, reduction="sum")
    if teacher is None:
        return cross_entropy, torch.zeros_like(cross_entropy)
    if teacher.hidden is None:
        return cross_entropy, stored_kl_sum(log_q, teacher.top_ids, teacher.top_logprobs)
    log_p = log_probs(F.linear(teacher.hidden.to(teacher.weight.dtype), teacher.weight), temperature)  # (chunk, vocab)
    if temperature != 1:  # log_softmax(log q / T) = log_softmax(logits / T): the logits need not be kept
        log_q = log_probs(log_q, temperature)
    return cross_entropy, kl_sum(log_q, log_p)
