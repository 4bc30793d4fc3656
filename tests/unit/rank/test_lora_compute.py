"""The unit tests of what tests/e2e/test_lora_compute.py tests end to end (no server here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hosted_tinker.core.types import LoraSpec
from hosted_tinker.rank.adapters import Adapter, Lora, LoraAdapters
from hosted_tinker.rank.serve import local_rank
from tests.support.batches import random_batch
from tests.support.megatron import ADAM

pytestmark = pytest.mark.fast

IN, OUT, R, ALPHA = 64, 48, 8, 16.0


class Tree(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def peft_layer(base: Tree, a: torch.Tensor, b: torch.Tensor) -> nn.Module:
    """PEFT's LoRA on a copy of ``base``'s layer, with float32 ``a`` and ``b``."""
    from peft import LoraConfig, get_peft_model

    twin = Tree(base.proj.weight.dtype)
    twin.load_state_dict(base.state_dict())
    peft = get_peft_model(twin, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["proj"], lora_dropout=0.0))
    layer = peft.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.data = a.clone()
        layer.lora_B["default"].weight.data = b.clone()
    return peft


def run(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, params: list[torch.Tensor], autocast: bool):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=x.dtype, enabled=autocast):
        y = model(x)
    y.backward(grad)
    return [y.detach(), x.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("compute", ["float32", "base"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_layer_computes_as_peft_does(compute: str, dtype: torch.dtype) -> None:
    """``float32`` is PEFT's layer as it stands, ``base`` PEFT's under autocast to the base's
    dtype: the output, the input's gradient and the adapter's, to the bit."""
    torch.manual_seed(0)
    base = Tree(dtype)
    a, b = torch.randn(R, IN) * 0.1, torch.randn(OUT, R) * 0.1
    x, grad = torch.randn(2, 20, IN).to(dtype), torch.randn(2, 20, OUT).to(dtype)

    ours = LoraAdapters(base, compute)
    lora = Lora(nn.Parameter(a.clone()), nn.Parameter(b.clone()))
    ours.routes.everything(ours.add(Adapter({"proj": lora}, ALPHA / R)))
    got = run(base, x, grad, [lora.A, lora.B], autocast=False)

    peft = peft_layer(Tree(dtype), a, b)
    peft.base_model.model.proj.base_layer.load_state_dict(base.proj.state_dict())
    theirs = peft.base_model.model.proj
    params = [theirs.lora_A["default"].weight, theirs.lora_B["default"].weight]
    want = run(peft, x, grad, params, autocast=compute == "base" and dtype != torch.float32)

    assert got[0].dtype == dtype and got[2].dtype == got[3].dtype == torch.float32
    for name, g, w in zip(("output", "input grad", "A grad", "B grad"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)


def test_a_bad_compute_is_refused() -> None:
    with pytest.raises(ValueError, match="lora compute 'half'"):
        LoraAdapters(Tree(torch.float32), "half")


def test_a_bfloat16_trainer_under_base_compute(tiny_model_dir: Path) -> None:
    """A step under ``base`` lands near the float32 products' (bf16's rounding apart), keeps
    float32 weights and moments, and the rank's sampler computes its LoRA as training does."""
    results = {}
    for compute in ("float32", "base"):
        rank = local_rank(str(tiny_model_dir), dtype="bfloat16", lora_compute=compute)
        assert rank.trainer.model.adapters.compute == rank.sampler.adapters.compute == compute
        trainer = rank.trainer
        trainer.create_adapter("m", LoraSpec(rank=8, seed=3, train_unembed=True))
        out = []
        for seed in (1, 2):  # the second step runs with B off zero: every product counts
            result = trainer.forward_backward("m", random_batch(np.random.default_rng(seed), 3, "cross_entropy"))
            out.append((result.loss_sum, trainer.optim_step("m", ADAM)["grad_norm"]))
        state = trainer.export_state("m")
        assert {t.dtype for t in [*state.weights.values(), *state.optimizer.values()]} == {torch.float32}
        results[compute] = out
    for (loss_f, norm_f), (loss_b, norm_b) in zip(results["float32"], results["base"], strict=True):
        assert loss_b == pytest.approx(loss_f, rel=1e-2)
        assert norm_b == pytest.approx(norm_f, rel=5e-2)
