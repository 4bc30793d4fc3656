"""What a rank's memory holds, sent with each of its answers so that the server can show it
(``/healthz``, ``/metrics``, the console) without asking the rank, which may be busy for minutes.

    {"device": "cuda:0", "allocated": bytes, "reserved": bytes, "peak": bytes, "rss": bytes}

``allocated``/``reserved``/``peak`` are the CUDA caching allocator's (peak since the rank
started); on a CPU rank only ``rss``, the process's resident memory, and its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import resource

import torch

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def rss_bytes() -> int | None:
    """Resident memory of this process now (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory this process frees for its next allocations rather
    than give it back to the kernel: no ``mmap`` for large blocks, no trimming of the heap.

    A CPU rank's activations are tensors of tens of MB, which glibc serves from fresh ``mmap``
    pages that the kernel zeroes on first touch and takes back on free, every step: one
    forward_backward of 2,048 tokens on a 0.5B model spent 23 s of its 50 in the kernel (8 M page
    faults); with this, no fault after the first step and 32 s (``benchmarks/train_efficiency.py``).
    The price is that resident memory stays at the largest step's peak, as a caching allocator's
    does. glibc only; whether it applied."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))  # -1: never trim


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
