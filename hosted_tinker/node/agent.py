"""``hosted-tinker node``: one machine's share of the training ranks, for the server on node 0.

The agent connects to the server's cluster port and stays connected; what it exchanges there
is listed in ``server.workers.cluster``. Asked to start a group's ranks, it ends those of
older groups and spawns one process per rank (``rank.serve.serve_remote``), which connects to
the server by itself; when one ends, the agent says how. It holds no model and no state: if the
server goes away, it ends its ranks and waits for a server to connect to again, so node 0 can
restart (a preempted VM) without the other nodes restarting.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from hosted_tinker.core.messages import recv, send
from hosted_tinker.core.processes import worker_context
from hosted_tinker.rank.serve import serve_remote

log = logging.getLogger("hosted_tinker.node")

RETRY_S = 1.0  # between attempts to reach the server
SAY_WAITING_EVERY_S = 30.0


class Refused(Exception):
    """The server will not take this agent (a wrong --nnodes or --node-rank, or a duplicate)."""


def run(node_rank: int, nnodes: int, address: tuple[str, int], authkey: bytes) -> int:
    """Serve the server at ``address`` until told to stop (SIGTERM, SIGINT); 2 if it refuses us."""
    signal.signal(signal.SIGTERM, _interrupted)
    ranks: dict[tuple[int, int], BaseProcess] = {}  # (generation, rank) -> its process
    try:
        while True:
            try:
                conn = _connect(address, authkey)
            except AuthenticationError:
                log.error("the server at %s:%d refused the cluster key (is it the same on every node?)", *address)
                return 2
            try:
                _serve(conn, node_rank, nnodes, address, authkey, ranks)
            except Refused as e:
                log.error("the server at %s:%d refused node %d: %s", *address, node_rank, e)
                return 2
            finally:
                conn.close()
                _end(ranks, lambda _: True)
            log.warning("lost the server at %s:%d; waiting for it to come back", *address)
    except KeyboardInterrupt:
        _end(ranks, lambda _: True)
        return 0


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the agent as Ctrl-C does: its ranks first


def _connect(address: tuple[str, int], authkey: bytes) -> Connection:
    """A connection to the server, however long it takes to come up. A wrong cluster key is
    not retried: the server refuses it at once (``AuthenticationError``)."""
    said = 0.0
    while True:
        try:
            return Client(address, family="AF_INET", authkey=authkey)
        except (OSError, EOFError) as e:  # refused, reset, unreachable, turned away while busy: try again
            if time.monotonic() - said > SAY_WAITING_EVERY_S:
                log.info("waiting for the server at %s:%d (%s)", *address, e)
                said = time.monotonic()
            time.sleep(RETRY_S)


def _serve(
    conn: Connection,
    node_rank: int,
    nnodes: int,
    address: tuple[str, int],
    authkey: bytes,
    ranks: dict[tuple[int, int], BaseProcess],
) -> None:
    """Start and end ranks as the server says, until it disconnects."""
    send(conn, "node", node_rank, nnodes, socket.gethostname())
    reply = recv(conn)
    if reply[0] == "refused":
        raise Refused(reply[1])
    log.info("node %d of %d: serving the server at %s:%d", node_rank, nnodes, *address)
    context = worker_context()  # as on node 0
    while True:
        by_sentinel = {p.sentinel: key for key, p in ranks.items()}
        for ready in wait([conn, *by_sentinel]):
            if ready is conn:
                try:
                    message = recv(conn)
                except (EOFError, OSError):
                    return
                _obey(message, ranks, context, address, authkey)
            elif isinstance(ready, int):  # a rank's sentinel
                generation, rank = key = by_sentinel[ready]
                process = ranks.pop(key)
                process.join()
                log.info(
                    "rank %d of group %d (pid %d) ended: exit code %s", rank, generation, process.pid, process.exitcode
                )
                try:
                    send(conn, "exited", generation, rank, process.exitcode)
                except OSError:
                    return


def _obey(
    message: tuple[Any, ...],
    ranks: dict[tuple[int, int], BaseProcess],
    context: Any,
    address: tuple[str, int],
    authkey: bytes,
) -> None:
    kind, generation, *rest = message
    if kind == "spawn":
        (factories,) = rest
        _end(ranks, lambda key: key[0] < generation)  # an older group's ranks cannot rejoin anything
        for rank, factory in factories.items():
            process = context.Process(
                target=serve_remote,
                args=(address, authkey, generation, rank, factory),
                name=f"rank-{rank}",
            )
            process.start()
            ranks[(generation, rank)] = process
        log.info("group %d: started ranks %s", generation, sorted(factories))
    elif kind == "kill":
        (rank,) = rest
        process = ranks.get((generation, rank))
        if process is not None:
            process.kill()  # its sentinel fires, and the server hears how it ended
    else:
        log.warning("ignored an unknown message %r from the server", kind)


def _end(ranks: dict[tuple[int, int], BaseProcess], which: Any) -> None:
    """Kill the ranks whose (generation, rank) ``which`` accepts, and forget them."""
    for key in [key for key in ranks if which(key)]:
        process = ranks.pop(key)
        process.kill()
        process.join(10)
