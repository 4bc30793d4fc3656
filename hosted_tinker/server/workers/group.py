"""The worker processes of one backend: one per rank (``rank.serve``), started, called and
stopped together; a single worker is a group of one.

Rank 0 answers what needs one copy (``call``); what every rank must do goes to all at once
(``call_each``), and while their answers are awaited every rank is watched: if one dies, hangs,
or leaves the others waiting in a collective past its timeout, the whole group is stopped (a
group that lost a collective cannot go on) and ``WorkerDied`` says which rank and how.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from hosted_tinker.core.errors import UserError, WorkerDied, WorkerError, WorkerStartFailed
from hosted_tinker.core.types import Capabilities
from hosted_tinker.server.workers.cluster import Cluster
from hosted_tinker.server.workers.process import POLL_S, Worker, WorkerProcess, outcome, said

PEER_GRACE_S = 5.0  # after a rank's collective failed, how long the others get to answer


class WorkerGroup:
    """``factories``: one per rank. Without a ``cluster`` every rank runs here; with one, this
    node runs the first ``cluster.ranks_per_node`` and the other nodes' agents the rest."""

    def __init__(
        self,
        factories: Sequence[Callable[[], Any]],
        call_timeout_s: float | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        self.call_timeout_s = call_timeout_s
        single = len(factories) == 1
        here = len(factories) if cluster is None else cluster.ranks_per_node
        self.workers: list[Worker] = [
            WorkerProcess(factory, call_timeout_s, "the training worker" if single else f"training rank {rank}")
            for rank, factory in enumerate(factories[:here])
        ]
        if cluster is not None:
            elsewhere = {rank: factory for rank, factory in enumerate(factories) if rank >= here}
            self.workers += cluster.start(elsewhere, call_timeout_s)

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def pids(self) -> list[int | None]:  # None: a rank not yet connected (``WorkerProcess.pid``)
        return [w.pid for w in self.workers]

    def ranks(self) -> list[dict]:
        """Each rank's pid, device and memory as of its last answer (for /healthz and /metrics)."""
        return [{"pid": w.pid, "device": (w.memory or {}).get("device"), "memory": w.memory} for w in self.workers]

    @property
    def alive(self) -> bool:
        return all(w.alive for w in self.workers)

    def how_it_died(self) -> str:
        dead = [w for w in self.workers if not w.alive] or self.workers
        return dead[0].how_it_died()

    def wait_ready(self, timeout_s: float) -> Capabilities:
        """Block until every rank's backend is built; rank 0's capabilities. If one cannot start,
        the others (waiting for it to join the group) are stopped."""
        if self.size == 1:
            return self.workers[0].wait_ready(timeout_s)
        replies = self._gather(
            time.monotonic() + timeout_s,
            f"did not start within {timeout_s:g} s",
            stop_early=lambda kind: kind == "error",
        )
        for rank, (kind, *rest) in replies.items():
            if kind == "error":
                self.kill()  # the others wait for it to join the group
                raise WorkerStartFailed(f"training rank {rank} could not start: {rest[0]}")
        return replies[0][1]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on rank 0 alone (callable arguments allowed, see ``WorkerProcess.call``)."""
        return self.workers[0].call(method, *args, **kwargs)

    def call_each(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        """``method`` on every rank at once, rank r with ``per_rank_args[r]`` (and ``kwargs``, no
        callables); their results. A failure is reported from the rank where it happened, not
        from a rank that only followed it (``PeerFailed``). If some ranks failed and others did
        not, the state they should share has diverged: the group is stopped (``WorkerDied``),
        to be rebuilt from the models' saved states, rather than train on out of step."""
        if self.size == 1:
            return [self.workers[0].call(method, *per_rank_args[0], **kwargs)]
        try:
            for worker, args in zip(self.workers, per_rank_args, strict=True):
                worker.start_call(method, args, kwargs)
        except WorkerDied:
            self.kill()
            raise
        timeout = self.call_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        replies = self._gather(deadline, f"did not answer {said(method)} within {timeout} s")
        failed = [(rank, kind, value) for rank, (kind, value) in replies.items() if kind != "ok"]
        origin = [f for f in failed if f[1] != "peer_failed"] or failed
        if origin:
            rank, kind, value = origin[0]
            if len(failed) < self.size:
                done = min(r for r, (k, _) in replies.items() if k == "ok")
                self.kill()
                raise WorkerDied(
                    f"training rank {rank} failed {said(method)} ({value}) where rank {done} completed it, "
                    "so the ranks no longer hold the same state"
                )
            if kind == "user_error":
                raise UserError(value)
            raise WorkerError(f"rank {rank}: {value}")
        return [outcome(*replies[rank]) for rank in range(self.size)]

    def stop(self) -> None:
        """Ask every rank to exit (killing those that do not)."""
        for worker in self.workers:
            worker.stop()

    def kill(self) -> None:
        """Kill every rank at once: after one died, the others may be stuck in a collective."""
        for worker in self.workers:
            worker.kill()

    def _gather(
        self, deadline: float | None, overdue: str, stop_early: Callable[[str], bool] | None = None
    ) -> dict[int, tuple]:
        """One message from each rank, by rank; stops (and stops the group) if a rank dies or
        the deadline passes, and returns early once ``stop_early`` holds for a message's kind.

        A rank whose collective failed (``group_broken``) leaves the group unusable. The others
        get ``PEER_GRACE_S`` to answer or be seen dead, so that a death that broke it is the one
        reported; ranks still silent then are named with it (on a timeout, they are the ones
        it waited for; otherwise they may be waiting for it)."""
        replies: dict[int, tuple] = {}
        broken: int | None = None
        while len(replies) < self.size:
            # A remote rank that has not connected yet has no connection to wait on: it is
            # looked at again after POLL_S.
            waiting = {w.conn: rank for rank, w in enumerate(self.workers) if rank not in replies and w.conn}
            sentinels = [s for w in self.workers for s in w.sentinels]
            for conn in wait([*waiting, *sentinels], timeout=POLL_S):
                if conn in waiting:
                    rank = waiting[conn]
                    try:
                        replies[rank] = self.workers[rank].read()
                    except WorkerDied:
                        self.kill()
                        raise
                    kind = replies[rank][0]
                    if stop_early is not None and stop_early(kind):
                        return replies
                    if kind == "group_broken" and broken is None:
                        broken = rank
                        grace = time.monotonic() + PEER_GRACE_S
                        deadline = grace if deadline is None else min(deadline, grace)
            if not self.alive:
                reason = self.how_it_died()
                self.kill()
                raise WorkerDied(reason)
            if deadline is not None and time.monotonic() > deadline:
                silent = [rank for rank in range(self.size) if rank not in replies]
                self.kill()
                if broken is None:
                    late = silent[0]
                    raise WorkerDied(f"{self.workers[late].named} {overdue} and was killed")
                raise WorkerDied(f"{self._said_by(broken, replies)}; {self._named(silent)} had not answered")
        if broken is not None:  # every rank answered, yet one's collective failed
            self.kill()
            raise WorkerDied(self._said_by(broken, replies))
        return replies

    def _said_by(self, rank: int, replies: dict[int, tuple]) -> str:
        return f"{self.workers[rank].named}: {replies[rank][1]}"

    def _named(self, ranks: list[int]) -> str:
        return ", ".join(self.workers[rank].named.removeprefix("training ") for rank in ranks)
