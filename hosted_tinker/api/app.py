"""The FastAPI application: routers, error shapes, and the server's lifetime."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from hosted_tinker.api import openai_proxy_routes, openai_routes, ops_routes, rest_routes, tinker_routes
from hosted_tinker.api.auth import authenticate
from hosted_tinker.api.state import ServerState
from hosted_tinker.protocol.proto_codec import WireError
from hosted_tinker.serving.errors import ApiError

log = logging.getLogger(__name__)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.scheduler.bind_loop(asyncio.get_running_loop())
        sweeper = asyncio.create_task(_sweep(state))
        watchdog = asyncio.create_task(_watch_worker(state))
        if state.vllm is not None:  # training is served while vLLM loads
            state.vllm.start()
        yield
        sweeper.cancel()
        watchdog.cancel()
        state.scheduler.shutdown()  # first: a step finishing now may still publish to vLLM
        state.backend.close()
        if state.openai_proxy is not None:
            await state.openai_proxy.aclose()
        if state.vllm is not None:
            await state.vllm.stop()
        state.store.close()

    app = FastAPI(title="hosted-tinker", lifespan=lifespan)
    app.state.server = state
    keyed = [Depends(authenticate)]  # every route but health checks and signed downloads needs a key
    app.include_router(tinker_routes.router, dependencies=keyed)
    app.include_router(rest_routes.router, dependencies=keyed)
    app.include_router(openai_routes.router if state.vllm is None else openai_proxy_routes.router, dependencies=keyed)
    app.include_router(rest_routes.downloads)
    app.include_router(ops_routes.router)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if _is_openai(request):
            return _openai_error(exc.status, exc.detail, code=exc.code, headers=exc.headers)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(WireError)
    async def wire_error(request: Request, exc: WireError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Keep each error's location and message; drop echoed input (it may be large).
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        if _is_openai(request):
            first = errors[0]
            param = ".".join(str(p) for p in first["loc"][1:])
            return _openai_error(400, f"{param}: {first['msg']}", param=param)
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        if _is_openai(request):
            return _openai_error(500, f"internal error: {type(exc).__name__}")
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}"}, status_code=500)

    return app


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def _openai_error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error shape, which its SDK turns into typed exceptions."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _sweep(state: ServerState) -> None:
    """At start-up and periodically: delete checkpoints past their TTL and results past retention,
    so that neither the disk nor the database grows without bound."""
    retention = state.config.result_retention_s
    every_s = min(600.0, max(1.0, retention / 4))
    while True:
        try:
            checkpoints = await asyncio.to_thread(state.checkpoints.delete_expired)
            results = await asyncio.to_thread(state.store.delete_futures_finished_before, time.time() - retention)
            if checkpoints or results:
                log.info("deleted %d expired checkpoints and %d old results", checkpoints, results)
        except Exception:
            log.exception("sweep failed")
        await asyncio.sleep(every_s)


async def _watch_worker(state: ServerState, every_s: float = 1.0) -> None:
    """A worker that dies while idle is replaced within a second, not at the next request."""
    while True:
        await asyncio.sleep(every_s)
        if not state.backend.status()["alive"]:  # a new worker counts as alive while it loads
            state.scheduler.run_on_worker(state.backend.ensure_alive)
