"""The CPU image (``deploy/Dockerfile``) as a user runs it, with the real SDK from outside the
container: the first start makes an API key on the data volume (a published port is never
open), the tiny model is served under its usual name, ``docker stop`` parks the live model
within the grace period and exits cleanly, and after ``docker start`` the same client goes on
with exactly the losses of an uninterrupted run (a second model of the same seed, same container).

It needs a Docker daemon and a built image, named by ``HOSTED_TINKER_IMAGE``::

    docker build -f deploy/Dockerfile -t hosted-tinker:cpu .
    HOSTED_TINKER_IMAGE=hosted-tinker:cpu pytest tests/test_docker_image.py

And ``deploy/startup.sh`` as a GCP VM runs it, under systemd, in a container standing in for the
VM (``tests/vm/Dockerfile``, named by ``HOSTED_TINKER_VM_IMAGE``; a stand-in metadata server
gives the instance attributes launch.sh sets): the checkout installed as ``--from-checkout`` copies
it up, the first boot's key, the service, ``systemctl stop`` parking, a reboot (``docker
restart``: systemd's own shutdown, the service enabled at boot), the startup script's second run
changing nothing, and a SIGKILLed server restarted by systemd.

CI's machine has no Docker daemon: there both are skipped."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
import yaml

from tests.conftest import free_port
from tests.test_residency import datum, step

IMAGE = os.environ.get("HOSTED_TINKER_IMAGE")
VM_IMAGE = os.environ.get("HOSTED_TINKER_VM_IMAGE")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
TINY = "hosted-tinker/tiny-qwen3"
STOP_GRACE_S = 40  # compose.yaml's stop_grace_period: the server parks within --shutdown-timeout (25 s)


def docker(*args: str, timeout: float = 120) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True, timeout=timeout).stdout.strip()


def healthy(base_url: str, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return httpx.get(f"{base_url}/healthz", timeout=2).raise_for_status().json()
        except httpx.HTTPError:
            time.sleep(0.25)
    raise AssertionError(f"the container did not answer {base_url}/healthz in {timeout} s")


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
    status = healthy(base_url)
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
    assert healthy(base_url)["active"]["parked_models"] == 1
    assert docker("exec", name, "cat", "/data/launch-key") == key  # kept, not made again
    losses += [step(tc, k) for k in range(3, 6)]
    assert tc.get_info().model_id == model_id

    uninterrupted = sc.create_lora_training_client(base_model=TINY, rank=4, seed=31).result()
    assert losses == [step(uninterrupted, k) for k in range(6)]
    sc.__exit__(None, None, None)


# ---- deploy/startup.sh under systemd, in a container standing in for the VM ------------------------

# what systemd as a container's PID 1 needs (no --privileged: it asks for more than this machine has)
SYSTEMD_IN_DOCKER = [
    *("--cap-add", "SYS_ADMIN", "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined"),
    *("--cgroupns", "host", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw", "--tmpfs", "/run", "--tmpfs", "/run/lock"),
]
BOOTED = (  # systemd's boot finished (its bus may not answer at first)
    "for i in $(seq 600); do case $(systemctl is-system-running --wait 2>/dev/null) in"
    " running|degraded) exit 0;; esac; sleep 0.2; done; exit 1"
)
TARBALL = "/opt/hosted-tinker/src.tar.gz"  # where launch.sh --from-checkout copies the checkout
ATTRIBUTES = "/metadata/computeMetadata/v1/instance/attributes"
METADATA_UNIT = """[Unit]
Description=a stand-in for GCP's metadata server (the instance attributes launch.sh sets)
[Service]
ExecStart=/usr/bin/python3 -m http.server 80 --bind 127.0.0.1 --directory /metadata
[Install]
WantedBy=multi-user.target
"""


def in_vm(vm: str, script: str, timeout: float = 300) -> str:
    return docker("exec", vm, "bash", "-c", script, timeout=timeout)


def checkout_tarball(path: Path) -> None:
    """The checkout with its uncommitted changes to tracked files, as launch.sh --from-checkout makes it."""
    ref = subprocess.run(["git", "-C", str(REPO), "stash", "create"], capture_output=True, text=True, check=True)
    archive = ["git", "-C", str(REPO), "archive", "--format=tar.gz", "--prefix=hosted-tinker/", "-o", str(path)]
    subprocess.run([*archive, ref.stdout.strip() or "HEAD"], check=True, timeout=60)


@pytest.fixture
def vm(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A booted stand-in VM (systemd as PID 1) in this machine's network namespace, so that the
    server keeps the VM's default of listening on 127.0.0.1; its port is a free one."""
    name, port = f"hosted-tinker-vm-{uuid.uuid4().hex[:8]}", free_port()
    with socket.socket() as probe:  # the metadata stand-in listens where GCP's does: 127.0.0.1:80
        if probe.connect_ex(("127.0.0.1", 80)) == 0:
            pytest.fail("127.0.0.1:80 is taken (a stand-in VM left running? docker rm -f hosted-tinker-vm-...)")
    metadata_host = ["--add-host", "metadata.google.internal:127.0.0.1"]  # kept across reboots
    docker("run", "-d", "--name", name, "--network", "host", *metadata_host, *SYSTEMD_IN_DOCKER, str(VM_IMAGE))
    try:
        in_vm(name, BOOTED)
        checkout_tarball(tmp_path / "src.tar.gz")
        in_vm(name, f"mkdir -p {ATTRIBUTES} /opt/hosted-tinker")
        docker("cp", str(tmp_path / "src.tar.gz"), f"{name}:{TARBALL}")
        for attribute, value in {"source": TARBALL, "port": str(port), "serve-args": "--shutdown-timeout 25"}.items():
            (tmp_path / attribute).write_text(value)
            docker("cp", str(tmp_path / attribute), f"{name}:{ATTRIBUTES}/hosted-tinker-{attribute}")
        (tmp_path / "metadata.service").write_text(METADATA_UNIT)
        docker("cp", str(tmp_path / "metadata.service"), f"{name}:/etc/systemd/system/metadata.service")
        in_vm(name, "systemctl enable --now metadata")
        yield name, f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True, timeout=120)


def boot_script(vm: str) -> None:
    """What GCP does at every boot: run the instance's startup-script (launch.sh sets it to
    deploy/startup.sh) as root."""
    in_vm(vm, "bash /usr/local/sbin/startup-script", timeout=600)


def service(vm: str, base_url: str) -> dict:
    """The systemd service's main pid and restart count, once the server behind it answers."""
    healthy(base_url)
    shown = in_vm(vm, "systemctl show -p MainPID -p NRestarts -p ActiveState -p UnitFileState hosted-tinker")
    return dict(line.split("=", 1) for line in shown.splitlines())


@pytest.mark.skipif(not VM_IMAGE, reason="HOSTED_TINKER_VM_IMAGE names no stand-in VM image (tests/vm/Dockerfile)")
def test_startup_script_under_systemd(vm: tuple[str, str]) -> None:
    name, base_url = vm
    docker("cp", str(DEPLOY / "startup.sh"), f"{name}:/usr/local/sbin/startup-script")
    boot_script(name)
    first = service(name, base_url)
    assert first["ActiveState"] == "active" and first["UnitFileState"] == "enabled", first
    assert healthy(base_url)["auth"] == {"mode": "api-keys"}
    key = in_vm(name, "cat /var/lib/hosted-tinker/launch-key")
    assert in_vm(name, "stat -c %a /var/lib/hosted-tinker/launch-key") == "600"

    sc = tinker.ServiceClient(base_url=base_url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=31).result()
    losses = [step(tc, k) for k in range(2)]
    # systemctl stop: SIGTERM to the server alone (KillMode=mixed), which parks the model
    in_vm(name, "systemctl stop hosted-tinker")
    journal = in_vm(name, "journalctl -u hosted-tinker --no-pager")
    assert "shutdown: parked 1 models (0 could not be)" in journal
    in_vm(name, "systemctl start hosted-tinker")
    healthy(base_url)
    losses += [step(tc, k) for k in range(2, 4)]

    # a reboot: systemd's shutdown stops the service (the model parked again), and at boot the
    # enabled service starts before the startup script runs again, which changes nothing
    docker("restart", "-t", str(STOP_GRACE_S), name, timeout=STOP_GRACE_S + 60)
    rebooted = service(name, base_url)
    assert healthy(base_url)["active"]["parked_models"] == 1
    installed = in_vm(name, "stat -c %Y /opt/hosted-tinker/installed-source")
    boot_script(name)
    assert service(name, base_url)["MainPID"] == rebooted["MainPID"]  # not restarted: nothing changed
    assert in_vm(name, "stat -c %Y /opt/hosted-tinker/installed-source") == installed  # not installed again
    assert in_vm(name, "cat /var/lib/hosted-tinker/launch-key") == key
    losses += [step(tc, k) for k in range(4, 5)]

    # a crash: systemd starts the server again (Restart=on-failure); the model comes back from its
    # last save, the step after it lost (the documented loss), its next request failing once to say so
    path = tc.save_state("before-crash").result().path
    step(tc, 5)
    in_vm(name, "kill -KILL $(systemctl show -p MainPID --value hosted-tinker)")
    deadline = time.monotonic() + 120
    while (now := service(name, base_url))["MainPID"] in ("0", rebooted["MainPID"]):
        assert time.monotonic() < deadline, f"systemd did not restart the server: {now}"
        time.sleep(0.5)
    assert now["NRestarts"] == "1"
    with pytest.raises(tinker.RequestFailedError, match=f"restored from {path} \\(optimizer step 5\\)"):
        tc.forward_backward([datum(5)], "cross_entropy").result()
    losses += [step(tc, 5)]

    uninterrupted = sc.create_lora_training_client(base_model=TINY, rank=4, seed=31).result()
    assert losses == [step(uninterrupted, k) for k in range(6)]
    sc.__exit__(None, None, None)
