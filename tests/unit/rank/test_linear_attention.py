"""Qwen3.5's hybrid linear attention (``rank.linear_attention``): packed sequences kept apart in
the Gated-DeltaNet layers, LoRA in Tinker's layout there (q, k, v apart; z and out; no gates),
against transformers' own forward of each sequence alone and an independent float64 reference
(``tests.support.lora_reference``). Packed == padded for every loss: ``tests/unit/rank/test_packing.py``;
rows leaving and joining a decode: ``tests/unit/rank/test_sampling_families.py``;
the MoE variant's experts: ``tests/unit/rank/test_moe_lora.py``; through the SDK:
``tests/e2e/test_linear_attention_sdk.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hosted_tinker.core.tiny_model import build_tiny_model
from hosted_tinker.core.types import LoraSpec
from hosted_tinker.rank import linear_attention
from hosted_tinker.rank.model import HfLoraModel
from hosted_tinker.rank.serve import Rank, local_rank
from tests.support.lora_reference import (
    KEY_PREFIX,
    assert_as_close_as_float32_goes,
    datum,
    reference_logprobs,
    trained_looking,
)

pytestmark = [pytest.mark.fast, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def rank(tmp_path_factory) -> Rank:
    path = build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", family="qwen3_5", hidden_size=64)
    return local_rank(str(path))


def bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_the_packed_convolution_is_each_sequences_own():
    """Sequences shorter than the kernel, of one token, and long ones: each output reads its own
    sequence only, as transformers' convolution of that sequence alone (left-padded with zeros)."""
    torch.manual_seed(0)
    lengths, channels, kernel = [1, 2, 9, 3, 30], 6, 4
    x = torch.randn(sum(lengths), channels, dtype=torch.float64)
    weight = torch.randn(channels, kernel, dtype=torch.float64)
    ours = linear_attention.packed_causal_conv(x, weight, None, bounds(lengths), "silu")
    cuts = bounds(lengths).tolist()
    alone = [
        F.silu(F.conv1d(x[s:e].T[None], weight[:, None], padding=kernel - 1, groups=channels)[0, :, : e - s]).T
        for s, e in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    torch.testing.assert_close(ours, torch.cat(alone), rtol=0, atol=1e-13)


def test_a_packed_row_is_each_sequence_alone_and_nothing_leaks(rank: Rank):
    """A Gated-DeltaNet layer over a packed row equals transformers' own forward of each sequence
    alone (float64: the same operations up to rounding), and changing one sequence changes no
    output of another (the convolution and the recurrence restart at each boundary)."""
    model: HfLoraModel = rank.trainer.model
    (name,) = linear_attention.gated_delta_modules(model.base)
    layer = copy.deepcopy(model.base.get_submodule(name)).double()  # the packed forward, on a copy
    lengths = [5, 1, 70, 3]
    cuts = bounds(lengths).tolist()
    x = torch.randn(1, sum(lengths), model.base.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        packed = layer(x, cu_seq_lens_q=bounds(lengths))
        alone = torch.cat([type(layer).forward(layer, x[:, s:e]) for s, e in zip(cuts[:-1], cuts[1:], strict=True)], 1)
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)
        edited = x.clone()
        edited[:, cuts[2] : cuts[3]] += 1.0  # the third sequence only
        after = layer(edited, cu_seq_lens_q=bounds(lengths))
    assert torch.equal(after[:, : cuts[2]], packed[:, : cuts[2]])
    assert torch.equal(after[:, cuts[3] :], packed[:, cuts[3] :])
    assert not torch.equal(after[:, cuts[2] : cuts[3]], packed[:, cuts[2] : cuts[3]])


def test_lora_goes_where_tinker_puts_it(rank: Rank):
    """q, k and v each their own LoRA (rows of the fused in_proj_qkv), z and out too; none on the
    per-head gates in_proj_a / in_proj_b nor on the fused projection as a whole."""
    model: HfLoraModel = rank.trainer.model
    handle = model.add_adapter(LoraSpec(rank=4, seed=1, train_mlp=False, train_unembed=False))
    try:
        shapes = dict(zip(handle.keys, (tuple(p.shape) for p in handle.params), strict=True))
        (name,) = linear_attention.gated_delta_modules(model.base)
        layer, hidden = model.base.get_submodule(name), model.base.config.hidden_size
        expected_rows = {
            "in_proj_q": layer.key_dim,
            "in_proj_k": layer.key_dim,
            "in_proj_v": layer.value_dim,
            "in_proj_z": layer.value_dim,
        }
        for target, rows in expected_rows.items():
            assert shapes[f"{KEY_PREFIX}{name}.{target}.lora_A.weight"] == (4, hidden)
            assert shapes[f"{KEY_PREFIX}{name}.{target}.lora_B.weight"] == (rows, 4)
        assert shapes[f"{KEY_PREFIX}{name}.out_proj.lora_A.weight"] == (4, layer.value_dim)
        linear = [k for k in shapes if f"{name}." in k]
        assert len(linear) == 2 * 5
        assert not any(k.split(".")[-3] in ("in_proj_qkv", "in_proj_a", "in_proj_b") for k in shapes)
        assert f"{name}.in_proj_q" in model.adapter_config(handle)["target_modules"]
    finally:
        model.remove_adapter(handle)


def test_logprobs_and_gradients_equal_the_float64_reference(rank: Rank):
    """Two models' data packed into one pass: each datum's log-probs, and each model's gradients,
    those of the HF model in float64 running each sequence alone with that model's adapter
    applied by hand."""
    model: HfLoraModel = rank.trainer.model
    a = trained_looking(model, LoraSpec(rank=4, seed=2))
    b = trained_looking(model, LoraSpec(rank=2, seed=3, train_mlp=False))
    try:
        data = [datum(list(range(7, 40))), datum([3, 9, 14, 2]), datum(list(range(60, 71)))]
        handles = [a, b, a]
        ours = model.logprobs(handles, data)
        grads = torch.autograd.grad(sum(lp.sum() for lp in ours), a.params + b.params)
        expected: dict[tuple[str, str], list] = {}  # (model, key) -> [float64 gradient, float32 one]
        for i, (handle, d) in enumerate(zip(handles, data, strict=True)):
            weights = dict(zip(handle.keys, handle.params, strict=True))
            scale = model.adapters.adapters[handle.name].scale
            logprobs, per_key = reference_logprobs(model, weights, scale, d)
            _, per_key_in_float32 = reference_logprobs(model, weights, scale, d, torch.float32)
            # float32 against float64: log-probs near -13 carry ~1e-6 of rounding, whose last bits
            # depend on the CPU's vector kernels (2.2e-5 on one 2-core machine, under 2e-5 on another)
            torch.testing.assert_close(ours[i].double(), logprobs, rtol=4e-6, atol=2e-5)
            for key, grad in per_key.items():
                sums = expected.setdefault((handle.name, key), [0, 0])
                sums[0], sums[1] = sums[0] + grad, sums[1] + per_key_in_float32[key]
        named = [(a.name, k) for k in a.keys] + [(b.name, k) for k in b.keys]
        for key, grad in zip(named, grads, strict=True):
            assert_as_close_as_float32_goes(grad, *expected[key])
        assert any(".in_proj_v." in k and g.abs().sum() > 0 for (_, k), g in zip(named, grads, strict=True))
    finally:
        model.remove_adapter(a)
        model.remove_adapter(b)


def test_recomputed_linear_attention_layers_give_the_same_bits(rank: Rank):
    model: HfLoraModel = rank.trainer.model
    handle = trained_looking(model, LoraSpec(rank=4, seed=4))
    try:
        data = [datum(list(range(20, 50))), datum(list(range(5, 12)))]
        kept = model.logprobs([handle, handle], data)
        kept_grads = torch.autograd.grad(sum(lp.sum() for lp in kept), handle.params)
        again = model.logprobs([handle, handle], data, recompute=len(model.layers))
        again_grads = torch.autograd.grad(sum(lp.sum() for lp in again), handle.params)
        for got, want in zip([*again, *again_grads], [*kept, *kept_grads], strict=True):
            assert torch.equal(got, want)
    finally:
        model.remove_adapter(handle)


def test_flash_linear_attention_runs_on_cuda_only(monkeypatch):
    """With flash-linear-attention installed, its varlen kernel is used for CUDA tensors only: on
    a CPU the per-sequence reference runs whatever is installed (fla's Triton kernels need a GPU).
    No GPU has run the varlen call here."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "fla" else find_spec(name, *a)
    )
    assert linear_attention.fla_available()
    layer = type("Layer", (), {})()  # the reference is found through the layer's modeling module
    type(layer).__module__ = "transformers.models.qwen3_5.modeling_qwen3_5"
    reference = linear_attention.torch_delta_rule(layer)
    q = k = torch.randn(1, 5, 2, 4)
    v = torch.randn(1, 5, 4, 4)
    g, beta = -torch.rand(1, 5, 4), torch.rand(1, 5, 4)
    out = linear_attention.packed_delta_rule(reference, q, k, v, g, beta, bounds([2, 3]))  # no fla import on a CPU
    assert out.shape == (1, 5, 4, 4)


def test_only_the_recurrent_layers_this_server_can_pack_are_served():
    """Qwen3.5's Gated-DeltaNet is packed here; other recurrent or convolutional sequence mixers
    (Qwen3-Next's fused variant, Mamba) are named, so that such a model is refused at start."""
    from torch import nn

    class Qwen3NextGatedDeltaNet(nn.Module):  # the name is what is read: no in_proj_qkv of Qwen3.5's layout
        pass

    class MambaMixer(nn.Module):
        pass

    model = nn.Sequential(Qwen3NextGatedDeltaNet(), MambaMixer(), nn.Linear(2, 2))
    assert linear_attention.unpackable_layers(model) == ["MambaMixer", "Qwen3NextGatedDeltaNet"]
    assert linear_attention.unpackable_layers(nn.Sequential(nn.Linear(2, 2))) == []
