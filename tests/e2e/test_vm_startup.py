"""``deploy/startup.sh`` as a GCP VM runs it, under systemd, in containers standing in for VMs
(``tests/support/vm/Dockerfile``, named by ``HOSTED_TINKER_VM_IMAGE``), each with a stand-in metadata
server giving the instance attributes launch.sh sets, and the checkout installed as
``launch.sh --from-checkout`` copies it up:

- one VM: the first boot's key, the service, ``systemctl stop`` parking (KillMode=mixed), a
  reboot (``docker restart``: systemd's own shutdown, the service enabled at boot), the script's
  second run changing nothing, a SIGKILLed server restarted by systemd; the losses of an
  uninterrupted run;
- two VMs on a network of their own (``--nodes 2``: node 0 the server, node 1 ``hosted-tinker
  node``, joined over their addresses with the cluster key): the same losses as one machine with
  as many ranks, and node 1 stopped and started again is a group fault the server recovers from;
- ``launch.sh`` itself, with ``tests/support/vm/gcloud`` (a gcloud whose VMs are these containers) first
  on PATH: ``GPU_TYPE=l4 bash launch.sh --from-checkout`` prints a URL and key the SDK trains with.

It needs a Docker daemon::

    docker build -t hosted-tinker-vm tests/support/vm
    HOSTED_TINKER_VM_IMAGE=hosted-tinker-vm pytest tests/e2e/test_vm_startup.py

CI's machine has no Docker daemon: there it is skipped."""

from __future__ import annotations

import contextlib
import json
import os
import re
import runpy
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker

from tests.support.docker import DEPLOY, REPO, STOP_GRACE_S, TINY, docker
from tests.support.residency import datum, step
from tests.support.server import free_port, start_server, wait_healthy

VM_IMAGE = os.environ.get("HOSTED_TINKER_VM_IMAGE")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not VM_IMAGE, reason="HOSTED_TINKER_VM_IMAGE names no stand-in VM image (tests/support/vm/Dockerfile)"
    ),
]

# the stand-in VMs as tests/support/vm/gcloud makes them: one definition, in that script
GCLOUD = runpy.run_path(str(REPO / "tests" / "support" / "vm" / "gcloud"))
SYSTEMD_IN_DOCKER = GCLOUD["SYSTEMD"]
BOOTED, ATTRIBUTES, METADATA_UNIT = GCLOUD["BOOTED"], GCLOUD["ATTRIBUTES"], GCLOUD["METADATA_UNIT"]
TARBALL = "/opt/hosted-tinker/src.tar.gz"  # where launch.sh --from-checkout copies the checkout


def in_vm(vm: str, script: str, timeout: float = 300) -> str:
    return docker("exec", vm, "bash", "-c", script, timeout=timeout)


def put(vm: str, path: str, text: str, tmp_path: Path) -> None:
    local = tmp_path / uuid.uuid4().hex
    local.write_text(text)
    docker("cp", str(local), f"{vm}:{path}")


@pytest.fixture(scope="module")
def tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout with its uncommitted changes to tracked files, as launch.sh --from-checkout makes it."""
    path = tmp_path_factory.mktemp("checkout") / "src.tar.gz"
    ref = subprocess.run(["git", "-C", str(REPO), "stash", "create"], capture_output=True, text=True, check=True)
    archive = ["git", "-C", str(REPO), "archive", "--format=tar.gz", "--prefix=hosted-tinker/", "-o", str(path)]
    subprocess.run([*archive, ref.stdout.strip() or "HEAD"], check=True, timeout=60)
    return path


@contextlib.contextmanager
def stand_in_vm(network: list[str], tarball: Path, tmp_path: Path) -> Iterator[str]:
    """A booted VM (systemd as PID 1) with the checkout copied up, its metadata server running
    and startup.sh where GCP keeps the startup-script; attributes are set with ``put``."""
    name = f"hosted-tinker-vm-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, "--hostname", name, *network, *SYSTEMD_IN_DOCKER, str(VM_IMAGE))
    try:
        in_vm(name, BOOTED)
        in_vm(name, f"mkdir -p {ATTRIBUTES} /opt/hosted-tinker")
        docker("cp", str(tarball), f"{name}:{TARBALL}")
        docker("cp", str(DEPLOY / "startup.sh"), f"{name}:/usr/local/sbin/startup-script")
        put(name, "/etc/systemd/system/metadata.service", METADATA_UNIT, tmp_path)
        put(name, f"{ATTRIBUTES}/hosted-tinker-source", TARBALL, tmp_path)
        in_vm(name, "systemctl enable --now metadata")
        yield name
    finally:
        subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True, timeout=120)


def set_attributes(vm: str, tmp_path: Path, **attributes: str) -> None:
    for key, value in attributes.items():
        put(vm, f"{ATTRIBUTES}/hosted-tinker-{key.replace('_', '-')}", value, tmp_path)


def metadata_port_is_free() -> None:
    """A VM in this machine's network namespace serves its metadata where GCP does: 127.0.0.1:80."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 80)) == 0:
            pytest.fail("127.0.0.1:80 is taken (a stand-in VM left running? docker rm -f hosted-tinker-vm-...)")


@pytest.fixture
def vm(tarball: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """One VM in this machine's network namespace, so that the server keeps the VM's default of
    listening on 127.0.0.1 (on a free port) and the SDK reaches it from here."""
    metadata_port_is_free()
    port = free_port()
    with stand_in_vm(["--network", "host"], tarball, tmp_path) as name:
        set_attributes(name, tmp_path, port=str(port), serve_args="--shutdown-timeout 25")
        yield name, f"http://127.0.0.1:{port}"


def boot_script(vm: str) -> None:
    """What GCP does at every boot: run the instance's startup-script (launch.sh sets it to
    deploy/startup.sh) as root."""
    in_vm(vm, "bash /usr/local/sbin/startup-script", timeout=600)


def service(vm: str, base_url: str) -> dict:
    """The systemd service's main pid and restart count, once the server behind it answers."""
    wait_healthy(base_url)
    shown = in_vm(vm, "systemctl show -p MainPID -p NRestarts -p ActiveState -p UnitFileState hosted-tinker")
    return dict(line.split("=", 1) for line in shown.splitlines())


def test_startup_script_under_systemd(vm: tuple[str, str]) -> None:
    name, base_url = vm
    boot_script(name)
    first = service(name, base_url)
    assert first["ActiveState"] == "active" and first["UnitFileState"] == "enabled", first
    assert wait_healthy(base_url)["auth"] == {"mode": "api-keys"}
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
    wait_healthy(base_url)
    losses += [step(tc, k) for k in range(2, 4)]

    # a reboot: systemd's shutdown stops the service (the model parked again), and at boot the
    # enabled service starts before the startup script runs again, which changes nothing
    docker("restart", "-t", str(STOP_GRACE_S), name, timeout=STOP_GRACE_S + 60)
    rebooted = service(name, base_url)
    assert wait_healthy(base_url)["active"]["parked_models"] == 1
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


# The client of the two-VM test, run inside node 0 (its server listens on node 0's loopback) and
# here against one machine: 4 steps of 2 datums, the losses printed as JSON.
CLIENT = """
import json, sys
import tinker
from tinker import types

def datum(k):
    t = [(7 * k + i) % 50 + 5 for i in range(6)]
    return types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                       loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * 5})

with tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2]) as sc:
    tc = sc.create_lora_training_client(base_model=sys.argv[3], rank=4, seed=31).result()
    losses = []
    for k in range(4):
        losses.append(tc.forward_backward([datum(k), datum(k + 10)], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
print(json.dumps(losses))
"""


def node0_health(vm: str) -> dict:
    return json.loads(in_vm(vm, "curl -fs --retry 120 --retry-delay 1 --retry-all-errors 127.0.0.1:8000/healthz"))


def test_two_vms_train_as_one_machine_and_survive_a_node_restart(tarball: Path, tmp_path: Path) -> None:
    network = f"hosted-tinker-net-{uuid.uuid4().hex[:8]}"
    docker("network", "create", network)
    try:
        with (
            stand_in_vm(["--network", network], tarball, tmp_path) as node0,
            stand_in_vm(["--network", network], tarball, tmp_path) as node1,
        ):
            # what launch.sh --nodes 2 sets: node 0's address (here its container's), a shared key
            address = docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", node0)
            rendezvous = f"--nnodes 2 --master-addr {address} --master-port 29500"
            cluster_key = secrets.token_hex(32)
            set_attributes(node0, tmp_path, role="server", cluster_key=cluster_key)
            set_attributes(node0, tmp_path, serve_args=f"--backend ddp --train-devices cpu:1 {rendezvous}")
            set_attributes(node1, tmp_path, role="node", cluster_key=cluster_key)
            set_attributes(node1, tmp_path, serve_args=f"--node-rank 1 {rendezvous}")
            boot = ["bash", "/usr/local/sbin/startup-script"]
            boots = [subprocess.Popen(["docker", "exec", vm, *boot]) for vm in (node1, node0)]  # at once, as VMs boot
            assert [boot.wait(timeout=400) for boot in boots] == [0, 0]
            worker = node0_health(node0)["worker"]
            assert worker["nodes"] == [{"node": 1, "host": node1, "connected": True}]
            put(node0, "/tmp/client.py", CLIENT, tmp_path)
            python, key = "/opt/hosted-tinker/venv/bin/python", "$(cat /var/lib/hosted-tinker/launch-key)"
            run_client = f"{python} /tmp/client.py http://127.0.0.1:8000 {key} {TINY}"
            two_vms = json.loads(in_vm(node0, run_client).splitlines()[-1])

            in_vm(node1, "systemctl stop hosted-tinker")  # node 1 goes away: a group fault, named
            deadline = time.monotonic() + 60
            while (worker := node0_health(node0)["worker"])["nodes"][0]["connected"]:
                assert time.monotonic() < deadline, worker
                time.sleep(0.5)
            in_vm(node1, "systemctl start hosted-tinker")
            deadline = time.monotonic() + 120
            while not ((worker := node0_health(node0)["worker"])["alive"] and worker["nodes"][0]["connected"]):
                assert time.monotonic() < deadline, worker
                time.sleep(0.5)
            assert "its node disconnected (node 1" in worker["last_death"] and worker["restarts"] >= 1
            again = json.loads(in_vm(node0, run_client).splitlines()[-1])
    finally:
        subprocess.run(["docker", "network", "rm", network], capture_output=True, timeout=60)

    one = start_server(tmp_path / "one", "--backend", "ddp", "--train-devices", "cpu:2", alias=None)
    try:
        (tmp_path / "client.py").write_text(CLIENT)
        run = [sys.executable, str(tmp_path / "client.py"), one.base_url, "tml-open", TINY]
        printed = subprocess.run(run, capture_output=True, text=True, check=True, timeout=300).stdout
        one_machine = json.loads(printed.splitlines()[-1])
    finally:
        one.stop()
    assert two_vms == one_machine
    assert again == one_machine


# ---- launch.sh itself, against a gcloud whose VMs are these containers -----------------------------


def test_launch_sh_from_checkout_prints_a_url_and_key_the_sdk_trains_with(tmp_path: Path) -> None:
    """``GPU_TYPE=l4 bash launch.sh --from-checkout`` with tests/support/vm/gcloud first on PATH: the VM
    made, the checkout copied up and installed by its startup script, /healthz waited for through
    the "tunnel", and the URL and key it prints serve the SDK."""
    name, port = f"hosted-tinker-vm-{uuid.uuid4().hex[:8]}", free_port()
    metadata_port_is_free()
    env = {**os.environ, "PATH": f"{REPO / 'tests' / 'vm'}{os.pathsep}{os.environ['PATH']}", "GPU_TYPE": "l4"}
    args = ["--project", "fake-project", "--zones", "us-central1-a", "--name", name, "--from-checkout"]
    args += ["--port", str(port), "--serve-args", "--device cpu", "--wait-timeout", "400"]
    tunnel = None
    try:
        done = subprocess.run(
            ["bash", str(REPO / "launch.sh"), *args], env=env, capture_output=True, text=True, timeout=540
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        printed = re.search(r"export TINKER_BASE_URL=(\S+) TINKER_API_KEY=(tml-\S+)", done.stdout)
        assert printed, done.stdout
        tunnel = re.search(r"The SSH tunnel runs as pid (\d+)", done.stdout)
        url, key = printed.groups()
        assert url == f"http://localhost:{port}" and wait_healthy(url)["auth"] == {"mode": "api-keys"}
        with tinker.ServiceClient(base_url=url, api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=31).result()
            assert step(tc, 0) > 0
    finally:
        if tunnel:
            os.kill(int(tunnel.group(1)), signal.SIGTERM)
        subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True, timeout=120)
