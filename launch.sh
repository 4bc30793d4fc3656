#!/usr/bin/env bash
# launch.sh: hosted-tinker on a GCP spot VM (or N of them), from one command; `--help` lists it all.
#
#   GPU_TYPE=h100 bash launch.sh          create a spot VM, wait for /healthz, print the URL and key
#   bash launch.sh --vm NAME              reuse (start) an existing VM, then the same
#   bash launch.sh --vm NAME --status | --stop | --delete | --logs
#
# The contract with deploy/startup.sh (the VM's startup-script): these instance metadata attributes.
#   hosted-tinker-source       the pip requirement to install: "hosted-tinker @ git+URL@REF", or
#                              /opt/hosted-tinker/src.tar.gz with --from-checkout (launch.sh copies
#                              the checkout there with `gcloud compute scp`, removes
#                              /opt/hosted-tinker/installed-source and runs the startup script again)
#   hosted-tinker-serve-args   the arguments of `hosted-tinker serve` (role server) or of
#                              `hosted-tinker node` (role node): words split at spaces, no quotes
#   hosted-tinker-port         the API's port, on localhost (and 0.0.0.0 with --open-firewall); read
#                              back by --vm NAME, so that --status and the tunnel use the VM's own
#   hosted-tinker-role         server (one VM, or node 0 of --nodes N: the gateway) or node (nodes
#                              1..N-1, whose serve-args are `--node-rank K --nnodes N --master-addr
#                              IP --master-port 29500`; node 0's get `--nnodes N --master-addr IP
#                              --master-port 29500`, IP being node 0's reserved internal address)
#   hosted-tinker-cluster-key  only with --nodes N: the secret every node shares (hex, generated here;
#                              the server and `node` read it as $HOSTED_TINKER_CLUSTER_KEY)
# startup.sh writes the API key it creates on the first boot to /var/lib/hosted-tinker/launch-key
# (mode 0600); launch.sh reads it over ssh once /healthz answers.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# GPU_TYPE  GPUs  machine type (GPUs attached by the type)  accelerator  boot disk type
GPU_TABLE="
h100  1  a3-highgpu-1g   nvidia-h100-80gb   pd-balanced
h100  2  a3-highgpu-2g   nvidia-h100-80gb   pd-balanced
h100  4  a3-highgpu-4g   nvidia-h100-80gb   pd-balanced
h100  8  a3-highgpu-8g   nvidia-h100-80gb   pd-balanced
h200  8  a3-ultragpu-8g  nvidia-h200-141gb  hyperdisk-balanced
a100  1  a2-highgpu-1g   nvidia-tesla-a100  pd-balanced
a100  2  a2-highgpu-2g   nvidia-tesla-a100  pd-balanced
a100  4  a2-highgpu-4g   nvidia-tesla-a100  pd-balanced
a100  8  a2-highgpu-8g   nvidia-tesla-a100  pd-balanced
b200  8  a4-highgpu-8g   nvidia-b200        hyperdisk-balanced
l4    1  g2-standard-4   nvidia-l4          pd-balanced
l4    2  g2-standard-24  nvidia-l4          pd-balanced
l4    4  g2-standard-48  nvidia-l4          pd-balanced
l4    8  g2-standard-96  nvidia-l4          pd-balanced
"
# gcloud's words for "this zone cannot make it now": try the next zone.
NO_CAPACITY='ZONE_RESOURCE_POOL_EXHAUSTED|does not have enough resources|stockout|does not exist in zone'
NO_CAPACITY+='|QUOTA_EXCEEDED|Quota .* exceeded' # GPU quotas are regional
DATA_DIR=/var/lib/hosted-tinker
CHECKOUT_TARBALL=/opt/hosted-tinker/src.tar.gz

# What only making a VM uses: with --vm they would change nothing, so they are refused, not ignored.
CREATE_ONLY="GPU_TYPE NUM_GPUS ZONES DISK_SIZE DISK_TYPE NODES BACKEND BACKEND_OPTIONS MODEL SERVE_ARGS TRAIN_GPUS
  VLLM_GPUS INSTALL_SOURCE INSTALL_REPO INSTALL_VERSION IMAGE_PROJECT IMAGE_FAMILY NETWORK SUBNET SCOPES MASTER_PORT"
# Settings: the environment, then the flags (parse_args). GIVEN: those set by either.
GIVEN=" "
for name in $CREATE_ONLY SERVER_PORT; do if [ -n "${!name:-}" ]; then GIVEN+="$name "; fi; done
GPU_TYPE="${GPU_TYPE:-}" NUM_GPUS="${NUM_GPUS:-}" PROJECT="${PROJECT:-}" ZONES="${ZONES:-}"
VM_NAME="${VM_NAME:-hosted-tinker}" DISK_SIZE="${DISK_SIZE:-200}" DISK_TYPE="${DISK_TYPE:-}"
NODES="${NODES:-1}" BACKEND="${BACKEND:-}" BACKEND_OPTIONS="${BACKEND_OPTIONS:-}" MODEL="${MODEL:-}"
SERVE_ARGS="${SERVE_ARGS:-}" TRAIN_GPUS="${TRAIN_GPUS:-}" VLLM_GPUS="${VLLM_GPUS:-}"
INSTALL_SOURCE="${INSTALL_SOURCE:-}" INSTALL_REPO="${INSTALL_REPO:-}" INSTALL_VERSION="${INSTALL_VERSION:-}"
FROM_CHECKOUT="${FROM_CHECKOUT:-}" SERVER_PORT="${SERVER_PORT:-8000}" MASTER_PORT="${MASTER_PORT:-29500}"
IMAGE_PROJECT="${IMAGE_PROJECT:-deeplearning-platform-release}"
# Driver R580: PyPI's torch 2.13 and vLLM wheels are CUDA 13 builds, which R570 (CUDA 12.8) cannot run.
IMAGE_FAMILY="${IMAGE_FAMILY:-common-cu129-ubuntu-2404-nvidia-580}"
NETWORK="${NETWORK:-default}" SUBNET="${SUBNET:-default}" SCOPES="${SCOPES:-default,storage-rw}"
OPEN_FIREWALL="${OPEN_FIREWALL:-}" WAIT_TIMEOUT="${WAIT_TIMEOUT:-1800}" POLL_S="${POLL_S:-10}"
DRY_RUN="${DRY_RUN:-}" YES="${YES:-}" WAIT=1 ACTION=create REUSE=""
VM_PORT="" METADATA="" ZONE="" MACHINE_TYPE="" ACCELERATOR="" SOURCE="" SERVE="" CLUSTER_KEY="" VMS=() STATUSES=() TMP_FILES=() SSH=()

usage() {
  cat <<'EOF'
Usage: GPU_TYPE=h100|h200|a100|b200|l4 bash launch.sh [flags]     create spot VM(s), serve, print URL+key
       bash launch.sh --vm NAME [--status|--stop|--delete|--logs]  reuse or manage one (or a cluster)

Every setting is a flag or an environment variable (in brackets):
  --gpu-type T          h100, h200, a100, b200 or l4 [GPU_TYPE]
  --gpus N              GPUs per VM (h100, a100: 1 2 4 8; l4: 1 2 4 8; h200, b200: 8) [NUM_GPUS]
  --project ID          GCP project (default: `gcloud config get-value project`) [PROJECT]
  --zones Z1,Z2,...     zones to try in order, the next one when a zone has no capacity
                        (default: every zone offering the GPU, us-* first) [ZONES]
  --name NAME           the VM's name; with --nodes N, NAME-0..NAME-(N-1) (default hosted-tinker) [VM_NAME]
  --vm NAME             use the existing VM (or cluster) NAME as it was made: start it if stopped
                        (settings only creating uses are refused; --from-checkout, --open-firewall work)
  --disk-size GB        boot disk, which holds the data directory (default 200) [DISK_SIZE]
  --disk-type TYPE      boot disk type (default: the GPU type's, pd-balanced or hyperdisk-balanced) [DISK_TYPE]
  --nodes N             N VMs in one zone under a compact placement policy; node 0 is the gateway [NODES]
  --backend B           peft, ddp or megatron (default: peft on one training GPU, else ddp) [BACKEND]
  --backend-option K=V  a backend option, repeatable [BACKEND_OPTIONS, comma-separated]
  --model M             the base model, an HF id (default: the server's) [MODEL]
  --train-gpus LIST     training GPUs, e.g. 0,1,2,3 (default: those vLLM does not use) [TRAIN_GPUS]
  --vllm-gpus LIST      run vLLM for sampling on these GPUs, e.g. 4,5,6,7 [VLLM_GPUS]
  --serve-args "ARGS"   more arguments for `hosted-tinker serve` (no quotes inside) [SERVE_ARGS]
  --version REF         the git ref to install (default: this checkout's HEAD commit, which must be
                        on a branch of origin) [INSTALL_VERSION]
  --repo URL            the git repository to install from (default: this checkout's origin) [INSTALL_REPO]
  --source SPEC         any pip requirement instead, e.g. "hosted-tinker==0.1.0" [INSTALL_SOURCE]
  --from-checkout       install this checkout (with uncommitted changes to tracked files), copied up
                        with scp [FROM_CHECKOUT=1]
  --image-family F      Deep Learning VM image family (default common-cu129-ubuntu-2404-nvidia-580;
                        its driver must run CUDA 13, R580 or newer) [IMAGE_FAMILY]
  --image-project P     its project (default deeplearning-platform-release) [IMAGE_PROJECT]
  --network N, --subnet S   VPC network and subnet (default: default, default) [NETWORK, SUBNET]
  --port P              the server's port on a new VM and the tunnel's local port (default 8000;
                        with --vm the VM's own, and P only the tunnel's) [SERVER_PORT]
  --open-firewall CIDR  also open the port to CIDR (the API keys are then all that guard it) [OPEN_FIREWALL]
  --no-wait             do not wait for /healthz
  --wait-timeout S      how long to wait for /healthz (default 1800: the first boot installs) [WAIT_TIMEOUT]
  --dry-run             print every gcloud command (+ ...) instead of running it; only read-only
                        lookups (project, zones, existing VMs) run [DRY_RUN=1]
  --status | --stop | --delete | --logs   manage the VM named by --vm/--name (--delete asks unless --yes)
  --yes                 do not ask [YES=1]

The server is reached through an SSH tunnel (gcloud compute ssh -- -N -L PORT:localhost:VM_PORT) that
launch.sh leaves running (VM_PORT: the port the VM was made with, read from its metadata); it prints TINKER_BASE_URL and TINKER_API_KEY. Spot VMs stop on preemption
(--instance-termination-action=STOP): the disk and its runs stay; `--vm NAME` starts it again.
EOF
}

say() { echo "launch.sh: $*" >&2; }
die() { say "$*"; exit 1; }
dry() { [ -n "$DRY_RUN" ]; }
quote() { # shell words, quoted only where needed
  local a out=""
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=" $a"; else out+=" '${a//\'/\'\\\'\'}'"; fi
  done
  echo "${out# }"
}
show() { echo "+ $(quote "$@")" >&3; }
run() { if dry; then show "$@"; else "$@"; fi; }  # a command that changes something
run_out() { # run_out PLACEHOLDER CMD...: CMD's output, or with --dry-run the command shown and PLACEHOLDER
  local placeholder="$1"
  shift
  if dry; then show "$@" && echo "$placeholder"; else "$@"; fi
}
tmp() { local f && f="$(mktemp "${TMPDIR:-/tmp}/launch.XXXXXX")" && TMP_FILES+=("$f") && printf -v "$1" %s "$f"; }
cleanup() { if [ ${#TMP_FILES[@]} -gt 0 ]; then rm -f "${TMP_FILES[@]}"; fi; }
gc() { gcloud "$@" --project="$PROJECT"; }  # read-only lookups: they run even with --dry-run

# --flag VALUE: the setting it sets
VALUE_FLAGS="gpu-type=GPU_TYPE gpus=NUM_GPUS project=PROJECT zones=ZONES zone=ZONES name=VM_NAME vm=VM_NAME
  disk-size=DISK_SIZE disk-type=DISK_TYPE nodes=NODES backend=BACKEND backend-option=BACKEND_OPTIONS model=MODEL
  train-gpus=TRAIN_GPUS vllm-gpus=VLLM_GPUS serve-args=SERVE_ARGS version=INSTALL_VERSION repo=INSTALL_REPO
  source=INSTALL_SOURCE image-family=IMAGE_FAMILY image-project=IMAGE_PROJECT network=NETWORK subnet=SUBNET
  port=SERVER_PORT open-firewall=OPEN_FIREWALL wait-timeout=WAIT_TIMEOUT"

parse_args() {
  local var
  while [ $# -gt 0 ]; do
    case "$1" in --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac
    var="$(tr -s ' \n' '\n' <<<"$VALUE_FLAGS" | awk -F= -v f="$1" '"--" $1 == f { print $2 }')"
    if [ -n "$var" ]; then
      [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"
      if [ "$var" = BACKEND_OPTIONS ]; then set -- "$1" "${BACKEND_OPTIONS:+$BACKEND_OPTIONS,}$2" "${@:3}"; fi
      printf -v "$var" %s "$2"
      if [ "$1" = --vm ]; then REUSE=1; fi
      GIVEN+="$var "
      shift 2
      continue
    fi
    case "$1" in
      -h | --help) usage && exit 0 ;;
      --from-checkout) FROM_CHECKOUT=1 ;;
      --no-wait) WAIT="" ;;
      --dry-run) DRY_RUN=1 ;;
      --yes | -y) YES=1 ;;
      --status | --stop | --delete | --logs) ACTION="${1#--}" ;;
      *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
  done
  [[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive number, not '$NODES'"
}

pick_machine() { # MACHINE_TYPE, ACCELERATOR and DISK_TYPE from the table, for GPU_TYPE and NUM_GPUS
  local types row
  GPU_TYPE="$(tr '[:upper:]' '[:lower:]' <<<"$GPU_TYPE")"
  types="$(awk 'NF { print $1 }' <<<"$GPU_TABLE" | uniq | paste -sd' ' -)"
  [ -n "$GPU_TYPE" ] || die "set GPU_TYPE to one of: $types (e.g. GPU_TYPE=h100 bash launch.sh)"
  row="$(awk -v t="$GPU_TYPE" -v n="$NUM_GPUS" '$1 == t && (n == "" || $2 == n) { print; exit }' <<<"$GPU_TABLE")"
  if [ -z "$row" ]; then
    awk -v t="$GPU_TYPE" '$1 == t { f = 1 } END { exit !f }' <<<"$GPU_TABLE" ||
      die "GPU_TYPE=$GPU_TYPE is not one of: $types; set GPU_TYPE to one of them"
    row="$(awk -v t="$GPU_TYPE" '$1 == t { print $2 }' <<<"$GPU_TABLE" | paste -sd' ' -)"
    die "GPU_TYPE=$GPU_TYPE comes with $row GPUs per VM, not $NUM_GPUS: set --gpus (NUM_GPUS) to one of them"
  fi
  read -r _ NUM_GPUS MACHINE_TYPE ACCELERATOR row <<<"$row"
  DISK_TYPE="${DISK_TYPE:-$row}"
}

install_source() { # the pip requirement the VM installs (metadata hosted-tinker-source)
  if [ -n "$FROM_CHECKOUT" ]; then echo "$CHECKOUT_TARBALL" && return; fi
  if [ -n "$INSTALL_SOURCE" ]; then echo "$INSTALL_SOURCE" && return; fi
  local repo="${INSTALL_REPO:-$(git -C "$HERE" remote get-url origin 2>/dev/null || true)}"
  local ref="${INSTALL_VERSION:-$(git -C "$HERE" rev-parse HEAD 2>/dev/null || true)}"
  [ -n "$repo" ] && [ -n "$ref" ] ||
    die "nothing to install: pass --repo URL --version REF, --source SPEC or --from-checkout"
  if [ -z "$INSTALL_VERSION" ] && [ -z "$INSTALL_REPO" ] &&
    [ -z "$(git -C "$HERE" branch -r --contains "$ref" 2>/dev/null || true)" ]; then # the VM could not fetch it
    die "this checkout's HEAD (${ref:0:12}) is on no branch of origin that it knows of: push it," \
      "pass --version REF, or --from-checkout to install the checkout as it is"
  fi
  repo="$(sed -E 's#^git@([^:]+):#https://\1/#' <<<"$repo")" # the VM has no ssh key for git
  echo "hosted-tinker @ git+$repo@$ref"
}

serve_args() { # `hosted-tinker serve`'s arguments from the settings (node 0's, before the rendezvous)
  local all=() train=() gpu args=""
  for ((gpu = 0; gpu < NUM_GPUS; gpu++)); do all+=("$gpu"); done
  if [ -n "$TRAIN_GPUS" ]; then
    IFS=, read -r -a train <<<"$TRAIN_GPUS"
  else
    for gpu in "${all[@]}"; do [[ ",$VLLM_GPUS," == *",$gpu,"* ]] || train+=("$gpu"); done
  fi
  [ ${#train[@]} -gt 0 ] || die "no GPU left for training: pass --train-gpus (it may share vLLM's)"
  local backend="${BACKEND:-ddp}"
  if [ -z "$BACKEND" ] && [ ${#train[@]} -eq 1 ] && [ "$NODES" -eq 1 ]; then backend=peft; fi
  if [ "$backend" = peft ]; then
    [ ${#train[@]} -eq 1 ] && [ "$NODES" -eq 1 ] ||
      die "the peft backend trains on one GPU of one VM: pass --backend ddp or megatron"
    args="--backend peft --device cuda:${train[0]}"
  else
    args="--backend $backend --train-devices cuda:$(
      IFS=,
      echo "${train[*]}"
    )"
  fi
  local opt options=()
  IFS=, read -r -a options <<<"$BACKEND_OPTIONS"
  for opt in ${options[@]+"${options[@]}"}; do args+=" --backend-option $opt"; done
  if [ -n "$MODEL" ]; then args+=" --model $MODEL"; fi
  if [ -n "$VLLM_GPUS" ]; then args+=" --inference vllm --vllm-gpus $VLLM_GPUS"; fi
  if [ -n "$OPEN_FIREWALL" ]; then args+=" --host 0.0.0.0"; fi
  if [ -n "$SERVE_ARGS" ]; then args+=" $SERVE_ARGS"; fi
  echo "$args"
}

default_zones() { # every zone that offers the accelerator, us-* first
  local zones
  zones="$(gc compute accelerator-types list --filter="name~^$ACCELERATOR\$" --format='value(zone.basename())' | sort -u)"
  [ -n "$zones" ] || die "no zone offers $ACCELERATOR to project $PROJECT: pass --zones"
  { grep '^us-' <<<"$zones" || true; grep -v '^us-' <<<"$zones" || true; } | paste -sd, -
}

create_vm() { # create_vm ZONE NAME ROLE SERVE_ARGS [IP [FLAGS...]]: 0, or 1 when ZONE cannot make it now
  local zone="$1" name="$2" role="$3" args="$4" ip="${5:-}" err
  shift $(($# < 5 ? $# : 5))
  # install-nvidia-driver=True: GCP's documented switch for Deep Learning VM images to install their
  # NVIDIA driver at the first boot where the image does not hold it already (startup.sh waits for it).
  local meta="^;;^install-nvidia-driver=True;;hosted-tinker-source=$SOURCE;;hosted-tinker-serve-args=$args"
  meta+=";;hosted-tinker-port=$SERVER_PORT"
  meta+=";;hosted-tinker-role=$role${CLUSTER_KEY:+;;hosted-tinker-cluster-key=$CLUSTER_KEY}"
  tmp err
  if run gcloud compute instances create "$name" --project="$PROJECT" --zone="$zone" \
    --machine-type="$MACHINE_TYPE" --provisioning-model=SPOT --instance-termination-action=STOP \
    --maintenance-policy=TERMINATE --image-project="$IMAGE_PROJECT" --image-family="$IMAGE_FAMILY" \
    --boot-disk-size="${DISK_SIZE}GB" --boot-disk-type="$DISK_TYPE" \
    --network-interface="nic-type=GVNIC,network=$NETWORK,subnet=$SUBNET${ip:+,private-network-ip=$ip}" \
    --scopes="$SCOPES" --labels="hosted-tinker=$VM_NAME,gpu=$ACCELERATOR" \
    --metadata-from-file="startup-script=$HERE/deploy/startup.sh" --metadata="$meta" "$@" 2>"$err"; then
    cat "$err" >&2
    return 0
  fi
  cat "$err" >&2
  grep -Eqi "$NO_CAPACITY" "$err" || die "creating $name failed (see gcloud's message above)"
  say "$zone cannot make $MACHINE_TYPE now (no capacity or quota): trying the next zone"
  return 1
}

create_in_zone() { # one VM, or NODES of them under one placement policy: 0, or 1 to try the next zone
  local zone="$1" region="${1%-*}" k
  VMS=()
  if [ "$NODES" -eq 1 ]; then
    create_vm "$zone" "$VM_NAME" server "$SERVE" && VMS=("$VM_NAME")
    return
  fi
  local policy="$VM_NAME-placement" address="$VM_NAME-master" ip rendezvous
  run gcloud compute resource-policies create group-placement "$policy" --project="$PROJECT" \
    --region="$region" --collocation=COLLOCATED || die "could not create the placement policy $policy"
  run gcloud compute addresses create "$address" --project="$PROJECT" --region="$region" --subnet="$SUBNET" ||
    die "could not reserve node 0's internal address $address"
  ip="$(run_out '<node-0-internal-ip>' gcloud compute addresses describe "$address" --project="$PROJECT" \
    --region="$region" --format='value(address)')" || true
  [ -n "$ip" ] || die "could not read the address $address"
  rendezvous="--nnodes $NODES --master-addr $ip --master-port $MASTER_PORT"
  for ((k = 0; k < NODES; k++)); do
    local role=node args="--node-rank $k $rendezvous" node_ip=""
    if [ "$k" -eq 0 ]; then role=server args="$SERVE $rendezvous" node_ip="$ip"; fi
    if ! create_vm "$zone" "$VM_NAME-$k" "$role" "$args" "$node_ip" --resource-policies="$policy"; then
      if [ ${#VMS[@]} -gt 0 ]; then
        run gcloud compute instances delete "${VMS[@]}" --project="$PROJECT" --zone="$zone" --quiet || true
      fi
      run gcloud compute addresses delete "$address" --project="$PROJECT" --region="$region" --quiet || true
      run gcloud compute resource-policies delete "$policy" --project="$PROJECT" --region="$region" --quiet || true
      VMS=()
      return 1
    fi
    VMS+=("$VM_NAME-$k")
  done
}

create() {
  pick_machine
  SOURCE="$(install_source)"
  SERVE="$(serve_args)"
  case "$SERVE$SOURCE" in
    *'"'* | *';;'* | *$'\n'*) die "serve args and source must not hold double quotes, ';;' or newlines" ;;
  esac
  if [ "$NODES" -gt 1 ]; then # the secret the nodes share
    CLUSTER_KEY="$(openssl rand -hex 32 2>/dev/null || python3 -c 'import secrets; print(secrets.token_hex(32))')"
  fi
  local zone zone_list zones
  zone_list="${ZONES:-$(default_zones)}"
  say "$NODES x $MACHINE_TYPE ($NUM_GPUS x $ACCELERATOR, spot) as $VM_NAME; zones to try: $zone_list"
  IFS=, read -r -a zones <<<"$zone_list"
  for zone in "${zones[@]}"; do
    if create_in_zone "$zone"; then ZONE="$zone" && break; fi
  done
  [ -n "$ZONE" ] ||
    die "no zone of ${zones[*]} could make $MACHINE_TYPE (capacity or quota, see above): try --zones or later"
  if dry && [ ${#zones[@]} -gt 1 ]; then echo "# (the next zone of ${zones[*]} when $ZONE has no capacity)" >&3; fi
}

find_vms() { # VMS (node 0 first), their STATUSES and ZONE for the VM or cluster VM_NAME
  local lines name zone status
  lines="$(gc compute instances list --filter="name~^$VM_NAME\$ OR labels.hosted-tinker~^$VM_NAME\$" \
    --format='value(name,zone.basename(),status)' | sort)"
  [ -n "$lines" ] ||
    die "no VM named $VM_NAME in project $PROJECT (create one: GPU_TYPE=h100 bash launch.sh --name $VM_NAME)"
  while read -r name zone status; do VMS+=("$name") STATUSES+=("$status") ZONE="$zone"; done <<<"$lines"
  # The port its server was made with (its metadata); --port then picks only the tunnel's local end.
  METADATA="$(gc compute instances describe "${VMS[0]}" --zone="$ZONE" --format='value(metadata.items)')" ||
    die "could not read the metadata of ${VMS[0]} (see gcloud's message above)"
  VM_PORT="$(sed -n "s/.*'key': 'hosted-tinker-port', 'value': '\([0-9]*\)'.*/\1/p" <<<"$METADATA" | head -n 1)"
  if [ -z "$VM_PORT" ]; then say "${VMS[0]} has no hosted-tinker-port in its metadata: port 8000" && VM_PORT=8000; fi
  if [[ "$GIVEN" != *" SERVER_PORT "* ]]; then SERVER_PORT="$VM_PORT"; fi
}

reuse() { # start what is stopped; resume what is suspended
  local i name given=() stopped=() suspended=()
  for name in $CREATE_ONLY; do if [[ "$GIVEN" == *" $name "* ]]; then given+=("$name"); fi; done
  [ ${#given[@]} -eq 0 ] ||
    die "--vm $VM_NAME starts the VM as it was made; ${given[*]} (a flag or the environment) would change" \
      "nothing: unset it, or --delete the VM and create it again (--from-checkout installs new code on it)"
  find_vms
  for i in "${!VMS[@]}"; do
    case "${STATUSES[$i]}" in
      TERMINATED | STOPPED | STOPPING) stopped+=("${VMS[$i]}") ;;
      SUSPENDED | SUSPENDING) suspended+=("${VMS[$i]}") ;;
    esac
  done
  if [ ${#stopped[@]} -gt 0 ]; then
    run gcloud compute instances start "${stopped[@]}" --project="$PROJECT" --zone="$ZONE"
  fi
  if [ ${#suspended[@]} -gt 0 ]; then
    run gcloud compute instances resume "${suspended[@]}" --project="$PROJECT" --zone="$ZONE"
  fi
  say "using ${VMS[*]} in $ZONE"
}

ssh_to() { SSH=(gcloud compute ssh "$1" --project="$PROJECT" --zone="$ZONE" --quiet --); } # then "${SSH[@]}" CMD

upload_checkout() { # --from-checkout: the checkout, uncommitted changes included, then install it again
  local tarball ref vm tries dir="${CHECKOUT_TARBALL%/*}"
  local install="mkdir -p $dir && mv /tmp/hosted-tinker-src.tar.gz $CHECKOUT_TARBALL && rm -f $dir/installed-source"
  install+=" && google_metadata_script_runner startup" # startup.sh again: it installs the new source
  tmp tarball
  # a commit of the working tree that touches neither it nor the stash list (none: HEAD)
  ref="$(if ! dry; then git -C "$HERE" -c user.name=launch.sh -c user.email=launch.sh@localhost stash create; fi || true)"
  run git -C "$HERE" archive --format=tar.gz --prefix=hosted-tinker/ -o "$tarball" "${ref:-HEAD}"
  for vm in "${VMS[@]}"; do
    tries=0
    until run gcloud compute scp "$tarball" "$vm:/tmp/hosted-tinker-src.tar.gz" --project="$PROJECT" --zone="$ZONE" \
      --quiet; do
      [ $((tries += 1)) -lt 30 ] || die "could not copy the checkout to $vm"
      sleep "$POLL_S" # the VM's sshd is not up yet
    done
    ssh_to "$vm"
    run "${SSH[@]}" "sudo sh -c '$install'"
  done
}

open_firewall() {
  say "WARNING: opening tcp:$VM_PORT of ${VMS[0]} to $OPEN_FIREWALL: its API keys are all that guard it" \
    "(the SSH tunnel needs no open port)"
  if [ -n "$REUSE" ]; then say "the server listens beyond localhost only when launch.sh made it with --open-firewall"; fi
  run gcloud compute instances add-tags "${VMS[0]}" --project="$PROJECT" --zone="$ZONE" --tags="$VM_NAME"
  local verb=create scope=(--network="$NETWORK" --target-tags="$VM_NAME")
  if [ -n "$(gc compute firewall-rules list --filter="name~^$VM_NAME-api\$" --format='value(name)')" ]; then
    verb=update scope=() # made by an earlier --open-firewall: now open to this CIDR instead
  fi
  run gcloud compute firewall-rules "$verb" "$VM_NAME-api" --project="$PROJECT" ${scope[@]+"${scope[@]}"} \
    --allow="tcp:$VM_PORT" --source-ranges="$OPEN_FIREWALL"
}

startup_failed() { # VM's startup script ended in an error (GCP's guest agent logs its exit status to
  # the serial port): its last lines. Only for a VM made now, whose serial output is this boot's.
  local out
  out="$(gc compute instances get-serial-port-output "$1" --zone="$ZONE" 2>/dev/null)" || return 1
  grep -q 'startup-script exit status [1-9]' <<<"$out" || return 1
  grep 'startup-script' <<<"$out" | tail -n 12
}

wait_and_print() { # an SSH tunnel to node 0, /healthz until it answers, then the URL and the API key
  local vm="${VMS[0]}" url="http://localhost:$SERVER_PORT" pid="" log key polls=0 node lines
  local tunnel=(gcloud compute ssh "$vm" --project="$PROJECT" --zone="$ZONE" --quiet --
    -N -L "$SERVER_PORT:localhost:$VM_PORT" -o ExitOnForwardFailure=yes)
  local probe=(curl -fsS -m 5 -o /dev/null "$url/healthz")
  if dry; then
    echo "+ $(quote "${tunnel[@]}") &" >&3
    show "${probe[@]}"
  else
    tmp log
    local deadline=$((SECONDS + WAIT_TIMEOUT))
    say "waiting up to ${WAIT_TIMEOUT}s for $url/healthz through an SSH tunnel (a first boot installs: minutes)"
    while :; do
      if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
        "${tunnel[@]}" >>"$log" 2>&1 </dev/null 3>&- &
        pid=$!
      fi
      if "${probe[@]}" 2>/dev/null; then break; fi
      if [ -z "$REUSE" ] && [ $((polls++ % 6)) -eq 5 ]; then # a failed first boot says why, at once
        for node in "${VMS[@]}"; do
          if lines="$(startup_failed "$node")"; then
            kill "$pid" 2>/dev/null || true
            echo "$lines" >&2
            die "the startup script of $node failed (its last lines above; all: bash launch.sh --vm $VM_NAME --logs)"
          fi
        done
      fi
      if [ "$SECONDS" -ge "$deadline" ]; then
        kill "$pid" 2>/dev/null || true
        tail -n 5 "$log" >&2
        die "no answer from $url/healthz within ${WAIT_TIMEOUT}s: see bash launch.sh --vm $VM_NAME --logs"
      fi
      sleep "$POLL_S"
    done
  fi
  ssh_to "$vm"
  key="$(run_out '<api-key>' "${SSH[@]}" sudo cat "$DATA_DIR/launch-key")"
  echo "hosted-tinker answers on $vm ($ZONE). Use it with:"
  echo "  export TINKER_BASE_URL=$url TINKER_API_KEY=$key"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "The SSH tunnel runs as pid $pid (kill $pid to close it)."; fi
  echo "Reopen the tunnel with: $(quote "${tunnel[@]}")"
  if [ -n "$OPEN_FIREWALL" ]; then
    echo "Open to $OPEN_FIREWALL at http://$(run_out '<external-ip>' gcloud compute instances describe "$vm" \
      --project="$PROJECT" --zone="$ZONE" --format='value(networkInterfaces[0].accessConfigs[0].natIP)'):$VM_PORT"
  fi
}

status() {
  run gcloud compute instances list --project="$PROJECT" --filter="name~^$VM_NAME\$ OR labels.hosted-tinker~^$VM_NAME\$" \
    --format='table(name,zone.basename(),status,machineType.basename(),networkInterfaces[0].networkIP)'
  if [ "${STATUSES[0]}" = RUNNING ]; then
    ssh_to "${VMS[0]}"
    run "${SSH[@]}" "systemctl is-active hosted-tinker; curl -sS -m 5 localhost:$VM_PORT/healthz | head -c 400; echo"
  fi
}

stop() { run gcloud compute instances stop "${VMS[@]}" --project="$PROJECT" --zone="$ZONE"; }

logs() {
  local vm
  for vm in "${VMS[@]}"; do
    echo "==> $vm"
    ssh_to "$vm"
    run "${SSH[@]}" sudo journalctl -u google-startup-scripts -u hosted-tinker -n 200 --no-pager ||
      run gcloud compute instances get-serial-port-output "$vm" --project="$PROJECT" --zone="$ZONE"
  done
}

delete() {
  local region="${ZONE%-*}" answer
  say "deleting ${VMS[*]} ($ZONE) deletes their disks, with the data directory: runs, sessions and checkpoints"
  if ! grep -q -- '--checkpoint-mirror' <<<"$SERVE_ARGS $METADATA"; then
    say "WARNING: no --checkpoint-mirror is configured, so the checkpoints on these disks are lost for good"
  fi
  if [ -z "$YES" ] && ! dry; then
    read -r -p "Delete ${VMS[*]}? [y/N] " answer || true
    [[ "$answer" == [yY]* ]] || die "nothing deleted"
  fi
  run gcloud compute instances delete "${VMS[@]}" --project="$PROJECT" --zone="$ZONE" --quiet
  if [ ${#VMS[@]} -gt 1 ]; then
    run gcloud compute addresses delete "$VM_NAME-master" --project="$PROJECT" --region="$region" --quiet || true
    run gcloud compute resource-policies delete "$VM_NAME-placement" --project="$PROJECT" --region="$region" --quiet || true
  fi
  if [ -n "$(gc compute firewall-rules list --filter="name~^$VM_NAME-api\$" --format='value(name)')" ]; then
    run gcloud compute firewall-rules delete "$VM_NAME-api" --project="$PROJECT" --quiet
  fi
}

main() {
  parse_args "$@"
  VM_PORT="$SERVER_PORT" # a new VM's; find_vms reads an existing one's
  exec 3>&1 # --dry-run shows commands here, even from inside $(...)
  trap cleanup EXIT
  if [ "$ACTION" = create ] && [ -z "$REUSE" ]; then pick_machine; fi # a bad GPU_TYPE says so first
  command -v gcloud >/dev/null ||
    die "gcloud not found: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install), then run 'gcloud init'"
  PROJECT="${PROJECT:-$(gcloud config get-value project 2>/dev/null || true)}"
  [ -n "$PROJECT" ] || die "no GCP project: pass --project ID or run 'gcloud config set project ID'"
  case "$ACTION" in
    create)
      if [ -n "$REUSE" ]; then reuse; else create; fi
      if [ -n "$FROM_CHECKOUT" ]; then upload_checkout; fi
      if [ -n "$OPEN_FIREWALL" ]; then open_firewall; fi
      if [ -n "$WAIT" ]; then
        wait_and_print
      else
        echo "created/started ${VMS[*]} in $ZONE; its server comes up in minutes: bash launch.sh --vm $VM_NAME --status"
      fi
      ;;
    *)
      find_vms
      "$ACTION"
      ;;
  esac
}

main "$@"
