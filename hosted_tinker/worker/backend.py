"""``ProcessBackend``: the training backend interface, served by a worker process that may die.

When the worker dies during a call (SIGKILL, the kernel's OOM killer, a crash in native code),
a new worker is started, ``restore`` puts the training models back (from their last saved
state where one exists), and the call raises ``WorkerCrashed``: its future fails with
``category: server`` while the requests queued behind it run on the new worker. A worker
found dead between calls is replaced the same way before the next call, which then runs.
Every other restored model is behind where its client thinks it is: its next training call
raises ``RolledBack`` (once), unless that call replaces or deletes its state anyway.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from hosted_tinker.backends.base import (
    AdamParams,
    AdapterState,
    Capabilities,
    ForwardBackwardBatch,
    ForwardBackwardResult,
    LoraSpec,
    RolledBack,
    TrainingBackend,
    WorkerCrashed,
)
from hosted_tinker.worker.messages import Listener
from hosted_tinker.worker.process import WorkerDied, WorkerProcess

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # loading a large model from a cold disk can take minutes
RESTORE_ATTEMPTS = 3  # new workers tried in a row when each dies while models are restored

# Calls on one model's state: the first after its rollback raises ``RolledBack``...
_TRAINING_CALLS = frozenset({"forward_backward", "optim_step", "export_state", "peft_config", "snapshot_weights"})
# ...and these make the rollback moot.
_STATE_REPLACING_CALLS = frozenset({"load_state", "delete_adapter"})


class Recovery(Protocol):
    """Puts the dead worker's training models back on a new one (``serving.recovery``)."""

    def restore(self, model_id: str) -> str:
        """Recreate ``model_id``; what became of it ("was restored from ...", or why not)."""
        ...

    def lose(self, model_id: str, why: str) -> str:
        """Give ``model_id`` up; what its client is told."""
        ...


class ProcessBackend:
    """Implements ``TrainingBackend`` by calling the real backend in a worker process.

    Called from the scheduler's single worker thread only, like any backend.
    """

    def __init__(self, factory: Callable[[], TrainingBackend], call_timeout_s: float | None = None) -> None:
        self._factory = factory
        self._call_timeout_s = call_timeout_s  # see WorkerProcess
        self._worker = WorkerProcess(factory, call_timeout_s)  # loads now; ``capabilities`` waits for it
        self._capabilities: Capabilities | None = None
        self._ready = threading.Lock()
        self._restoring = False
        self.recovery: Recovery | None = None  # set by the server; without it, models are not restored
        self._adapters: list[str] = []  # training models the worker holds, oldest first
        self._rolled_back: dict[str, str] = {}  # model -> what its next training call is told
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
        _ = self.capabilities  # the first worker's "ready" must be read before any call's answer
        self.ensure_alive()
        model_id = args[0] if method in _TRAINING_CALLS | _STATE_REPLACING_CALLS else None
        if model_id is not None and not self._restoring:
            notice = self._rolled_back.pop(model_id, None)
            if notice is not None and method in _TRAINING_CALLS:
                raise RolledBack(notice)
        try:
            return self._worker.call(method, *args, **kwargs)
        except WorkerDied as e:
            if self._restoring:  # the new worker died too: _replace starts another
                raise
            restored = self._replace(str(e))
            self._rolled_back.pop(model_id, None)  # this call's own failure tells its client
            raise WorkerCrashed(str(e), restored) from None

    def _replace(self, reason: str) -> dict[str, str]:
        """Start a new worker in place of the dead one and restore the models onto it; per model,
        what became of it. Each model that came back from a saved state is owed a ``RolledBack``
        (see ``_call``). A model whose restoring kills the new worker too is given up, and the
        others go onto yet another worker."""
        log.error("%s; starting a new worker", reason)
        self.restarts += 1
        self.last_death = reason
        todo, self._adapters = self._adapters, []  # models to put back, oldest first
        outcome: dict[str, str] = {}
        for _ in range(RESTORE_ATTEMPTS):
            self._worker.stop()
            try:
                self._worker = WorkerProcess(self._factory, self._call_timeout_s)
                self._worker.wait_ready(START_TIMEOUT_S)
            except BaseException:
                self._adapters = todo  # still owed: the next replacement restores them
                raise
            if self.recovery is None:
                return outcome
            self._restoring = True
            try:
                while todo:
                    outcome[todo[0]] = self.recovery.restore(todo[0])
                    todo.pop(0)
                break
            except WorkerDied as e:  # while restoring todo[0], which is not tried again
                log.error("%s while restoring %s; starting another worker", e, todo[0])
                self.restarts += 1
                self.last_death = str(e)
                culprit = todo.pop(0)
                outcome[culprit] = self.recovery.lose(culprit, f"killed the new worker too while being restored ({e})")
                todo, self._adapters = self._adapters + todo, []  # those restored died with it
            finally:
                self._restoring = False
        for model_id in todo:  # the workers kept dying
            outcome[model_id] = self.recovery.lose(model_id, "could not be restored: new workers kept dying")
        log.info("after the restart: %s", "; ".join(f"{m} {how}" for m, how in outcome.items()) or "no models")
        for model_id, how in outcome.items():
            if how.startswith("was restored"):
                self._rolled_back[model_id] = (
                    f"{reason} while running another request; the worker was restarted and model {model_id} {how}. "
                    "Training goes on from that state from your next request"
                )
        return outcome

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
