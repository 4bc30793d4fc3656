"""Which training models are resident on the workers, and parking the others.

A parked model's full training state (adapter, optimizer moments, step count and randomness:
what ``save_state`` writes) is on disk under ``<data-dir>/parked/``, its adapter is freed on the
workers, and its status is ``parked``. Its next request brings it back first, on the dispatch
thread, so that its client gets exactly the results it would have had if the model had never
left. A model is parked

- when its session has been silent (no heartbeat) and the model unused for ``idle_s``: a client
  that died must not hold worker memory forever (``park_idle``, from the server's sweep);
- when a model must become resident while ``max_resident`` are: the least recently used goes;
- when the server stops (``park_all``): the next start serves the same models, under the same
  ids, from where they were.

Everything here that touches a model runs on the dispatch thread, between the model's jobs.
"""

from __future__ import annotations

import logging
import time

from hosted_tinker.core.checkpoints import CheckpointFiles, TinkerPath, state_from_files, state_to_files
from hosted_tinker.core.errors import ServerError
from hosted_tinker.core.types import TrainingBackend
from hosted_tinker.server.scheduler import Job
from hosted_tinker.server.store import Store

log = logging.getLogger(__name__)

PARKED = "parked"


class ServerStopping(ServerError):
    """A job reached the worker after the server began parking its models to stop."""


class Residency:
    def __init__(
        self, backend: TrainingBackend, store: Store, files: CheckpointFiles, *, max_resident: int | None = None
    ) -> None:
        self.backend = backend
        self.store = store
        self.files = files  # <data-dir>/parked: one private checkpoint per parked model
        self.max_resident = max_resident
        self._used: dict[str, float] = {}  # resident model -> when it last ran a job (monotonic)
        self.parked_total = 0  # since start, for /healthz
        self.restored_total = 0
        self.closing = False  # at shutdown: models are being parked, no job may bring one back

    @staticmethod
    def _path(model_id: str) -> TinkerPath:
        return TinkerPath(model_id, "weights", "parked")

    def status(self) -> dict:
        """For /healthz."""
        return {
            "resident": len(self._used),
            "max_resident": self.max_resident,
            "parked_since_start": self.parked_total,
            "restored_since_start": self.restored_total,
        }

    # ---- around a model's jobs ------------------------------------------------------------

    def around(self, model_id: str, job: Job) -> Job:
        """``job``, run once its model is resident."""

        def run() -> tuple[bytes, str]:
            self.bring_back(model_id)
            return job()

        return run

    def admit(self, model_id: str) -> None:
        """Before a new adapter is made for ``model_id``: room for it."""
        self._check_open()
        self._make_room(model_id)
        self._used[model_id] = time.monotonic()

    def bring_back(self, model_id: str) -> None:
        """Make ``model_id`` resident again if it is parked, and note that it is in use."""
        self._check_open()
        model = self.store.get_model(model_id)
        if model is not None and model.status == PARKED:
            self._make_room(model_id)
            path = self._path(model_id)
            loaded = state_from_files(path, self.files.read(path))
            self.backend.create_adapter(model_id, loaded.state.lora)
            try:
                self.backend.load_state(model_id, loaded.state, with_optimizer=True)
            except BaseException:
                self.backend.delete_adapter(model_id)
                raise
            self.store.set_model_status(model_id, "active")
            self.files.delete(path)
            self.restored_total += 1
            log.info("restored parked model %s (optimizer step %d)", model_id, loaded.state.steps)
        if model is not None and model.status in ("active", PARKED):
            self._used[model_id] = time.monotonic()

    def forget(self, model_id: str) -> None:
        """``model_id`` is gone (unloaded, failed, lost): its parked state too, if any."""
        self._used.pop(model_id, None)
        self.files.delete(self._path(model_id))

    def is_resident(self, model_id: str) -> bool:
        return model_id in self._used

    # ---- parking --------------------------------------------------------------------------

    def park(self, model_id: str) -> bool:
        """Write ``model_id``'s full state to disk and free its adapter; whether it was parked.
        The status changes only once the state is on disk, and the adapter is freed after it,
        so that a kill at any point leaves the model whole somewhere."""
        model = self.store.get_model(model_id)
        if model is None or model.status != "active" or model_id not in self._used:
            return False
        state = self.backend.export_state(model_id, with_optimizer=True)
        config = self.backend.peft_config(model_id)
        self.files.write(self._path(model_id), state_to_files(state, config, model.base_model), overwrite=True)
        self.store.set_model_status(model_id, PARKED)
        del self._used[model_id]
        self.backend.delete_adapter(model_id)
        self.parked_total += 1
        log.info("parked model %s (optimizer step %d)", model_id, state.steps)
        return True

    def park_idle(self, model_ids: list[str], idle_s: float) -> int:
        """Park those of ``model_ids`` (of silent sessions) that ran nothing for ``idle_s``."""
        now = time.monotonic()
        idle = [m for m in model_ids if now - self._used.get(m, now) >= idle_s]
        return sum(self.park(m) for m in idle)

    def park_all(self, deadline: float) -> tuple[int, int]:
        """Park every resident model, least recently used first, until ``deadline`` (monotonic);
        returns (parked, left resident)."""
        parked = 0
        for model_id in sorted(self._used, key=self._used.__getitem__):
            if time.monotonic() >= deadline:
                break
            try:
                parked += self.park(model_id)
            except Exception:  # one model's failure must not keep the others from being saved
                log.exception("could not park %s", model_id)
        return parked, len(self._used)

    def _check_open(self) -> None:
        if self.closing:
            raise ServerStopping("the server is stopping and did not run this request; send it again")

    def _make_room(self, model_id: str) -> None:
        if self.max_resident is None:
            return
        while len([m for m in self._used if m != model_id]) >= self.max_resident:
            victim = min((m for m in self._used if m != model_id), key=self._used.__getitem__)
            if not self.park(victim):  # not active any more (unloaded meanwhile): not resident
                self._used.pop(victim, None)
