"""What ``/healthz`` says of the server, gathered from its parts: one function, used by the
route and by the console's server page (which must not ask the server over HTTP)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from hosted_tinker.rank.plans import backend_options
from hosted_tinker.server.protocol import responses as rsp

if TYPE_CHECKING:
    from hosted_tinker.server.api.state import ServerState


def health(state: ServerState) -> rsp.ServerHealthResponse:
    # Each part is its owner's open object (``ServerHealthResponse``).
    return rsp.ServerHealthResponse(
        status="ok",
        served_models=state.config.served_names(),
        capabilities=asdict(state.backend.capabilities),
        backend_options=backend_options(state.config).model_dump(),
        queue=state.scheduler.queue_status(),
        body_bytes=state.body_bytes.status(),
        worker=state.backend.status(),
        inference=state.vllm.status() if state.vllm is not None else state.sampling.embedded.status(),
        active=state.store.count_active(),
        residency=state.training.residency.status(),
        joint_passes=state.training.joint.status(),
        checkpoint_mirror=state.checkpoints.mirror.status(),
        auth=state.keys.describe(),
    )
