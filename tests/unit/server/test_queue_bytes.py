"""The scheduler's bound on the bytes pending forward_backward batches hold (``QueueLimits.
max_pending_bytes``, a key's ``pending_bytes``): over it a 429; the request a model's queue waits
for, and a batch when nothing else holds bytes, always get in. (Through the SDK and raw HTTP with
a key's own limit: tests/e2e/test_quotas.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from hosted_tinker.core.errors import ApiError
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.scheduler import QueueLimits, Scheduler

pytestmark = pytest.mark.fast


def refusal(scheduler: Scheduler, seq_id: int, size: int) -> str:
    with pytest.raises(ApiError) as refused:
        scheduler.check_capacity("m", seq_id, size=size)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"]
    return refused.value.detail


def test_pending_batches_are_bounded_in_bytes(tmp_path: Path) -> None:
    scheduler = Scheduler(Store(tmp_path / "db.sqlite"), QueueLimits(max_pending_bytes=1000))
    scheduler.open_model("m")  # it waits for seq_id 1
    scheduler.check_capacity("m", 2, size=5000)  # nothing held: a batch over the bound still fits
    scheduler.submit("forward_backward", lambda: (b"", "x"), model_id="m", seq_id=2, size=5000)
    assert scheduler.queue_status()["pending_bytes"] == 5000
    assert "would pass its bound of 1000 (--max-pending-bytes)" in refusal(scheduler, 3, 10)
    scheduler.check_capacity("m", 3, size=0)  # a request that holds no batch is not held to it
    scheduler.check_capacity("m", 1, size=10)  # the awaited one gets in: it runs the others
    scheduler.close_model("m")  # unloaded: its waiting batch fails, and its bytes are free again
    assert scheduler.queue_status()["pending_bytes"] == 0 and scheduler.queue_status()["pending"] == 0
    scheduler.shutdown()
