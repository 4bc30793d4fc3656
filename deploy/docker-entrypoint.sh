#!/usr/bin/env bash
# The images' entrypoint (deploy/Dockerfile, deploy/Dockerfile.cuda). Before the first
# `hosted-tinker serve` on a data volume it makes an API key and keeps it with the data
# (<data dir>/launch-key, mode 0600; /data in the images), as startup.sh does on a VM's first boot: the
# server listens on 0.0.0.0 in the container, and a published port must never serve without keys.
#   docker exec CONTAINER cat /data/launch-key
# Later starts keep the key (revoke it with `hosted-tinker keys revoke launch`; the file stays).
set -euo pipefail
if [ "${1:-}" = hosted-tinker ] && [ "${2:-}" = serve ]; then
  # the data directory serve will use, as it resolves it (flags, then environment, then file)
  data="$("$@" --print-config | python -c 'import json, sys; print(json.load(sys.stdin)["data_dir"])')"
  if ! [ -s "$data/launch-key" ]; then
    mkdir -p "$data"
    (umask 077 && hosted-tinker keys create --data-dir "$data" --name launch >"$data/launch-key.new")
    sync "$data/launch-key.new" # on disk before it counts as made: a lost key would be made again
    mv "$data/launch-key.new" "$data/launch-key"
    echo "made an API key for this data volume: docker exec <container> cat $data/launch-key" >&2
  fi
fi
# exec: the server is PID 1 and gets docker stop's SIGTERM itself (it parks every model).
exec "$@"
