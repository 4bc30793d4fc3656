"""Target log-probs computed chunk by chunk (``core.logprobs``): the chunk shrinks with the
vocabulary so one chunk's logits stay within a byte budget, and the chunking never changes a
value or a gradient (against one float64 log-softmax over all positions)."""

from __future__ import annotations

import pytest
import torch

from hosted_tinker.core.logprobs import LOGITS_CHUNK_BYTES, chunk_tokens_for, target_logprobs

pytestmark = pytest.mark.fast


def test_chunks_hold_a_bounded_number_of_logit_bytes():
    assert chunk_tokens_for(512) == 2048  # a small vocabulary: the most positions
    assert chunk_tokens_for(151_936) == 441  # Qwen3's: 441 x 151,936 float32 logits = 256 MiB
    assert 441 * 151_936 * 4 <= LOGITS_CHUNK_BYTES < 442 * 151_936 * 4
    assert chunk_tokens_for(10**9) == 64  # never fewer positions than that


@pytest.mark.parametrize("chunk", [1, 7, 64, 2048])
def test_any_chunking_gives_the_float64_values_and_gradients(chunk: int):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(150, 16, requires_grad=True)
    targets = torch.randint(0, 50, (150, 2))
    got = target_logprobs(head, hidden, targets, chunk)
    (got * torch.linspace(-1, 1, 300).reshape(150, 2)).sum().backward()

    h64 = hidden.detach().double().requires_grad_(True)
    w64 = head.weight.detach().double().requires_grad_(True)
    want = torch.log_softmax(h64 @ w64.T, dim=-1).gather(-1, targets)
    (want * torch.linspace(-1, 1, 300, dtype=torch.float64).reshape(150, 2)).sum().backward()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(head.weight.grad.double(), w64.grad, atol=1e-5, rtol=0)


def test_the_log_probs_of_a_chunk_see_that_chunks_logits_only():
    """The seam tensor-parallel ranks use (``from_logits``: megatron's vocab-parallel log-probs):
    it is given one chunk's logits at a time, forward and in the backward pass's recomputation."""
    from hosted_tinker.core.logprobs import full_vocab_logprobs

    rows: list[int] = []

    def from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows.append(logits.shape[0])
        return full_vocab_logprobs(logits, targets)

    torch.manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(150, 16, requires_grad=True)
    targets = torch.randint(0, 50, (150, 1))
    target_logprobs(head, hidden, targets, 64, from_logits).sum().backward()
    assert rows == [64, 64, 22] + [22, 64, 64]  # three chunks, then each again, last first
    torch.testing.assert_close(
        target_logprobs(head, hidden, targets, 64, from_logits), target_logprobs(head, hidden, targets, 150)
    )
