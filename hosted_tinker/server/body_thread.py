"""The thread on which large request bodies are decoded and encoded, off the event loop.

One thread: big bodies queue for it, never for the pool that store reads share (and under the
GIL two could not run at once anyway). ``api.json_body`` parses prompts here; the ``/v1`` proxy
decodes and re-encodes the JSON it forwards.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

OFF_LOOP_BYTES = 64 << 10  # smaller bodies are handled in place: the hop would cost more than it saves
T = TypeVar("T")

_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="json-body")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the body thread."""
    return await asyncio.get_running_loop().run_in_executor(_thread, functools.partial(fn, *args))


async def sized(fn: Callable[..., T], size: int, *args: Any) -> T:
    """``fn(*args)`` on the body thread if it handles ``size`` bytes or more, else in place."""
    return fn(*args) if size < OFF_LOOP_BYTES else await off_loop(fn, *args)
