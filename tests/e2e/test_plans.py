"""Every registered parallel plan (``rank.plans.PLANS``) against a float64 single-process reference.

Each plan runs in worker processes through ``ProcessBackend``, as the server runs it, on two CPU
ranks where it accepts two (else one). The reference is the single plan in float64 in this
process on the padded path, started from the plan's own initial weights. Every loss, datums of unequal lengths,
gradients accumulated over two calls before each step, full AdamParams: per-datum logprobs,
``loss:sum``, ``grad_norm`` and the weights after the steps agree to float32 precision; and
three Dimuon steps, whose update needs whole matrices where a plan shards them; a custom loss;
and two models' requests in one pass. The layouts a plan names for mixture-of-experts models
(``CHECKED_MOE_LAYOUTS``) run the same on the tiny Qwen3-MoE, routed-expert LoRA included.

A new plan is checked by registering it: nothing here names one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hosted_tinker.core import losses
from hosted_tinker.core.config import ServerConfig
from hosted_tinker.core.custom_loss import CustomLossDef
from hosted_tinker.core.types import (
    AdamParams,
    AdapterState,
    DatumInput,
    DimuonParams,
    ForwardBackwardBatch,
    LoraSpec,
)
from hosted_tinker.rank.plans import PLANS, backend_options, plan_module
from hosted_tinker.rank.serve import local_rank
from hosted_tinker.rank.trainer import Trainer
from hosted_tinker.server.workers.backend import ProcessBackend
from hosted_tinker.server.workers.launch import rank_factories
from tests.support.batches import padded_path, random_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ADAM = AdamParams(learning_rate=5e-3, beta1=0.85, beta2=0.98, eps=1e-8, weight_decay=0.05, grad_clip_norm=50.0)
DIMUON = functools.partial(DimuonParams, grad_clip_norm=3.0, beta1=0.8, damping=0.05)
RTOL = 2e-4  # float32 against float64, over a few steps


def grad_norm_rtol(family: str | None) -> float:
    """How far a plan's gradient norm may part from the reference's. On Qwen3.5, after Dimuon's
    steps, every float32 plan parts from the float64 reference by up to ~2e-4, the peft plan by as
    much as megatron's (945.05 against 945.20): not the reference's float32 islands (its norms and
    the gates' decay computed in float64 moved it by 2e-5), so float32 itself on this model."""
    return 5e-4 if family in ("qwen3_5", "qwen3_5_moe") else 1e-4


def layouts() -> list:
    """(plan, devices, options, family) to check: a plan's own ``CHECKED_LAYOUTS`` where it names
    them, else two CPU ranks where it takes them (``devices`` None: found at run time), else one,
    on the tiny dense model (``family`` None); and its ``CHECKED_MOE_LAYOUTS`` on the tiny Qwen3-MoE
    or the family a layout names."""
    out = []
    for backend in sorted(PLANS):
        module = plan_module(backend)
        named = [(*layout, None) for layout in getattr(module, "CHECKED_LAYOUTS", None) or [(None, {})]]
        for devices, options, *family in getattr(module, "CHECKED_MOE_LAYOUTS", []):
            named.append((devices, options, family[0] if family else "qwen3_moe"))
        for devices, options, family in named:
            label = "-".join([backend, devices or "auto", *(f"{k}={v}" for k, v in options.items()), family or "dense"])
            out.append(pytest.param(backend, devices, options, family, id=label))
    return out


def devices_for(backend: str, model: Path) -> str:
    """Two CPU ranks where the plan takes them, else one."""
    for devices in ("cpu:2", "cpu"):
        config = ServerConfig(model=str(model), backend=backend, train_devices=devices)
        try:
            backend_options(config)
            return devices
        except ValueError:
            continue
    raise AssertionError(f"plan {backend} runs on neither two CPU ranks nor one")


def batch(rng: np.random.Generator, size: int, loss_fn: str) -> ForwardBackwardBatch:
    return random_batch(rng, size, loss_fn)


def as_float64(state: AdapterState) -> AdapterState:
    return dataclasses.replace(
        state,
        weights={k: v.double() for k, v in state.weights.items()},
        optimizer={k: v.double() if v.is_floating_point() else v for k, v in state.optimizer.items()},
    )


@pytest.fixture(scope="module")
def references() -> Iterator[Callable[[Path], Trainer]]:
    """The single plan in float64 on the padded, stored-activation path (what packing and
    recomputation replaced), one per model: a plan that packs, recomputes or shards must still
    agree with it."""
    with contextlib.ExitStack() as stack:

        @functools.cache
        def reference(model: Path) -> Trainer:
            trainer = local_rank(str(model), dtype="float64").trainer
            stack.enter_context(padded_path(trainer))
            return trainer

        yield reference


@pytest.mark.parametrize("backend, devices, options, family", layouts())
def test_plan_trains_like_the_float64_reference(
    backend: str,
    devices: str | None,
    options: dict[str, str],
    family: str | None,
    tiny_model_dir: Path,
    tiny_family: Callable[[str], Path],
    references: Callable[[Path], Trainer],
):
    model = tiny_family(family) if family else tiny_model_dir
    reference = references(model)
    devices = devices or devices_for(backend, model)
    config = ServerConfig(model=str(model), backend=backend, train_devices=devices, backend_options=options)
    plan = ProcessBackend(rank_factories(config, str(model)))
    model_id = f"plan-{backend}"
    grad_rtol = grad_norm_rtol(family)
    try:
        assert plan.capabilities.backend == backend
        plan.trainer.create_adapter(model_id, LoraSpec(rank=8, seed=3))
        reference.create_adapter(model_id, LoraSpec(rank=8, seed=3))
        reference.load_state(model_id, as_float64(plan.trainer.export_state(model_id)), with_optimizer=True)
        rng = np.random.default_rng(7)
        for step, loss_fn in enumerate(sorted(losses.LOSSES)):
            for size in (3, 2):  # two calls, accumulated before the step
                b = batch(rng, size, loss_fn)
                got, want = plan.trainer.forward_backward(model_id, b), reference.forward_backward(model_id, b)
                for g, w in zip(got.logprobs, want.logprobs, strict=True):
                    np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-4, err_msg=f"step {step} ({loss_fn})")
                assert got.loss_sum == pytest.approx(want.loss_sum, rel=RTOL, abs=1e-4), loss_fn
            got_step, want_step = plan.trainer.optim_step(model_id, ADAM), reference.optim_step(model_id, ADAM)
            assert got_step["grad_norm"] == pytest.approx(want_step["grad_norm"], rel=grad_rtol), loss_fn
        got_state, want_state = plan.trainer.export_state(model_id), reference.export_state(model_id)
        assert got_state.steps == want_state.steps == len(losses.LOSSES)
        assert got_state.weights.keys() == want_state.weights.keys()
        for key, tensor in got_state.weights.items():
            np.testing.assert_allclose(tensor.double(), want_state.weights[key], rtol=1e-3, atol=1e-5, err_msg=key)
        check_dimuon(plan, reference, f"{model_id}-dimuon", rng, grad_rtol)
        check_custom_loss(plan, reference, model_id, rng)
        check_joint_pass(plan, reference, [model_id, f"{model_id}-dimuon"], rng, grad_rtol)
        if family:  # expert-parallel ranks run in lock step (a failure on one ddp rank: test_ddp.py)
            check_replay(plan, local_rank(str(model), dtype="float64").trainer, f"{model_id}-replay", rng)
            check_a_failing_shard(plan, reference, model_id, rng)
    finally:
        for name in (model_id, f"{model_id}-dimuon"):
            if reference.has_adapter(name):
                reference.delete_adapter(name)
        plan.close()


def _weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/weight:mean": weights.mean()}


def check_custom_loss(plan: ProcessBackend, reference: Trainer, model_id: str, rng: np.random.Generator) -> None:
    """A session's custom loss runs on every rank that holds a shard; its metrics add up."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(_weighted_nll, {"logprobs": 1, "weights": 1}, "s")
    nodes = tuple(node.model_dump() for node in encode_graph(handle).nodes)
    loss = CustomLossDef(handle.name, (("logprobs", 1), ("weights", 1)), nodes)
    b = dataclasses.replace(batch(rng, 5, "cross_entropy"), loss_fn="custom", loss_config={}, custom_loss=loss)
    got, want = plan.trainer.forward_backward(model_id, b), reference.forward_backward(model_id, b)
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=RTOL)
    assert got.metrics.keys() == want.metrics.keys() == {"custom/nll:sum", "custom/weight:mean"}
    assert got.metrics["custom/nll:sum"] == pytest.approx(want.loss_sum, rel=RTOL)
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-4)


def check_joint_pass(
    plan: ProcessBackend, reference: Trainer, model_ids: list[str], rng: np.random.Generator, grad_rtol: float
) -> None:
    """Two models' requests in one pass (``forward_backward_many``), split over the plan's
    replicas per request: each model's results, gradients and gradient norm are those of its
    request alone."""
    requests = [(model_id, batch(rng, size, "ppo")) for model_id, size in zip(model_ids, (3, 4), strict=True)]
    got = plan.trainer.forward_backward_many(requests)
    for (model_id, b), result in zip(requests, got, strict=True):
        want = reference.forward_backward(model_id, b)
        assert result.loss_sum == pytest.approx(want.loss_sum, rel=RTOL, abs=1e-4), model_id
        for g, w in zip(result.logprobs, want.logprobs, strict=True):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-4)
    # Parking exports the gradients not yet applied, summed over the replicas, and leaves the
    # ranks ready to step as if nothing had been exported.
    got_state = plan.trainer.export_state(model_ids[0], with_gradients=True)
    want_state = reference.export_state(model_ids[0], with_gradients=True)
    assert got_state.gradients and got_state.gradients.keys() == want_state.gradients.keys()
    scale = max(float(t.abs().max()) for t in want_state.gradients.values())
    for key, tensor in got_state.gradients.items():  # float32 sums against float64 ones
        np.testing.assert_allclose(
            tensor.double(), want_state.gradients[key], rtol=1e-3, atol=1e-4 * scale, err_msg=key
        )
    for model_id, params in zip(model_ids, (ADAM, DIMUON(0.02)), strict=True):
        got_step, want_step = plan.trainer.optim_step(model_id, params), reference.optim_step(model_id, params)
        assert got_step["grad_norm"] == pytest.approx(want_step["grad_norm"], rel=grad_rtol), model_id


def check_replay(plan: ProcessBackend, reference: Trainer, model_id: str, rng: np.random.Generator) -> None:
    """Recorded routing replayed (``DatumInput.routing``: random experts, each datum's first two
    positions left to the router) as a float64 reference replays it (packed, as the peft backend
    runs: replay follows the packed stream), whichever rank's routers see which positions:
    log-probs, loss, the routing counts and the gradients."""
    import torch

    layers, top_k = plan.capabilities.replay_routing
    experts = plan.capabilities.routed_experts
    b = batch(rng, 4, "cross_entropy")
    for d in b.data:
        n = d.num_tokens
        forced = np.stack([rng.permutation(experts)[:top_k] for _ in range(n * layers)]).reshape(n, layers, top_k)
        forced[:2] = -1
        d.routing = torch.from_numpy(forced.astype(np.int16))
    results = []
    for trainer in (plan.trainer, reference):
        trainer.create_adapter(model_id, LoraSpec(rank=4, seed=9))
        results.append(trainer.forward_backward(model_id, b))
    got, want = results
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-4)
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=RTOL, abs=1e-4)
    assert got.routed is not None and want.routed is not None
    replayed = sum(d.num_tokens - 2 for d in b.data) * layers
    assert want.routed.replayed == replayed and want.routed.changed > 0
    assert (got.routed.routings, got.routed.replayed, got.routed.changed) == (
        want.routed.routings,
        want.routed.replayed,
        want.routed.changed,
    )
    np.testing.assert_array_equal(got.routed.counts, want.routed.counts)
    got_g = plan.trainer.export_state(model_id, with_gradients=True).gradients
    want_g = reference.export_state(model_id, with_gradients=True).gradients
    scale = max(float(t.abs().max()) for t in want_g.values())
    for key, grad in want_g.items():
        np.testing.assert_allclose(got_g[key].double(), grad, rtol=1e-3, atol=1e-4 * scale, err_msg=key)


def check_a_failing_shard(plan: ProcessBackend, reference: Trainer, model_id: str, rng: np.random.Generator) -> None:
    """A request whose loss fails on one datum (one rank's shard, where there are several) fails
    at once on every rank, not at a collective's timeout (expert-parallel ranks meet inside each
    layer, the failed rank too), and leaves no gradient anywhere: the plan serves on as before."""
    import time

    good = batch(rng, 4, "cross_entropy")
    bad = good.data[-1]
    broken = DatumInput(bad.tokens, bad.target_tokens, {"weights": bad.inputs["weights"][:-1]})  # one short
    started = time.monotonic()
    with pytest.raises(Exception, match="size of tensor|another rank failed"):
        plan.trainer.forward_backward(model_id, dataclasses.replace(good, data=[*good.data[:-1], broken]))
    assert time.monotonic() - started < 60
    got, want = plan.trainer.forward_backward(model_id, good), reference.forward_backward(model_id, good)
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=RTOL, abs=1e-4)
    got_step, want_step = plan.trainer.optim_step(model_id, ADAM), reference.optim_step(model_id, ADAM)
    assert got_step["grad_norm"] == pytest.approx(want_step["grad_norm"], rel=1e-4)


def check_dimuon(
    plan: ProcessBackend, reference: Trainer, model_id: str, rng: np.random.Generator, grad_rtol: float
) -> None:
    """Dimuon takes whole matrices: a plan that shards them must make them whole for the step."""
    spec = LoraSpec(rank=4, seed=5, optimizer="dimuon")
    plan.trainer.create_adapter(model_id, spec)
    reference.create_adapter(model_id, spec)
    reference.load_state(model_id, as_float64(plan.trainer.export_state(model_id)), with_optimizer=True)
    for lr in (0.02, 0.01, 0.03):
        b = batch(rng, 3, "cross_entropy")
        plan.trainer.forward_backward(model_id, b), reference.forward_backward(model_id, b)
        got_step, want_step = plan.trainer.optim_step(model_id, DIMUON(lr)), reference.optim_step(model_id, DIMUON(lr))
        assert got_step["grad_norm"] == pytest.approx(want_step["grad_norm"], rel=grad_rtol)
    got_state, want_state = plan.trainer.export_state(model_id), reference.export_state(model_id)
    assert {k for k in got_state.optimizer if k.endswith(".momentum")} == {f"{k}.momentum" for k in got_state.weights}
    for key, tensor in [*got_state.weights.items(), *got_state.optimizer.items()]:
        want = {**want_state.weights, **want_state.optimizer}[key]
        np.testing.assert_allclose(tensor.double(), want, rtol=1e-3, atol=1e-5, err_msg=key)
