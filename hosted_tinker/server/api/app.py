"""The FastAPI application: routers, middleware, error handlers, and the server's lifetime."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.staticfiles import StaticFiles

from hosted_tinker.core.config import ServerConfig
from hosted_tinker.server.api import (
    anthropic_routes,
    doors,
    openai_proxy_routes,
    openai_routes,
    ops_routes,
    rest_routes,
    tinker_routes,
    upload_routes,
)
from hosted_tinker.server.api.auth import authenticate
from hosted_tinker.server.api.body_limit import BodyLimit
from hosted_tinker.server.api.errors import install_error_handlers
from hosted_tinker.server.api.key_check import KeyCheck
from hosted_tinker.server.api.request_log import RequestLines, RequestLog, open_request_log
from hosted_tinker.server.api.state import ServerState
from hosted_tinker.server.console import routes as console

log = logging.getLogger(__name__)


def create_app(state: ServerState) -> FastAPI:
    logger = open_request_log(state.config.request_log_target())
    request_lines = RequestLines(logger, state.config.request_log_anonymous_per_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.scheduler.bind_loop(asyncio.get_running_loop())
        sweeper = asyncio.create_task(_sweep(state))
        watchdog = asyncio.create_task(_watch_worker(state))
        parker = asyncio.create_task(_park_silent(state))
        if state.vllm is not None:  # training is served while vLLM loads
            state.vllm.start()
        yield
        sweeper.cancel()
        watchdog.cancel()
        parker.cancel()
        deadline = await _park_all(state)  # the next start serves the same models from where they are now
        if not await asyncio.to_thread(state.checkpoints.mirror.drain, deadline):
            log.warning("shutdown: checkpoint copies still queued for the mirror are made at the next start")
        await asyncio.to_thread(state.checkpoints.mirror.close)
        state.scheduler.shutdown()  # first: a step finishing now may still publish to vLLM
        state.backend.close()
        if state.openai_proxy is not None:
            await state.openai_proxy.aclose()
        if state.vllm is not None:
            await state.vllm.stop()
        state.sequences.close()
        state.store.close()
        request_lines.flush()  # the count of lines held back since the last summary

    app = FastAPI(title="hosted-tinker", lifespan=lifespan)
    app.state.server = state
    keyed = [Depends(authenticate)]  # every route but health checks and signed downloads needs a key
    openai = openai_routes.router if state.vllm is None else openai_proxy_routes.router
    routers = [(tinker_routes.router, keyed), (rest_routes.router, keyed), (upload_routes.router, keyed)]
    # The same routes at each of their doors; /openapi.json describes them once, at the first.
    # Anthropic's first: /v1/messages is theirs, not the vLLM proxy's catch-all under /v1.
    for door, prefixes in ((anthropic_routes.router, doors.ANTHROPIC), (openai, doors.OPENAI)):
        routers += [(door(prefix, in_schema=i == 0), keyed) for i, prefix in enumerate(prefixes)]
    routers += [(rest_routes.downloads, []), (upload_routes.files, []), (ops_routes.router, [])]
    for router, dependencies in routers:
        app.include_router(router, dependencies=dependencies)
    # The web console: its own sign-in (a cookie that stands for a key), its assets in the package.
    app.include_router(console.router)
    app.mount(f"{console.PATH}/static", StaticFiles(directory=console.STATIC), name="console-static")
    # Starlette types a handler as taking any Exception; it calls this one with NotSignedIn alone.
    app.add_exception_handler(console.NotSignedIn, console.not_signed_in)  # type: ignore[arg-type]
    # What each route declares (errors.route_mark), for the middleware that runs before routing.
    app.state.declared_routes = [route for router, _ in routers for route in router.routes]
    app.add_middleware(
        BodyLimit,
        max_bytes=state.config.max_body_bytes,
        max_control_bytes=state.config.max_control_body_bytes,
        max_prompt_bytes=state.config.max_prompt_body_bytes,
        body_bytes=state.body_bytes,
    )
    # Before any body is read: the key, and its rate (quotas.admit).
    app.add_middleware(
        KeyCheck,
        keys=state.keys,
        quotas=state.quotas,
        public_docs=state.config.public_docs,
        public_metrics=state.config.public_metrics,
    )
    # Outermost: its line covers every answer, the body limit's 413 included.
    app.add_middleware(RequestLog, lines=request_lines, metrics=state.scheduler.metrics)
    install_error_handlers(app)
    return app


async def _sweep(state: ServerState) -> None:
    """At start-up and periodically: count the checkpoints' storage (``serving.usage``), delete
    checkpoints past their TTL, results past retention and
    sampling records past their day, and end sessions silent for longer than retention (their
    models, parked ones too, go), so that neither the disk nor the database grows without bound.
    A session outlives its silence by at least ``--session-timeout`` (after which its models are
    parked, not lost), however short the retention of results."""
    retention = state.config.result_retention_s
    session_horizon = max(retention, state.config.session_timeout_s)
    every_s = min(600.0, max(1.0, retention / 4))
    while True:
        try:
            await asyncio.to_thread(state.usage.accrue_storage)  # what was stored since the last sweep
            checkpoints = await asyncio.to_thread(state.checkpoints.delete_expired)
            await asyncio.to_thread(state.uploads.expire)  # uploads never finished: their bytes and reservations
            results = await asyncio.to_thread(state.store.delete_futures_finished_before, time.time() - retention)
            sequences = await asyncio.to_thread(state.sequences.delete_expired)
            await asyncio.to_thread(state.audit.delete_expired)
            for session_id in await asyncio.to_thread(state.store.silent_sessions, time.time() - session_horizon):
                state.sessions.expire(session_id)
            if checkpoints or results or sequences:
                log.info(
                    "deleted %d expired checkpoints, %d old results and %d expired sampling records",
                    checkpoints,
                    results,
                    sequences,
                )
        except Exception:
            log.exception("sweep failed")
        await asyncio.sleep(every_s)


async def _park_silent(state: ServerState) -> None:
    """Park the models of sessions silent for ``--session-timeout`` (their clients died, or
    sleep): saved whole and freed, they come back at their next request."""
    timeout = state.config.session_timeout_s
    every_s = min(60.0, max(0.25, timeout / 4))
    residency = state.training.residency
    while True:
        await asyncio.sleep(every_s)
        try:
            silent = await asyncio.to_thread(state.store.silent_models, time.time() - timeout)
            if silent:

                def park(model_ids: list[str] = silent) -> None:
                    residency.park_idle(model_ids, timeout)

                state.scheduler.run_on_worker(park)
        except Exception:
            log.exception("parking the models of silent sessions failed")


GRACEFUL_S = 5.0  # at SIGTERM, how long open requests (a long-poll, a stream) may take to finish


def graceful_shutdown_s(config: ServerConfig) -> float:
    """uvicorn's ``timeout_graceful_shutdown``: its part of ``--shutdown-timeout``; parking has the rest."""
    return min(GRACEFUL_S, config.shutdown_timeout_s / 4)


async def _park_all(state: ServerState) -> float:
    """At shutdown: once the jobs already handed to the worker have run, park every resident
    model within ``--shutdown-timeout``. A job that reaches the worker after that fails, saying
    to send it again (``ServerStopping``), rather than bring a model back that would be lost.
    Returns the deadline, which what else must be done at shutdown shares."""
    deadline = time.monotonic() + state.config.shutdown_timeout_s - graceful_shutdown_s(state.config)
    residency, done = state.training.residency, threading.Event()
    outcome: list[tuple[int, int]] = []

    def park() -> None:
        try:
            outcome.append(residency.park_all(deadline))
        finally:
            done.set()

    if not state.backend.status()["alive"]:  # parking would first start a new worker group
        log.warning("shutdown: the training worker is not alive; resident models are lost")
        return deadline
    state.scheduler.run_on_worker(park)
    if not await asyncio.to_thread(done.wait, max(0.0, deadline - time.monotonic())):
        log.warning("shutdown: the worker was still busy after --shutdown-timeout; resident models are lost")
    elif outcome:
        log.info("shutdown: parked %d models (%d could not be)", *outcome[0])
    return deadline


async def _watch_worker(state: ServerState, every_s: float = 1.0, max_wait_s: float = 60.0) -> None:
    """A worker that dies while idle is replaced within a second, not at the next request. One
    replacement is queued at a time, and after a failed one (a worker that cannot start) the
    next waits twice as long, up to ``max_wait_s``."""
    queued, wait_s = threading.Event(), every_s

    def replace() -> None:  # on the dispatch thread
        nonlocal wait_s
        try:
            state.backend.ensure_alive()
            wait_s = every_s
        except Exception:
            log.exception("could not replace the training worker; trying again in %.0f s", 2 * wait_s)
            wait_s = min(2 * wait_s, max_wait_s)
        finally:
            queued.clear()

    while True:
        await asyncio.sleep(wait_s)
        try:
            if not queued.is_set() and not state.backend.status()["alive"]:  # alive while it loads
                queued.set()
                state.scheduler.run_on_worker(replace)
        except Exception:  # the watch must go on
            log.exception("watching the training worker failed")
