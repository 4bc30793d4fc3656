"""``deploy/startup.sh`` in its local mode, as a VM's boots would run it: installed from this
checkout, the key made on the first boot, the server supervised and answering. The stop between
the boots is a SIGTERM to the whole process group (as a terminal, or systemd without
KillMode=mixed, sends it): the server still parks its model, so the second boot keeps the key,
the install, the data, and the live model, whose client goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.support.server import ALIAS, free_port, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def boot(root: Path, env: dict[str, str]) -> None:
    subprocess.run(
        ["bash", str(REPO / "deploy" / "startup.sh"), "--local", str(root)], env=env, check=True, timeout=300
    )


def shut_down(root: Path, port: int) -> None:
    """SIGTERM to the service's whole process group, and wait until it is gone."""
    supervisor = int((root / "opt/hosted-tinker/supervisor.pid").read_text())
    os.killpg(supervisor, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(supervisor, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(supervisor, signal.SIGKILL)
    raise AssertionError(f"the service on port {port} did not stop within 60 s")


def test_first_and_second_boot(tmp_path: Path, tiny_model_dir: Path):
    root, port = tmp_path / "vm", free_port()
    env = {
        **os.environ,
        "HT_SOURCE": str(REPO),
        "HT_SERVE_ARGS": f"--model {tiny_model_dir} --model-name {ALIAS}",
        "HT_PORT": str(port),
        # CI's hook: the new environment uses this one's packages instead of downloading torch.
        "HT_PIP_ARGS": "--no-deps",
        "HT_DEPS_SITE": sysconfig.get_paths()["purelib"],
        "HT_SYSFS": str(tmp_path / "no-pci-devices"),  # a machine without a GPU, wherever this runs
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    data = root / "var/lib/hosted-tinker"
    boot(root, env)
    try:
        key = (data / "launch-key").read_text().strip()
        assert key.startswith("tml-") and (data / "launch-key").stat().st_mode & 0o777 == 0o600
        # never open: the key was made first
        assert wait_healthy(f"http://127.0.0.1:{port}")["auth"] == {"mode": "api-keys"}
        assert (root / "opt/hosted-tinker/venv/bin/hosted-tinker").exists()
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key)
        tc = sc.create_lora_training_client(base_model=ALIAS, rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        saved = tc.save_state("before-reboot").result().path
    finally:
        shut_down(root, port)
    assert "shutdown: parked 1 models" in (data / "server.log").read_text()  # the ranks outlived the SIGTERM

    installed = (root / "opt/hosted-tinker/installed-source").stat().st_mtime
    boot(root, env)
    try:
        assert (data / "launch-key").read_text().strip() == key
        assert (root / "opt/hosted-tinker/installed-source").stat().st_mtime == installed  # not installed again
        wait_healthy(f"http://127.0.0.1:{port}")
        rest = tinker.RestClient(base_url=f"http://127.0.0.1:{port}", api_key=key)
        runs = rest.list_training_runs().result().training_runs
        checkpoints = [
            c.tinker_path for r in runs for c in rest.list_checkpoints(r.training_run_id).result().checkpoints
        ]
        assert saved in checkpoints
        tc.forward_backward([datum], "cross_entropy").result()  # the parked model, back under its id
        sc.__exit__(None, None, None)
    finally:
        shut_down(root, port)


def test_a_gpu_vm_whose_torch_cannot_use_it_stops_with_the_reason(tmp_path: Path) -> None:
    """An NVIDIA device on the PCI bus: the script waits for the driver, then checks that torch
    can use it, and names what is wrong instead of starting a server that trains on nothing."""
    root, fake = tmp_path / "vm", tmp_path / "fake"
    device = fake / "sys/bus/pci/devices/0000:00:04.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x10de\n")
    (fake / "bin").mkdir()
    smi = fake / "bin/nvidia-smi"  # answers once the "driver" is installed
    smi.write_text(f'#!/bin/sh\n[ -e {fake}/driver ] || exit 9\necho "570.133.20"\n')
    smi.chmod(0o755)
    env = {
        **os.environ,
        "HT_SOURCE": str(REPO),
        "HT_PORT": str(free_port()),
        "HT_PIP_ARGS": "--no-deps",
        "HT_DEPS_SITE": sysconfig.get_paths()["purelib"],
        "HT_SYSFS": str(fake / "sys"),
        "HT_DRIVER_WAIT": "0",
        "CUDA_VISIBLE_DEVICES": "",  # torch sees no GPU, wherever this runs
        "PATH": f"{fake / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    script = ["bash", str(REPO / "deploy" / "startup.sh"), "--local", str(root)]

    try:
        no_driver = subprocess.run(script, env=env, capture_output=True, text=True, timeout=300)
        assert no_driver.returncode == 1
        assert "waiting up to 0s for nvidia-smi" in no_driver.stdout
        assert "this VM has an NVIDIA GPU but no working driver" in no_driver.stderr

        (fake / "driver").touch()
        unusable = subprocess.run(script, env=env, capture_output=True, text=True, timeout=300)
        assert unusable.returncode == 1
        assert "cannot use this VM's GPUs (driver 570.133.20)" in unusable.stderr
        assert not (root / "opt/hosted-tinker/supervisor.pid").exists()  # no server was started
        assert not (root / "var/lib/hosted-tinker/launch-key").exists()
    finally:
        if (root / "opt/hosted-tinker/supervisor.pid").exists():
            shut_down(root, int(env["HT_PORT"]))
