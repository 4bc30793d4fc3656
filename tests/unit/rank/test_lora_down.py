"""``rank.lora_products.lora_down``, the first half of every LoRA update: the values and gradients of
``F.linear(x.to(A.dtype), A)``, float32 master weights over a bfloat16 model, but keeping the
input for the backward pass in its own dtype rather than its float32 copy; and ``add_into``, the
last step: ``(base + update).to(base.dtype)`` bit for bit, as one operation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hosted_tinker.rank.lora_products import add_into, lora_down

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_into_is_the_sum_rounded_once_with_its_gradients(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = (torch.randn(2, 40, 96) * 50).to(dtype).requires_grad_(True)
    update = (torch.randn(2, 40, 96) * 3).requires_grad_(True)
    with torch.no_grad():  # values a cast meets at its edges
        base[0, 0, :3] = torch.tensor([float("inf"), 0.0, -0.0])
        update[0, 0, 3:6] = torch.tensor([1e-30, 65504.0, float("nan")])
    grad = (torch.randn(2, 40, 96) * 7).to(dtype)

    got = add_into(base, update)
    (gb, gu) = torch.autograd.grad(got, (base, update), grad)
    b2, u2 = base.detach().clone().requires_grad_(True), update.detach().clone().requires_grad_(True)
    want = (b2 + u2).to(dtype)
    (wb, wu) = torch.autograd.grad(want, (b2, u2), grad)
    assert got.dtype == gb.dtype == dtype and gu.dtype == torch.float32
    for g, w in ((got, want), (gb, wb), (gu, wu)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
