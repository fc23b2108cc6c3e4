"""The distillation loss: the KL to the parent, in chunks, against the definition computed independently."""

from __future__ import annotations

import pytest
import torch

from gqaify.uptrain.distill import distillation_kl


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
