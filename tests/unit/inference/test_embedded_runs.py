"""How the embedded engine shares the worker: a run admits its key's newcomers on its weights
between decode steps, for its first ``ADMIT_STEPS`` steps only; it decodes in time slices, going
to the back of the worker's queue after each, so training jobs and other keys' runs queued
meanwhile go first; each key has a run of its own; and a request is answered as soon as its own
rows have finished. A fake sampler stands in for the rank (``decode_slice``); the worker is a
one-thread executor, as the scheduler's dispatch thread is."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hosted_tinker.core.sampling import Admission, SampledSequence, SampleOutput, SampleSpec
from hosted_tinker.inference import embedded
from hosted_tinker.inference.embedded import EmbeddedEngine
from hosted_tinker.inference.engine import WeightsRef

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]


class Steps:
    """A sampler whose requests each take ``spec.max_tokens`` decode steps of ``step_s`` (a run's
    rows decode together); ``log`` records each step as (run's first prompt token, step); at the
    steps in ``arrive_at`` of its first run ``send(step)`` is called (a client sending a request
    meanwhile)."""

    def __init__(self, arrive_at: tuple[int, ...] = (), send=None, step_s: float = 0.0) -> None:
        self.arrive_at, self.send, self.step_s = arrive_at, send, step_s
        self.runs: list[list[int]] = []  # per run, the prompt (its first token) of each request
        self.log: list[tuple] = []
        self._state: dict[str, tuple[list[int], list[SampleSpec], list[int]]] = {}  # id -> (run, specs, steps done)

    def has_sampler(self, key: str) -> bool:
        return True

    def decode_slice(self, run_id, key, specs, admit, on_token=None, on_finished=None) -> bool:
        if run_id not in self._state:
            self.runs.append([spec.prompt[0] for spec in specs])
            self._state[run_id] = (self.runs[-1], list(specs), [0] * len(specs))
        run, specs, done = self._state[run_id]
        step = 0
        while any(d < spec.max_tokens for d, spec in zip(done, specs, strict=True)):
            step = max(done) + 1
            time.sleep(self.step_s)
            for i, spec in enumerate(specs):
                if done[i] < spec.max_tokens:
                    done[i] += 1
                    if done[i] == spec.max_tokens:
                        on_finished(i, SampleOutput([SampledSequence(tokens=[spec.prompt[0]])]))
            self.log.append((run[0], step))
            if len(self.runs) == 1 and step in self.arrive_at:
                self.send(step)
            admission = admit()
            specs += admission.arrivals
            done += [0] * len(admission.arrivals)
            run += [spec.prompt[0] for spec in admission.arrivals]
            if admission.pause and any(d < s.max_tokens for d, s in zip(done, specs, strict=True)):
                return False
        del self._state[run_id]
        return True


def spec(first: int, max_tokens: int = 4) -> SampleSpec:
    return SampleSpec(prompt=[first, 7], max_tokens=max_tokens)


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

        sampler = Steps(arrive_at=(3, 10, 11, 25), send=send)
        engine = EmbeddedEngine(sampler, lambda job: threading.Thread(target=job).start(), batch_window_s=0)
        await engine.sample(WeightsRef(None), spec(0, max_tokens=30))
        for future in sent:
            await asyncio.wrap_future(future)
        return sampler.runs

    runs = asyncio.run(main())
    # a request sent before the step's admission joins at once: those of steps 3 and 10 (the
    # 10th admission); those of steps 11 and 25 wait for the next run
    assert runs == [[0, 3, 10], [11, 25]]


def _engine(sampler: Steps, worker: ThreadPoolExecutor, slice_s: float = 0.0) -> EmbeddedEngine:
    return EmbeddedEngine(sampler, worker.submit, batch_window_s=0, slice_s=slice_s)


def test_a_run_gives_the_worker_back_after_each_slice() -> None:
    """With slices of one step, a job queued while a run decodes (at its step 2) runs before the
    run's next step, not after its last."""

    async def main() -> list[tuple]:
        with ThreadPoolExecutor(1) as worker:
            sampler = Steps(arrive_at=(2,), send=lambda step: worker.submit(sampler.log.append, ("train",)))
            await _engine(sampler, worker).sample(WeightsRef(None), spec(1, max_tokens=50))
            return sampler.log

    log = asyncio.run(main())
    assert log[:4] == [(1, 1), (1, 2), ("train",), (1, 3)] and len(log) == 51


def _send_from_the_worker(engine: EmbeddedEngine, loop, asks: list[tuple[SampleSpec, str]], sent: list) -> None:
    """Send ``asks`` (spec, owner) as clients would while the worker decodes; return once the
    engine has them all."""
    waiting = engine.status()["waiting"]
    for ask, owner in asks:
        sent.append(asyncio.run_coroutine_threadsafe(engine.sample(WeightsRef(None), ask, owner=owner), loop))
    deadline = time.monotonic() + 10
    while engine.status()["waiting"] < waiting + len(asks):
        assert time.monotonic() < deadline, "the requests never reached the engine"
        time.sleep(0.001)


def test_keys_have_runs_of_their_own_that_take_turns_and_answer_as_rows_finish() -> None:
    """Key b's 2-step request, sent while key a's 40-step run decodes on the same weights, gets
    a run of its own (it does not join a's) and is answered after a few slices; key a's second
    request, 3 steps, joins a's run and is answered as soon as its rows are done."""

    async def main() -> tuple[list[list[int]], list[int], int]:
        loop = asyncio.get_running_loop()
        sent: list = []
        answered: list[int] = []  # the steps decoded when each request was answered
        with ThreadPoolExecutor(1) as worker:
            asks = [(spec(2, max_tokens=2), "b"), (spec(3, max_tokens=3), "a")]
            sampler = Steps(arrive_at=(2,), send=lambda _: _send_from_the_worker(engine, loop, asks, sent), step_s=0.01)
            engine = _engine(sampler, worker)
            long = asyncio.ensure_future(engine.sample(WeightsRef(None), spec(1, max_tokens=40), owner="a"))
            deadline = time.monotonic() + 10
            while len(sent) < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
            for future in (*sent, long):
                await asyncio.wrap_future(future) if not isinstance(future, asyncio.Future) else await future
                answered.append(len(sampler.log))
        return sampler.runs, answered, len(sampler.log)

    runs, answered, steps = asyncio.run(main())
    assert runs == [[1, 3], [2]]  # b's request decoded in a run of its own
    assert steps == 42  # a's run: 40 steps; b's: 2
    assert answered[0] < 25 and answered[1] < 25, answered  # long before a's 40 steps


def test_runs_beyond_the_live_bound_wait_for_one_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "MAX_LIVE_RUNS", 2)
    live: list[int] = []

    class Counting(Steps):
        def decode_slice(self, run_id, key, specs, admit, on_token=None, on_finished=None) -> bool:
            done = super().decode_slice(run_id, key, specs, admit, on_token, on_finished)
            live.append(len(self._state))  # runs paused here after this slice
            return done

    async def main() -> list[list[int]]:
        with ThreadPoolExecutor(1) as worker:
            sampler = Counting(step_s=0.002)
            engine = _engine(sampler, worker)
            await asyncio.gather(*[engine.sample(WeightsRef(None), spec(k, 10), owner=str(k)) for k in range(4)])
            return sampler.runs

    assert sorted(asyncio.run(main())) == [[0], [1], [2], [3]]
    assert max(live) == 2


def test_an_admission_asks_for_a_pause_once_the_slice_is_over() -> None:
    """A slice ends by time: with a long slice the run decodes to its end in one call."""
    calls: list[bool] = []

    class Counting(Steps):
        def decode_slice(self, run_id, key, specs, admit, on_token=None, on_finished=None) -> bool:
            calls.append(bool(specs))
            return super().decode_slice(run_id, key, specs, admit, on_token, on_finished)

    async def main() -> None:
        with ThreadPoolExecutor(1) as worker:
            await _engine(Counting(), worker, slice_s=60).sample(WeightsRef(None), spec(1, max_tokens=20))

    asyncio.run(main())
    assert calls == [True]  # one call, with its specs: never paused
    assert Admission().pause is False


def test_a_keys_runs_that_keep_opening_do_not_take_every_turn() -> None:
    """From a review: new runs went first in line, so a key whose requests each fill a run (64
    rows of one step: nothing joins them) opened one after another ahead of another key's paused
    run, which waited until the key stopped (41 s for a 100-token sample). New runs now go last:
    the victim's 20 steps end while the attacker's 30 runs are still being served."""

    async def main() -> list[tuple]:
        loop = asyncio.get_running_loop()
        sent: list = []
        hog = SampleSpec(prompt=[2, 7], max_tokens=1, num_samples=64)
        with ThreadPoolExecutor(1) as worker:
            sampler = Steps(arrive_at=(1,), send=lambda _: _send_from_the_worker(engine, loop, [(hog, "a")] * 30, sent))
            engine = _engine(sampler, worker)
            await engine.sample(WeightsRef(None), spec(1, max_tokens=20), owner="v")
            for future in sent:
                await asyncio.wrap_future(future)
            return sampler.log

    log = asyncio.run(main())
    victim_done = log.index((1, 20))
    attacker_steps = [i for i, (run, _) in enumerate(log) if run == 2]
    assert len(attacker_steps) == 30 and victim_done < attacker_steps[-1], log
