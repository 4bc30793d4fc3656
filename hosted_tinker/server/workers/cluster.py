"""The other machines of a multi-node server, seen from node 0, where the server runs.

Every other node runs an agent (``hosted-tinker node``, ``node.agent``) that connects to the
cluster port (``--master-addr:--master-port``) and stays connected. Each time the server starts
a group of ranks (at start-up, and after a fault), the agents start that group's ranks on their
machines, and each rank connects back here with a socket of its own over which it is called
exactly as a local rank is over its pipe (``core.messages``). The ranks then meet one another
through torch.distributed's own rendezvous (``tcp://`` on node 0, a fresh port per group).

The connections are ``multiprocessing.connection``'s, authenticated with the cluster key (an
HMAC challenge before anything is unpickled). Each connection is greeted on a thread of its own
and must prove the key and say who it is within ``HANDSHAKE_TIMEOUT_S``: one that reads the
challenge and never answers (a port scanner, a hung peer) is cut at that deadline and never
holds up another (it held the one accepting thread, and a restarted node waited 87 s to rejoin).
Messages besides the ranks' calls:

agent -> server   ("node", node_rank, nnodes, hostname)   first: this agent serves that node
                  ("exited", generation, rank, exitcode)  a rank it started has ended
server -> agent   ("welcome",) | ("refused", why)
                  ("spawn", generation, {rank: factory})  start these ranks (ending older ones)
                  ("kill", generation, rank)               end this one now
rank -> server    ("rank", generation, rank, pid)          first; then the rank serves calls

A node whose agent disconnects (its machine gone, or the agent killed) is a group fault, as
a rank's death is: the server replaces the group, and the new group's ranks on that node start
when an agent for it connects again (a restarted machine). Silence without a disconnect (a
machine cut off) is caught by TCP keepalive, or by the call timeout while a call runs.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from hosted_tinker.core.errors import how_it_ended
from hosted_tinker.core.messages import recv, send
from hosted_tinker.core.throttle import Throttle
from hosted_tinker.server.workers.process import Worker

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not proved the key and named itself within this is cut
# Connections being greeted at once: past it a new one is closed at once (each holds a thread
# for at most HANDSHAKE_TIMEOUT_S; an agent that is turned away tries again a second later).
MAX_HANDSHAKES = 64
# ... and from one address at once: one peer that keeps opening connections cannot take every
# place (a node's agent, from its own address, finds one).
MAX_HANDSHAKES_PER_PEER = 4
DROPPED_LOG_EVERY_S = 10.0  # connections refused or dropped are logged once in this, counted
EXIT_REPORT_WAIT_S = 2.0  # after a rank's socket closed, how long to wait for its agent to say how it ended

Factory = Callable[[], Any]


@dataclass(eq=False)
class _Node:
    """One connected agent. A node whose agent reconnects is a new ``_Node``."""

    rank: int
    host: str
    conn: Connection
    lost: str | None = None  # why it is gone
    lock: threading.Lock = field(default_factory=threading.Lock)  # one sender at a time
    _closed: bool = False
    _closing: threading.Lock = field(default_factory=threading.Lock)

    def send(self, *message: Any) -> None:
        with self.lock:
            try:
                send(self.conn, *message)
            except OSError:  # its reader notices the disconnect and says so
                pass

    def close(self) -> None:
        """Close the connection once. Its reader (on the agent's disconnect) and ``Cluster.close``
        may both get here at the same moment; ``Connection.close`` is not safe to race (the second
        closes a descriptor already closed, or one the process has since reused)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self.conn.close()


class Cluster:
    """Node 0's end of the other nodes: their agents, and the ranks they run for the current
    group (``WorkerGroup`` asks for them with ``start``)."""

    def __init__(self, nnodes: int, ranks_per_node: int, address: tuple[str, int], authkey: bytes) -> None:
        self.nnodes = nnodes
        self.ranks_per_node = ranks_per_node
        self._authkey = authkey
        self._socket = socket.create_server(address, backlog=MAX_HANDSHAKES)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self._greeting = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._greeted_by: dict[str, int] = {}  # peer address -> its connections being greeted
        self._dropped = Throttle(DROPPED_LOG_EVERY_S)
        self._changed = threading.Condition()  # guards everything below
        self._nodes: dict[int, _Node] = {}
        self._generation = 0
        self._workers: dict[int, RemoteWorker] = {}  # the current group's remote ranks
        self._pending: dict[int, dict[int, Factory]] = {}  # node -> ranks to start once it connects
        self._closed = False
        threading.Thread(target=self._accept, name="cluster-accept", daemon=True).start()

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def start(self, factories: dict[int, Factory], call_timeout_s: float | None) -> list[RemoteWorker]:
        """A new group's ranks on the other nodes (``factories`` by global rank): started now on
        the nodes that are connected, on the others when their agent connects."""
        with self._changed:
            self._generation += 1
            self._workers = {
                rank: RemoteWorker(self, self._generation, rank, self.node_of(rank), call_timeout_s)
                for rank in sorted(factories)
            }
            self._pending = {}
            for rank, factory in factories.items():
                self._pending.setdefault(self.node_of(rank), {})[rank] = factory
            for node in list(self._nodes.values()):
                if node.lost is None:
                    self._spawn_on(node)
            return list(self._workers.values())

    def status(self) -> list[dict[str, Any]]:
        """For /healthz: each other node, and whether its agent is connected."""
        nodes = []
        with self._changed:
            for n in range(1, self.nnodes):
                node = self._nodes.get(n)
                connected = node is not None and node.lost is None
                nodes.append({"node": n, "host": node.host if node is not None else None, "connected": connected})
        return nodes

    def close(self) -> None:
        """Stop listening and drop the agents (they end their ranks and wait for a new server)."""
        with self._changed:
            self._closed = True
            nodes = list(self._nodes.values())
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (a close alone does not)
        except OSError:
            pass
        self._socket.close()
        for node in nodes:
            node.close()

    # ---- what a RemoteWorker asks of its node ------------------------------------------------

    def kill(self, worker: RemoteWorker) -> None:
        with self._changed:
            node = worker.node
        if node is not None and node.lost is None:
            node.send("kill", worker.generation, worker.rank)

    def wait_for_exit(self, worker: RemoteWorker, timeout_s: float) -> None:
        """Until ``worker``'s agent said how it ended, its node is lost, or ``timeout_s`` passed."""
        with self._changed:
            self._changed.wait_for(
                lambda: worker.exit is not None or (worker.node is not None and worker.node.lost is not None),
                timeout_s,
            )

    # ---- connections ---------------------------------------------------------------------------

    def _spawn_on(self, node: _Node) -> None:
        """Send ``node`` its ranks of the current group, if it has any not yet started (under the lock)."""
        ranks = self._pending.pop(node.rank, None)
        if not ranks:
            return
        for rank in ranks:
            self._workers[rank].node = node
        node.send("spawn", self._generation, ranks)
        log.info("node %d (%s): starting ranks %s", node.rank, node.host, sorted(ranks))

    def _accept(self) -> None:
        """Take each connection, and hand it to a thread of its own: nothing here waits on a peer."""
        while True:
            try:
                sock, peer = self._socket.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("the cluster port could not accept a connection: %s", e)
                continue
            with self._changed:
                from_peer = self._greeted_by.get(peer[0], 0)
                admitted = from_peer < MAX_HANDSHAKES_PER_PEER and self._greeting.acquire(blocking=False)
                if admitted:
                    self._greeted_by[peer[0]] = from_peer + 1
            if not admitted:
                self._drop(
                    peer[0], f"{from_peer} of its connections (or {MAX_HANDSHAKES} in all) already being greeted"
                )
                sock.close()
                continue
            threading.Thread(target=self._greet, args=(sock, peer[0]), name="cluster-greet", daemon=True).start()

    def _drop(self, peer: str, why: str) -> None:
        """Log a connection refused or dropped, at most once per ``DROPPED_LOG_EVERY_S`` with the
        count since (a peer opening thousands a second would fill the server's log)."""
        if count := self._dropped.due():
            log.warning(
                "dropped a connection to the cluster port from %s: %s (%d dropped since the last warning)",
                peer,
                why,
                count,
            )

    def _greet(self, sock: socket.socket, peer: str) -> None:
        """The cluster key's challenge both ways and the peer's first message, all within
        ``HANDSHAKE_TIMEOUT_S``: at the deadline the connection is shut down, which ends
        whatever read is waiting on it."""
        conn = Connection(os.dup(sock.fileno()))  # ``sock`` stays ours, to be shut down at the deadline
        lock, done = threading.Lock(), [False]

        def cut() -> None:
            with lock:
                if not done[0]:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:  # the peer is gone already
                        pass

        deadline = threading.Timer(HANDSHAKE_TIMEOUT_S, cut)
        deadline.start()
        try:
            deliver_challenge(conn, self._authkey)  # nothing is unpickled before both have passed
            answer_challenge(conn, self._authkey)
            hello = recv(conn)
        except Exception as e:  # a wrong key, a port scan, silence past the deadline
            self._drop(peer, f"{type(e).__name__}: {e}")
            conn.close()
            return
        finally:
            with lock:
                done[0] = True
            deadline.cancel()
            sock.close()  # the connection lives on in ``conn``'s own descriptor
            with self._changed:
                left = self._greeted_by.pop(peer, 1) - 1
                if left:
                    self._greeted_by[peer] = left
            self._greeting.release()
        try:
            _keep_alive(conn)
            if hello[0] == "node":
                self._join(conn, *hello[1:])
            elif hello[0] == "rank":
                self._attach(conn, *hello[1:])
            else:
                raise ValueError(f"an unknown greeting {hello[0]!r}")
        except Exception as e:
            log.warning("dropped a connection to the cluster port from %s: %s: %s", peer, type(e).__name__, e)
            conn.close()

    def _join(self, conn: Connection, node_rank: int, nnodes: int, host: str) -> None:
        with self._changed:
            current = self._nodes.get(node_rank)
            if nnodes != self.nnodes:
                why = f"the server runs --nnodes {self.nnodes}; this agent says --nnodes {nnodes}"
            elif not 1 <= node_rank < self.nnodes:
                why = f"--node-rank must be 1 to {self.nnodes - 1} (node 0 is the server's)"
            elif current is not None and current.lost is None:
                why = f"node {node_rank} is already connected from {current.host}"
            else:
                why = None
            if why is not None:
                send(conn, "refused", why)
                conn.close()
                log.warning("refused an agent from %s: %s", host, why)
                return
            node = self._nodes[node_rank] = _Node(node_rank, host, conn)
            node.send("welcome")
            log.info("node %d joined from %s", node_rank, host)
            self._spawn_on(node)
            self._changed.notify_all()
        self._listen_to(node)

    def _listen_to(self, node: _Node) -> None:
        """The agent's reports, until it disconnects: then its node is lost."""
        try:
            while True:
                kind, generation, rank, exitcode = recv(node.conn)
                if kind != "exited":
                    continue
                with self._changed:
                    worker = self._workers.get(rank)
                    if generation == self._generation and worker is not None and worker.exit is None:
                        worker.exit = how_it_ended(exitcode)
                        self._changed.notify_all()
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("node %d sent what could not be read", node.rank)
        with self._changed:
            node.lost = f"disconnected (node {node.rank}, {node.host})"
            self._changed.notify_all()
        node.close()
        if not self._closed:
            log.error("node %d (%s) disconnected", node.rank, node.host)

    def _attach(self, conn: Connection, generation: int, rank: int, pid: int) -> None:
        with self._changed:
            worker = self._workers.get(rank)
            if generation != self._generation or worker is None or worker.conn is not None:
                conn.close()  # a rank of a group that was already replaced
                return
            worker.pid = pid
            worker._conn = conn
            self._changed.notify_all()


class RemoteWorker(Worker):
    """A rank that runs on another node: started by that node's agent, called over the socket
    it opened to us."""

    def __init__(
        self, cluster: Cluster, generation: int, rank: int, node_rank: int, call_timeout_s: float | None
    ) -> None:
        self.cluster = cluster
        self.generation = generation
        self.rank = rank
        self.label = f"training rank {rank} on node {node_rank}"
        self.call_timeout_s = call_timeout_s
        self.pid = None
        self._conn = None
        self.node: _Node | None = None  # the agent asked to start it (None: its node has not connected)
        self.exit: str | None = None  # how it ended, as its agent said

    @property
    def named(self) -> str:
        if self.pid is not None:
            return super().named
        return f"{self.label} ({'not started: the node has not connected' if self.node is None else 'not connected'})"

    @property
    def alive(self) -> bool:
        return self.exit is None and (self.node is None or self.node.lost is None)

    def how_it_died(self) -> str:
        self.cluster.wait_for_exit(self, EXIT_REPORT_WAIT_S)
        if self.exit is not None:
            return f"{self.named} {self.exit}"
        if self.node is not None and self.node.lost is not None:
            return f"{self.named}: its node {self.node.lost}"
        return f"{self.named}: its connection was lost"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._conn is not None:
            try:
                send(self._conn, "stop")
            except OSError:
                pass
            self.cluster.wait_for_exit(self, timeout_s)
        self.kill()

    def kill(self) -> None:
        if self.exit is None:
            self.cluster.kill(self)
        if self._conn is not None:
            self._conn.close()


def _keep_alive(conn: Connection) -> None:
    """Have the kernel probe an idle connection, so a machine that vanished without closing it
    (a preempted VM) is noticed in about half a minute rather than never."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    finally:
        sock.detach()  # the socket stays the connection's
