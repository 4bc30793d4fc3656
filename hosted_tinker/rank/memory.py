"""What a rank's memory holds, sent with each of its answers so that the server can show it
(``/healthz``, ``/metrics``, the console) without asking the rank, which may be busy for minutes.

    {"device": "cuda:0", "allocated": bytes, "reserved": bytes, "peak": bytes, "rss": bytes}

``allocated``/``reserved``/``peak`` are the CUDA caching allocator's (peak since the rank
started); on a CPU rank only ``rss``, the process's resident memory, and its peak.
"""

from __future__ import annotations

import os
import resource

import torch

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """Resident memory of this process now (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return None


def snapshot() -> dict[str, int | str | None]:
    """This rank's memory now: a few cheap calls (no device synchronisation)."""
    stats: dict[str, int | str | None] = {
        "rss": rss_bytes(),
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        stats.update(
            device=f"cuda:{device}",
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
            peak=torch.cuda.max_memory_allocated(device),
        )
    else:
        stats["device"] = "cpu"
    return stats
