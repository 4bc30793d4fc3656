"""Which training models are resident on the workers, and parking the others.

A parked model's full training state (adapter, optimizer moments, step count and randomness:
what ``save_state`` writes) is on disk under ``<data-dir>/parked/``, its adapter is freed on the
workers, and its status is ``parked``. Its next request brings it back first, on the dispatch
thread, so that its client gets exactly the results it would have had if the model had never
left. A model is parked

- when its session has been silent (no heartbeat) and the model unused for ``idle_s``: a client
  that died must not hold worker memory forever (``park_idle``, from the server's sweep);
- when a model must become resident while ``max_resident`` are: the least recently used model
  of the tenant holding the most resident models (the incoming one counted) goes, so that one key
  with many models parks its own before anyone else's (``fair_victim``);
- when the server stops (``park_all``): the next start serves the same models, under the same
  ids, from where they were.

Everything here that touches a model runs on the dispatch thread, between the model's jobs.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable

from hosted_tinker.core.calls import on_rank_0
from hosted_tinker.core.checkpoints import (
    CheckpointError,
    CheckpointFiles,
    TinkerPath,
    state_from_files,
    state_to_files,
)
from hosted_tinker.core.errors import RolledBack, ServerError, UserError, WorkerCrashed, WorkerDied
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.scheduler import Job, Scheduler
from hosted_tinker.server.workers.backend import ProcessBackend

log = logging.getLogger(__name__)

PARKED = "parked"
NOTICE = "rolled_back.txt"  # in a parked state: the RolledBack notice its model is still owed
RECREATE = "create it again (or load a checkpoint)"


class ServerStopping(ServerError):
    """A job reached the worker after the server began parking its models to stop."""


class Residency:
    def __init__(
        self,
        backend: ProcessBackend,
        store: Store,
        scheduler: Scheduler,
        files: CheckpointFiles,
        *,
        max_resident: int | None = None,
    ) -> None:
        self.backend = backend
        self.store = store
        self.scheduler = scheduler
        self.files = files  # <data-dir>/parked: one private checkpoint per parked model
        self.max_resident = max_resident
        self._used: dict[str, float] = {}  # resident model -> when it last ran a job (monotonic)
        self._owners: dict[str, str] = {}  # model -> its tenant, read once from the store
        self.parked_total = 0  # since start, for /healthz
        self.restored_total = 0
        self.closing = False  # set by the shutdown's park_all: no later job may bring a model back

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

    def resident(self) -> list[str]:
        """The models on the workers, most recently used first (the console's server page)."""
        used = dict(self._used)  # the dispatch thread changes it: a copy, then sort
        return sorted(used, key=used.__getitem__, reverse=True)

    def clear_orphans(self) -> int:
        """At start-up: delete saved states whose model is not parked (a kill between writing
        one and recording it, or between bringing a model back and deleting it)."""
        parked = {model_id for model_id, _ in self.store.parked_models()}
        orphans = [d.name for d in self.files.root.iterdir() if d.is_dir() and not d.name.startswith(".")]
        orphans = [run_id for run_id in orphans if run_id not in parked]
        for run_id in orphans:
            shutil.rmtree(self.files.root / run_id, ignore_errors=True)
        return len(orphans)

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
            self._restore(model_id)
        if model is not None and model.status in ("active", PARKED):
            self._used[model_id] = time.monotonic()

    def _restore(self, model_id: str) -> None:
        self._make_room(model_id)
        path = self._path(model_id)
        try:
            files = self.files.read(path)
            loaded = state_from_files(path, files, self.backend.capabilities.family)
        except CheckpointError as e:  # nothing to come back from: say so once, and for good
            self.store.set_model_status_if(model_id, "lost", PARKED)
            raise ServerError(
                f"model {model_id} was parked, and its saved state cannot be read ({e}); {RECREATE}"
            ) from None
        self.backend.trainer.create_adapter(model_id, loaded.state.lora)
        try:
            self.backend.trainer.load_state(model_id, loaded.state, with_optimizer=True)
        except BaseException:
            self._free(model_id)
            raise
        if not self.store.set_model_status_if(model_id, "active", PARKED):  # unloaded meanwhile
            self._free(model_id)
            self._drop_state(model_id)
            raise UserError(f"model {model_id} was unloaded")
        self._drop_state(model_id)
        if NOTICE in files:  # rolled back by a worker death before it was parked, and not yet told
            self.backend.owe_notice(model_id, RolledBack.said(files[NOTICE].decode()))
        self.restored_total += 1
        log.info("restored parked model %s (optimizer step %d)", model_id, loaded.state.steps)

    def _free(self, model_id: str) -> None:
        """Delete the adapter if the workers hold it (a new group, after a death, does not)."""
        try:
            if self.backend.trainer.has_adapter(model_id):
                self.backend.trainer.delete_adapter(model_id)
        except Exception:
            log.exception("could not free the adapter of %s", model_id)

    def _drop_state(self, model_id: str) -> None:
        """Delete a parked state, and the model's folder with it."""
        self.files.delete(self._path(model_id))
        shutil.rmtree(self.files.root / model_id, ignore_errors=True)

    def is_resident(self, model_id: str) -> bool:
        """Whether ``model_id`` is on the workers now (no store read: this process tracks it)."""
        return model_id in self._used

    def forget(self, model_id: str) -> None:
        """``model_id`` is gone (unloaded, failed, lost): its parked state too, if any."""
        self._used.pop(model_id, None)
        self._owners.pop(model_id, None)
        self._drop_state(model_id)

    # ---- parking --------------------------------------------------------------------------

    def park(self, model_id: str) -> bool:
        """Write ``model_id``'s full state to disk and free its adapter; whether it was parked.
        The status changes only once the state is on disk, and only from ``active`` (an unload
        queued meanwhile wins: its job frees the adapter), and the adapter is freed after it, so
        that a kill at any point leaves the model whole somewhere."""
        model = self.store.get_model(model_id)
        if model is None or model.status != "active" or model_id not in self._used:
            return False
        notice = self.backend.take_notice(model_id)  # exporting must not use it up: it is the client's
        try:  # its gradients too: a model parked between forward_backward and optim_step loses nothing
            state = on_rank_0(self.backend.trainer.export_state(model_id, with_optimizer=True, with_gradients=True))
            config, family = self.backend.trainer.peft_config(model_id), self.backend.capabilities.family
            files = state_to_files(state, config, model.base_model, family)
        except BaseException:
            if notice is not None:
                self.backend.owe_notice(model_id, notice)
            raise
        if notice is not None:
            files[NOTICE] = str(notice).encode()
        self.files.write(self._path(model_id), files, overwrite=True)
        if not self.store.set_model_status_if(model_id, PARKED, "active", next_seq=self.scheduler.next_seq(model_id)):
            self._drop_state(model_id)
            return False
        del self._used[model_id]
        self.backend.trainer.delete_adapter(model_id)
        self.parked_total += 1
        log.info("parked model %s (optimizer step %d)", model_id, state.steps)
        return True

    def park_idle(self, model_ids: list[str], idle_s: float) -> int:
        """Park those of ``model_ids`` (of silent sessions) that ran nothing for ``idle_s``."""
        now = time.monotonic()
        idle = [m for m in model_ids if now - self._used.get(m, now) >= idle_s]
        return sum(self.park(m) for m in idle)

    def park_all(self, deadline: float) -> tuple[int, int]:
        """At shutdown, on the dispatch thread: from now on no job brings a model back, and every
        resident model is parked, least recently used first, until ``deadline`` (monotonic).
        Returns (parked, left resident)."""
        self.closing = True
        parked = 0
        for model_id in sorted(self._used, key=self._used.__getitem__):
            if time.monotonic() >= deadline:
                break
            try:
                parked += self.park(model_id)
            except Exception:  # one model's failure must not keep the others from being saved
                log.exception("could not park %s", model_id)
        return parked, len(self._used)

    def _owner(self, model_id: str) -> str:
        if model_id not in self._owners:
            model = self.store.get_model(model_id)
            owner = self.store.session_owner(model.session_id) if model is not None else None
            self._owners[model_id] = owner or ""  # unknown owners (an open server's, gone rows) count as one
        return self._owners[model_id]

    def _check_open(self) -> None:
        if self.closing:
            raise ServerStopping("the server was stopping and did not run this request")

    def _make_room(self, model_id: str) -> None:
        """Park least recently used models until ``model_id`` fits. A victim that cannot be
        parked stays resident, and its error is logged, never reported to this request's client
        (it is about another tenant's model); a worker's death is, as for any call."""
        tried: set[str] = set()
        while self.max_resident is not None:
            others = [m for m in self._used if m != model_id]
            candidates = [m for m in others if m not in tried]
            if len(others) < self.max_resident or not candidates:
                return
            victim = fair_victim(candidates, self._used, self._owner, self._owner(model_id))
            tried.add(victim)
            try:
                if not self.park(victim):  # not active any more (unloaded, lost): not resident
                    self._used.pop(victim, None)
            except (WorkerDied, WorkerCrashed):
                raise
            except Exception:
                log.exception("could not park %s to make room for %s", victim, model_id)


def fair_victim(
    candidates: list[str], used: dict[str, float], owner_of: Callable[[str], str], incoming_owner: str
) -> str:
    """The model to park so that another of ``incoming_owner``'s can be resident: among the
    tenants, the one with the most resident ``candidates`` (the incoming model counted for its
    own), the oldest last use breaking ties; and of its models the least recently used. A global
    LRU would let one key with many models push every other tenant's off the workers, each of
    their next steps paying a save and a restore."""
    mine: dict[str, list[str]] = {}
    for model_id in candidates:
        mine.setdefault(owner_of(model_id), []).append(model_id)
    held = {owner: len(models) + (owner == incoming_owner) for owner, models in mine.items()}
    oldest = {owner: min(used[m] for m in models) for owner, models in mine.items()}
    owner = max(mine, key=lambda o: (held[o], -oldest[o]))
    return min(mine[owner], key=used.__getitem__)


def park_after_kill(store: Store, checkpoints: CheckpointFiles, parked: CheckpointFiles) -> list[str]:
    """At start-up, before anything runs. After a kill (no SIGTERM: nothing was parked) each model
    that was loaded and has a saved training state (``save_state``) is parked from the newest
    one, owing its client the notice that what it learned after it is gone; a model with none
    is lost (``Store.recover_after_restart``). Returns the models parked."""
    adopted = []
    for model_id in store.model_ids("active"):
        saved = [c for c in store.list_checkpoints(model_id) if c.kind == "weights"]  # newest first
        if not saved:
            continue
        source = TinkerPath(model_id, "weights", saved[0].name)
        try:
            files = checkpoints.read(source)
            steps = json.loads(files["training_state.json"])["steps"]
        except (CheckpointError, KeyError, ValueError):
            log.exception("model %s cannot come back from %s", model_id, source)
            continue
        notice = (
            f"the server was killed and started again, and model {model_id} was restored from {source} "
            f"(optimizer step {steps}): training after that checkpoint was lost. Training goes on from "
            "that state from your next request"
        )
        parked.write(TinkerPath(model_id, "weights", "parked"), {**files, NOTICE: notice.encode()}, overwrite=True)
        store.set_model_status_if(model_id, PARKED, "active")
        adopted.append(model_id)
    return adopted
