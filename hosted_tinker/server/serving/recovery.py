"""After the worker process died: put each training model it held back on the new worker.

A model comes back from its newest training-state checkpoint (``save_state``), with its
optimizer moments, step count and randomness; what it learned after that checkpoint is gone,
and its client is told (``ProcessBackend``). A model with no such checkpoint, or one that
cannot be loaded, cannot come back: it is marked lost, and its next request is told to
recreate it.
"""

from __future__ import annotations

import logging

from hosted_tinker.core.checkpoints import CheckpointFiles, TinkerPath, state_from_files
from hosted_tinker.core.errors import WorkerDied
from hosted_tinker.core.types import LoraSpec
from hosted_tinker.server.serving.training import TrainingService

log = logging.getLogger(__name__)

RECREATE = "create it again (or load a checkpoint)"


class ModelRecovery:
    """What ``ProcessBackend`` calls, on the dispatch thread, once a new worker is up."""

    def __init__(self, training: TrainingService, files: CheckpointFiles) -> None:
        self.training = training
        self.files = files

    def restore(self, model_id: str) -> str:
        """Recreate ``model_id`` on the new worker from its last saved state; what became of it.
        Raises ``WorkerDied`` if the new worker dies meanwhile."""
        store, backend = self.training.store, self.training.backend
        model = store.get_model(model_id)
        if model is None or model.status != "active":
            return "was no longer in use"
        saved = [c for c in store.list_checkpoints(model_id) if c.kind == "weights"]  # newest first
        if not saved:
            return self.lose(model_id, "had no saved training state")
        path = TinkerPath(model_id, "weights", saved[0].name)
        try:
            loaded = state_from_files(path, self.files.read(path), backend.capabilities.family)
            backend.trainer.create_adapter(model_id, LoraSpec(**model.lora))
            backend.trainer.load_state(model_id, loaded.state, with_optimizer=True)
        except WorkerDied:
            raise
        except Exception:
            log.exception("could not restore %s from %s", model_id, path)
            if backend.trainer.has_adapter(model_id):  # created, not loaded: give its memory back
                backend.trainer.delete_adapter(model_id)
            return self.lose(model_id, f"could not be restored from {path}")
        self.training.events.weights_changed(model_id)
        return (
            f"was restored from {path} (optimizer step {loaded.state.steps}); training after that checkpoint was lost"
        )

    def lose(self, model_id: str, why: str) -> str:
        """Mark ``model_id`` lost: its waiting requests fail, and so will its next ones."""
        self.training.store.set_model_status(model_id, "lost")
        self.training.residency.forget(model_id)
        self.training.scheduler.close_model_threadsafe(model_id, "was lost when its worker died", "server")
        self.training.events.gone(model_id)
        return f"{why} and is lost; {RECREATE}"
