"""The distillation loss: the KL to the parent, in chunks, and from stored top-k log-probabilities, against the
definitions computed independently."""

from __future__ import annotations

import pytest
import torch

from gqaify.eval.perplexity import kl_sums
from gqaify.uptrain.distill import distillation_kl, stored_kl
from helpers import reference_coarsened_kl, reference_kl


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


@pytest.mark.parametrize("chunk", [5, 7, 40, 1000])  # 40 tokens: chunks that divide them, that do not, one, wider
@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
def test_the_one_chunked_kl_equals_kl_div_over_all_tokens_at_once(chunk, temperature):
    """eval's KL to the parent and the distillation loss's value both come from `kl_sums`: its chunks add up to
    torch's kl_div over every token in one piece, and there is one sum per chunk of `chunk` tokens."""
    generator = torch.Generator().manual_seed(2)
    student = torch.randn(4, 10, 33, generator=generator, dtype=torch.float64)
    parent = torch.randn(4, 10, 33, generator=generator, dtype=torch.float64)
    expected = torch.nn.functional.kl_div(
        torch.log_softmax(student / temperature, -1),
        torch.log_softmax(parent / temperature, -1),
        log_target=True,
        reduction="sum",
    )
    sums = list(kl_sums(student, parent, temperature, chunk))
    assert len(sums) == -(-40 // chunk)
    assert sum(s.item() for s in sums) == pytest.approx(expected.item(), rel=1e-12)
    loss = distillation_kl(student, parent, temperature, chunk=chunk)
    assert loss.item() == pytest.approx(expected.item() / 40 * temperature**2, rel=1e-12)


def test_kl_of_a_distribution_with_itself_is_zero_and_positive_otherwise():
    logits = torch.randn(3, 5, 17)
    assert distillation_kl(logits, logits).item() == pytest.approx(0, abs=1e-6)
    assert distillation_kl(torch.randn(3, 5, 17), logits).item() > 0.01


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
