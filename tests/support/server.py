"""A real server process on 127.0.0.1 for the end-to-end tests and the benchmarks, started and
health-checked before any SDK call (the SDK retries a dead server for ~5 minutes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from hosted_tinker.core.config import built_in_model_dir
from tests.support.zygote import ForkedProcess, zygote

# Offline, quiet, and keyed as the servers the tests start are (the benchmarks import this too)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TINKER_API_KEY", "tml-test")

ALIAS = "Qwen/Qwen3-8B-Base"

# Servers started here are forked from a zygote that has imported what a server imports
# (``tests.support.zygote``), where the tests have asked for one (``use_zygote``); otherwise each
# is a new ``python -m hosted_tinker serve`` (the benchmarks, ``HOSTED_TINKER_TEST_SPAWN=1``).
_forked = False


def use_zygote() -> None:
    global _forked
    _forked = not os.environ.get("HOSTED_TINKER_TEST_SPAWN")


def launch(argv: list[str], stdout: Path, stderr: Path | None = None) -> subprocess.Popen | ForkedProcess:
    """``python -m hosted_tinker *argv``, its output to ``stdout`` (and ``stderr``, else there too)."""
    if _forked:
        return zygote().spawn(argv, stdout, stderr)
    cmd = [sys.executable, "-m", "hosted_tinker", *argv]
    with open(stdout, "wb") as out:
        if stderr is None:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        with open(stderr, "wb") as err:
            return subprocess.Popen(cmd, stdout=out, stderr=err)


def run_cli(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python -m hosted_tinker *argv`` to its end (a start that must be refused), as
    ``subprocess.run(..., capture_output=True, text=True)`` says it."""
    with tempfile.TemporaryDirectory(prefix="hosted-tinker-cli-") as outputs:
        out, err = Path(outputs) / "stdout", Path(outputs) / "stderr"
        proc = launch(argv, out, err)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(proc.args, code, out.read_text(), err.read_text())


# The tiny model a server builds into its data dir when started with no --model costs ~3.4 s of
# CPU a build; where the tests have built it once (``use_built_in_model``), a new data dir gets a
# link to that one instead. The build is deterministic: it is the model the server would build.
_built_in_model: Path | None = None


def use_built_in_model(model_dir: Path) -> None:
    global _built_in_model
    _built_in_model = model_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen | ForkedProcess
    base_url: str
    data_dir: Path
    log_path: Path

    def stop(self, sig: int | None = None) -> None:
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(
    data_dir: Path,
    *extra: str,
    alias: str | None = ALIAS,
    timeout: float = 180.0,
    port: int | None = None,
    profile: Path | None = None,
) -> ServerProcess:
    """A server on 127.0.0.1, healthy; ``port`` to come back where a stopped one was;
    ``profile``: run under cProfile, which writes there when the server exits (benchmarks).
    A free port found here can be taken by another process before the server binds it: then
    the start is tried again on another one (never when ``port`` was given)."""
    for attempt in range(3):
        try:
            return _start_server(data_dir, *extra, alias=alias, timeout=timeout, port=port, profile=profile)
        except PortTaken:
            if port is not None or attempt == 2:
                raise
    raise AssertionError("unreachable")


class ServerExited(RuntimeError):
    """The server process ended before it was healthy (a refusal at start); its log's end says why."""


class PortTaken(ServerExited):
    pass


def _start_server(
    data_dir: Path,
    *extra: str,
    alias: str | None,
    timeout: float,
    port: int | None,
    profile: Path | None,
) -> ServerProcess:
    port = port or free_port()
    log_path = data_dir / f"server-{port}.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    built_in = built_in_model_dir(data_dir)
    model_given = any(flag == "--model" or flag.startswith("--model=") for flag in extra)
    if _built_in_model is not None and not model_given and not built_in.exists():
        built_in.parent.mkdir(parents=True, exist_ok=True)
        built_in.symlink_to(_built_in_model)
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir), "--log-level", "warning"]
    argv += [*extra, *(["--model-name", alias] if alias is not None else [])]
    if profile is None:
        proc = launch(argv, log_path)
    else:
        with open(log_path, "w") as log:
            cmd = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "hosted_tinker", *argv]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log_text = log_path.read_text()
            failure = PortTaken if "address already in use" in log_text else ServerExited
            raise failure(f"server exited with {proc.returncode}:\n{log_text[-4000:]}")
        try:
            if httpx.get(f"{base_url}/healthz", timeout=1.0).status_code == 200:
                return ServerProcess(proc, base_url, data_dir, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{log_path.read_text()[-4000:]}")


def wait_healthy(base_url: str, timeout: float = 180.0) -> dict:
    """Poll ``/healthz`` until it answers 200 (a server, a container or a VM coming up); its body."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return httpx.get(f"{base_url}/healthz", timeout=2).raise_for_status().json()
        except httpx.HTTPError:
            time.sleep(0.25)
    raise AssertionError(f"nothing answered {base_url}/healthz in {timeout} s")
