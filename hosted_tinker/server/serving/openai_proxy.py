"""``/v1/*`` with vLLM as the engine: requests forwarded to vLLM, responses streamed straight back.

Our model names (served base names, ``tinker://`` sampler paths, sampling session ids, training
run ids for the live adapter) are resolved here, the adapter is leased in vLLM for the request's
lifetime, and vLLM's name for it is swapped back to the client's in every response line. vLLM's
own parameters pass through untouched, so it validates them (but for what
``openai_proxy_edits`` changes: the usage it meters, greedy copies); its admin routes are not
exposed. A large body is decoded and re-encoded on ``core.body_thread``, not on the loop.

The bytes go over aiohttp rather than the engine's httpx client: a streamed answer is one SSE
chunk per token, and aiohttp's C parser halves what each chunk costs us. On a 2-core machine,
where the proxy shares a core with vLLM's API server, that moved streamed throughput through us
from 0.82-0.91 of direct to 0.98-1.0 (benchmarks/vllm_proxy.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import aiohttp
from fastapi.responses import Response, StreamingResponse

from hosted_tinker.core.body_thread import sized, too_many_containers
from hosted_tinker.core.errors import ApiError, EngineUnavailable, UserError, bad_request, unavailable
from hosted_tinker.inference.vllm_engine import REQUEST_TIMEOUT_S, VllmEngine
from hosted_tinker.server.serving.openai import OpenAIService
from hosted_tinker.server.serving.openai_proxy_edits import (
    USAGE,
    GreedyCopies,
    Meter,
    asks_routing,
    least_routing,
    without_routing,
)

# Paths of vLLM's we never forward: adapter management is ours alone.
BLOCKED = {"load_lora_adapter", "unload_lora_adapter"}
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def _unavailable(e: EngineUnavailable) -> ApiError:
    return unavailable(str(e), e.retry_after)


def _asks_prompt_logprobs(payload: dict) -> bool:
    return payload.get("prompt_logprobs") is not None or bool(
        payload.get("echo") and payload.get("logprobs") is not None
    )


def _encode(payload: dict) -> bytes:
    return json.dumps(payload).encode()


class _Stream(StreamingResponse):
    """A streamed answer that releases the adapter lease and the upstream response even when the
    client goes away before the first chunk (when the body generator never starts)."""

    def __init__(self, content: AsyncIterator[bytes], stack: AsyncExitStack, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._stack = stack

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stack.aclose()


class OpenAIProxy:
    def __init__(self, openai: OpenAIService, vllm: VllmEngine) -> None:
        self.openai = openai
        self.vllm = vllm
        self._session: aiohttp.ClientSession | None = None

    def _upstream(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use: it belongs to the server's event loop
            # Idle connections are dropped before vLLM's own 5 s keep-alive ends (see VllmEngine).
            connector = aiohttp.TCPConnector(limit=512, keepalive_timeout=2.0)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=REQUEST_TIMEOUT_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(
        self, method: str, path: str, query: str, body: bytes, headers: dict[str, str], tenant: str
    ) -> Response:
        path = path.strip("/")
        if path in BLOCKED:
            raise ApiError(404, f"/v1/{path} is not available through this server")
        if path.partition("/")[0] == "messages":  # vLLM's own Messages API would skip ours (api.doors)
            raise ApiError(404, "the Anthropic Messages API is at /anthropic/api/v1/messages and /v1/messages")
        payload = None
        if body and (why := too_many_containers(body)) is not None:
            raise bad_request(why)
        if body:
            try:
                payload = await sized(json.loads, len(body), body)
            except (ValueError, RecursionError):
                raise bad_request("the request body is not valid JSON") from None
        if isinstance(payload, dict) and _asks_prompt_logprobs(payload):
            # vLLM 0.32's engine dies on prompt logprobs whenever LoRA is enabled (vllm#29955).
            raise bad_request(
                "prompt logprobs (prompt_logprobs, or echo with logprobs) are not available through vLLM here; "
                "use the Tinker SDK's compute_logprobs, which the trainer answers"
            )
        stack = AsyncExitStack()
        try:
            rename, vllm_name, meter, copies = None, None, None, None
            # a vLLM started to return routing (for replay; ours or one at --inference-url) returns it
            # in every whole answer
            hide_routing = not (isinstance(payload, dict) and asks_routing(payload))
            if isinstance(payload, dict):
                # No model means the base model, which must still go through the engine's lease
                # (on CPU it is an all-zero adapter, see VllmEngine.zero_adapter).
                name = payload.get("model", self.openai.served_names[0])
                if not isinstance(name, str):
                    raise bad_request("model must be a string")
                weights = self.openai.resolve(name, tenant)
                stack.enter_context(self.openai.slot(name, tenant))
                vllm_name = await stack.enter_async_context(self.vllm.lease(weights))
                meter = Meter(self.openai.sampling.usage, self.openai.charge(tenant), payload, path)
                copies = GreedyCopies(payload, path)
                forwarded = payload | {"model": vllm_name} | meter.asks | copies.asks
                if self.vllm.layout.routing.layers:  # it returns routing with every answer
                    forwarded |= least_routing(payload, path)
                body = await sized(_encode, len(body), forwarded)
                if vllm_name != name:
                    rename = (json.dumps(vllm_name).encode(), json.dumps(name).encode())
            else:
                self.vllm.check_ready()
            url = f"{self.vllm.host.base_url}/v1/{path}" + (f"?{query}" if query else "")
            content_type = headers.get("content-type", "application/json")
            upstream = await self._upstream().request(method, url, data=body, headers={"content-type": content_type})
            stack.callback(upstream.close)  # a no-op once the body is read; else vLLM sees the client go
            if upstream.status == 404 and vllm_name is not None and vllm_name != name:
                raise self.vllm.lost(vllm_name)
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
            if upstream.status != 200:
                meter, copies = None, None  # a refusal: nothing was sampled
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                lines = _lines(upstream, rename, meter, copies)
                return _Stream(lines, stack, status_code=upstream.status, headers=out_headers)
            content = await upstream.read()
            if hide_routing:
                content = await sized(without_routing, len(content), content)
            if copies is not None and copies.n > 1:
                content = await sized(copies.answer, len(content) * copies.n, content)
            if meter is not None:
                await sized(meter.count_answer, len(content), content)
        except EngineUnavailable as e:
            await stack.aclose()
            raise _unavailable(e) from None
        except UPSTREAM_ERRORS as e:
            await stack.aclose()
            raise _unavailable(EngineUnavailable(f"vLLM is not answering ({type(e).__name__}: {e})")) from None
        except UserError as e:
            await stack.aclose()
            raise bad_request(str(e)) from None
        except BaseException:
            await stack.aclose()
            raise
        await stack.aclose()
        if rename is not None:
            content = content.replace(*rename)
        return Response(content, status_code=upstream.status, headers=out_headers)


async def _lines(
    upstream: aiohttp.ClientResponse,
    rename: tuple[bytes, bytes] | None,
    meter: Meter | None,
    copies: GreedyCopies | None,
) -> AsyncIterator[bytes]:
    """Pass server-sent events through as they arrive, whole lines at a time (a name is never
    split across chunks), with vLLM's adapter name swapped for the client's, greedy choices
    copied, and the usage event read by ``meter`` (and dropped, if only the meter asked)."""
    try:
        pending = b""
        async for chunk in upstream.content.iter_any():
            pending += chunk
            cut = pending.rfind(b"\n") + 1
            if cut:
                ready, pending = pending[:cut], pending[cut:]
                if copies is not None and copies.n > 1:
                    ready = copies.events(ready)
                if meter is not None and USAGE.search(ready):
                    ready = meter.count_events(ready)
                yield ready.replace(*rename) if rename is not None else ready
        if pending:
            yield pending.replace(*rename) if rename is not None else pending
    except UPSTREAM_ERRORS as e:
        error = {"error": {"message": f"vLLM failed mid-stream: {type(e).__name__}", "type": "server_error"}}
        yield f"data: {json.dumps(error)}\n\n".encode()
