"""The embedded engine: rank 0's sampler (``rank.sampler``), fed requests in runs.

Requests that arrive while the worker is busy (training another model, or a run) accumulate
and go out as one run, so concurrent requests share forward passes. A run decodes in time
slices: after ``slice_s`` it pauses (its state kept on the worker) and goes to the back of the
worker's queue, so the training requests and the other runs queued meanwhile go first; a
request waits for a slice, never for another request's whole run. Each key has one run at a
time (its requests on the same weights join it); up to ``MAX_LIVE_RUNS`` runs take turns. A
request is answered as soon as its own rows have finished, whatever is left of its run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hosted_tinker.core.checkpoints import adapter_weights, peft_config
from hosted_tinker.core.errors import WorkerError
from hosted_tinker.core.sampling import Admission, SampleOutput, SampleSpec
from hosted_tinker.inference.engine import SampleListener, WeightsRef
from hosted_tinker.rank.sampler import EmbeddedSampler

MAX_BATCH_ROWS = 64  # sequences decoded together in one run
# Newcomers join a run during its first this many decode steps only: a run then ends within
# ADMIT_STEPS + max_tokens steps however requests keep coming (each late one would otherwise
# keep its key's next requests waiting, up to max_tokens more).
ADMIT_STEPS = 256
# Runs that take turns on the worker, each holding its KV cache between its slices (one per
# key, so a key cannot take every turn); a key that finds them all taken waits for one to end.
MAX_LIVE_RUNS = 4


@dataclass
class _Pending:
    weights: WeightsRef
    spec: SampleSpec
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    on_token: SampleListener | None = None
    owner: str | None = None  # the key it counts for: each key has one run at a time
    abandoned: bool = False  # its caller stopped waiting (a cancelled request): not worth decoding

    def settle(self, result: SampleOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(_settle, self.done, result)


@dataclass
class _Run:
    """A run of one key's requests on one set of weights, decoded slice by slice."""

    weights: WeightsRef
    owner: str | None
    items: list[_Pending]  # in the order the sampler numbers its requests
    budget: int  # rows it may still admit
    id: str = field(default_factory=lambda: secrets.token_hex(8))
    steps: int = 0
    started: bool = False  # its first slice (with the prefill) has been asked for
    dropped: set[int] = field(default_factory=set)


class EmbeddedEngine:
    name = "embedded"

    def __init__(
        self,
        sampler: EmbeddedSampler,
        run_on_worker: Callable[[Callable[[], None]], None],
        batch_window_s: float = 0.01,
        slice_s: float = 0.1,
        family: str = "",
    ) -> None:
        self.sampler = sampler
        self.family = family  # the served model's, whose adapters' names files say (``core.checkpoints``)
        # Queues a job behind the worker's earlier jobs (``Scheduler.run_on_worker``): sampling
        # and training share the worker, one call at a time.
        self.run_on_worker = run_on_worker
        # A request that finds the engine idle waits this long for company: clients send a
        # group's requests at once, and one batch of 16 costs about what a batch of 1 does.
        self.batch_window_s = batch_window_s
        self.slice_s = slice_s  # a run's turn on the worker (``--sample-slice``)
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._runs: deque[_Run] = deque()  # the next to decode first
        self._scheduled = False  # a turn is queued on the worker (one at a time)

    def status(self) -> dict:
        with self._lock:
            waiting, runs = len(self._pending), len(self._runs)
        return {"engine": self.name, "state": "ready", "waiting": waiting, "runs": runs}

    async def sample(
        self, weights: WeightsRef, spec: SampleSpec, on_token: SampleListener | None = None, owner: str | None = None
    ) -> SampleOutput:
        loop = asyncio.get_running_loop()
        spec = dataclasses.replace(spec, stream=on_token is not None)
        item = _Pending(weights, spec, loop.create_future(), loop, on_token, owner)
        item.done.add_done_callback(lambda done: setattr(item, "abandoned", done.cancelled()))
        with self._lock:
            self._pending.append(item)
            start = not self._scheduled
            self._scheduled = True
        if start and self.batch_window_s > 0:
            loop.call_later(self.batch_window_s, self.run_on_worker, self._turn)
        elif start:
            self.run_on_worker(self._turn)
        return await item.done

    # ---- on the worker ----------------------------------------------------------------------

    def _take(self, key: str | None, owner: str | None, max_rows: int, at_least_one: bool = False) -> list[_Pending]:
        """``owner``'s oldest-first waiting requests on weights ``key``, up to ``max_rows``
        sequences; with ``at_least_one``, the oldest even if it alone has more (it then runs
        alone: a request validation accepted must be served, and one left waiting would be
        retried forever). Call with the lock held."""
        taken: list[_Pending] = []
        rest: list[_Pending] = []
        rows = 0
        for item in self._pending:
            if item.abandoned:  # never started: nothing to stop
                continue
            fits = rows + item.spec.num_samples <= max_rows or (at_least_one and not taken)
            if item.weights.key == key and item.owner == owner and fits:
                taken.append(item)
                rows += item.spec.num_samples
            else:
                rest.append(item)
        self._pending = rest
        return taken

    def _open_runs(self) -> None:
        """New runs, last in line, for the oldest waiting requests of keys that have none, while
        fewer than ``MAX_LIVE_RUNS`` are live. A key's request that finds its key's run waits
        for it: it joins it (``_slice``'s admissions) or follows it. Last in line: a key whose
        one-step runs kept opening first took every turn from another key's paused run. Call
        with the lock held."""
        self._pending = [item for item in self._pending if not item.abandoned]
        busy = {run.owner for run in self._runs}
        for item in list(self._pending):
            if len(self._runs) >= MAX_LIVE_RUNS:
                return
            if item.owner in busy:
                continue
            items = self._take(item.weights.key, item.owner, MAX_BATCH_ROWS, at_least_one=True)
            budget = MAX_BATCH_ROWS - sum(i.spec.num_samples for i in items)  # below 0 after a large one: none admitted
            self._runs.append(_Run(item.weights, item.owner, items, budget))
            busy.add(item.owner)

    def _turn(self) -> None:
        """One turn on the worker: open runs for waiting requests, give the first run in line
        one slice (it then goes to the back of the line), and queue the next turn behind
        whatever was queued meanwhile (the next training requests)."""
        with self._lock:
            self._open_runs()
            run = self._runs.popleft() if self._runs else None
        if run is not None and not self._slice(run):
            with self._lock:
                self._runs.append(run)
        with self._lock:
            more = bool(self._runs or self._pending)
            self._scheduled = more
        if more:
            self.run_on_worker(self._turn)

    def _slice(self, run: _Run) -> bool:
        """Decode ``run`` for one slice, admitting its key's newcomers on the same weights
        between steps, up to ``MAX_BATCH_ROWS`` sequences; whether it has ended."""
        end = time.monotonic() + self.slice_s

        def admit() -> Admission:  # between decode steps
            run.steps += 1
            gone = [n for n, item in enumerate(run.items) if item.abandoned and n not in run.dropped]
            run.dropped.update(gone)
            arrivals = []
            if run.budget > 0 and run.steps <= ADMIT_STEPS:
                with self._lock:
                    arrivals = self._take(run.weights.key, run.owner, run.budget)
            run.budget -= sum(i.spec.num_samples for i in arrivals)
            run.items.extend(arrivals)
            return Admission([i.spec for i in arrivals], tuple(gone), pause=time.monotonic() >= end)

        def on_token(request: int, sample: int, token: int, logprob: float) -> None:
            listener = run.items[request].on_token  # items and the sampler's requests share one order
            if listener is not None:
                listener(sample, token, logprob)

        def on_finished(request: int, output: SampleOutput) -> None:
            run.items[request].settle(output)

        try:
            specs = [] if run.started else [i.spec for i in run.items]
            if not run.started:
                self._ensure_loaded(run.weights)
                run.started = True
            done = self.sampler.decode_slice(run.id, run.weights.key, specs, admit, on_token, on_finished)
        except Exception as e:  # UserError or not: the caller tells them apart
            for item in run.items:
                item.settle(e)
            return True
        if done:  # each was settled as it finished (a failed listener was logged): none may wait on
            for item in run.items:
                item.settle(WorkerError("the sampler ended its run without this request's output"))
        return done

    def _ensure_loaded(self, weights: WeightsRef) -> None:
        if weights.key is None or self.sampler.has_sampler(weights.key):
            return
        saved, path = weights.saved()
        files = saved.read(path, only=("adapter_config.json", "adapter_model.safetensors"))
        config = peft_config(json.loads(files["adapter_config.json"]), self.family)
        self.sampler.load_sampler(weights.key, config, adapter_weights(files["adapter_model.safetensors"], self.family))


def _settle(future: asyncio.Future, result: object) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
