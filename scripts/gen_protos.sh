#!/usr/bin/env bash
# Regenerates protos/pstrain_pb2.py, .pyi and _pb2_grpc.py from protos/pstrain.proto.
# Usage: bash scripts/gen_protos.sh [OUTPUT_DIR]   (default: the repository root)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
py=${PYTHON:-$root/.venv/bin/python}
cd "$root"
"$py" -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/pstrain.proto
