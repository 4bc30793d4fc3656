"""A sampler's snapshot of a training model's adapter (``save_weights_for_sampler`` without a
name, behind ``save_weights_and_get_sampling_client``): a frozen copy among the ephemeral files,
registered as a sampling session, not a checkpoint (no row, no quota, no download). Older ones
are retired as new ones come; a finished session's go with it."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from hosted_tinker.core.checkpoints import CheckpointFiles, TinkerPath
from hosted_tinker.core.errors import bad_request
from hosted_tinker.inference.engine import WeightsRef
from hosted_tinker.server.persistence.records import ModelRecord, SamplerRecord
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.scheduler import Job
from hosted_tinker.server.serving.events import CheckpointEvents
from hosted_tinker.server.serving.training import TrainingService, json_result

# Ephemeral sampler snapshots kept per training model; older ones are deleted (asking for one
# then gets a 404). Async RL samples from a policy a few steps stale, never from 8 steps back.
KEEP_SNAPSHOTS = 8

# A model's adapter as the files of a checkpoint of a kind (``CheckpointService._export``).
Export = Callable[[str, ModelRecord], dict[str, bytes]]


class SamplerSnapshots:
    def __init__(
        self, training: TrainingService, ephemeral: CheckpointFiles, events: CheckpointEvents, export: Export
    ) -> None:
        self.training = training
        self.store = training.store
        self.ephemeral = ephemeral
        self.events = events  # a snapshot is heard of (vLLM loads it ahead), as a checkpoint is
        self.export = export

    def save(self, req: wire.SaveWeightsForSamplerRequest) -> str:
        """A frozen copy of the current adapter, registered as a sampling session. An inflight
        one is also the new target of every inflight session of the model (``weights_of``)."""

        def prepare(model: ModelRecord) -> Job:
            sampler_id = f"{model.session_id}:sample:{req.sampling_session_seq_id}"
            if self.store.get_sampler(sampler_id) is not None:
                raise bad_request(f"sampling_session_seq_id {req.sampling_session_seq_id} is already used")

            def job() -> tuple[bytes, str]:
                snapshot = TinkerPath(req.model_id, "sampler_weights", f"ephemeral-{secrets.token_hex(8)}")
                self.ephemeral.write(snapshot, self.export("sampler_weights", model), overwrite=False)
                self.store.add_sampler(
                    sampler_id,
                    session_id=model.session_id,
                    base_model=model.base_model,
                    model_path=None,
                    model_id=req.model_id,
                    snapshot=str(snapshot),
                    kind=req.kind,
                )
                self._retire_old(req.model_id)
                self.events.snapshot(WeightsRef(str(snapshot), self.ephemeral, snapshot))
                return json_result({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

            return job

        return self.training.submit_ordered("save_weights_for_sampler", req.model_id, req.seq_id, prepare)

    def _retire_old(self, model_id: str) -> None:
        """Keep a model's newest snapshot sessions; an inflight session stays (it follows the
        newest inflight weights), only its own old weights go."""
        samplers = self.store.ephemeral_samplers(model_id=model_id)
        self._retire_snapshots([s for s in samplers if s.kind == "snapshot"][KEEP_SNAPSHOTS:])
        for sampler in [s for s in samplers if s.kind == "inflight"][KEEP_SNAPSHOTS:]:
            self.ephemeral.delete(_snapshot(sampler))

    def _retire_snapshots(self, samplers: list[SamplerRecord]) -> None:
        """Delete ephemeral snapshots (an RL loop makes one per step; each is a full adapter)."""
        for sampler in samplers:
            self.store.delete_sampler(sampler.sampler_id)
            self.ephemeral.delete(_snapshot(sampler))

    def finish_session(self, session_id: str) -> None:
        """A finished session's ephemeral samplers can no longer be used: free their disk."""
        self._retire_snapshots(self.store.ephemeral_samplers(session_id=session_id))


def _snapshot(sampler: SamplerRecord) -> TinkerPath:
    """Where an ephemeral sampler's snapshot is (``ephemeral_samplers`` lists only those with one)."""
    if sampler.snapshot is None:
        raise ValueError(f"sampler {sampler.sampler_id} has no snapshot")
    return TinkerPath.parse(sampler.snapshot)
