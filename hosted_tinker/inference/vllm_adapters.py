"""The adapters we keep in vLLM: one fresh vLLM name per content version, so a name never changes
meaning while a request uses it; a version nobody uses any more is unloaded."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import shutil
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from hosted_tinker.core.errors import EngineUnavailable, UserError

log = logging.getLogger(__name__)

MAX_IDLE_ADAPTERS = 32  # loaded in vLLM but unused; beyond this the least recently used go


@dataclass(eq=False)
class LoadedAdapter:
    """One adapter version in vLLM, and who is using it."""

    key: str  # our version key
    name: str  # vLLM's lora_name
    users: int = 0
    retired: bool = False  # a newer version replaces it: unload once nobody uses it
    gone: bool = False  # vLLM no longer holds it (unloaded, or vLLM restarted)
    last_used: float = field(default_factory=time.monotonic)
    cleanup: Callable[[], None] | None = None  # for a retired version's files, run once
    scratch: Callable[[], None] | None = None  # files made for this load alone: deleted once vLLM lets it go


class AdapterRegistry:
    """Which adapter versions vLLM holds, under which names; loads and unloads them.

    Use counts live on the ``LoadedAdapter`` a caller got from ``acquire`` and gives back to
    ``release``, so a version reloaded after a vLLM restart never mixes with the old one's users.
    Idle versions beyond ``MAX_IDLE_ADAPTERS`` are unloaded (and load again on demand); only a
    retired version's ``cleanup`` deletes files.
    """

    def __init__(self, client: httpx.AsyncClient, base_url: Callable[[], str]) -> None:
        self.client = client
        self.base_url = base_url
        self.prefix = f"ht-{secrets.token_hex(3)}"  # our names, never another process's
        self._counter = itertools.count(1)
        self._loaded: dict[str, LoadedAdapter] = {}  # version key -> adapter
        self._loading: dict[str, asyncio.Future] = {}
        self._retired: set[str] = set()  # retired while loading
        self.loads = 0

    def loaded(self) -> int:
        return len(self._loaded)

    def forget(self) -> None:
        """vLLM restarted: it holds none of our adapters now."""
        for adapter in self._loaded.values():
            adapter.gone = True
            _run_scratch(adapter)
            if adapter.retired and adapter.users == 0:
                _run_cleanup(adapter)
        self._loaded.clear()
        self._retired.clear()

    def discard(self, name: str) -> None:
        """vLLM answered that it does not know ``name``: load it again next time."""
        for key, adapter in list(self._loaded.items()):
            if adapter.name == name:
                adapter.gone = True
                _run_scratch(adapter)
                del self._loaded[key]

    async def acquire(
        self,
        key: str,
        directory: Path,
        cleanup: Callable[[], None] | None = None,
        verify: Callable[[], None] | None = None,
        prepare: Callable[[Path], tuple[Path, Callable[[], None] | None]] | None = None,
    ) -> LoadedAdapter:
        """Adapter version ``key``, loaded from ``directory`` if vLLM lacks it (after ``verify``
        passes; what ``prepare`` makes of ``directory``, with what deletes that, if given),
        counted as in use until ``release``."""
        while (adapter := self._loaded.get(key)) is None:
            pending = self._loading.get(key)
            if pending is not None:
                try:
                    await asyncio.shield(pending)
                except asyncio.CancelledError:
                    task = asyncio.current_task()  # (a coroutine's: never None)
                    if task is not None and task.cancelling():
                        raise
                    # The loading request was cancelled, not this one: load it ourselves.
                continue
            pending = asyncio.get_running_loop().create_future()
            self._loading[key] = pending
            scratch = None
            try:
                if verify is not None:
                    await asyncio.to_thread(verify)
                source = directory
                if prepare is not None:
                    source, scratch = await asyncio.to_thread(prepare, directory)
                name = f"{self.prefix}-{next(self._counter)}"
                await self._load(name, source)
                retired = key in self._retired
                self._retired.discard(key)
                self._loaded[key] = LoadedAdapter(key, name, retired=retired, cleanup=cleanup, scratch=scratch)
                pending.set_result(None)
            except BaseException as e:
                if scratch is not None:
                    scratch()
                if key in self._retired and cleanup is not None:  # retired meanwhile: nobody will load it
                    self._retired.discard(key)
                    cleanup()
                pending.set_exception(e)
                pending.exception()  # retrieved: waiters re-raise it, no "never retrieved" log
                raise
            finally:
                del self._loading[key]
        adapter.users += 1
        adapter.last_used = time.monotonic()
        return adapter

    def release(self, adapter: LoadedAdapter) -> None:
        adapter.users -= 1
        adapter.last_used = time.monotonic()
        if adapter.users == 0 and adapter.retired:
            if adapter.gone:
                _run_cleanup(adapter)
            else:
                self._unload(adapter, cleanup=True)
        self._evict_idle()

    def retire(self, key: str) -> bool:
        """A newer version replaces ``key``: unload it once its last request is done, then run its
        cleanup. False if vLLM neither holds nor is loading it (its files are the caller's)."""
        adapter = self._loaded.get(key)
        if adapter is None:
            if key in self._loading:
                self._retired.add(key)
                return True
            return False
        adapter.retired = True
        if adapter.users == 0:
            self._unload(adapter, cleanup=True)
        return True

    def _evict_idle(self) -> None:
        idle = sorted((a.last_used, k) for k, a in self._loaded.items() if a.users == 0 and not a.retired)
        for _, key in idle[: max(0, len(idle) - MAX_IDLE_ADAPTERS)]:
            self._unload(self._loaded[key], cleanup=False)

    def _unload(self, adapter: LoadedAdapter, cleanup: bool) -> None:
        if self._loaded.get(adapter.key) is adapter:
            del self._loaded[adapter.key]
        adapter.gone = True
        spawn(self._post_unload(adapter, cleanup))

    async def _load(self, name: str, directory: Path) -> None:
        try:
            resp = await self.client.post(
                f"{self.base_url()}/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(directory), "load_inplace": True},
                timeout=120.0,
            )
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"could not load an adapter into vLLM: {type(e).__name__}: {e}") from e
        if resp.status_code >= 500:
            raise EngineUnavailable(f"vLLM failed to load an adapter: {resp.status_code} {resp.text[:300]}")
        if resp.status_code != 200:
            raise UserError(f"vLLM refused the adapter: {resp.text[:500]}")
        self.loads += 1

    async def _post_unload(self, adapter: LoadedAdapter, cleanup: bool) -> None:
        try:
            await self.client.post(
                f"{self.base_url()}/v1/unload_lora_adapter", json={"lora_name": adapter.name}, timeout=60.0
            )
        except httpx.HTTPError as e:  # vLLM is down: it forgot the adapter anyway
            log.info("unloading %s: %s", adapter.name, e)
        _run_scratch(adapter)
        if cleanup:
            _run_cleanup(adapter)


def _run_cleanup(adapter: LoadedAdapter) -> None:
    cleanup, adapter.cleanup = adapter.cleanup, None
    if cleanup is not None:
        cleanup()


def _run_scratch(adapter: LoadedAdapter) -> None:
    scratch, adapter.scratch = adapter.scratch, None
    if scratch is not None:
        scratch()


_background: set[asyncio.Task] = set()


def spawn(coro: Coroutine) -> asyncio.Task:
    """Run ``coro`` in the background, holding a reference until it ends."""
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


def remove_dir(directory: Path) -> Callable[[], None]:
    return lambda: shutil.rmtree(directory, ignore_errors=True)
