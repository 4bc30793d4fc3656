"""The embedded engine: rank 0's sampler (``rank.sampler``), fed requests in batches.

Requests that arrive while the worker is busy (training another model, or a previous batch)
accumulate and go out as one batch, so concurrent requests share forward passes, and a
training request waits for at most one sampling batch (``MAX_BATCH_ROWS`` sequences).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from safetensors.torch import load as load_safetensors

from hosted_tinker.core.sampling import Admission, SampleOutput, SampleSpec, TokenListener
from hosted_tinker.inference.engine import SampleListener, WeightsRef

MAX_BATCH_ROWS = 64  # sequences decoded together in one run
# Newcomers join a run during its first this many decode steps only: a run then ends within
# ADMIT_STEPS + max_tokens steps however requests keep coming (each late one would otherwise
# hold the worker, and the training requests queued behind the run, up to max_tokens more).
ADMIT_STEPS = 256


@dataclass
class _Pending:
    weights: WeightsRef
    spec: SampleSpec
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    on_token: SampleListener | None = None
    abandoned: bool = False  # its caller stopped waiting (a cancelled request): not worth decoding

    def settle(self, result: SampleOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(_settle, self.done, result)


class Sampler(Protocol):
    """The embedded sampler's calls (``rank.sampler.EmbeddedSampler``, on the worker)."""

    def has_sampler(self, key: str) -> bool: ...

    def load_sampler(self, key: str, adapter_config: dict, weights: dict[str, torch.Tensor]) -> None: ...

    def generate(
        self,
        key: str | None,
        specs: list[SampleSpec],
        admit: Callable[[], Admission] | None = None,
        on_token: TokenListener | None = None,
    ) -> list[SampleOutput]: ...


class EmbeddedEngine:
    name = "embedded"

    def __init__(
        self, sampler: Sampler, run_on_worker: Callable[[Callable[[], None]], None], batch_window_s: float = 0.01
    ) -> None:
        self.sampler = sampler
        # Queues a batch behind the worker's earlier jobs (``Scheduler.run_on_worker``): sampling
        # and training share the worker, one call at a time.
        self.run_on_worker = run_on_worker
        # A request that finds the engine idle waits this long for company: clients send a
        # group's requests at once, and one batch of 16 costs about what a batch of 1 does.
        self.batch_window_s = batch_window_s
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._scheduled = False

    def status(self) -> dict:
        with self._lock:
            waiting = len(self._pending)
        return {"engine": self.name, "state": "ready", "waiting": waiting}

    async def sample(
        self, weights: WeightsRef, spec: SampleSpec, on_token: SampleListener | None = None
    ) -> SampleOutput:
        loop = asyncio.get_running_loop()
        spec = dataclasses.replace(spec, stream=on_token is not None)
        item = _Pending(weights, spec, loop.create_future(), loop, on_token)
        item.done.add_done_callback(lambda done: setattr(item, "abandoned", done.cancelled()))
        with self._lock:
            self._pending.append(item)
            start = not self._scheduled
            self._scheduled = True
        if start and self.batch_window_s > 0:
            loop.call_later(self.batch_window_s, self.run_on_worker, self._run_batch)
        elif start:
            self.run_on_worker(self._run_batch)
        return await item.done

    # ---- on the worker ----------------------------------------------------------------------

    def _take(self, key: str | None, max_rows: int, at_least_one: bool = False) -> list[_Pending]:
        """Oldest-first waiting requests on weights ``key``, up to ``max_rows`` sequences; with
        ``at_least_one``, the oldest even if it alone has more (it then runs alone: a request
        validation accepted must be served, and one left waiting would be retried forever)."""
        with self._lock:
            taken, rest, rows = [], [], 0
            for item in self._pending:
                if item.abandoned:  # never started: nothing to stop
                    continue
                fits = rows + item.spec.num_samples <= max_rows or (at_least_one and not taken)
                if item.weights.key == key and fits:
                    taken.append(item)
                    rows += item.spec.num_samples
                else:
                    rest.append(item)
            self._pending = rest
            return taken

    def _run_batch(self) -> None:
        """Decode the oldest request's weights group, admitting newcomers on the same weights
        between steps, up to ``MAX_BATCH_ROWS`` sequences per run (so a run ends, and training
        requests queued behind it wait for one run at most)."""
        with self._lock:
            head = self._pending[0] if self._pending else None
        if head is not None:
            self._sample_group(head.weights)
        with self._lock:
            more = bool(self._pending)
            self._scheduled = more
        if more:
            self.run_on_worker(self._run_batch)

    def _sample_group(self, weights: WeightsRef) -> None:
        items = self._take(weights.key, MAX_BATCH_ROWS, at_least_one=True)
        budget = MAX_BATCH_ROWS - sum(i.spec.num_samples for i in items)  # below 0 after a large one: none admitted
        steps = 0
        dropped: set[int] = set()

        def admit() -> Admission:  # between decode steps
            nonlocal budget, steps
            steps += 1
            gone = [n for n, item in enumerate(items) if item.abandoned and n not in dropped]
            dropped.update(gone)
            arrivals = self._take(weights.key, budget) if budget > 0 and steps <= ADMIT_STEPS else []
            budget -= sum(i.spec.num_samples for i in arrivals)
            items.extend(arrivals)
            return Admission([i.spec for i in arrivals], tuple(gone))

        def on_token(request: int, sample: int, token: int, logprob: float) -> None:
            listener = items[request].on_token  # items and the engine's requests share one order
            if listener is not None:
                listener(sample, token, logprob)

        try:
            self._ensure_loaded(weights)
            specs = [i.spec for i in items]
            outputs = self.sampler.generate(weights.key, specs, admit, on_token)
        except Exception as e:  # UserError or not: the caller tells them apart
            for item in items:
                item.settle(e)
            return
        for item, output in zip(items, outputs, strict=True):
            item.settle(output)

    def _ensure_loaded(self, weights: WeightsRef) -> None:
        if weights.key is None or self.sampler.has_sampler(weights.key):
            return
        files = weights.files.read(weights.path, only=("adapter_config.json", "adapter_model.safetensors"))
        config = json.loads(files["adapter_config.json"])
        self.sampler.load_sampler(weights.key, config, load_safetensors(files["adapter_model.safetensors"]))


def _settle(future: asyncio.Future, result: object) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
