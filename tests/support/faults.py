"""Fault-injection helpers: heavy and small requests, waiting until a worker computes, a server
that must fail to start."""

from __future__ import annotations

import os
import signal
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.server import run_cli


def datum(length: int, start: int = 1) -> types.Datum:
    tokens = [(start + i) % 500 + 1 for i in range(length + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
    )


SMALL = [datum(16)]

HEAVY = [datum(2048, start=i) for i in range(24)]  # a few seconds of CPU: time to kill it


def wait_until_computing(base_url: str, pid: int, cpu_s: float = 0.3, timeout: float = 60.0) -> None:
    """Return once a request is in flight and worker process ``pid`` has spent ``cpu_s`` seconds
    of CPU on it: the request reached the worker, which is well inside its forward pass (an idle
    worker uses next to none)."""
    deadline = time.monotonic() + timeout
    while health(base_url)["queue"]["in_flight"] == 0:
        assert time.monotonic() < deadline, "the request never reached the worker"
        time.sleep(0.02)
    start = cpu_seconds(pid)
    while cpu_seconds(pid) - start < cpu_s:
        assert time.monotonic() < deadline, f"worker {pid} never started computing the request"
        time.sleep(0.02)


def kill_a_rank_mid_step(tc, base_url: str, rank: int = 1) -> tuple[tinker.RequestFailedError, list[int]]:
    """Send a heavy ``forward_backward`` on ``tc``, SIGKILL training rank ``rank`` once it is inside
    the step, and return how the request failed and the ranks' pids before the kill."""
    old = health(base_url)["worker"]["pids"]
    doomed = tc.forward_backward(HEAVY, "cross_entropy")
    wait_until_computing(base_url, old[rank])
    os.kill(old[rank], signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError) as failure:
        doomed.result()
    return failure.value, old


def forward_logprobs(tc) -> np.ndarray:
    return tc.forward(SMALL, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def serve_fails(tmp_path, *flags: str) -> str:
    """Start the server with ``flags``; it must refuse to start. What it said."""
    done = run_cli(["serve", "--data-dir", str(tmp_path), "--port", "0", *flags], timeout=120)
    assert done.returncode != 0, done.stdout
    return done.stderr


def health(base_url: str) -> dict:
    return httpx.get(f"{base_url}/healthz", timeout=5).json()


def cpu_seconds(pid: int) -> float:
    """The CPU time ``pid`` has used so far, all its threads together (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
