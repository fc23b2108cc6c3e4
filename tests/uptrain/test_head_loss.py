"""The fused head and loss (`head_loss`) against the plain loss, which asks transformers for the whole logits, and
against the loss written from its definitions and differentiated by torch's autograd through the unfused model: the
same loss and the same gradient for every parameter and for the last hidden states, whatever the chunk, with a live
teacher, stored top-k, or the LM loss alone, each mixed; a model that changes its logits after the head is trained on
the plain loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gqaify.testing import build_model
from gqaify.uptrain.head_loss import returns_head_output
from gqaify.uptrain.settings import UptrainSettings
from gqaify.uptrain.student import fused, student_loss
from helpers import reference_coarsened_kl, reference_kl


class _Plain:
    """The accelerator `student_loss` is handed outside a launch: one process, no mixed precision."""

    mixed_precision = "no"
    distributed_type = None

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()


def _loss_and_grads(model, teacher, batch, s, loss_of=None):
    """(the loss, the LM loss, the gradient of each parameter that gets one and of the last hidden states) of
    `loss_of(model, teacher, batch, s)`: `student.student_loss` unless another is given."""
    model.zero_grad(set_to_none=True)
    hidden = []
    keep = model.lm_head.register_forward_pre_hook(lambda head, args: hidden.append(args[0]))  # the head's input
    try:
        loss, lm = (loss_of or _student_loss)(model, teacher, batch, s)
    finally:
        keep.remove()
    hidden[-1].retain_grad()  # the last: the probe `fused` may run first feeds the head zeros
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), lm, grads | {"last hidden states": hidden[-1].grad}


def _student_loss(model, teacher, batch, s):
    return student_loss(model, teacher, batch, s, _Plain())


def _defined_loss(model, teacher, batch, s):
    """The loss from its definitions, on the unfused model's whole logits, for torch's autograd to differentiate:
    (1 - w) · the mean cross-entropy of each next token + w · T² · KL(teacher || student) per position, or the KL
    over the k + 1 outcomes of the stored top-k (at T = 1), each in float64 (`helpers`)."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, use_cache=False).logits  # (batch, seq, vocab)
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    if s.distill_weight == 0:
        return lm, lm.detach()
    if s.distill_from_data:
        kl = reference_coarsened_kl(logits, batch["top_ids"], batch["top_logprobs"])
    else:
        with torch.no_grad():
            parent = teacher(input_ids=ids, use_cache=False).logits
        kl = reference_kl(logits, parent, s.temperature)
    return (1 - s.distill_weight) * lm + s.distill_weight * kl, lm.detach()


def _settings(**changes) -> UptrainSettings:
    return dataclasses.replace(UptrainSettings(), **changes)


def _models(tie: bool):
    student = build_model("llama", num_kv_heads=1, seed=0, tie_word_embeddings=tie).train()
    teacher = build_model("llama", num_kv_heads=2, seed=1, tie_word_embeddings=tie).requires_grad_(False)
    return student, teacher


@pytest.mark.parametrize("chunk", [5, 1024])
@pytest.mark.parametrize(
    "case",
    [
        {"distill_weight": 0.5, "temperature": 2.0},
        {"distill_weight": 0.5, "temperature": 1.0},
        {"distill_weight": 1.0, "temperature": 1.0},
        {"distill_weight": 0.0},
        {"distill_weight": 0.3, "distill_from_data": True},
    ],
    ids=["mixed-T2", "mixed-T1", "kl-only", "lm-only", "stored-top-k"],
)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_the_fused_loss_and_its_gradients_equal_the_plain_ones_and_autograds(case, chunk, tie, monkeypatch):
    """The fused loss, its LM loss and the gradients of every parameter (the head's weight among them) and of the last
    hidden states equal those of the plain loss (`student_loss` on whole logits) and those torch's autograd takes
    through the unfused model of the loss written from its definitions (`_defined_loss`)."""
    from gqaify.uptrain import head_loss

    student, teacher = _models(tie)
    vocab = student.config.vocab_size
    monkeypatch.setattr(head_loss, "HEAD_CHUNK_ELEMENTS", {"cpu": chunk * vocab})
    torch.manual_seed(2)
    ids = torch.randint(0, vocab, (3, 7))
    batch = {"input_ids": ids}
    if case.get("distill_from_data"):
        with torch.no_grad():
            top = torch.log_softmax(teacher(input_ids=ids).logits, -1).topk(6, dim=-1)
        batch |= {"top_ids": top.indices, "top_logprobs": top.values}
        teacher = None
    plain_s, fused_s = _settings(**case, fused_loss=False), _settings(**case, fused_loss=True)
    assert fused(student, teacher, fused_s, _Plain()) and not fused(student, teacher, plain_s, _Plain())
    fused_loss_, fused_lm, fused_grads = _loss_and_grads(student, teacher, batch, fused_s)
    head = next(n for n, p in student.named_parameters() if p is student.get_output_embeddings().weight)
    for loss_of in (_student_loss, _defined_loss):
        loss, lm, grads = _loss_and_grads(student, teacher, batch, plain_s, loss_of)
        torch.testing.assert_close(fused_loss_, loss.float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused_lm, lm, rtol=1e-5, atol=1e-6)
        assert fused_grads.keys() == grads.keys() and {head, "last hidden states"} <= grads.keys()
        for name, grad in grads.items():
            message = f"{loss_of.__name__}: {name}"
            torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=message)


def test_a_frozen_head_gets_no_gradient_and_the_rest_the_plain_ones():
    """trainable attention leaves the head frozen: the fused loss makes no gradient for it, the same for the rest."""
    student, teacher = _models(tie=False)
    student.lm_head.weight.requires_grad_(False)
    batch = {"input_ids": torch.randint(0, student.config.vocab_size, (2, 5))}
    case = {"distill_weight": 0.5}
    _, _, grads = _loss_and_grads(student, teacher, batch, _settings(**case, fused_loss=False))
    _, _, fused_grads = _loss_and_grads(student, teacher, batch, _settings(**case, fused_loss=True))
    assert "lm_head.weight" not in fused_grads and fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_model_that_changes_its_logits_after_the_head_trains_on_the_plain_loss():
    """Gemma 2 soft-caps its logits after the head: fusing the head there would train on other logits, so the probe
    says no and the step is the plain one; a Llama's head output is its logits."""
    capped = build_model("gemma2", num_kv_heads=1, final_logit_softcapping=3.0)
    assert not returns_head_output(capped)
    assert returns_head_output(build_model("llama", num_kv_heads=1))
    assert not fused(capped, None, _settings(fused_loss=True), _Plain())
