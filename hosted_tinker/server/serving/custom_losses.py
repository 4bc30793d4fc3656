"""Custom losses a session uploads (``create_custom_loss``) and its training clients run by id
(``forward_backward`` with ``loss_fn="custom"``, ``loss_fn_config={"loss_id": …}``).

The graph is checked against the allowed operations when it is created (a 400 naming the
node that is not allowed: ``core.custom_loss``), stored as the data it came as in the server's
SQLite file (so a loss outlives a restart, like its session), and compiled again on the ranks
for each batch. A loss belongs to its session: another session's id is unknown to a model.
A session stores at most ``MAX_PER_SESSION`` losses, its key at most ``custom_loss_bytes`` of them
over its unfinished sessions (``server.quotas``); a finished session's go with it.
"""

from __future__ import annotations

import json
import secrets
import threading
import time

import numpy as np
import torch

from hosted_tinker.core.custom_loss import CustomLossDef, CustomLossError
from hosted_tinker.core.errors import ApiError, bad_request, not_found
from hosted_tinker.server.persistence.schema import connect
from hosted_tinker.server.persistence.store import Store
from hosted_tinker.server.protocol import json_types as wire
from hosted_tinker.server.protocol.proto_codec import WireDatum
from hosted_tinker.server.quotas import Quotas
from hosted_tinker.server.scheduler import Scheduler

_SCHEMA = """
CREATE TABLE IF NOT EXISTS custom_losses (
    loss_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    name TEXT NOT NULL,
    inputs TEXT NOT NULL,
    nodes TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""


MAX_PER_SESSION = 64


class CustomLossService:
    def __init__(self, store: Store, scheduler: Scheduler, quotas: Quotas | None = None) -> None:
        self.store = store
        self.scheduler = scheduler
        self.quotas = quotas  # the key's custom_loss_bytes
        self._db = connect(store.path, _SCHEMA)
        self._lock = threading.Lock()

    def create(self, req: wire.CreateCustomLossRequest, owner: str) -> str:
        """A future whose result names the stored loss; a resend (same session and
        ``custom_loss_seq_id``) gets the first one's. Runs on the event loop: the quotas are
        checked and the loss stored in one step."""
        key = f"{req.session_id}:custom_loss"
        if (existing := self.scheduler.find(key, req.custom_loss_seq_id)) is not None:
            return existing
        if self.store.session_status(req.session_id) != "active":
            raise bad_request(f"session {req.session_id} has finished; start a new ServiceClient")
        definition = CustomLossDef(req.name, tuple((i.name, i.rank) for i in req.inputs), tuple(req.graph.nodes))
        try:
            definition.compile()
        except CustomLossError as e:
            raise bad_request(f"create_custom_loss {req.name!r}: {e}") from None
        loss_id = f"loss-{secrets.token_urlsafe(12)}"
        inputs, nodes = json.dumps(definition.inputs), json.dumps(req.graph.nodes)
        row = (loss_id, req.session_id, req.name, inputs, nodes, time.time())
        with self._lock:
            (count,) = self._db.execute(
                "SELECT COUNT(*) FROM custom_losses WHERE session_id=?", (req.session_id,)
            ).fetchone()
            if count >= MAX_PER_SESSION:
                raise ApiError(
                    403, f"this session stores {count} custom losses, the most a session may", code="quota_exceeded"
                )
            if self.quotas is not None:
                self.quotas.new_custom_loss(owner, len(inputs) + len(nodes), lambda: self._stored_by(owner))
            self._db.execute("INSERT INTO custom_losses VALUES (?,?,?,?,?,?)", row)
        request_id = self.scheduler.register("create_custom_loss", model_id=key, seq_id=req.custom_loss_seq_id)
        body = json.dumps({"loss_id": loss_id, "type": "create_custom_loss"}).encode()
        self.scheduler.complete(request_id, body, "application/json")
        return request_id

    def _stored_by(self, owner: str) -> int:
        """Bytes of the losses of ``owner``'s unfinished sessions (under ``_lock``)."""
        (size,) = self._db.execute(
            "SELECT COALESCE(SUM(LENGTH(inputs) + LENGTH(nodes)), 0) FROM custom_losses WHERE session_id IN "
            "(SELECT session_id FROM sessions WHERE owner=? AND status='active')",
            (owner,),
        ).fetchone()
        return size

    def finish_session(self, session_id: str) -> None:
        """A finished session's losses can no longer be run: they go."""
        with self._lock:
            self._db.execute("DELETE FROM custom_losses WHERE session_id=?", (session_id,))

    def get(self, session_id: str, loss_id: object) -> CustomLossDef:
        """The session's loss ``loss_id`` (a 400 for a malformed id, a 404 for another's)."""
        if not isinstance(loss_id, str):
            raise bad_request("loss_fn_config.loss_id must be the loss_id create_custom_loss returned")
        with self._lock:
            row = self._db.execute(
                "SELECT name, inputs, nodes FROM custom_losses WHERE loss_id=? AND session_id=?", (loss_id, session_id)
            ).fetchone()
        if row is None:
            raise not_found(f"loss_fn_config.loss_id {loss_id!r} does not exist in this model's session")
        name, inputs, nodes = row
        return CustomLossDef(name, tuple((n, r) for n, r in json.loads(inputs)), tuple(json.loads(nodes)))


def datum_inputs(loss: CustomLossDef, d: WireDatum, where: str, targets: np.ndarray) -> dict[str, torch.Tensor]:
    """The inputs ``loss`` reads from one datum, each at its declared rank: 0 a scalar, 1 one
    value per position, 2 ``(N, K)``; ``logprobs`` is shaped like the targets."""
    (_, lp_rank), *declared = loss.inputs
    if targets.ndim != lp_rank:
        raise bad_request(
            f"{where}.loss_fn_inputs.target_tokens has rank {targets.ndim}, but loss {loss.name!r} "
            f"declared logprobs with rank {lp_rank}"
        )
    n = len(d.tokens)
    tensors: dict[str, torch.Tensor] = {}
    for name, rank in declared:
        value = d.loss_fn_inputs.get(name)
        field = f"{where}.loss_fn_inputs.{name}"
        if value is None:
            raise bad_request(f"{field} is required by loss {loss.name!r}")
        if rank == 0 and value.size == 1:
            value = value.reshape(())
        if value.ndim != rank or (rank and value.shape[0] != n):
            expected = "a scalar" if rank == 0 else f"rank {rank} with {n} rows"
            raise bad_request(f"{field} has shape {list(value.shape)}; loss {loss.name!r} declared {expected}")
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise bad_request(f"{field} contains NaN or infinity")
        tensors[name] = torch.from_numpy(value.astype(np.float32 if value.dtype.kind == "f" else np.int64))
    # Inputs the loss does not read stay here, as the SDK's client-side runner ignores them.
    return tensors
