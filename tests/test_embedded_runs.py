"""How the embedded engine shares the worker: a run admits newcomers on its weights between
decode steps, for its first ``ADMIT_STEPS`` steps only, so that requests arriving all the time
cannot stretch one run (and hold up the training requests queued behind it) without end."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hosted_tinker.core.sampling import SampledSequence, SampleOutput, SampleSpec
from hosted_tinker.inference import embedded
from hosted_tinker.inference.embedded import EmbeddedEngine
from hosted_tinker.inference.engine import WeightsRef

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]


class Steps:
    """A sampler whose runs take ``steps`` decode steps; at the steps in ``arrive_at`` of its
    first run a request comes in (sent from the worker thread, as a client would, meanwhile)."""

    def __init__(self, steps: int, arrive_at: list[int], send) -> None:
        self.steps, self.arrive_at, self.send = steps, arrive_at, send
        self.runs: list[list[int]] = []  # per run, the prompt (its first token) of each request

    def has_sampler(self, key: str) -> bool:
        return True

    def generate(self, key, specs: list[SampleSpec], admit=None, on_token=None) -> list[SampleOutput]:
        run = [spec.prompt[0] for spec in specs]
        self.runs.append(run)
        for step in range(1, self.steps + 1):
            if len(self.runs) == 1 and step in self.arrive_at:
                self.send(step)
            arrivals = admit().arrivals
            specs = [*specs, *arrivals]
            run += [spec.prompt[0] for spec in arrivals]
        return [SampleOutput([SampledSequence(tokens=[1])]) for _ in specs]


def test_newcomers_join_a_run_for_its_first_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "ADMIT_STEPS", 10)

    async def main() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        sent: list = []

        def send(step: int) -> None:  # on the worker thread: returns once the request waits
            waiting = engine.status()["waiting"]
            sent.append(asyncio.run_coroutine_threadsafe(engine.sample(WeightsRef(None), spec(step)), loop))
            deadline = time.monotonic() + 10
            while engine.status()["waiting"] == waiting:
                assert time.monotonic() < deadline, "the request never reached the engine"
                time.sleep(0.001)

        sampler = Steps(steps=30, arrive_at=[3, 10, 11, 25], send=send)
        engine = EmbeddedEngine(sampler, lambda job: threading.Thread(target=job).start(), batch_window_s=0)
        await engine.sample(WeightsRef(None), spec(0))
        for future in sent:
            await asyncio.wrap_future(future)
        return sampler.runs

    runs = asyncio.run(main())
    # a request sent before the step's admission joins at once: those of steps 3 and 10 (the
    # 10th admission); those of steps 11 and 25 wait for the next run
    assert runs == [[0, 3, 10], [11, 25]]


def spec(first: int) -> SampleSpec:
    return SampleSpec(prompt=[first, 7], max_tokens=4)
