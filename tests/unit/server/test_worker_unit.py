"""The unit tests of what tests/e2e/test_worker_unit.py tests end to end (no server here)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from hosted_tinker.server.api.app import _watch_worker

pytestmark = pytest.mark.fast


def test_the_watchdog_queues_one_replacement_at_a_time_and_backs_off():
    """While a replacement is queued or running, no other is queued; failed ones wait longer."""
    calls, running, overlaps, polls = [], 0, [], [0]

    class Backend:
        def status(self) -> dict:
            polls[0] += 1
            return {"alive": len(calls) >= 4 and running == 0}

        def ensure_alive(self) -> None:
            nonlocal running
            running += 1
            overlaps.append(running)
            calls.append(time.monotonic())
            time.sleep(0.05)
            running -= 1
            if len(calls) < 4:
                raise RuntimeError("the training worker could not start")

    class Scheduler:
        def run_on_worker(self, fn) -> None:
            threading.Thread(target=fn).start()

    state = SimpleNamespace(backend=Backend(), scheduler=Scheduler())

    async def until(condition, deadline_s: float = 10.0) -> None:
        deadline = time.monotonic() + deadline_s
        while not condition():
            assert time.monotonic() < deadline, "the watchdog did not get there in time"
            await asyncio.sleep(0.01)

    async def watch() -> None:
        task = asyncio.create_task(_watch_worker(state, every_s=0.02, max_wait_s=0.08))
        await until(lambda: len(calls) >= 4 and running == 0)  # replaced, after three failures
        seen = polls[0]
        await until(lambda: polls[0] >= seen + 5)  # seen alive a few times: nothing more queued
        task.cancel()

    asyncio.run(watch())
    assert len(calls) == 4 and max(overlaps) == 1  # three failures, then a success, never two at once
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert gaps[1] > gaps[0] + 0.01  # backing off
