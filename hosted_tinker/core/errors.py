"""Every failure the server names, with what it means to a client: one HTTP status and one
category (``user``: the request's fault, ``server``: ours) per type.

The HTTP handlers (``server.api.errors``) answer a raised ``ServerError`` with its ``status``;
the scheduler fails a future with its ``category``. Nothing else maps exceptions to either, so a
new failure is one class here. Process boundaries (the worker pipe) carry the class by name
by kind (``core.messages``), so a rank's ``UserError`` is the server's ``UserError``.
"""

from __future__ import annotations

import signal


class ServerError(Exception):
    """Base of every named failure. ``status``: the HTTP answer when raised while handling a
    request; ``category``: what a failed future says (``retrieve_future``'s ``category``)."""

    status = 500
    category = "server"
    code: str | None = None  # a machine-readable reason, e.g. OpenAI's "model_not_found"
    headers: dict[str, str] = {}

    def message_for(self, model_id: str | None) -> str:
        """What a failed future of ``model_id`` says (the scheduler's ``fail_with``)."""
        return str(self)


class ApiError(ServerError):
    """A request answered at once with ``status`` (always with a body naming the problem)."""

    def __init__(
        self, status: int, detail: str, headers: dict[str, str] | None = None, code: str | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.category = "user" if status < 500 else "server"
        self.detail = detail
        self.headers = headers or {}
        self.code = code


def bad_request(detail: str) -> ApiError:
    return ApiError(400, detail)


def not_found(detail: str) -> ApiError:
    return ApiError(404, detail)


def too_many(detail: str, retry_after_s: float) -> ApiError:
    """Over a queue bound (429): the SDK waits ``Retry-After`` and sends the request again."""
    return ApiError(429, f"{detail}; retry later", headers={"Retry-After": str(max(1, round(retry_after_s)))})


def unavailable(detail: str, retry_after: float) -> ApiError:
    """The inference engine cannot take the request now (503: clients, the SDK among them, retry)."""
    return ApiError(503, detail, headers={"Retry-After": str(max(1, round(retry_after)))}, code="engine_unavailable")


# ---- the request's fault ------------------------------------------------------------------------


class UserError(ServerError, ValueError):
    """A request that cannot be honoured because of what the user asked for."""

    status = 400
    category = "user"


class WireError(UserError):
    """A request body that cannot be decoded; the message names the offending field."""


class UnsupportedEncoding(WireError):
    """A Content-Encoding we cannot undo: the body is fine, its packaging is not."""

    status = 415


# ---- ours ---------------------------------------------------------------------------------------


class EngineUnavailable(ServerError):
    """The inference engine cannot take requests now; ``retry_after`` says when to try again."""

    status = 503
    code = "engine_unavailable"

    def __init__(self, message: str, retry_after: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WorkerDied(ServerError):
    """A worker process ended, or was killed for hanging (the message says how)."""


class WorkerStartFailed(ServerError, RuntimeError):
    """A rank could not build its backend (no GPU, a missing model, ...): the message says why."""


def how_it_ended(exitcode: int | None) -> str:
    """A process's end as ``WorkerDied`` says it, from its exit code (negative: a signal)."""
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:  # a real-time signal has no name
            name = f"signal {-exitcode}"
        hint = " (the kernel's out-of-memory killer sends SIGKILL)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {exitcode}"


class WorkerError(ServerError):
    """The worker raised an unexpected exception while running a call; it still serves."""

    def message_for(self, model_id: str | None) -> str:
        return f"the training worker failed this request: {self}"


class WorkerCrashed(ServerError):
    """The worker process died while running a call; a new one has taken its place.

    reason    how it died, e.g. "killed by SIGKILL"
    restored  per training model: how it came back ("was restored from tinker://...") or why not
    """

    def __init__(self, reason: str, restored: dict[str, str]) -> None:
        super().__init__(worker_restarted(reason))
        self.reason = reason
        self.restored = restored

    def message_for(self, model_id: str | None) -> str:
        """What the failed request of ``model_id`` is told (nothing about other tenants' models)."""
        message = f"{worker_restarted(self.reason)} and this request was not completed"
        if model_id in self.restored:
            message += f". Model {model_id} {self.restored[model_id]}"
        return message


class RolledBack(ServerError):
    """The worker died while running another request, and this model came back from its last
    saved state. Its next request fails with this, once, so that its client learns that the
    training since that state is gone."""

    def __init__(self, reason: str, model_id: str, how: str) -> None:
        super().__init__(
            f"{worker_restarted(f'{reason} while running another request')} and model {model_id} {how}. "
            "Training goes on from that state from your next request"
        )

    @classmethod
    def said(cls, message: str) -> RolledBack:
        """The notice again, from its message (a parked model carries it on disk)."""
        notice = cls.__new__(cls)
        ServerError.__init__(notice, message)
        return notice


def worker_restarted(reason: str) -> str:
    """The one wording of "the worker died": how, and that a new one took its place."""
    return f"{reason}; the worker was restarted"


# ---- between the ranks of a group (never seen by a client as such) -------------------------------


class PeerFailed(ServerError):
    """Another rank of the group failed this request; that rank's error is the one to report,
    and this rank has undone its part too."""


class GroupBroken(ServerError):
    """A collective of the group failed: a peer went away, or stayed silent past the collective
    timeout. The group can no longer be trusted and is replaced as a whole."""
