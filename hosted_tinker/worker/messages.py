"""What travels over the pipe between the server and its worker: pickled tuples.

parent -> child   ("call", method, args, kwargs)   run ``backend.method(*args, **kwargs)``
                  ("answer", value)                what a callback returned
                  ("answer_error", message)        a callback raised
                  ("stop",)                        exit cleanly
child -> parent   ("ready", capabilities)          the backend is built
                  ("callback", name, args)         call the parent's callable argument ``name``
                  ("notify", name, args)           the same, but send no answer (streamed tokens)
                  ("ok", value)                    the call's result
                  ("user_error", message)          the backend raised ``UserError``
                  ("error", summary)               the backend raised anything else

Plain pickle, not multiprocessing's: tensors travel by value rather than as shared-memory
handles, so nothing the server holds refers to memory of a worker that may die.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


@dataclass(frozen=True)
class Callback:
    """Stands in, on the wire, for a callable argument the worker calls back (``admit``).
    ``answer`` False: the worker does not wait for the call (a listener such as ``on_token``)."""

    name: str
    answer: bool = True


@dataclass(frozen=True)
class Listener:
    """Wraps a callable argument whose return value nobody needs: the worker notifies it and
    goes on, rather than waiting a round trip per call (one per streamed token)."""

    fn: Callable[..., Any]


def send(conn: Connection, *message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())
