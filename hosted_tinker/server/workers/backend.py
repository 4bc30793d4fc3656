"""``ProcessBackend``: the training calls, served by worker processes that may die.

The ranks run in a ``WorkerGroup``, one worker process each (``rank.serve``). Where a call goes
is declared on the method that runs it (``@rank_call`` on ``rank.trainer.Trainer`` and
``rank.sampler.EmbeddedSampler``): to every rank, to rank 0, or split over the data-parallel
replicas by token count (``core.sharding``). The server calls them as ``backend.trainer.optim_step(...)``,
typed by the method itself (``core.calls.calls_to``). Nothing here knows which plan the ranks run.

When a worker dies during a call (SIGKILL, the kernel's OOM killer, a crash in native code, a
hang past the call timeout), the group is stopped and a new one started, ``recovery`` puts the
training models back (from their last saved state where one exists), and the call raises
``WorkerCrashed``: its future fails with ``category: server`` while the requests queued behind
it run on the new group. A group found dead between calls is replaced the same way before the
next call, which then runs. Every other restored model is behind where its client thinks it
is: its next call that uses its state raises ``RolledBack`` (once), unless that call replaces
its state anyway.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from hosted_tinker.core.calls import Call, calls_to
from hosted_tinker.core.errors import RolledBack, WorkerCrashed, WorkerDied
from hosted_tinker.core.sharding import merge_many, merge_results, shard_batch, shard_by_tokens
from hosted_tinker.core.types import Capabilities, ForwardBackwardBatch, ForwardBackwardResult, RequestFailed
from hosted_tinker.rank.sampler import EmbeddedSampler
from hosted_tinker.rank.trainer import Trainer
from hosted_tinker.server.workers.cluster import Cluster
from hosted_tinker.server.workers.group import WorkerGroup

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # loading a large model from a cold disk can take minutes
RESTORE_ATTEMPTS = 3  # new groups tried in a row when each dies while models are restored

Factory = Callable[[], Any]  # builds one rank in its worker process (``rank.serve.build_rank``)


def one_worker(factory: Factory) -> Callable[[], list[Factory]]:
    """The ``ranks`` of a backend that runs in a single worker process."""
    return lambda: [factory]


class Recovery(Protocol):
    """Puts the dead group's training models back on a new one (``serving.recovery``)."""

    def restore(self, model_id: str) -> str:
        """Recreate ``model_id``; what became of it ("was restored from ...", or why not)."""
        ...

    def lose(self, model_id: str, why: str) -> str:
        """Give ``model_id`` up; what its client is told."""
        ...


class ProcessBackend:
    """The ranks' calls, made in worker processes: ``trainer`` (typed as ``rank.trainer.Trainer``)
    and ``sampler`` (rank 0's ``rank.sampler.EmbeddedSampler``), each call routed by its
    declaration (``core.calls``).

    ``ranks`` returns one factory per rank, afresh for every (re)start of the group; with a
    ``cluster``, the ranks past this node's run on the other nodes. Called from the scheduler's
    single dispatch thread only, like any backend.
    """

    def __init__(
        self,
        ranks: Callable[[], list[Factory]],
        call_timeout_s: float | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        self._ranks = ranks
        self._call_timeout_s = call_timeout_s  # see WorkerProcess
        self._cluster = cluster
        self._group = self._new_group()  # loads now; ``capabilities`` waits for it
        self._capabilities: Capabilities | None = None
        self._ready = threading.Lock()
        self._restoring = False
        self.recovery: Recovery | None = None  # set by the server; without it, models are not restored
        self._adapters: list[str] = []  # training models the group holds, oldest first
        self._rolled_back: dict[str, RolledBack] = {}  # model -> what its next training call raises
        self.restarts = 0
        self.last_death: str | None = None
        self.trainer = calls_to(Trainer, self._call)
        # sampling is not a training call, but it shares the training group's worker (and its restarts)
        self.sampler = calls_to(EmbeddedSampler, self._call)

    @property
    def capabilities(self) -> Capabilities:
        if self._capabilities is None:
            with self._ready:
                if self._capabilities is None:
                    self._capabilities = self._group.wait_ready(START_TIMEOUT_S)
        return self._capabilities

    def status(self) -> dict:
        """For /healthz (on the event loop, while the dispatch thread may be replacing the group:
        ``restarts`` is read first and the group once, so a new count never comes with the dead
        group's pid)."""
        restarts, group = self.restarts, self._group
        status = {
            "pid": group.pids[0],
            "pids": group.pids,  # each on its own node's machine
            "ranks": group.ranks(),
            "alive": group.alive,
            "restarts": restarts,
            "last_death": self.last_death,
        }
        if self._cluster is not None:
            status["nodes"] = self._cluster.status()
        return status

    def close(self) -> None:
        self._group.stop()
        if self._cluster is not None:
            self._cluster.close()

    def _new_group(self) -> WorkerGroup:
        return WorkerGroup(self._ranks(), self._call_timeout_s, self._cluster)

    # ---- calls, and what happens when a worker dies -------------------------------------------

    def ensure_alive(self) -> None:
        """Replace a group that lost a worker between calls (on the dispatch thread, like a call)."""
        if not self._group.alive and not self._restoring:
            self._replace(self._group.how_it_died())

    def _call(self, call: Call) -> Any:
        """``call`` on the ranks its declaration names, with what a worker's death entails; rank
        0's answer (merged over replicas for a split batch). ``self.trainer``'s and
        ``self.sampler``'s calls all come here."""
        _ = self.capabilities  # the first group's "ready" must be read before any call's answer
        self.ensure_alive()
        spec = call.spec
        if spec.ranks == "split_many":
            return self._joint(call)
        # the model whose notice this call uses up (a model being created has none yet)
        model_id = call.model_id if spec.model != "creates" else None
        if model_id is not None and not self._restoring:
            notice = self._rolled_back.pop(model_id, None)
            if notice is not None and spec.model == "uses":
                raise notice

        def run() -> Any:
            if spec.ranks == "first":
                return self._group.call(call.method, *call.args, **call.kwargs)
            if spec.ranks == "split" and self.capabilities.replicas > 1:
                return self._split(call.method, *call.args)
            return self._group.call_each(call.method, [call.args] * self._group.size, **call.kwargs)[0]

        answer = self._surviving([model_id] if model_id is not None else [], run)
        if spec.model == "creates":  # what the group holds, to restore after a worker death
            self._adapters.append(call.args[0])
        elif spec.model == "deletes":
            self._adapters.remove(call.args[0])
        return answer

    def _surviving(self, model_ids: list[str], call: Callable[[], Any]) -> Any:
        """``call()``; if a worker dies in it, a new group with the models restored, and
        ``WorkerCrashed`` for this call (whose own failure tells its clients of ``model_ids``)."""
        try:
            return call()
        except WorkerDied as e:
            if self._restoring:  # the new group died too: _replace starts another
                raise
            restored = self._replace(str(e))
            for model_id in model_ids:
                self._rolled_back.pop(model_id, None)
            raise WorkerCrashed(str(e), restored) from None

    def _split(self, name: str, model_id: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        """Each replica's shard of ``batch`` to its ranks (consecutive ranks form a replica),
        and the replicas' results back in batch order."""
        per_replica = self._group.size // self.capabilities.replicas
        shards = shard_by_tokens([d.num_tokens for d in batch.data], self.capabilities.replicas)
        batches = shard_batch(batch, shards)
        results = self._group.call_each(name, [(model_id, batches[r // per_replica]) for r in range(self._group.size)])
        return merge_results(results[::per_replica], shards)

    def _replace(self, reason: str) -> dict[str, str]:
        """Start a new group in place of the dead one and restore the models onto it; per model,
        what became of it. Each model that came back from a saved state is owed a ``RolledBack``
        (see ``_call``). A model whose restoring kills the new group too is given up, and the
        others go onto yet another group."""
        log.error("%s; starting new training workers", reason)
        self.last_death = reason
        todo, self._adapters = self._adapters, []  # models to put back, oldest first
        outcome: dict[str, str] = {}
        for _ in range(RESTORE_ATTEMPTS):
            self._group.kill()
            try:
                self._group = self._new_group()
                self.restarts += 1  # after the group is assigned: see ``status``
                self._group.wait_ready(START_TIMEOUT_S)
            except BaseException:
                self._adapters = todo  # still owed: the next replacement restores them
                raise
            if self.recovery is None:
                return outcome
            self._restoring = True
            try:
                while todo:
                    outcome[todo[0]] = self.recovery.restore(todo[0])
                    todo.pop(0)
                break
            except WorkerDied as e:  # while restoring todo[0], which is not tried again
                log.error("%s while restoring %s; starting new training workers", e, todo[0])
                self.last_death = str(e)
                culprit = todo.pop(0)
                outcome[culprit] = self.recovery.lose(culprit, f"killed the new worker too while being restored ({e})")
                todo, self._adapters = self._adapters + todo, []  # those restored died with it
            finally:
                self._restoring = False
        for model_id in todo:  # the workers kept dying (with a recovery: without one, returned above)
            assert self.recovery is not None
            outcome[model_id] = self.recovery.lose(model_id, "could not be restored: new workers kept dying")
        log.info("after the restart: %s", "; ".join(f"{m} {how}" for m, how in outcome.items()) or "no models")
        for model_id, how in outcome.items():
            if how.startswith("was restored"):
                self._rolled_back[model_id] = RolledBack(reason, model_id, how)
        return outcome

    def take_notice(self, model_id: str) -> RolledBack | None:
        """The ``RolledBack`` notice ``model_id`` is owed, if any, no longer owed here (a model
        being parked carries it to disk, and owes it again when it comes back)."""
        return self._rolled_back.pop(model_id, None)

    def owe_notice(self, model_id: str, notice: RolledBack) -> None:
        self._rolled_back[model_id] = notice

    def _joint(self, call: Call) -> list[ForwardBackwardResult | RequestFailed]:
        """Several models' requests in one pass (``Trainer.forward_backward_many``); per request,
        its result or its failure. A model owed a ``RolledBack`` notice gets it (as a
        ``RequestFailed`` of kind "rolled_back") instead of a run."""
        (requests,) = call.args
        outcomes: dict[str, ForwardBackwardResult | RequestFailed] = {}
        for model_id, _batch in requests:
            notice = self._rolled_back.pop(model_id, None)
            if notice is not None:
                outcomes[model_id] = RequestFailed("rolled_back", str(notice))
        todo = [(model_id, batch) for model_id, batch in requests if model_id not in outcomes]
        if todo:
            replies = self._surviving([m for m, _ in todo], lambda: self._split_many(call.method, todo))
            for (model_id, _batch), reply in zip(todo, replies, strict=True):
                outcomes[model_id] = reply
        return [outcomes[model_id] for model_id, _ in requests]

    def _split_many(
        self, name: str, requests: list[tuple[str, ForwardBackwardBatch]]
    ) -> list[ForwardBackwardResult | RequestFailed]:
        """Each replica its shard of every request; per request, the replicas' results merged."""
        replicas = self.capabilities.replicas
        per_replica = self._group.size // replicas
        shards = [shard_by_tokens([d.num_tokens for d in batch.data], replicas) for _, batch in requests]
        split = [shard_batch(batch, s) for (_, batch), s in zip(requests, shards, strict=True)]
        per_rank = [
            ([(model_id, split[i][rank // per_replica]) for i, (model_id, _) in enumerate(requests)],)
            for rank in range(self._group.size)
        ]
        replies = self._group.call_each(name, per_rank)
        return [merge_many([reply[i] for reply in replies], shards[i], per_replica) for i in range(len(requests))]
