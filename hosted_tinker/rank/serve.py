"""The worker process: build the backend, then run the server's calls one at a time."""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from hosted_tinker.core.errors import GroupBroken, PeerFailed, UserError
from hosted_tinker.core.messages import Callback, recv, send
from hosted_tinker.core.types import TrainingBackend

log = logging.getLogger("hosted_tinker.worker")


def serve(conn: Connection, factory: Callable[[], TrainingBackend]) -> None:
    """Entry point of the worker process; returns when told to stop or when the server is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it stops us
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s worker %(name)s: %(message)s")
    try:
        backend = factory()
    except BaseException as e:
        log.exception("could not build the backend")
        send(conn, "error", f"{type(e).__name__}: {e}")
        return
    send(conn, "ready", backend.capabilities)
    while True:
        try:
            message = recv(conn)
        except (EOFError, OSError):  # the server exited
            return
        if message[0] == "stop":
            return
        _, method, args, kwargs = message
        kwargs = {k: _remote(conn, v) if isinstance(v, Callback) else v for k, v in kwargs.items()}
        try:
            result = getattr(backend, method)(*args, **kwargs)
            reply: tuple = ("ok", _portable(result))
        except UserError as e:
            reply = ("user_error", str(e))
        except PeerFailed as e:  # another rank's failure, which that rank reports
            reply = ("peer_failed", str(e))
        except GroupBroken as e:  # the server replaces the whole group
            log.error("%s: %s", method, e)
            reply = ("group_broken", str(e))
        except Exception as e:
            log.exception("%s failed", method)
            if torch.cuda.is_initialized():  # after an OOM, give the cached blocks back
                torch.cuda.empty_cache()
            reply = ("error", describe(e))
        try:
            send(conn, *reply)
        except (EOFError, OSError):
            return
        except Exception as e:  # a result that cannot be pickled is our bug, not a reason to die
            send(conn, "error", f"{method} returned what cannot be sent to the server: {e}")


def describe(error: Exception) -> str:
    """What the failed request's error says. Running out of memory is said plainly, with what
    it means here: a failed call leaves the backend as it was (``backends.base``)."""
    summary = f"{type(error).__name__}: {error}"
    out_of_memory = isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)  # torch's CPU allocator
    )
    if out_of_memory:
        return f"out of memory ({summary}); the model is as it was before this request (a smaller batch may fit)"
    return summary


def _remote(conn: Connection, callback: Callback) -> Callable[..., Any]:
    """A stand-in that runs the server's callable and returns its answer."""

    def call(*args: Any) -> Any:
        if not callback.answer:
            send(conn, "notify", callback.name, args)
            return None
        send(conn, "callback", callback.name, args)
        kind, value = recv(conn)
        if kind == "answer_error":
            raise RuntimeError(f"the server's {callback.name} failed: {value}")
        return value

    return call


def _portable(value: Any) -> Any:
    """``value`` with every tensor on the CPU: the server process never touches the GPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _portable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v) for v in value)
    return value
