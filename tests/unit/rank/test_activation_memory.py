"""Recomputing as few decoder layers as a memory budget needs (``activation_memory_gib``):
what a stored layer keeps per token is measured right (against the sum of what its operations
save, derived by hand), the trainer stores as many layers as fit the budget and recomputes the
first of the rest, and every split gives the stored path's results. The tensor-parallel group's
agreement runs in ``test_plans.py`` (megatron's ``CHECKED_LAYOUTS``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hosted_tinker.core.tiny_model import build_tiny_model
from hosted_tinker.rank.activations import SavedBytes, layers_to_store
from hosted_tinker.rank.plans import PlanOptions
from hosted_tinker.rank.plans.single import Options as SingleOptions
from hosted_tinker.rank.serve import local_rank
from hosted_tinker.rank.trainer import Trainer
from tests.support.batches import random_batch
from tests.support.memory import (
    LORA,  # noqa: F401
    stored_bytes_per_token,  # noqa: F401
)

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny-4", num_layers=4)


def test_layers_to_store_fit_the_budget_with_room_for_one_recomputed_layer():
    assert layers_to_store(100, 4, 10.0, budget_bytes=4000) == 4  # all fit: nothing is recomputed
    assert layers_to_store(100, 4, 10.0, budget_bytes=3999) == 2  # 3 fit: 2 stored, 1 being recomputed
    assert layers_to_store(100, 4, 10.0, budget_bytes=2000) == 1
    assert layers_to_store(100, 4, 10.0, budget_bytes=1999) == 0
    assert layers_to_store(100, 4, 10.0, budget_bytes=0) == 0
    assert layers_to_store(0, 4, 10.0, budget_bytes=0) == 4  # no tokens, nothing to keep


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_stored_layer_keeps_what_its_operations_save(tiny_model_dir: Path, dtype: str):
    """A Qwen3 layer of a ``dtype`` base with LoRA on its seven projections keeps per token: the
    two RMSNorms' float32 inputs and their ``dtype`` outputs; q_norm's and k_norm's float32
    inputs; q, k and v expanded to all heads, the attention's output and o_proj's input; the MLP's
    gate, up, SiLU and product; and each LoRA's float32 ``x A`` (rank wide)."""
    c = json.loads((tiny_model_dir / "config.json").read_text())
    e, f, r = torch.finfo(getattr(torch, dtype)).bits // 8, 4, LORA.rank
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    by_hand = 2 * f * h + 2 * e * h + f * (q + kv) + 5 * e * q + 4 * e * i + 7 * f * r
    # the last layer in a long and a short pass; every layer
    figures = stored_bytes_per_token(tiny_model_dir, dtype, "cpu", [(512, 1), (40, 1), (512, 0)])
    # the sum leaves out small things (RMSNorm's per-token scale, RoPE's rotated copy)
    assert figures[0] == pytest.approx(by_hand, rel=0.05), (figures, by_hand)
    assert figures[1] == pytest.approx(figures[0], rel=0.01)  # a figure per token: no constant in it
    assert figures[2] < figures[0]  # the first layer keeps less: its input needs no gradient


def counting_layer_runs(trainer: Trainer) -> tuple[list[int], list]:
    """How often each decoder layer's insides ran (a recomputed layer runs twice a step)."""
    runs = [0] * len(trainer.model.layers)
    hooks = []
    for j, layer in enumerate(trainer.model.layers):
        inside = next(layer.children())  # the layer's own hooks stay outside the checkpoint

        def count(*_, j: int = j) -> None:
            runs[j] += 1

        hooks.append(inside.register_forward_pre_hook(count))
    return runs, hooks


def test_a_budget_stores_as_many_layers_as_fit_and_recomputes_the_first(four_layers: Path):
    trainer = local_rank(str(four_layers)).trainer
    trainer.activation_memory = 1e12  # plenty: but before the measurement only the last is stored
    trainer.create_adapter("m", LORA)
    batch = random_batch(np.random.default_rng(1), 2, lengths=(60, 61))
    tokens = sum(d.num_tokens for d in batch.data)
    runs, hooks = counting_layer_runs(trainer)
    try:
        trainer.forward_backward("m", batch)
        assert runs == [2, 2, 2, 1]  # the first pass measured its last layer
        per_layer = tokens * trainer.layer_bytes_per_token
        assert trainer.layer_bytes_per_token > 0
        for budget, recomputed in [(1e12, 0), (4 * per_layer, 0), (3.5 * per_layer, 2), (2 * per_layer, 3), (0, 4)]:
            trainer.activation_memory = budget
            runs[:] = [0] * 4
            trainer.forward_backward("m", batch)
            assert runs == [2] * recomputed + [1] * (4 - recomputed), budget
    finally:
        for hook in hooks:
            hook.remove()


def test_every_split_gives_the_stored_results(four_layers: Path):
    """Three steps (forward_backward + optim_step) under budgets that recompute 0, 2 and 4 of the
    four layers: the same log-probs, losses and updated weights as storing them all."""
    from hosted_tinker.core.types import AdamParams

    def three_steps(budget: float | None) -> tuple[list, list]:
        trainer = local_rank(str(four_layers)).trainer
        trainer.activation_memory = None if budget is None else 1e12
        trainer.create_adapter("m", LORA)
        # measures, if budgeted: more tokens than any step below, which then keeps the figure
        trainer.forward_backward("m", random_batch(np.random.default_rng(9), 3, lengths=(40, 41)))
        for p in trainer.adapters["m"].handle.params:
            p.grad = None
        if budget is not None:
            trainer.activation_memory = budget * trainer.layer_bytes_per_token * 100
        out = []
        for step in range(3):
            batch = random_batch(np.random.default_rng(step), 3, lengths=(30, 40))
            if budget is not None:
                tokens = sum(d.num_tokens for d in batch.data)
                assert trainer.layers_to_recompute(tokens) == {10.0: 0, 3.5: 2, 0.0: 4}[budget]
            result = trainer.forward_backward("m", batch)
            out.append((result.loss_sum, [lp.copy() for lp in result.logprobs]))
            trainer.optim_step("m", AdamParams(learning_rate=1e-2))
        return out, [p.detach().clone() for p in trainer.adapters["m"].handle.params]

    stored, stored_weights = three_steps(None)
    for layers_fitting in (10.0, 3.5, 0.0):  # ~100 tokens a step: all stored; 2 recomputed; all
        got, weights = three_steps(layers_fitting)
        for (loss, lps), (loss_s, lps_s) in zip(got, stored, strict=True):
            assert loss == pytest.approx(loss_s, rel=1e-6)
            for a, b in zip(lps, lps_s, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        for a, b in zip(weights, stored_weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_larger_micro_batch_measures_again(four_layers: Path):
    trainer = local_rank(str(four_layers)).trainer
    trainer.activation_memory = 1e12
    trainer.create_adapter("m", LORA)
    trainer.forward_backward("m", random_batch(np.random.default_rng(1), 1, lengths=(20, 21)))
    first = trainer.layer_bytes_per_token
    assert first > 0 and trainer._measured_tokens == 20
    trainer.forward_backward("m", random_batch(np.random.default_rng(1), 1, lengths=(10, 11)))
    assert trainer._measured_tokens == 20  # fewer tokens: not measured again
    trainer.forward_backward("m", random_batch(np.random.default_rng(1), 2, lengths=(50, 51)))
    assert trainer._measured_tokens == 100 and trainer.layer_bytes_per_token == pytest.approx(first, rel=0.02)


def test_one_rule_at_a_time_and_auto_needs_a_gpu():
    with pytest.raises(ValueError, match="activation_memory_gib or recompute_above_tokens, not both"):
        PlanOptions(activation_memory_gib=8, recompute_above_tokens=1024)
    for bad in (0, "inf", "nan", "-1", "lots"):
        with pytest.raises(ValueError, match="activation_memory_gib"):
            PlanOptions(activation_memory_gib=bad)
    assert PlanOptions(activation_memory_gib="1.5").activation_memory_gib == 1.5  # as --backend-option gives it
    with pytest.raises(ValueError, match="activation_memory_gib=auto needs GPU ranks"):
        SingleOptions(activation_memory_gib="auto").check(["cpu"], 3600)
    SingleOptions(activation_memory_gib="auto").check(["cuda:0"], 3600)


def test_gpu_ranks_budget_auto_unless_a_rule_is_given():
    """On GPU ranks the default is ``auto`` (the threshold is blind to the model and the card),
    unless a vLLM the server launches shares their GPU; on CPU ranks, or once either option is
    given, what was asked."""
    gpus, cpu = ["cuda:0", "cuda:1"], ["cpu"]
    assert PlanOptions().activation_budget(gpus) == "auto"
    assert PlanOptions().activation_budget(gpus, shares_gpu=True) is None  # vLLM must find its share
    assert PlanOptions(activation_memory_gib="auto").activation_budget(gpus, shares_gpu=True) == "auto"  # as asked
    assert PlanOptions().activation_budget(cpu) is None
    assert PlanOptions().activation_budget(["cuda:0", "cpu"]) is None  # auto needs every rank on a GPU
    assert PlanOptions(recompute_above_tokens=8192).activation_budget(gpus) is None  # the threshold, as asked
    assert PlanOptions(activation_memory_gib="1.5").activation_budget(gpus) == 1.5 * 2**30
    assert PlanOptions(activation_memory_gib="auto").activation_budget(gpus) == "auto"


def test_layers_no_hook_can_measure_fall_back_to_the_threshold(four_layers: Path, monkeypatch, caplog):
    """Layers whose saved tensors no hook sees (a kernel library's own autograd, say) measure
    nothing: the budget gives way to the token threshold, rather than recompute all but the last
    layer for good."""
    import hosted_tinker.rank.trainer as trainer_module

    class SeesNothing(SavedBytes):
        def _pack(self, t: torch.Tensor) -> torch.Tensor:
            return t

    monkeypatch.setattr(trainer_module, "SavedBytes", SeesNothing)
    trainer = local_rank(str(four_layers)).trainer
    trainer.activation_memory, trainer.recompute_above_tokens = 1e12, 64
    trainer.create_adapter("m", LORA)
    with caplog.at_level("WARNING"):
        trainer.forward_backward("m", random_batch(np.random.default_rng(1), 1, lengths=(20, 21)))
    assert trainer.layer_bytes_per_token is None and trainer.activation_memory is None
    assert "cannot be measured" in caplog.text
    assert (trainer.layers_to_recompute(64), trainer.layers_to_recompute(65)) == (0, 4)
