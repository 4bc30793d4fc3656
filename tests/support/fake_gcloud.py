"""A stand-in ``gcloud`` for tests/e2e/test_launch.py (put first on PATH as ``gcloud``): it appends its
argv as one JSON line to $FAKE_GCLOUD_LOG and answers as gcloud would, as the FAKE_GCLOUD_*
variables say (instances, metadata, zones, stockouts, serial output, errors)."""

import json
import os
import sys

args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
words = [a for a in args if not a.startswith("-")]
flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
fmt = flags.get("format", "")
env = os.environ.get
if words[:3] == ["config", "get-value", "project"]:
    print(env("FAKE_GCLOUD_PROJECT", "fake-project"))
elif words[:3] == ["compute", "instances", "create"]:
    if flags.get("zone") in env("FAKE_GCLOUD_STOCKOUT_ZONES", "").split(","):
        zone = flags["zone"]
        sys.stderr.write(
            "ERROR: (gcloud.compute.instances.create) Could not fetch resource:\n"
            f" - The zone 'projects/p/zones/{zone}' does not have enough resources available to fulfill"
            " the request.  Try a different zone, or try again later. (ZONE_RESOURCE_POOL_EXHAUSTED)\n"
        )
        sys.exit(1)
    if env("FAKE_GCLOUD_CREATE_ERROR"):
        sys.stderr.write(env("FAKE_GCLOUD_CREATE_ERROR") + "\n")
        sys.exit(1)
    sys.stderr.write(f"Created [{words[3]}].\n")
elif words[:3] == ["compute", "instances", "list"]:
    print(env("FAKE_GCLOUD_INSTANCES", "").replace(";", "\n"))
elif words[:3] == ["compute", "instances", "describe"]:
    if env("FAKE_GCLOUD_DESCRIBE_ERROR"):
        sys.stderr.write(env("FAKE_GCLOUD_DESCRIBE_ERROR") + "\n")
        sys.exit(1)
    if "metadata" in fmt:
        print(env("FAKE_GCLOUD_METADATA", "{'key': 'hosted-tinker-serve-args', 'value': '--backend peft'}"))
    elif "natIP" in fmt:
        print("203.0.113.7")
    else:
        print("RUNNING")
elif words[:3] == ["compute", "instances", "get-serial-port-output"]:
    print(env("FAKE_GCLOUD_SERIAL", ""))
elif words[:3] == ["compute", "addresses", "describe"]:
    print("10.128.0.42")
elif words[:3] == ["compute", "accelerator-types", "list"]:
    print(env("FAKE_GCLOUD_ZONES", "europe-west4-b\nus-central1-a"))
elif words[:3] == ["compute", "firewall-rules", "list"]:
    print(env("FAKE_GCLOUD_FIREWALL_RULES", ""))
elif words[:2] == ["compute", "scp"] and env("FAKE_GCLOUD_SCP_DIR"):
    import shutil

    shutil.copy(words[2], env("FAKE_GCLOUD_SCP_DIR"))
elif words[:2] == ["compute", "ssh"] and any("launch-key" in a for a in args):
    print(env("FAKE_GCLOUD_KEY", ""))
