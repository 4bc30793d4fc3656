"""The repository, the deploy folder and ``docker`` in a subprocess, for the image and VM tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

DEPLOY = REPO / "deploy"

TINY = "hosted-tinker/tiny-qwen3"

STOP_GRACE_S = 40  # compose.yaml's stop_grace_period: the server parks within --shutdown-timeout (25 s)


def docker(*args: str, timeout: float = 120) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True, timeout=timeout).stdout.strip()
