"""Many tenants, one pass, through the front door: SDK clients of several models whose
``forward_backward`` requests queue up together run in one pass over the base
(``serving.joint_passes``), and each model trains exactly as it would alone. And the rule that
keeps each model's order: a request runs ahead of its turn only when it is its model's next job.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from hosted_tinker.core.config import ServerConfig
from tests.support.metrics import moved, scrape
from tests.support.server import ALIAS
from tests.support.training import datums

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TENANTS = 3


def test_tenants_queued_together_share_a_pass_and_train_as_alone(base_url: str):
    """Pairs of identical models (same seed, same data): one of each pair trains alone, its twin
    in a joint pass with the other tenants' twins. After a step each twin has the same weights
    as its pair (compared through a forward pass), and /metrics counts the joint pass."""
    adam = types.AdamParams(learning_rate=1e-2)
    batches = [datums(seed, 3, 20 + 7 * seed) for seed in range(TENANTS)]
    probe = datums(99, 2, 16)
    with tinker.ServiceClient(base_url=base_url) as sc:
        alone = [sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=i) for i in range(TENANTS)]
        joint = [sc.create_lora_training_client(base_model=ALIAS, rank=4, seed=i) for i in range(TENANTS)]
        blocker = sc.create_lora_training_client(base_model=ALIAS, rank=4)

        alone_out = [tc.forward_backward(b, "cross_entropy").result() for tc, b in zip(alone, batches, strict=True)]
        before = scrape(base_url)
        # The blocker keeps the dispatch thread busy while the tenants' requests queue behind it.
        busy = blocker.forward_backward(datums(7, 48, 400), "cross_entropy")
        deadline = time.monotonic() + 30
        while scrape(base_url)[("hosted_tinker_in_flight", ())] < 1:
            assert time.monotonic() < deadline, "the blocker never reached the dispatch thread"
        futures = [tc.forward_backward(b, "cross_entropy") for tc, b in zip(joint, batches, strict=True)]
        joint_out = [f.result() for f in futures]
        busy.result()
        after = scrape(base_url)

        for a, j in zip(alone_out, joint_out, strict=True):
            assert j.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-5)
            for da, dj in zip(a.loss_fn_outputs, j.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(dj["logprobs"].tolist(), da["logprobs"].tolist(), atol=1e-5)
        assert moved(before, after, "hosted_tinker_joint_pass_joined_total") == TENANTS - 1
        assert moved(before, after, "hosted_tinker_joint_passes_total") == 1
        health = httpx.get(f"{base_url}/healthz", timeout=10).json()["joint_passes"]
        # the server's joint passes as /healthz counts them (the bound is the setting's, one declaration)
        assert health["joined"] >= TENANTS - 1 and health["passes"] >= 1
        assert health["max_tokens"] == ServerConfig.model_fields["joint_pass_tokens"].default

        for tc in (*alone, *joint):
            tc.optim_step(adam).result()
        for a, j in zip(alone, joint, strict=True):
            pa = a.forward(probe, "cross_entropy").result()
            pj = j.forward(probe, "cross_entropy").result()
            for da, dj in zip(pa.loss_fn_outputs, pj.loss_fn_outputs, strict=True):
                np.testing.assert_allclose(dj["logprobs"].tolist(), da["logprobs"].tolist(), atol=1e-5)


class FakeScheduler:
    def __init__(self, up_next: dict[str, int], next_seq: dict[str, int]) -> None:
        self._up, self._next = up_next, next_seq

    def up_next(self, model_id: str) -> int | None:
        return self._up.get(model_id)

    def next_seq(self, model_id: str) -> int | None:
        return self._next.get(model_id)


class FakeBackend:
    def __init__(self) -> None:
        self.calls: list = []

    def forward_backward(self, model_id, batch):
        self.calls.append(("alone", model_id))
        return f"result of {model_id}"

    def forward_backward_many(self, requests):
        self.calls.append(("joint", [m for m, _ in requests]))
        return [f"joint result of {m}" if m != "b" else ValueError("b's own failure") for m, _ in requests]


def test_a_request_joins_only_when_it_is_its_models_next_job():
    from hosted_tinker.core.types import ForwardBackwardBatch
    from hosted_tinker.server.serving.joint_passes import JointPasses

    def batch(forward_only: bool = False) -> ForwardBackwardBatch:
        return ForwardBackwardBatch(data=[], loss_fn="cross_entropy", loss_config={}, forward_only=forward_only)

    resident = {"a", "b", "c", "e"}.__contains__  # d is parked
    # b's seq 1 is up next; c's seq 5 waits behind its seq 4 (an optim_step, say); d is parked;
    # e's request is forward-only; a2 is a's own next request.
    scheduler = FakeScheduler({"a": 1, "b": 1, "c": 4, "d": 2, "e": 3}, {"a": 3, "b": 2, "c": 6, "d": 3, "e": 4})
    backend = FakeBackend()
    joint = JointPasses(backend, scheduler, resident, max_tokens=100)
    lead = joint.register("a", 1, batch())
    a2 = joint.register("a", 2, batch())
    b1 = joint.register("b", 1, batch())
    c5 = joint.register("c", 5, batch())
    d2 = joint.register("d", 2, batch())
    e3 = joint.register("e", 3, batch(forward_only=True))

    assert joint.run(lead) == "joint result of a"
    assert backend.calls == [("joint", ["a", "b"])]
    with pytest.raises(ValueError, match="b's own failure"):
        joint.run(b1)  # its turn: the outcome of the pass it joined, no second run
    assert backend.calls == [("joint", ["a", "b"])]
    assert (joint.passes, joint.joined) == (1, 1)
    for entry in (a2, c5, d2, e3):
        assert entry.outcome is None

    off = JointPasses(backend, scheduler, resident, max_tokens=0)
    assert off.run(off.register("a", 1, batch())) == "result of a"
