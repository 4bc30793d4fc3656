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
                  ("peer_failed", message)         another rank of the group failed the call
                  ("group_broken", message)        a collective failed: the group must be replaced
                  ("error", summary)               the backend raised anything else

Plain pickle, not multiprocessing's: tensors travel by value rather than as shared-memory
handles, so nothing the server holds refers to memory of a worker that may die. They travel as
numpy arrays, which pickle their buffers directly: torch's own reduction serialises each
storage like ``torch.save`` and costs ~20x more (5 ms for one 8 x 256-token batch).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch


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
    conn.send_bytes(dumps(message))


def dumps(message: tuple) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(message)
    return buffer.getvalue()


# A dtype numpy lacks (bfloat16, float8, complex32) travels as its bits, as integers of its size.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type != "cpu":
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # torch's own way, for the rare rest
    tensor = tensor.detach().resolve_conj().resolve_neg()  # numpy() refuses lazy conj/neg views
    try:
        return torch.from_numpy, (tensor.numpy(),)
    except TypeError:
        bits = tensor.view(_BITS[tensor.element_size()]).numpy()
        return _from_bits, (bits, str(tensor.dtype).removeprefix("torch."))


def _from_bits(bits: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(bits).view(getattr(torch, dtype))


# Exact types only: an ``nn.Parameter`` (never sent) would keep torch's own reduction.
_DISPATCH = copyreg.dispatch_table | {torch.Tensor: _reduce_tensor}


def recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())
