"""``rank.adapters.lora_down``, the first half of every LoRA update: the values and gradients of
``F.linear(x.to(A.dtype), A)``, float32 master weights over a bfloat16 model, but keeping the
input for the backward pass in its own dtype rather than its float32 copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hosted_tinker.rank.adapters import lora_down

pytestmark = pytest.mark.fast


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of ``fn()`` (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stacked", [False, True])
def test_lora_down_is_the_float32_product_with_its_gradients(dtype: torch.dtype, stacked: bool) -> None:
    torch.manual_seed(0)
    shape_x, shape_a = ((3, 40, 64), (3, 8, 64)) if stacked else ((1, 40, 64), (8, 64))
    x = torch.randn(shape_x).to(dtype).requires_grad_(True)
    a = torch.randn(shape_a, requires_grad=True)
    grad = torch.randn((*shape_x[:-1], 8))

    got = lora_down(x, a)
    (gx, ga) = torch.autograd.grad(got, (x, a), grad)
    x2, a2 = x.detach().clone().requires_grad_(True), a.detach().clone().requires_grad_(True)
    want = x2.to(torch.float32) @ a2.transpose(-1, -2) if stacked else F.linear(x2.to(torch.float32), a2)
    (wx, wa) = torch.autograd.grad(want, (x2, a2), grad)
    assert got.dtype == torch.float32 and gx.dtype == dtype and ga.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(gx, wx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ga, wa, rtol=1e-6, atol=1e-5)


def test_a_bfloat16_input_is_kept_in_bfloat16() -> None:
    x = torch.randn(1, 512, 256).to(torch.bfloat16).requires_grad_(True)
    a = torch.randn(8, 256, requires_grad=True)
    kept = saved_bytes(lambda: lora_down(x, a))
    copied = saved_bytes(lambda: F.linear(x.to(torch.float32), a))
    assert kept == x.numel() * 2 + a.numel() * 4  # the input as it came, and A
    assert copied == x.numel() * 4 + a.numel() * 4  # its float32 copy instead
