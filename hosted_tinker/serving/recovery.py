"""After the worker process died: put each training model it held back on the new worker.

A model comes back from its newest training-state checkpoint (``save_state``), with its
optimizer moments, step count and randomness; what it learned after that checkpoint is gone,
and the error of the request that was running says so. A model with no such checkpoint
cannot come back: it is marked lost, and its next request is told to recreate it.
"""

from __future__ import annotations

import logging

from hosted_tinker.backends.base import LoraSpec
from hosted_tinker.checkpoints import CheckpointFiles, TinkerPath, state_from_files
from hosted_tinker.serving.training import TrainingService

log = logging.getLogger(__name__)


class ModelRecovery:
    def __init__(self, training: TrainingService, files: CheckpointFiles) -> None:
        self.training = training
        self.files = files

    def __call__(self, model_ids: list[str]) -> dict[str, str]:
        """On the dispatch thread, with the new worker up: per model, what became of it."""
        return {model_id: self._restore(model_id) for model_id in model_ids}

    def _restore(self, model_id: str) -> str:
        store, backend = self.training.store, self.training.backend
        model = store.get_model(model_id)
        if model is None or model.status != "active":
            return "was no longer in use"
        saved = [c for c in store.list_checkpoints(model_id) if c.kind == "weights"]  # newest first
        if not saved:
            self._lose(model_id)
            return "had no saved training state and is lost; create it again (or load a checkpoint)"
        path = TinkerPath(model_id, "weights", saved[0].name)
        try:
            loaded = state_from_files(path, self.files.read(path))
            backend.create_adapter(model_id, LoraSpec(**model.lora))
            backend.load_state(model_id, loaded.state, with_optimizer=True)
        except Exception:
            log.exception("could not restore %s from %s", model_id, path)
            self._lose(model_id)
            return f"could not be restored from {path} and is lost; create it again (or load a checkpoint)"
        self.training.weights_changed(model_id)
        return (
            f"was restored from {path} (optimizer step {loaded.state.steps}); training after that checkpoint was lost"
        )

    def _lose(self, model_id: str) -> None:
        self.training.store.set_model_status(model_id, "lost")
        self.training.scheduler.close_model_threadsafe(model_id, "was lost when its worker died", "server")
        if self.training.live is not None:
            self.training.live.drop(model_id)
