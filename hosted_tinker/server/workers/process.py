"""One rank seen from the server, and the worker process that runs it on this machine: start,
call, notice death, stop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from hosted_tinker.core.errors import UserError, WorkerDied, WorkerError, WorkerStartFailed, how_it_ended
from hosted_tinker.core.messages import Callback, Listener, recv, send
from hosted_tinker.core.processes import worker_context
from hosted_tinker.core.types import Capabilities
from hosted_tinker.rank import serve as child

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a waiting call checks that the worker is still alive
FINAL = frozenset({"ready", "ok", "user_error", "peer_failed", "group_broken", "error"})  # a call's answers


class Worker:
    """One rank seen from the server, over a connection that carries ``core.messages``: a pipe
    to a child process on this machine (``WorkerProcess``), or a socket from a rank on another
    node (``server.workers.cluster.RemoteWorker``). Calls are synchronous, one at a time; a
    subclass says whether its rank is alive, how it died, and how to end it."""

    label: str  # how messages name it: "training rank 2", "training rank 2 on node 1"
    pid: int | None  # the rank's process id on its own machine, once known
    # A call that shows no sign of life (an answer, a callback, a notification) for this long
    # has hung (a deadlocked collective, a wedged GPU): the rank is killed.
    call_timeout_s: float | None
    _conn: Connection | None
    memory: dict | None = None  # the rank's memory as of its last answer (``rank.memory``)

    @property
    def conn(self) -> Connection | None:
        """Our end of the connection, for ``multiprocessing.connection.wait`` over several
        ranks (None while a remote rank has not connected yet)."""
        return self._conn

    @property
    def sentinels(self) -> list[Any]:
        """What else ``wait`` may watch for the rank's end."""
        return []

    @property
    def named(self) -> str:
        return f"{self.label} (pid {self.pid})"

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def how_it_died(self) -> str:
        raise NotImplementedError

    def kill(self) -> None:
        """End the rank now, whatever it is doing (after one died, the others may be stuck in a
        collective)."""
        raise NotImplementedError

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the rank to exit; kill it if it does not."""
        raise NotImplementedError

    def wait_ready(self, timeout_s: float) -> Capabilities:
        """Block until the backend is built (loading a model takes a while); its capabilities."""
        kind, *rest = self._recv(time.monotonic() + timeout_s, f"did not start within {timeout_s:g} s")
        if kind == "error":
            self.stop()
            raise WorkerStartFailed(f"{self.label} could not start: {rest[0]}")
        return rest[0]

    def start_call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> None:
        """Send a call without waiting (no callable arguments): its answer comes to ``read``."""
        self._send("call", method, args, kwargs)

    def read(self) -> tuple:
        """The next message, which ``conn`` says is there. A rank's final answers end with its
        memory (``rank.memory.snapshot``): kept as ``self.memory``, left out of the message."""
        try:
            message = recv(self._require_conn())
        except (EOFError, OSError):
            raise WorkerDied(self.how_it_died()) from None
        if message[0] in FINAL and len(message) == 3:
            self.memory = message[2]
            return message[:2]
        return message

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``backend.method`` in the worker. Callable keyword arguments (and ``Listener``s)
        stay here; the worker calls them back. Raises ``UserError``, ``WorkerError`` or
        ``WorkerDied``."""
        callbacks, wire_kwargs = {}, {}
        for k, v in kwargs.items():
            if isinstance(v, Listener):
                callbacks[k], wire_kwargs[k] = v.fn, Callback(k, answer=False)
            elif callable(v):
                callbacks[k], wire_kwargs[k] = v, Callback(k)
            else:
                wire_kwargs[k] = v
        self._send("call", method, args, wire_kwargs)
        while True:
            deadline = None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s
            kind, *rest = self._recv(deadline, f"did not answer {said(method)} within {self.call_timeout_s} s")
            if kind == "notify":
                name, callback_args = rest
                try:
                    callbacks[name](*callback_args)
                except Exception:  # a listener's failure is its own; the call goes on
                    log.exception("the listener %s failed", name)
            elif kind == "callback":
                name, callback_args = rest
                try:
                    answer = ("answer", callbacks[name](*callback_args))
                except Exception as e:
                    answer = ("answer_error", f"{type(e).__name__}: {e}")
                try:
                    self._send(*answer)
                except WorkerDied:
                    raise
                except Exception as e:  # an answer that cannot be pickled: the worker still waits for one
                    self._send("answer_error", f"the answer could not be sent: {type(e).__name__}: {e}")
            else:
                return outcome(kind, rest[0])

    def _require_conn(self) -> Connection:
        if self._conn is None:
            raise WorkerDied(f"{self.named} is not connected")
        return self._conn

    def _send(self, *message: Any) -> None:
        try:
            send(self._require_conn(), *message)
        except OSError:
            raise WorkerDied(self.how_it_died()) from None

    def _recv(self, deadline: float | None, overdue: str) -> tuple:
        """The rank's next message; past ``deadline`` the rank is killed: it ``overdue``."""
        while self._conn is None or not self._conn.poll(POLL_S):
            if not self.alive:
                raise WorkerDied(self.how_it_died())
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                raise WorkerDied(f"{self.named} {overdue} and was killed")
            if self._conn is None:
                time.sleep(POLL_S)
        return self.read()


class WorkerProcess(Worker):
    """A spawned child on this machine running ``child.serve``."""

    def __init__(
        self,
        factory: Callable[[], Any],  # builds what the worker serves (``rank.serve.build_rank``)
        call_timeout_s: float | None = None,
        label: str = "the training worker",
    ) -> None:
        self.call_timeout_s = call_timeout_s
        self.label = label
        context = worker_context()
        self._conn, child_end = context.Pipe()
        self.process = context.Process(target=child.serve, args=(child_end, factory), name="backend-worker")
        self.process.start()
        child_end.close()  # ours closed, the pipe reports EOF as soon as the child is gone
        self.pid = self.process.pid

    @property
    def sentinels(self) -> list[Any]:
        return [self.process.sentinel]

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.alive:
            try:
                self._send("stop")
            except WorkerDied:
                pass
            self.process.join(timeout_s)
        if self.alive:
            self.process.kill()
            self.process.join(timeout_s)
        if self._conn is not None:
            self._conn.close()

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.join(10)
        if self._conn is not None:
            self._conn.close()

    def how_it_died(self) -> str:
        self.process.join(5)
        return f"{self.named} {how_it_ended(self.process.exitcode)}"


def said(method: str) -> str:
    """A call as errors name it: ``optim_step``, not ``trainer.optim_step``."""
    return method.rpartition(".")[2]


def outcome(kind: str, value: Any) -> Any:
    """A call's final answer: its result, or the exception its kind stands for."""
    if kind == "ok":
        return value
    if kind == "user_error":
        raise UserError(value)
    raise WorkerError(value)  # "error", or a data-parallel rank's "peer_failed" or "group_broken" (see worker.group)
