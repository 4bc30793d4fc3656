"""The thread on which large bodies are decoded and encoded, off the server's event loop.

One thread: big bodies queue for it, never for the pool that store reads share (and under the
GIL two could not run at once anyway). ``server.api.json_body`` parses prompts here; the ``/v1``
proxy decodes and re-encodes the JSON it forwards; the vLLM engine parses vLLM's answers.
"""

from __future__ import annotations

import asyncio
import functools
import gc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

OFF_LOOP_BYTES = 64 << 10  # smaller bodies are handled in place: the hop would cost more than it saves
# json.loads makes an object of each array and object (56 bytes or more for the two bytes of
# "[]": a 32 MiB body of them took 0.8 GB): a JSON body holds at most this many, counted in C
# before it is parsed ("[" and "{" in strings count too).
MAX_JSON_CONTAINERS = 1 << 20
T = TypeVar("T")

_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="json-body")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the body thread, with the cyclic garbage collector paused."""
    return await asyncio.get_running_loop().run_in_executor(_thread, functools.partial(_gc_paused, fn, *args))


def _gc_paused(fn: Callable[..., T], *args: Any) -> T:
    # Decoding JSON builds a container per array and object; every 700 of them start a collection
    # that walks the older ones too, so millions of "[]" took 1.9 s of json.loads (one C call,
    # the GIL held) where 0.15 s do without. Nothing decoded here forms a cycle.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return fn(*args)
    finally:
        if was_enabled:
            gc.enable()


def too_many_containers(body: bytes) -> str | None:
    """Why ``body`` is refused before it is parsed, or None."""
    count = body.count(b"[") + body.count(b"{")
    if count > MAX_JSON_CONTAINERS:
        return f"the JSON body holds {count} arrays and objects ('[' and '{{'), over the {MAX_JSON_CONTAINERS} allowed"
    return None


async def sized(fn: Callable[..., T], size: int, *args: Any) -> T:
    """``fn(*args)`` on the body thread if it handles ``size`` bytes or more, else in place."""
    return fn(*args) if size < OFF_LOOP_BYTES else await off_loop(fn, *args)
