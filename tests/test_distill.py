"""The distillation loss: the KL to the parent, in chunks, and from stored top-k log-probabilities, against the
definitions computed independently."""

from __future__ import annotations

import pytest
import torch

from gqaify.uptrain.distill import distillation_kl, hidden_state_error, stored_kl


def reference_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) per token times T², from the definition: sum_v p (log p - log q), in float64."""
    p = torch.softmax(teacher.double() / temperature, -1)
    q = torch.softmax(student.double() / temperature, -1)
    return (p * (p.log() - q.log())).sum(-1).mean() * temperature**2


@pytest.mark.parametrize("chunk", [1, 7, 40, 4096])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_chunked_kl_and_its_gradient_equal_the_full_kl(chunk, temperature):
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(4, 10, 33, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(4, 10, 33, generator=generator, dtype=torch.float64)
    reference = reference_kl(student, teacher, temperature)
    (expected_grad,) = torch.autograd.grad(reference, student)
    chunked = distillation_kl(student, teacher, temperature, chunk=chunk)
    (grad,) = torch.autograd.grad(chunked, student)
    assert chunked.item() == pytest.approx(reference.item(), abs=1e-6, rel=1e-9)
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=1e-9)


def test_kl_of_a_distribution_with_itself_is_zero_and_positive_otherwise():
    logits = torch.randn(3, 5, 17)
    assert distillation_kl(logits, logits).item() == pytest.approx(0, abs=1e-6)
    assert distillation_kl(torch.randn(3, 5, 17), logits).item() > 0.01


def reference_coarsened_kl(student: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL between the parent and student distributions over k + 1 outcomes (each stored token, and all others
    together), built outcome by outcome in float64 from the definition."""
    q = torch.softmax(student.double(), -1)
    q_kept = q.gather(-1, ids)
    p_kept = logprobs.double().exp()
    p = torch.cat([p_kept, (1 - p_kept.sum(-1, keepdim=True)).clamp_min(0)], -1)
    q = torch.cat([q_kept, 1 - q_kept.sum(-1, keepdim=True)], -1)
    return torch.special.xlogy(p, p).sub(torch.special.xlogy(p, q)).sum(-1).mean()


def teacher_top(teacher: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs, ids = torch.log_softmax(teacher.double(), -1).topk(k, dim=-1)
    return ids, logprobs


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_stored_kl_with_the_whole_vocabulary_equals_the_full_kl(chunk):
    generator = torch.Generator().manual_seed(1)
    student = torch.randn(3, 8, 29, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 8, 29, generator=generator, dtype=torch.float64)
    ids, logprobs = teacher_top(teacher, 29)
    reference = reference_kl(student, teacher, 1.0)
    (expected_grad,) = torch.autograd.grad(reference, student)
    stored = stored_kl(student, ids, logprobs, chunk=chunk)
    (grad,) = torch.autograd.grad(stored, student)
    assert stored.item() == pytest.approx(reference.item(), abs=1e-6)
    torch.testing.assert_close(grad, expected_grad, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("k", [1, 4, 28])
def test_stored_kl_of_the_top_k_and_its_gradient_equal_the_coarsened_kl(k):
    generator = torch.Generator().manual_seed(2)
    student = torch.randn(2, 9, 29, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = 3 * torch.randn(2, 9, 29, generator=generator, dtype=torch.float64)
    ids, logprobs = teacher_top(teacher, k)
    reference = reference_coarsened_kl(student, ids, logprobs)
    (expected_grad,) = torch.autograd.grad(reference, student)
    stored = stored_kl(student, ids, logprobs, chunk=5)
    (grad,) = torch.autograd.grad(stored, student)
    assert stored.item() == pytest.approx(reference.item(), abs=1e-9)
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=1e-9)
    full = reference_kl(student, teacher, 1.0).item()
    assert 0 < stored.item() <= full + 1e-12  # never more than the full KL; equal when one token is left out
    assert (stored.item() < full - 1e-3) == (k < 28)


def test_hidden_state_error_is_each_layers_relative_error_averaged():
    """mean over layers of ‖h − h*‖² / ‖h*‖², the embeddings (first) left out, no gradient to the teacher."""
    generator = torch.Generator().manual_seed(3)
    teacher = tuple(torch.randn(2, 5, 8, generator=generator, dtype=torch.float64) for _ in range(4))
    student = tuple((t + 0.1 * (i + 1) * torch.randn(2, 5, 8, generator=generator, dtype=torch.float64))
                    .requires_grad_() for i, t in enumerate(teacher))  # fmt: skip
    pairs = zip(student[1:], teacher[1:], strict=True)
    expected = sum(((s - t) ** 2).sum().item() / (t**2).sum().item() for s, t in pairs) / 3
    error = hidden_state_error(student, teacher)
    assert error.item() == pytest.approx(expected, rel=1e-6)
    error.backward()
    assert student[0].grad is None and all(s.grad.abs().sum() > 0 for s in student[1:])
    assert hidden_state_error(teacher, teacher).item() == 0


def test_the_training_loss_adds_the_weighted_hidden_state_error(tiny):
    """uptrain's loss with hidden_weight: (1 - w) LM + w KL + hidden_weight x the layers' error, each term
    computed here from the two models' outputs."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from gqaify.uptrain.settings import UptrainSettings
    from gqaify.uptrain.train import _loss

    model = AutoModelForCausalLM.from_pretrained(tiny["converted"])
    teacher = AutoModelForCausalLM.from_pretrained(tiny["parent"])
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(4))
    settings = UptrainSettings(model="m", data="d", output_dir="o", max_tokens=1, distill_from="p",
                               distill_weight=0.25, hidden_weight=2.0)  # fmt: skip
    loss, lm = _loss(model, teacher, {"input_ids": ids}, settings, Accelerator(cpu=True))
    student = model(input_ids=ids, labels=ids, output_hidden_states=True)
    with torch.no_grad():
        parent = teacher(input_ids=ids, output_hidden_states=True)
    pairs = zip(student.hidden_states[1:], parent.hidden_states[1:], strict=True)
    layers = [((s - t) ** 2).sum() / (t**2).sum() for s, t in pairs]
    kl = reference_kl(student.logits, parent.logits, 1.0)
    expected = 0.75 * student.loss + 0.25 * kl + 2 * sum(layers) / len(layers)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5) and lm.item() == pytest.approx(student.loss.item())
    assert sum(layers).item() > 0  # the conversion changed what the layers compute
