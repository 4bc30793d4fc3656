"""Plumbing shared by the tests that run tinker-cookbook recipes end to end against the server.

The recipes run unmodified, each in its own Python subprocess, so the tests only control what a
subprocess sees: its environment, its command line and its stdin. Everything here is that
plumbing; the recipe arguments and the assertions stay in the test files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import ALIAS, ServerProcess

# Import names of what the recipes need besides tinker-cookbook (tests/requirements-clients.txt).
RECIPE_EXTRAS = (
    "aiohttp",
    "anyio",
    "blobfile",
    "chz",
    "cloudpickle",
    "datasets",
    "huggingface_hub",
    "PIL",
    "pyrage",
    "termcolor",
    "tiktoken",
    "tqdm",
)
MATH_RL_EXTRAS = ("sympy", "pylatexenc", "math_verify")  # tinker-cookbook[math-rl], for rl_basic


def require_cookbook(*extras: str) -> Any:
    """The ``tinker_cookbook`` module; without it or one of ``extras`` the calling test module is
    skipped, saying what is missing. The extras are looked up, not imported, so collection stays
    cheap (``datasets`` alone takes over a second to import)."""
    missing = [name for name in extras if importlib.util.find_spec(name) is None]
    install = "pip install --no-deps tinker-cookbook==0.6.1 -r tests/requirements-clients.txt"
    if missing:
        pytest.skip(
            f"tinker-cookbook's extras are not installed: {', '.join(missing)} ({install})", allow_module_level=True
        )
    return pytest.importorskip("tinker_cookbook", reason=f"tinker-cookbook is not installed ({install})")


SNAPSHOT = "0" * 40  # any 40-hex commit id; refs/main only has to point at it
# Cache locations that would win over $HF_HOME and send a subprocess to the developer's own cache.
CACHE_OVERRIDES = ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_DATASETS_CACHE")


def seed_hf_cache(hf_home: Path, model_dir: Path, repo_id: str = ALIAS) -> None:
    """Make ``AutoTokenizer.from_pretrained(repo_id)`` resolve offline to the tiny model's tokenizer.

    The recipes load the tokenizer by the served model name (``Qwen/Qwen3-8B-Base``), which is not
    on disk here; a hub-cache snapshot under that name holding the tiny model's files stands in.
    """
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / SNAPSHOT
    snap.mkdir(parents=True)
    # config.json is required: AutoTokenizer fails offline without it.
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(model_dir / name, snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)


def offline_env(hf_home: Path, model_dir: Path, base_url: str) -> dict[str, str]:
    """Seed ``hf_home`` (see :func:`seed_hf_cache`) and return a recipe subprocess's environment.

    HF is forced offline so that a missing file fails fast instead of reaching the network, and the
    SDK is pointed at the test server with the test API key and no telemetry.
    """
    seed_hf_cache(hf_home, model_dir)
    env = {k: v for k, v in os.environ.items() if k not in CACHE_OVERRIDES}
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TINKER_API_KEY="tml-test",
        TINKER_TELEMETRY="0",
        TINKER_BASE_URL=base_url,
    )
    return env


def server_log_tail(server: ServerProcess, chars: int = 4000) -> str:
    """The end of the server's log: a recipe's traceback rarely says why the server refused it."""
    return f"--- server log {server.log_path} ---\n{server.log_path.read_text()[-chars:]}"


def run_recipe(
    name: str,
    argv: list[str],
    *,
    server: ServerProcess,
    env: dict[str, str],
    cwd: Path,
    timeout: float,
    stdin: str = "",
) -> str:
    """Run ``python *argv``; return its stdout and stderr (interleaved), or fail the test.

    ``stdin`` defaults to empty so that an unexpected prompt (e.g. the cookbook's "log dir exists")
    fails with EOFError instead of hanging until the timeout. On a timeout or a nonzero exit the
    test fails with the subprocess's output and the server log tail, labelled ``name``.
    """
    try:
        proc = subprocess.run(
            [sys.executable, *argv],
            cwd=cwd,
            env=env,
            input=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        # On a timeout the partial output is bytes even with text=True.
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        pytest.fail(f"{name} timed out after {timeout}s:\n{out}\n{server_log_tail(server)}")
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout[-8000:]}\n{server_log_tail(server)}"
    return proc.stdout


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a recipe's JSON-lines log (metrics.jsonl, checkpoints.jsonl), blank lines skipped."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
