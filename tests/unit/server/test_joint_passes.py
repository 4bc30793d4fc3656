"""A joint pass finishes each request's preparation where it runs (``Pending.finish``: the
recorded routing, read on the dispatch thread), and a request whose preparation fails fails
alone: the pass runs the others."""

from __future__ import annotations

import pytest

from hosted_tinker.core.errors import UserError
from hosted_tinker.core.types import DatumInput, ForwardBackwardBatch, ForwardBackwardResult
from hosted_tinker.server.serving.joint_passes import JointPasses


class Trainer:
    def __init__(self) -> None:
        self.passes: list[list[str]] = []

    def forward_backward_many(self, work: list[tuple[str, ForwardBackwardBatch]]) -> list[ForwardBackwardResult]:
        self.passes.append([model_id for model_id, _ in work])
        return [ForwardBackwardResult([], float(len(model_id))) for model_id, _ in work]

    def forward_backward(self, model_id: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        return self.forward_backward_many([(model_id, batch)])[0]


class Scheduler:
    """Every model's request 1 is up next."""

    def up_next(self, model_id: str) -> int:
        return 1

    def next_seq(self, model_id: str) -> int:
        return 1


def batch() -> ForwardBackwardBatch:
    import torch

    return ForwardBackwardBatch(
        [DatumInput(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]))], "cross_entropy", {}, False
    )


def test_a_preparation_that_fails_fails_its_request_alone_and_each_is_finished_when_its_pass_runs() -> None:
    trainer = Trainer()
    joint = JointPasses(trainer, Scheduler(), lambda _: True, max_tokens=100)  # type: ignore[arg-type]
    finished: list[str] = []

    def refuse() -> None:
        raise UserError("data[0].model_input_spans name sequences sampled from another model")

    lead = joint.register("a", 1, batch(), lambda: finished.append("a"))
    refused = joint.register("bb", 1, batch(), refuse)
    plain = joint.register("ccc", 1, batch())
    later = joint.register("dddd", 1, batch(), lambda: finished.append("dddd"))
    assert finished == []  # nothing of it where the requests were checked
    assert joint.run(lead).loss_sum == 1.0
    assert trainer.passes == [["a", "ccc", "dddd"]]  # the refused request left out, the others together
    assert finished == ["a", "dddd"]
    with pytest.raises(UserError, match="another model"):
        joint.run(refused)
    assert joint.run(plain).loss_sum == 3.0 and joint.run(later).loss_sum == 4.0
    assert trainer.passes == [["a", "ccc", "dddd"]] and finished == ["a", "dddd"]  # each finished once


def test_a_lead_whose_preparation_fails_runs_nothing() -> None:
    trainer = Trainer()
    joint = JointPasses(trainer, Scheduler(), lambda _: True, max_tokens=100)  # type: ignore[arg-type]

    def refuse() -> None:
        raise UserError("refused")

    lead = joint.register("a", 1, batch(), refuse)
    other = joint.register("b", 1, batch())
    with pytest.raises(UserError, match="refused"):
        joint.run(lead)
    assert trainer.passes == []
    assert joint.run(other).loss_sum == 1.0 and trainer.passes == [["b"]]
