"""LoRA sync: every training run's current adapter, live in vLLM after each optimizer step.

On the worker, right after ``optim_step`` (and after create/load, which also set the weights),
the adapter's tensors are cloned on their device: the only part on the training path. The rest
runs on the event loop and a writer thread: the tensors go to a fresh directory (``/dev/shm``
when there is one) as PEFT safetensors in the layout vLLM reads (``inference.vllm_layout``),
written under a temporary name and renamed, so vLLM never reads a half-written adapter; then
vLLM loads it under a new name and the previous version is retired (unloaded once no request
uses it, its directory deleted).

Steps that come faster than syncs coalesce: only the newest pending weights are written.
A request for a run's live adapter waits for a sync in progress, so after ``optim_step``
returns, the next request samples the new weights (if that sync failed, it is logged and the
previous version stays live until the next step).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hosted_tinker.core.errors import UserError
from hosted_tinker.inference.vllm_adapters import AdapterRegistry, remove_dir, spawn
from hosted_tinker.inference.vllm_layout import PLAIN, VllmLayout

log = logging.getLogger(__name__)


ROOT_PREFIX = "hosted-tinker-live-"


def default_root(data_dir: Path) -> Path:
    """A fresh folder in shared memory when the machine has it (an adapter write is then a memory
    copy), else in ``data_dir``; folders of servers that died without cleaning up are removed."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else data_dir
    for stale in base.glob(f"{ROOT_PREFIX}*"):
        pid = stale.name.removeprefix(ROOT_PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-", dir=base))


@dataclass
class _Snapshot:
    step: int
    adapter_config: dict
    weights: dict[str, torch.Tensor]  # cloned on the training device
    taken_at: float  # time.monotonic() when optim_step's work ended


@dataclass
class _Run:
    pending: _Snapshot | None = None
    current: tuple[str, Path] | None = None  # (version key, directory)
    syncing: asyncio.Event | None = None  # set when no sync is in progress


class LiveAdapters:
    def __init__(
        self, adapters: AdapterRegistry, ready: Callable[[], bool], root: Path, layout: VllmLayout = PLAIN
    ) -> None:
        self.adapters = adapters
        self.layout = layout  # how vLLM reads the served model's adapters
        self._ready = ready  # True when vLLM can load now (else a version loads on first use)
        self.root = root
        self._runs: dict[str, _Run] = {}
        self._dropped: set[str] = set()  # unloaded runs: a step already on the worker is ignored
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._latencies: deque[float] = deque(maxlen=256)
        self.synced = 0
        self.latency_total = 0.0  # seconds, over every sync (a Prometheus summary's sum)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def close(self) -> None:
        self._closed = True
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- called on the worker -------------------------------------------------------------

    def publish(self, model_id: str, step: int, adapter_config: dict, weights: dict[str, torch.Tensor]) -> None:
        """The run's weights just changed: queue them for vLLM (``weights`` must be a copy)."""
        snapshot = _Snapshot(step, adapter_config, weights, time.monotonic())
        if self._loop is None:  # bind_loop comes at start-up, before any training
            raise RuntimeError("LoRA sync is not bound to the event loop")
        self._loop.call_soon_threadsafe(self._enqueue, model_id, snapshot)

    # ---- on the event loop ----------------------------------------------------------------

    def _enqueue(self, model_id: str, snapshot: _Snapshot) -> None:
        if model_id in self._dropped or self._closed:
            return
        run = self._runs.setdefault(model_id, _Run())
        run.pending = snapshot
        if run.syncing is None or run.syncing.is_set():
            run.syncing = asyncio.Event()
            spawn(self._sync(model_id, run))

    async def _sync(self, model_id: str, run: _Run) -> None:
        try:
            while run.pending is not None:
                snapshot, run.pending = run.pending, None
                try:
                    await self._sync_one(model_id, run, snapshot)
                except Exception:  # the previous version stays live; the next step tries again
                    log.exception("LoRA sync of %s step %d failed", model_id, snapshot.step)
        finally:
            if run.syncing is not None:  # (set before this task was spawned)
                run.syncing.set()

    async def _sync_one(self, model_id: str, run: _Run, snapshot: _Snapshot) -> None:
        directory = self.root / model_id.replace(":", "_") / f"step{snapshot.step}-{secrets.token_hex(4)}"
        await asyncio.to_thread(_write_adapter, directory, snapshot, self.layout)
        key = f"live:{model_id}:{directory.name}"
        if self._runs.get(model_id) is not run:  # unloaded meanwhile
            shutil.rmtree(directory, ignore_errors=True)
            return
        if self._ready():
            try:  # load now, so the first request after the step does not pay for it
                self.adapters.release(await self.adapters.acquire(key, directory, remove_dir(directory)))
            except Exception as e:  # it loads on first use instead
                log.warning("LoRA sync of %s step %d: %s", model_id, snapshot.step, e)
        previous, run.current = run.current, (key, directory)
        if previous is not None and not self.adapters.retire(previous[0]):
            shutil.rmtree(previous[1], ignore_errors=True)
        self._latencies.append(time.monotonic() - snapshot.taken_at)
        self.latency_total += self._latencies[-1]
        self.synced += 1

    async def current(self, model_id: str) -> tuple[str, Path]:
        """The newest synced version of a run's adapter (waiting for a sync in progress)."""
        run = self._runs.get(model_id)
        if run is not None and run.syncing is not None:
            await run.syncing.wait()
        if run is None or run.current is None:
            raise UserError(f"training run {model_id!r} has no adapter on this server")
        return run.current

    def drop(self, model_id: str) -> None:
        """The run was unloaded: retire its adapter."""
        self._dropped.add(model_id)
        run = self._runs.pop(model_id, None)
        if run is not None and run.current is not None and not self.adapters.retire(run.current[0]):
            shutil.rmtree(run.current[1], ignore_errors=True)

    def stats(self) -> dict:
        lat = list(self._latencies)
        return {
            "synced_versions": self.synced,
            "live_runs": len(self._runs),
            "latency_ms_last": round(lat[-1] * 1000, 1) if lat else None,
            "latency_ms_p50": round(statistics.median(lat) * 1000, 1) if lat else None,
            "latency_ms_max": round(max(lat) * 1000, 1) if lat else None,
            "root": str(self.root),
        }


def write_zero_adapter(
    root: Path, adapter_config: dict, weights: dict[str, torch.Tensor], layout: VllmLayout = PLAIN
) -> Path:
    directory = root / "base-zero"
    _write_adapter(directory, _Snapshot(0, adapter_config, weights, time.monotonic()), layout)
    return directory


def _write_adapter(directory: Path, snapshot: _Snapshot, layout: VllmLayout) -> None:
    """Write under a temporary name in the same folder, then rename: readers see all or nothing."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".writing-", dir=directory.parent))
    try:
        weights = {k: v.to("cpu", non_blocking=False) for k, v in snapshot.weights.items()}
        for name, data in layout.files(snapshot.adapter_config, weights).items():
            (staging / name).write_bytes(data)
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
