"""Packed micro-batches (no padding) and per-layer activation recomputation, against the padded
path they replaced (``tests.support.batches.padded_path``) on one in-process rank: full attention
(Qwen3, every loss), hybrid linear attention (Qwen3.5, dense and MoE), attention sinks and sliding
windows (gpt-oss), a vision-language MoE (Qwen3-VL).
The parallel plans (ddp, megatron) are held to the same padded path in float64 by
``tests/e2e/test_plans.py``, with recomputation on in one layout of each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hosted_tinker.core import losses
from hosted_tinker.core.packing import microbatches, pack
from hosted_tinker.core.tiny_model import build_tiny_model
from hosted_tinker.core.types import DatumInput, LoraSpec
from hosted_tinker.rank.serve import Rank, local_rank
from hosted_tinker.rank.trainer import Trainer
from tests.support.batches import padded_path, random_batch

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5", "qwen3_5_moe", "gpt_oss", "qwen3_vl_moe"])
def rank(request, tiny_model_dir, tmp_path_factory) -> Rank:
    """A rank on the tiny Qwen3; on a tiny Qwen3.5, dense or MoE, whose Gated-DeltaNet layers must
    restart their convolution and recurrence at each packed sequence (``rank.linear_attention``);
    or on a tiny gpt-oss, whose attention has sinks and, every other layer, a sliding window."""
    if request.param == "qwen3":
        return local_rank(str(tiny_model_dir))
    path = tmp_path_factory.mktemp("models") / request.param
    return local_rank(str(build_tiny_model(path, family=request.param, hidden_size=64)))


@pytest.fixture()
def trainer(rank: Rank) -> Trainer:
    rank.trainer.create_adapter("packed", LoraSpec(rank=8, seed=4))
    with torch.no_grad():  # B = 0 at creation: move off it so every path carries a gradient
        for p in rank.trainer.adapters["packed"].handle.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    yield rank.trainer
    rank.trainer.delete_adapter("packed")


def datum(length: int) -> DatumInput:
    tokens = torch.arange(10, 11 + length)
    return DatumInput(tokens=tokens[:-1], target_tokens=tokens[1:])


def test_pack_lays_sequences_end_to_end():
    packed = pack([datum(3), datum(1), datum(4)])
    assert packed.tokens.tolist() == [10, 11, 12, 10, 10, 11, 12, 13]
    assert packed.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_len == 4


def test_microbatches_count_real_tokens_in_order():
    data = [datum(n) for n in (5, 5, 2, 9, 30, 1)]
    assert microbatches(data, 12) == [[0, 1, 2], [3], [4], [5]]
    assert microbatches(data, 100) == [[0, 1, 2, 3, 4, 5]]


def run(trainer: Trainer, batch) -> tuple:
    """A forward_backward's result and the gradients it left, which are then cleared."""
    result = trainer.forward_backward("packed", batch)
    params = trainer.adapters["packed"].handle.params
    grads = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return result, grads


def losses_checked(trainer: Trainer) -> list[str]:
    """Every loss on Qwen3. A loss reads each datum's log-probs after the packed row is cut back
    into datums, so on the other families two stand for all: a weighted sum (cross-entropy) and a
    policy loss whose terms take either sign (CISPO)."""
    if trainer.model.base.config.model_type == "qwen3":
        return sorted(losses.LOSSES)
    return ["cross_entropy", "cispo"]


def test_packed_equals_padded_and_recomputed_equals_stored(trainer: Trainer, subtests, monkeypatch):
    for loss_fn in losses_checked(trainer):
        with subtests.test(loss_fn=loss_fn):
            monkeypatch.setattr(trainer, "recompute_above_tokens", 10**9)
            check_packed_equals_padded(trainer, loss_fn, monkeypatch)


def check_packed_equals_padded(trainer: Trainer, loss_fn: str, monkeypatch) -> None:
    batch = random_batch(np.random.default_rng(11), 7, loss_fn, lengths=(2, 60))
    packed, packed_grads = run(trainer, batch)
    monkeypatch.setattr(trainer, "recompute_above_tokens", 0)
    recomputed, recomputed_grads = run(trainer, batch)
    with padded_path(trainer):
        padded, padded_grads = run(trainer, batch)

    # a sum of terms of either sign (CISPO's, for one): rounding of each token's 1e-5 adds up as √n
    tokens = sum(d.num_tokens for d in batch.data)
    assert packed.loss_sum == pytest.approx(padded.loss_sum, rel=1e-5, abs=1e-5 * tokens**0.5)
    for got, want in zip(packed.logprobs, padded.logprobs, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for got, want in zip(packed.elementwise_loss, padded.elementwise_loss, strict=True):
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    scale = max(float(g.abs().max()) for g in padded_grads)
    for got, want in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    # Recomputing a layer runs the same operations again: the results are the very same bits.
    assert recomputed.loss_sum == packed.loss_sum
    for got, want in zip(recomputed_grads, packed_grads, strict=True):
        assert torch.equal(got, want)


def test_no_pad_token_is_computed(trainer: Trainer):
    """The decoder sees each datum's tokens once, laid end to end: ΣN positions, not
    count × longest."""
    seen: list[tuple[int, ...]] = []
    embed = trainer.model.base.get_input_embeddings()
    hook = embed.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    try:
        batch = random_batch(np.random.default_rng(5), 6, lengths=(3, 90))
        run(trainer, batch)
    finally:
        hook.remove()
    lengths = [d.num_tokens for d in batch.data]
    assert seen == [(1, sum(lengths))]
    assert sum(lengths) < len(lengths) * max(lengths)  # what padding would have computed


def test_a_long_sequence_recomputes_its_layers(trainer: Trainer, monkeypatch):
    """Above ``recompute_above_tokens`` each decoder layer runs twice per step (forward, then
    again in the backward pass); below it, once."""
    calls = {"n": 0}
    inside = next(trainer.model.layers[0].children())  # the layer's own hooks stay outside the checkpoint
    hook = inside.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    monkeypatch.setattr(trainer, "recompute_above_tokens", 64)
    try:
        run(trainer, random_batch(np.random.default_rng(1), 1, lengths=(40, 41)))
        assert calls["n"] == 1
        calls["n"] = 0
        run(trainer, random_batch(np.random.default_rng(1), 1, lengths=(100, 101)))
        assert calls["n"] == 2
    finally:
        hook.remove()


def test_flash_attention_only_for_16_bit_models_on_cuda(monkeypatch):
    """flash-attn's varlen kernels take fp16/bf16 only: a float32 model on CUDA stays on packed attention."""
    import importlib.util

    from hosted_tinker.rank import attention

    attention.register()  # transformers imported before flash_attn is faked: it looks for it too
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else find_spec(name, *a)
    )
    cuda = torch.device("cuda", 0)
    assert attention.implementation(cuda, torch.bfloat16) == "flash_attention_2"
    assert attention.implementation(cuda, torch.float16) == "flash_attention_2"
    assert attention.implementation(cuda, torch.float32) == attention.PACKED
    assert attention.implementation(torch.device("cpu"), torch.bfloat16) == attention.PACKED


def test_packed_attention_reads_the_bounds_on_the_host():
    """Packed attention cuts the row in Python in every layer: its bounds stay on the host (read from a
    GPU, each layer would wait for it); flash-attn's kernels read them on the device ("meta"
    stands in for a GPU here; tests/e2e/test_gpu.py checks the layers on one)."""
    from hosted_tinker.rank import attention

    cu_seqlens, device = torch.tensor([0, 3, 8], dtype=torch.int32), torch.device("meta")
    host = attention.packing_kwargs(cu_seqlens, 5, attention.PACKED, device)
    assert host["cu_seq_lens_q"].device.type == "cpu" and host["max_length_q"] == 5
    flash = attention.packing_kwargs(cu_seqlens, 5, "flash_attention_2", device)
    assert flash["cu_seq_lens_q"].device.type == "meta" and flash["cu_seq_lens_k"].device.type == "meta"
