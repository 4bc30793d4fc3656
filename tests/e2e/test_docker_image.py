"""The CPU image (``deploy/Dockerfile``) as a user runs it, with the real SDK from outside the
container: the first start makes an API key on the data volume (a published port is never
open), the tiny model is served under its usual name, ``docker stop`` parks the live model
within the grace period and exits cleanly, and after ``docker start`` the same client goes on
with exactly the losses of an uninterrupted run (a second model of the same seed, same container).

``deploy/compose.yaml`` is run too, with Docker Compose 2.24+ (skipped without it); and the CUDA
image (``deploy/Dockerfile.cuda``) as far as it runs without a GPU.

It needs a Docker daemon and built images, named by ``HOSTED_TINKER_IMAGE`` and
``HOSTED_TINKER_CUDA_IMAGE`` (each test skipped without its own)::

    docker build -f deploy/Dockerfile -t hosted-tinker:cpu .
    docker build -f deploy/Dockerfile.cuda -t hosted-tinker:cuda .
    HOSTED_TINKER_IMAGE=hosted-tinker:cpu HOSTED_TINKER_CUDA_IMAGE=hosted-tinker:cuda \
        pytest tests/e2e/test_docker_image.py

CI's machine has no Docker daemon: there it is skipped."""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
import yaml

from tests.support.docker import DEPLOY, STOP_GRACE_S, TINY, docker
from tests.support.residency import step
from tests.support.server import free_port, wait_healthy

IMAGE = os.environ.get("HOSTED_TINKER_IMAGE")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def container() -> Iterator[tuple[str, str]]:
    """A container of the image on a fresh volume, its port published on 127.0.0.1."""
    name, port = f"hosted-tinker-test-{uuid.uuid4().hex[:8]}", free_port()
    docker("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", "-v", f"{name}:/data", str(IMAGE))
    try:
        yield name, f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True, timeout=120)
        subprocess.run(["docker", "volume", "rm", name], capture_output=True, timeout=120)


@pytest.mark.skipif(not IMAGE, reason="HOSTED_TINKER_IMAGE names no built image (needs a Docker daemon)")
def test_first_start_stop_and_start_again(container: tuple[str, str]) -> None:
    name, base_url = container
    status = wait_healthy(base_url)
    assert status["auth"] == {"mode": "api-keys"}  # the key was made before the server started
    assert status["served_models"] == [TINY]
    assert httpx.get(f"{base_url}/api/v1/training_runs", timeout=10).status_code == 401
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["hosted-tinker"]
    probe = compose["healthcheck"]["test"]
    assert probe[0] == "CMD"
    docker("exec", name, *probe[1:])  # compose's health check passes in the image
    key = docker("exec", name, "cat", "/data/launch-key")
    assert key.startswith("tml-") and docker("exec", name, "stat", "-c", "%a", "/data/launch-key") == "600"

    sc = tinker.ServiceClient(base_url=base_url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=31).result()
    model_id = tc.get_info().model_id
    losses = [step(tc, k) for k in range(3)]

    started = time.monotonic()
    docker("stop", "-t", str(STOP_GRACE_S), name, timeout=STOP_GRACE_S + 30)
    assert time.monotonic() - started < STOP_GRACE_S - 5  # it exited by itself, not killed at the deadline
    assert docker("inspect", "--format", "{{.State.ExitCode}}", name) == "0"
    logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=60)
    assert "shutdown: parked 1 models (0 could not be)" in logs.stdout + logs.stderr

    docker("start", name)
    assert wait_healthy(base_url)["active"]["parked_models"] == 1
    assert docker("exec", name, "cat", "/data/launch-key") == key  # kept, not made again
    losses += [step(tc, k) for k in range(3, 6)]
    assert tc.get_info().model_id == model_id

    uninterrupted = sc.create_lora_training_client(base_model=TINY, rank=4, seed=31).result()
    assert losses == [step(uninterrupted, k) for k in range(6)]
    sc.__exit__(None, None, None)


def compose_v2() -> bool:
    """Docker Compose 2.24 or newer: compose.yaml's ``env_file.required`` and the test's ``!override``."""
    found = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True, timeout=60)
    numbers = re.match(r"v?(\d+)\.(\d+)", found.stdout.strip())
    return found.returncode == 0 and numbers is not None and tuple(map(int, numbers.groups())) >= (2, 24)


@pytest.mark.skipif(not IMAGE, reason="HOSTED_TINKER_IMAGE names no built image (needs a Docker daemon)")
def test_compose_file_as_the_readme_runs_it(tmp_path: Path) -> None:
    """``deploy/compose.yaml`` with Docker Compose v2 (its ``env_file`` syntax needs v2): the
    built image instead of a build, the port on a free one, and an environment file of our own
    (the one the file names is optional, and absent here). Up, the key made on the volume,
    compose's own health check healthy, ``stop`` parks the model, ``up`` again goes on with it."""
    if not compose_v2():
        pytest.skip("no Docker Compose 2.24+ (docker compose)")
    port, project = free_port(), f"ht-test-{uuid.uuid4().hex[:8]}"
    env_file = tmp_path / "hosted-tinker.env"
    env_file.write_text("HOSTED_TINKER_MODEL_NAME=compose-tiny\n")
    override = tmp_path / "override.yaml"
    override.write_text(
        "services:\n"
        "  hosted-tinker:\n"
        f"    image: {IMAGE}\n"
        f'    ports: !override\n      - "127.0.0.1:{port}:8000"\n'
        f"    env_file: !override\n      - {env_file}\n"
        "    healthcheck:\n      interval: 2s\n"  # compose.yaml's 30 s, shortened for the test
    )
    compose = ["compose", "-p", project, "-f", str(DEPLOY / "compose.yaml"), "-f", str(override)]
    base_url = f"http://127.0.0.1:{port}"
    docker(*compose, "up", "-d", timeout=300)
    try:
        assert wait_healthy(base_url)["served_models"] == [TINY, "compose-tiny"]  # the env file was read
        key = docker(*compose, "exec", "-T", "hosted-tinker", "cat", "/data/launch-key")
        assert key.startswith("tml-")
        container = docker(*compose, "ps", "-q", "hosted-tinker")
        deadline = time.monotonic() + 60
        while docker("inspect", "--format", "{{.State.Health.Status}}", container) != "healthy":
            assert time.monotonic() < deadline, "compose's health check did not pass in 60 s"
            time.sleep(0.5)

        with tinker.ServiceClient(base_url=base_url, api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model="compose-tiny", rank=4, seed=7).result()
            losses = [step(tc, k) for k in range(2)]
            docker(*compose, "stop", timeout=STOP_GRACE_S + 30)
            assert docker("inspect", "--format", "{{.State.ExitCode}}", container) == "0"
            docker(*compose, "up", "-d", timeout=300)
            assert wait_healthy(base_url)["active"]["parked_models"] == 1  # the volume kept it
            losses += [step(tc, k) for k in range(2, 4)]
            uninterrupted = sc.create_lora_training_client(base_model="compose-tiny", rank=4, seed=7).result()
            assert losses == [step(uninterrupted, k) for k in range(4)]
    finally:
        subprocess.run(["docker", *compose, "down", "-v"], capture_output=True, timeout=180)


CUDA_IMAGE = os.environ.get("HOSTED_TINKER_CUDA_IMAGE")


@pytest.mark.skipif(not CUDA_IMAGE, reason="HOSTED_TINKER_CUDA_IMAGE names no built CUDA image")
def test_cuda_image_on_a_machine_without_a_gpu() -> None:
    """What of ``deploy/Dockerfile.cuda`` runs without a GPU: its default command stops at once
    with the reason as its last line; vLLM's OpenAI server imports in /opt/vllm; megatron-core is a
    release the megatron backend accepts; and the server itself (CUDA torch on the CPU) trains."""
    stopped = subprocess.run(["docker", "run", "--rm", str(CUDA_IMAGE)], capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 1
    assert (
        stopped.stderr.strip()
        .splitlines()[-1]
        .startswith("hosted-tinker serve: the training worker could not start: RuntimeError: Found no NVIDIA driver")
    )
    probe = (
        "from hosted_tinker.inference.vllm_setup import check_vllm_python;"
        "print(check_vllm_python('/opt/vllm/bin/python'));"
        "import importlib.metadata as m, torch; from hosted_tinker.rank.plans.megatron import MCORE_SUPPORTED;"
        "print(m.version('megatron-core') in MCORE_SUPPORTED, torch.version.cuda)"
    )
    said = docker("run", "--rm", "--entrypoint", "python", str(CUDA_IMAGE), "-c", probe, timeout=600).splitlines()
    assert said[-2:] == ["0.33.0", "True 13.0"], said

    name, port = f"hosted-tinker-test-{uuid.uuid4().hex[:8]}", free_port()
    on_cpu = [str(CUDA_IMAGE), "hosted-tinker", "serve", "--device", "cpu"]
    docker("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", *on_cpu)
    try:
        base_url = f"http://127.0.0.1:{port}"
        assert wait_healthy(base_url)["served_models"] == [TINY]
        key = docker("exec", name, "cat", "/data/launch-key")
        with tinker.ServiceClient(base_url=base_url, api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
            assert all(step(tc, k) > 0 for k in range(2))
    finally:
        subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True, timeout=120)
