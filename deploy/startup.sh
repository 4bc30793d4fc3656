#!/usr/bin/env bash
# The VM's startup script: launch.sh makes it the instance's startup-script, and GCP runs it as
# root at every boot. It installs hosted-tinker (again only when its source changed), creates the
# API key on the first boot, and runs the server as the systemd service `hosted-tinker`, whose
# data lives on the persistent boot disk: restarted on failure and at every boot, so a preempted
# VM that is started again serves the same runs (the service parks every model at SIGTERM).
#
#   startup.sh                on a VM: its settings from the instance's metadata attributes
#   startup.sh --local ROOT   anywhere (CI): settings from the environment, every path under
#                             ROOT, and a supervising loop instead of systemd if it is not running
#
# Settings (metadata attribute / environment variable in --local mode):
#   hosted-tinker-source       HT_SOURCE       pip requirement to install, e.g.
#                                              "hosted-tinker @ git+https://github.com/O/R@REF", or a path
#   hosted-tinker-serve-args   HT_SERVE_ARGS   arguments of `hosted-tinker serve` (or of `node`)
#   hosted-tinker-port         HT_PORT         the API's port (default 8000)
#   hosted-tinker-role         HT_ROLE         server (default) or node: `hosted-tinker node`
#   hosted-tinker-cluster-key  HT_CLUSTER_KEY  the secret every node shares (--nodes N)
# --local only: HT_PIP_ARGS (extra pip arguments), HT_DEPS_SITE (a site-packages whose packages
# the new environment may use, so that CI does not download torch again). For tests: HT_SYSFS (where
# the PCI devices are looked for, default /sys), HT_DRIVER_WAIT (seconds to wait for a GPU driver).
set -euo pipefail

LOCAL=""
if [ "${1:-}" = "--local" ]; then
  LOCAL="${2:?usage: startup.sh --local ROOT}"
fi

if [ -n "$LOCAL" ]; then
  mkdir -p "$LOCAL"
  LOCAL="$(cd "$LOCAL" && pwd)"
  PREFIX="$LOCAL/opt/hosted-tinker"
  DATA="$LOCAL/var/lib/hosted-tinker"
  ENV_FILE="$LOCAL/etc/hosted-tinker.env"
else
  PREFIX=/opt/hosted-tinker
  DATA=/var/lib/hosted-tinker
  ENV_FILE=/etc/hosted-tinker.env
fi
VENV="$PREFIX/venv"
HT="$VENV/bin/hosted-tinker"

setting() { # setting ATTRIBUTE VARIABLE DEFAULT: from the metadata server, or the environment
  local value=""
  if [ -n "$LOCAL" ]; then
    value="${!2:-}"
  else
    value="$(curl -fs --retry 10 --retry-connrefused -H "Metadata-Flavor: Google" \
      "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" || true)"
  fi
  printf '%s' "${value:-$3}"
}

SOURCE="$(setting hosted-tinker-source HT_SOURCE "")"
if [ -z "$SOURCE" ]; then # never a guess: that would install whatever PyPI has, as root
  echo "startup.sh: no hosted-tinker-source (HT_SOURCE): nothing to install" >&2
  exit 1
fi
SERVE_ARGS="$(setting hosted-tinker-serve-args HT_SERVE_ARGS "")"
PORT="$(setting hosted-tinker-port HT_PORT 8000)"
ROLE="$(setting hosted-tinker-role HT_ROLE server)"
CLUSTER_KEY="$(setting hosted-tinker-cluster-key HT_CLUSTER_KEY "")"

install() { # once per source: a venv of its own (torch's default wheels are CUDA builds on Linux)
  if [ -x "$HT" ] && [ "$(cat "$PREFIX/installed-source" 2>/dev/null)" = "$SOURCE" ]; then
    return
  fi
  if [ -z "$LOCAL" ] && ! python3 -c "import ensurepip" 2>/dev/null && command -v apt-get >/dev/null; then
    # Debian and Ubuntu ship venv's pip apart; at first boot unattended-upgrades holds dpkg's lock.
    apt-get -o DPkg::Lock::Timeout=600 update -q
    apt-get -o DPkg::Lock::Timeout=600 install -y -q python3-venv
  fi
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  if [ -n "${HT_DEPS_SITE:-}" ]; then
    local site
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$HT_DEPS_SITE" >"$site/hosted_tinker_deps.pth"
  fi
  # shellcheck disable=SC2086  # HT_PIP_ARGS is a list of arguments
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check ${HT_PIP_ARGS:-} "$SOURCE"
  case "$SERVE_ARGS" in # the filesystem of a --checkpoint-mirror URL
    *gs://*) "$VENV/bin/python" -m pip install --quiet gcsfs ;;
    *s3://*) "$VENV/bin/python" -m pip install --quiet s3fs ;;
  esac
  echo "$SOURCE" >"$PREFIX/installed-source"
}

has_nvidia_gpu() { # an NVIDIA device on the PCI bus, with a driver or not
  local vendor
  for vendor in "${HT_SYSFS:-/sys}"/bus/pci/devices/*/vendor; do
    if [ "$(cat "$vendor" 2>/dev/null)" = 0x10de ]; then return 0; fi
  done
  return 1
}

check_gpus() { # a GPU VM whose torch cannot use its GPUs would serve on nothing: say why, and stop
  has_nvidia_gpu || return 0
  local wait_s="${HT_DRIVER_WAIT:-900}"
  if ! nvidia-smi >/dev/null 2>&1; then # a driver installed at the first boot may still be on its way
    echo "startup.sh: an NVIDIA GPU and no working driver yet: waiting up to ${wait_s}s for nvidia-smi"
  fi
  local deadline=$((SECONDS + wait_s))
  until nvidia-smi >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "startup.sh: this VM has an NVIDIA GPU but no working driver (nvidia-smi fails). An image" \
        "without one: delete the VM and create it with an --image-family that has one." >&2
      exit 1
    fi
    sleep 10
  done
  "$VENV/bin/python" - <<'EOF' || exit 1
import subprocess, sys

import torch

if not torch.cuda.is_available():
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    driver = (subprocess.run(query, capture_output=True, text=True).stdout.split() or ["unknown"])[0]
    cuda = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    sys.exit(
        f"startup.sh: torch {torch.__version__} ({cuda}) cannot use this VM's GPUs (driver {driver}). "
        "A CUDA build needs a driver that runs its CUDA version (CUDA 13: R580 or newer): delete the VM "
        "and create it with an --image-family whose driver does, or install a torch built for this one."
    )
EOF
}

with_vllm() { # --inference vllm: vLLM in an environment of its own, made once
  case " $SERVE_ARGS " in
    *" --inference vllm "*) ;;
    *) return ;;
  esac
  case " $SERVE_ARGS " in *" --vllm-python "*) return ;; esac
  [ -x "$PREFIX/vllm/bin/python" ] || "$HT" setup-vllm "$PREFIX/vllm"
  SERVE_ARGS="$SERVE_ARGS --vllm-python $PREFIX/vllm/bin/python"
}

first_boot_key() { # the API key, made once and kept with the data (mode 0600)
  if [ "$ROLE" != server ] || [ -s "$DATA/launch-key" ]; then
    return
  fi
  (umask 077 && "$HT" keys create --data-dir "$DATA" --name launch >"$DATA/launch-key.new")
  mv "$DATA/launch-key.new" "$DATA/launch-key"
}

write_env() { # what the service reads (EnvironmentFile=): the settings of serve, by variable
  case "$SERVE_ARGS" in *'"'*) echo "startup.sh: serve args must not hold double quotes" >&2 && exit 1 ;; esac
  mkdir -p "$(dirname "$ENV_FILE")"
  local args="serve $SERVE_ARGS"
  [ "$ROLE" = node ] && args="node $SERVE_ARGS"
  (
    umask 077
    {
      # Double-quoted: read alike by systemd and by the supervising loop's shell.
      echo "HT_ARGS=\"$args\""
      echo "HOSTED_TINKER_DATA_DIR=\"$DATA\""
      echo "HOSTED_TINKER_PORT=\"$PORT\""
      if [ -n "$CLUSTER_KEY" ]; then echo "HOSTED_TINKER_CLUSTER_KEY=\"$CLUSTER_KEY\""; fi
    } >"$ENV_FILE"
  )
}

run_with_systemd() { # restarted only when what it runs changed: at boot systemd already started it
  local unit=/etc/systemd/system/hosted-tinker.service
  cat >"$unit.new" <<EOF
[Unit]
Description=hosted-tinker: a Tinker-compatible LoRA training server
Wants=network-online.target
After=network-online.target

[Service]
EnvironmentFile=$ENV_FILE
ExecStart=$HT \$HT_ARGS
Restart=on-failure
RestartSec=5
# SIGTERM, to the server only (mixed: its ranks must stay up while it parks every model within
# --shutdown-timeout, 25 s; GCP gives a preempted VM 30 s); SIGKILL to what is left after 40 s.
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec=40
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
EOF
  if cmp -s "$unit.new" "$unit" && [ "$(cat "$PREFIX/started-with" 2>/dev/null)" = "$(cat "$ENV_FILE" "$PREFIX/installed-source")" ]; then
    rm "$unit.new"
    systemctl enable --now hosted-tinker
    return
  fi
  mv "$unit.new" "$unit"
  systemctl daemon-reload
  systemctl enable hosted-tinker
  systemctl restart hosted-tinker
  cat "$ENV_FILE" "$PREFIX/installed-source" >"$PREFIX/started-with"
}

run_supervised() { # without systemd: the same command in a loop that restarts it on failure
  local pidfile="$PREFIX/supervisor.pid"
  if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    return # already running (this boot's script ran before)
  fi
  # shellcheck disable=SC2016  # the loop's own variables, expanded when it runs
  setsid bash -c '
    set -a; . "$1"; set +a
    trap "kill -TERM \$child 2>/dev/null; wait \$child; exit 0" TERM
    while true; do
      "$2" $HT_ARGS & child=$!
      wait $child && exit 0  # a clean stop is not restarted
      sleep 5
    done' supervise "$ENV_FILE" "$HT" >>"$DATA/server.log" 2>&1 </dev/null 9>&- &
  echo $! >"$pidfile"
}

mkdir -p "$DATA" "$PREFIX"
exec 9>"$PREFIX/startup.lock" # one run at a time (launch.sh --from-checkout runs it again)
flock 9
case "$SOURCE" in
  /*) if [ ! -e "$SOURCE" ]; then
    echo "hosted-tinker: $SOURCE is not there yet (launch.sh copies it up and runs this again)"
    exit 0
  fi ;;
esac
install
check_gpus
with_vllm
first_boot_key
write_env
if [ -z "$LOCAL" ] && [ -d /run/systemd/system ]; then
  run_with_systemd
else
  run_supervised
fi
echo "hosted-tinker: $ROLE on port $PORT, data in $DATA"
