"""Running the ``hosted-tinker`` CLI in a subprocess (``run_cli``, ``cli``): the tinker CLI's and
the keys command's tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(base_url: str, *args: str, cwd: Path, fmt: str = "json") -> subprocess.CompletedProcess:
    """Run `tinker --format <fmt> <args>` as a subprocess (no stdin: CI cannot answer prompts)."""
    env = {
        **os.environ,
        "TINKER_BASE_URL": base_url,
        "TINKER_API_KEY": "tml-test",
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "400",  # keep rich tables from wrapping/truncating paths
    }
    cmd = [sys.executable, "-m", "tinker.cli", "--format", fmt, *args]
    proc = subprocess.run(
        cmd,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hosted_tinker", *args], capture_output=True, text=True, timeout=120, check=check
    )


CLI_TIMEOUT = 120
