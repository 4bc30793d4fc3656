"""The data-parallel backend (issue #7) on CPU: two ranks over gloo, driven through the same
``ProcessBackend`` the server uses, against the PEFT backend in this process as the reference.

Sums, not means: whatever the split, the update is the single-process one. Batches of 1, 3
and 7 datums of unequal lengths (so one rank's shard is sometimes empty), every loss, full
AdamParams, gradients accumulated over several calls: logprobs and ``loss:sum`` agree within
1e-5 after six steps, and the ranks' adapters stay bitwise identical. A rank that stops
answering breaks the collective it was awaited in, and the group is replaced, not hung; so is
one whose ranks no longer agree.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hosted_tinker.core import losses
from hosted_tinker.core.config import ServerConfig
from hosted_tinker.core.errors import WorkerCrashed, WorkerError
from hosted_tinker.core.sharding import shard_by_tokens
from hosted_tinker.core.types import AdamParams, ForwardBackwardBatch, LoraSpec
from hosted_tinker.rank.plans import plan_module
from hosted_tinker.rank.serve import Rank, RankSpec, build_rank, local_rank
from hosted_tinker.rank.trainer import Trainer
from hosted_tinker.server.workers.backend import ProcessBackend
from hosted_tinker.server.workers.group import PEER_GRACE_S
from hosted_tinker.server.workers.launch import rank_factories, rendezvous
from tests.support.batches import random_batch

pytestmark = pytest.mark.timeout(300)

ADAM = AdamParams(learning_rate=2e-3, beta1=0.85, beta2=0.98, eps=1e-8, weight_decay=0.05, grad_clip_norm=400.0)


# ---- two ranks against one process -----------------------------------------------------------


def inspectable(factory) -> Rank:
    """A production rank that also answers ``local_state``: what this rank itself holds of a
    model (only rank 0's travels in ``export_state``), to check that the ranks agree."""
    rank = factory()
    rank.local_state = functools.partial(_local_state, rank.trainer)
    return rank


def _local_state(trainer: Trainer, model_id: str) -> dict[str, torch.Tensor]:
    adapter = trainer.adapters[model_id]
    state = {}
    for key, p in zip(adapter.handle.keys, adapter.handle.params, strict=True):
        state[key] = p.detach().clone()
        state |= {f"{key}.{f}": v.clone() for f, v in adapter.optimizer.state.get(p, {}).items()}
    return state


@pytest.fixture(scope="module")
def ddp(tiny_model_dir: Path):
    config = ServerConfig(model=str(tiny_model_dir), backend="ddp", train_devices="cpu:2")
    launch = rank_factories(config, str(tiny_model_dir))
    backend = ProcessBackend(lambda: [functools.partial(inspectable, f) for f in launch()])
    assert backend.capabilities.backend == "ddp" and backend.capabilities.devices == ("cpu", "cpu")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Trainer:
    return local_rank(str(tiny_model_dir)).trainer


def batch(rng: np.random.Generator, size: int, loss_fn: str = "cross_entropy") -> ForwardBackwardBatch:
    return random_batch(rng, size, loss_fn, lengths=(4, 48), vocab=512)


def forward(backend, model_id: str, b: ForwardBackwardBatch) -> list[np.ndarray]:
    return backend.forward_backward(model_id, dataclasses.replace(b, forward_only=True)).logprobs


def assert_same(got, want, what: str) -> None:
    diff = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
    assert diff < 1e-5, f"{what}: logprobs differ by {diff}"


@pytest.mark.slow
def test_two_ranks_train_exactly_like_one_process(ddp: ProcessBackend, reference: Trainer):
    """Seven steps, one per loss, of 1, 3 or 7 datums plus a second call that accumulates; also
    the per-token loss terms (``elementwise_loss``) merged back in batch order."""
    for backend in (ddp.trainer, reference):
        backend.create_adapter("same", LoraSpec(rank=8, seed=11))
    rng = np.random.default_rng(0)
    probe = batch(rng, 5)
    plan = zip((1, 3, 7, 3, 1, 7, 3), losses.LOSSES, strict=True)
    for step, (size, loss_fn) in enumerate(plan):
        for b in (batch(rng, size, loss_fn), batch(rng, 2, loss_fn)):
            got, want = ddp.trainer.forward_backward("same", b), reference.forward_backward("same", b)
            assert_same(got.logprobs, want.logprobs, f"step {step} ({loss_fn})")
            for g, w in zip(got.elementwise_loss, want.elementwise_loss, strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"step {step} ({loss_fn}) terms")
            assert got.loss_sum == pytest.approx(want.loss_sum, rel=1e-5, abs=1e-5)
        got, want = ddp.trainer.optim_step("same", ADAM), reference.optim_step("same", ADAM)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert_same(forward(ddp.trainer, "same", probe), forward(reference, "same", probe), "after seven steps")

    rank0 = ddp.trainer.export_state("same")
    rank1 = ddp._group.workers[1].call("local_state", "same")  # rank 1 alone, for this check
    assert rank0.steps == 7 and rank1.keys() == {**rank0.weights, **rank0.optimizer}.keys()
    for name, tensor in {**rank0.weights, **rank0.optimizer}.items():
        assert torch.equal(tensor, rank1[name]), f"the ranks differ in {name}"
    for backend in (ddp.trainer, reference):
        backend.delete_adapter("same")


@pytest.mark.slow
def test_one_rank_is_the_single_process_backend(tiny_model_dir: Path, reference: Trainer):
    """``--train-devices cpu:1`` (or one GPU): no collective runs, and the steps are exactly
    the peft backend's."""
    config = ServerConfig(model=str(tiny_model_dir), backend="ddp", train_devices="cpu:1")
    single = ProcessBackend(rank_factories(config, str(tiny_model_dir)))
    try:
        assert single.capabilities.devices == ("cpu",)
        for backend in (single.trainer, reference):
            backend.create_adapter("one", LoraSpec(rank=8, seed=4))
        rng = np.random.default_rng(4)
        for size in (3, 1):
            b = batch(rng, size, "ppo")
            got, want = single.trainer.forward_backward("one", b), reference.forward_backward("one", b)
            assert got.loss_sum == want.loss_sum
            assert single.trainer.optim_step("one", ADAM) == reference.optim_step("one", ADAM)
        probe = batch(rng, 2)
        assert_same(forward(single.trainer, "one", probe), forward(reference, "one", probe), "one rank")
    finally:
        reference.delete_adapter("one")
        single.close()


@pytest.mark.slow
def test_ranks_start_identical_whatever_else_rank_0_holds(ddp: ProcessBackend):
    """The embedded sampler lives on rank 0 alone, and ranks may have made different adapters
    before (their PEFT wrappers came and went differently). Rank 0's initial weights are
    broadcast, so the ranks still start out bitwise identical."""
    ddp.trainer.create_adapter("first", LoraSpec(rank=8, seed=1))
    config, weights = ddp.trainer.zero_adapter()
    ddp.sampler.load_sampler("zero", config, weights)
    ddp.trainer.delete_adapter("first")
    ddp.trainer.create_adapter("second", LoraSpec(rank=8, seed=2))
    rank0, rank1 = ddp.trainer.export_state("second"), ddp._group.workers[1].call("local_state", "second")
    for name, tensor in rank0.weights.items():
        assert torch.equal(tensor, rank1[name]), f"the ranks start apart in {name}"
    ddp.trainer.delete_adapter("second")


@pytest.mark.slow
def test_a_request_that_fails_on_one_rank_leaves_no_gradient_on_any(ddp: ProcessBackend, reference: Trainer):
    """One datum whose target is outside the vocabulary (the server's validation would refuse
    it; the backend is called directly here) fails on its rank alone. The error is that rank's,
    and the other rank drops its shard's gradients too: the next step equals one without it."""
    for backend in (ddp.trainer, reference):
        backend.create_adapter("atomic", LoraSpec(rank=4, seed=5))
    rng = np.random.default_rng(1)
    good = batch(rng, 3)
    spoiled = batch(rng, 2)
    bad = spoiled.data[1]
    spoiled.data[1] = dataclasses.replace(bad, target_tokens=torch.full_like(bad.target_tokens, 10**6))
    assert [len(s) for s in shard_by_tokens([d.num_tokens for d in spoiled.data], 2)] == [1, 1]

    for backend in (ddp.trainer, reference):
        backend.forward_backward("atomic", good)
    with pytest.raises(WorkerError) as failure:
        ddp.trainer.forward_backward("atomic", spoiled)
    assert "index" in str(failure.value) and "another rank" not in str(failure.value)
    got, want = ddp.trainer.optim_step("atomic", ADAM), reference.optim_step("atomic", ADAM)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert_same(forward(ddp.trainer, "atomic", good), forward(reference, "atomic", good), "after the failed request")
    for backend in (ddp.trainer, reference):
        backend.delete_adapter("atomic")


@pytest.mark.slow
def test_a_rank_that_hangs_fails_the_request_and_the_group_is_replaced(tiny_model_dir: Path):
    """Rank 1 is stopped (SIGSTOP: alive, silent, as on a wedged GPU). Rank 0 does its shard, then
    waits for rank 1 in the collective until ``collective_timeout_s``; the group is replaced and
    the error names the rank that hung, long before the hour-long call timeout."""
    timeout_s = 5.0
    config = ServerConfig(
        model=str(tiny_model_dir),
        backend="ddp",
        train_devices="cpu:2",
        backend_options={"collective_timeout_s": str(timeout_s)},
    )
    backend = ProcessBackend(rank_factories(config, str(tiny_model_dir)), call_timeout_s=3600)
    try:
        backend.trainer.create_adapter("m", LoraSpec(rank=4, seed=0))
        waiter, hung = backend.status()["pids"]
        os.kill(hung, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerCrashed) as crash:
            backend.trainer.forward_backward("m", batch(np.random.default_rng(2), 3))
        waited = time.monotonic() - started
        said = str(crash.value)
        assert said.startswith(f"training rank 0 (pid {waiter}): the ranks' agreement on a call's outcome failed")
        assert "Timed out" in said  # gloo's own words, passed on
        assert f"; rank 1 (pid {hung}) had not answered; the worker was restarted" in said
        assert timeout_s <= waited < timeout_s + PEER_GRACE_S + 120  # the restart's imports included

        status = backend.status()
        assert status["alive"] and status["restarts"] == 1 and hung not in status["pids"]
        backend.trainer.create_adapter("after", LoraSpec(rank=4, seed=0))  # no recovery here: "m" is gone
        assert len(backend.trainer.forward_backward("after", batch(np.random.default_rng(3), 3)).logprobs) == 3
    finally:
        backend.close()


def fails_on_rank_1(spec: RankSpec) -> Rank:
    """A rank that fails some calls on rank 1 alone (as on a GPU that went bad)."""
    rank = build_rank(spec)
    if spec.rank == 1:
        model, trainer = rank.trainer.model, rank.trainer
        add_adapter, delete_adapter = model.add_adapter, trainer.delete_adapter

        def add(lora: LoraSpec):  # inside create_adapter, where a real failure would be
            if lora.rank == 3:
                raise RuntimeError("CUDA error: out of memory")
            return add_adapter(lora)

        def delete(model_id: str) -> None:
            if model_id == "stuck":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            delete_adapter(model_id)

        model.add_adapter, trainer.delete_adapter = add, delete
    return rank


_STORES: list = []  # each group's rendezvous, held for the group's life (as rank_factories does)


def one_rank_fails(model: str) -> list:
    init_method, store = rendezvous("127.0.0.1")
    _STORES[:] = [store]
    options = plan_module("ddp").Options(collective_timeout_s=60)
    return [
        functools.partial(fails_on_rank_1, RankSpec("ddp", options, model, rank, ("cpu", "cpu"), init_method))
        for rank in range(2)
    ]


@pytest.mark.slow
def test_adapters_are_made_on_every_rank_or_none_and_ranks_that_disagree_are_replaced(tiny_model_dir: Path):
    """A create_adapter that fails on rank 1 is undone on rank 0: one clean error, the group
    kept. A delete that worked on rank 0 only cannot be undone: training on would run the ranks
    out of step, so the group is rebuilt (from saved states, when the server's recovery is on)."""
    backend = ProcessBackend(lambda: one_rank_fails(str(tiny_model_dir)))
    try:
        backend.trainer.create_adapter("stuck", LoraSpec(rank=4, seed=0))
        before = backend.status()["pids"]
        with pytest.raises(WorkerError, match=r"^rank 1: RuntimeError: CUDA error: out of memory$"):
            backend.trainer.create_adapter("too-big", LoraSpec(rank=3, seed=0))
        assert not backend.trainer.has_adapter("too-big") and backend.status()["pids"] == before

        with pytest.raises(WorkerCrashed) as crash:
            backend.trainer.delete_adapter("stuck")
        assert (
            "training rank 1 failed delete_adapter (RuntimeError: CUDA error: an illegal memory access was "
            "encountered) where rank 0 completed it, so the ranks no longer hold the same state" in str(crash.value)
        )
        status = backend.status()
        assert status["alive"] and status["restarts"] == 1 and not set(status["pids"]) & set(before)
        backend.trainer.create_adapter("fits", LoraSpec(rank=4, seed=0))
        assert len(backend.trainer.forward_backward("fits", batch(np.random.default_rng(5), 3)).logprobs) == 3
    finally:
        backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "gpt_oss"])
def test_two_ranks_train_a_mixture_of_experts_exactly_like_one_process(family: str, tiny_family):
    """The same for mixture-of-experts models, with a LoRA on every routed expert: each rank's
    shard routes its tokens to its own experts, the summed gradients give one process's update,
    and the routed token counts behind the MoE metrics add up to one process's. Qwen3.5-MoE's
    linear attention and gpt-oss's attention sinks and sliding windows run packed on each rank."""
    model = str(tiny_family(family))
    config = ServerConfig(model=model, backend="ddp", train_devices="cpu:2")
    ddp = ProcessBackend(rank_factories(config, model))
    reference = local_rank(model).trainer
    try:
        assert ddp.capabilities.routed_experts == 8
        for backend in (ddp.trainer, reference):
            backend.create_adapter("moe", LoraSpec(rank=4, seed=5))
        rng = np.random.default_rng(1)
        probe = batch(rng, 4)
        for step in range(3):
            b = batch(rng, 5)
            got, want = ddp.trainer.forward_backward("moe", b), reference.forward_backward("moe", b)
            assert_same(got.logprobs, want.logprobs, f"step {step}")
            np.testing.assert_array_equal(got.routed.counts, want.routed.counts)  # the replicas' routed tokens add up
            got, want = ddp.trainer.optim_step("moe", ADAM), reference.optim_step("moe", ADAM)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert_same(forward(ddp.trainer, "moe", probe), forward(reference, "moe", probe), "after three steps")
        state = ddp.trainer.export_state("moe")
        assert any(".experts.w2.lora_A" in k and v.abs().sum() > 0 for k, v in state.weights.items())
    finally:
        ddp.close()


@pytest.mark.slow
def test_two_ranks_train_on_images_exactly_like_one_process(tiny_family):
    """Qwen3.5 with its vision tower: datums with images split over two ranks, each embedding
    its own shard's images, give one process's log-probs and update."""
    from tests.support.images import image_datum, png

    model = str(tiny_family("qwen3_5"))
    config = ServerConfig(model=model, backend="ddp", train_devices="cpu:2")
    ddp = ProcessBackend(rank_factories(config, model))
    reference = local_rank(model)
    try:
        assert ddp.capabilities.images
        vision = reference.trainer.model.vision
        datums = [
            image_datum(vision.model.config, vision.processor, [[5, 6], [7, 8]], [png(96, 64, 0)]),
            image_datum(vision.model.config, vision.processor, [[9], [], [10]], [png(64, 64, 1), png(32, 96, 2)]),
            image_datum(vision.model.config, vision.processor, [[11, 12, 13, 14, 15, 16]], []),
            image_datum(vision.model.config, vision.processor, [list(range(20, 40)), [41]], [png(48, 48, 3)]),
        ]
        b = ForwardBackwardBatch(datums, "cross_entropy", {}, forward_only=False)
        for backend in (ddp.trainer, reference.trainer):
            backend.create_adapter("vl", LoraSpec(rank=4, seed=5))
        for step in range(2):
            got, want = ddp.trainer.forward_backward("vl", b), reference.trainer.forward_backward("vl", b)
            assert_same(got.logprobs, want.logprobs, f"step {step}")
            got, want = ddp.trainer.optim_step("vl", ADAM), reference.trainer.optim_step("vl", ADAM)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert_same(forward(ddp.trainer, "vl", b), forward(reference.trainer, "vl", b), "after two steps")
    finally:
        ddp.close()
