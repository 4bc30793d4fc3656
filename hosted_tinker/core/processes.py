"""How worker processes start: forked from a fork server (``worker_context``), started as early
as a server knows it will need one (``start_fork_server``), so that its imports run beside the
server's own. Light: the server's CLI imports it before anything heavy."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
from typing import Any

# What a worker needs, imported once by the fork server (``worker_context``) rather than by each
# worker: torch and transformers take seconds of CPU to import.
PRELOAD = ("hosted_tinker.rank.fork_server", "hosted_tinker.rank.serve", "hosted_tinker.rank.model", "transformers")


def worker_context() -> Any:  # a multiprocessing context: ForkServerContext, or SpawnContext
    """How workers start: forked from a fork server, a process of its own that imported what they
    need and nothing else (no threads, no event loop, CUDA untouched: the reasons a worker is never
    forked from the server itself), so each worker after the first starts without importing torch
    again. Where there is no fork server (not POSIX), spawned."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def start_fork_server() -> None:
    """Start the fork server now (where workers fork from one), rather than when the first worker
    starts: ``serve`` calls it before its own heavy imports, which then overlap the fork server's."""
    if worker_context().get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()
