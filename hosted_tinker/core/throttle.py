"""Warnings that a flood would repeat: counted, and let through at most once per interval with
how many there were since the last (a peer opening thousands of connections a second, a vLLM
that answers every sample without what was asked, would otherwise fill the log)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Throttle:
    """Counts events; ``due`` says when one may be logged. Thread-safe."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self._clock = every_s, clock
        self._lock = threading.Lock()
        self._since, self._said = 0, -every_s

    def due(self) -> int:
        """Count one event: the number since the last one let through (this one included) if it is
        time to log again, else 0."""
        with self._lock:
            self._since += 1
            now = self._clock()
            if now - self._said < self.every_s:
                return 0
            count, self._since, self._said = self._since, 0, now
            return count
