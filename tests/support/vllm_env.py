"""The vLLM environment the vLLM tests use (``scripts/install.sh --test`` makes ``.vllm-venv``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def vllm_python() -> str:
    """The vLLM venv's python: $HOSTED_TINKER_VLLM_PYTHON or ./.vllm-venv (scripts/install.sh --test)."""
    python = os.environ.get("HOSTED_TINKER_VLLM_PYTHON") or str(REPO / ".vllm-venv" / "bin" / "python")
    if not Path(python).exists():
        if os.environ.get("HOSTED_TINKER_REQUIRE_VLLM"):
            pytest.fail(f"no vLLM environment at {python}; run hosted-tinker setup-vllm")
        pytest.skip(f"no vLLM environment at {python} (hosted-tinker setup-vllm .vllm-venv)")
    return python
