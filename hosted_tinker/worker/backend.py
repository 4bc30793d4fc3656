"""``ProcessBackend``: the training backend interface, served by a worker process that may die.

When the worker dies during a call (SIGKILL, the kernel's OOM killer, a crash in native code),
a new worker is started, ``restore`` puts the training models back (from their last saved
state where one exists), and the call raises ``WorkerCrashed``: its future fails with
``category: server`` while the requests queued behind it run on the new worker. A worker
found dead between calls is replaced the same way before the next call, which then runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from hosted_tinker.backends.base import (
    AdamParams,
    AdapterState,
    Capabilities,
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
    TrainingBackend,
    WorkerCrashed,
)
from hosted_tinker.worker.messages import Listener
from hosted_tinker.worker.process import WorkerDied, WorkerProcess

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # loading a large model from a cold disk can take minutes


class ProcessBackend:
    """Implements ``TrainingBackend`` by calling the real backend in a worker process.

    Called from the scheduler's single worker thread only, like any backend.
    """

    def __init__(self, factory: Callable[[], TrainingBackend]) -> None:
        self._factory = factory
        self._worker = WorkerProcess(factory)  # starts loading now; ``capabilities`` waits for it
        self._capabilities: Capabilities | None = None
        self._ready = threading.Lock()
        self._restoring = False
        # Set by the server: given the models the dead worker held, recreate them on the new one;
        # returns per model what became of it (for the error of the request that was running).
        self.restore: Callable[[list[str]], dict[str, str]] | None = None
        self._adapters: list[str] = []  # training models the worker holds, oldest first
        self.restarts = 0
        self.last_death: str | None = None

    @property
    def capabilities(self) -> Capabilities:
        if self._capabilities is None:
            with self._ready:
                if self._capabilities is None:
                    self._capabilities = self._worker.wait_ready(START_TIMEOUT_S)
        return self._capabilities

    def status(self) -> dict:
        """For /healthz."""
        return {
            "pid": self._worker.pid,
            "alive": self._worker.alive,
            "restarts": self.restarts,
            "last_death": self.last_death,
        }

    def close(self) -> None:
        self._worker.stop()

    # ---- calls, and what happens when the worker dies -----------------------------------------

    def ensure_alive(self) -> None:
        """Replace a worker that died between calls (on the dispatch thread, like a call)."""
        if not self._worker.alive and not self._restoring:
            self._replace(self._worker.how_it_died())

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.ensure_alive()
        try:
            return self._worker.call(method, *args, **kwargs)
        except WorkerDied as e:
            if self._restoring:  # the new worker died too; restore() gives up on this model
                raise
            restored = self._replace(str(e))
            raise WorkerCrashed(str(e), restored) from None

    def _replace(self, reason: str) -> dict[str, str]:
        """Start a new worker in place of the dead one and restore the models onto it."""
        log.error("%s; starting a new worker", reason)
        self.restarts += 1
        self.last_death = reason
        self._worker.stop()
        self._worker = WorkerProcess(self._factory)
        self._worker.wait_ready(START_TIMEOUT_S)
        held, self._adapters = self._adapters, []
        if self.restore is None:
            return {}
        self._restoring = True
        try:
            restored = self.restore(held)
        finally:
            self._restoring = False
        log.info("after the restart: %s", "; ".join(f"{m} {how}" for m, how in restored.items()) or "no models")
        return restored

    # ---- the backend interface ------------------------------------------------------------------

    def create_adapter(self, model_id: str, lora: LoraSpec) -> None:
        self._call("create_adapter", model_id, lora)
        self._adapters.append(model_id)

    def delete_adapter(self, model_id: str) -> None:
        self._call("delete_adapter", model_id)
        self._adapters.remove(model_id)

    def has_adapter(self, model_id: str) -> bool:
        return self._call("has_adapter", model_id)

    def forward_backward(self, model_id: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        return self._call("forward_backward", model_id, batch)

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        return self._call("optim_step", model_id, params)

    def export_state(self, model_id: str, *, with_optimizer: bool = True) -> AdapterState:
        return self._call("export_state", model_id, with_optimizer=with_optimizer)

    def load_state(self, model_id: str, state: AdapterState, *, with_optimizer: bool) -> None:
        self._call("load_state", model_id, state, with_optimizer=with_optimizer)

    def peft_config(self, model_id: str) -> dict:
        return self._call("peft_config", model_id)

    def snapshot_weights(self, model_id: str) -> tuple[int, dict[str, torch.Tensor]]:
        return self._call("snapshot_weights", model_id)

    def zero_adapter(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return self._call("zero_adapter")

    def has_sampler(self, key: str) -> bool:
        return self._call("has_sampler", key)

    def load_sampler(self, key: str, adapter_config: dict, weights: dict[str, torch.Tensor]) -> None:
        self._call("load_sampler", key, adapter_config, weights)

    def generate(
        self,
        key: str | None,
        specs: list,
        admit: Callable[[], list] | None = None,
        on_token: Callable[[int, int, int, float], None] | None = None,
    ) -> list:
        listener = Listener(on_token) if on_token is not None else None
        return self._call("generate", key, specs, admit=admit, on_token=listener)
