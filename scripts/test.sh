#!/usr/bin/env bash
# Lint, type-check and run every test. Installs what it needs first (scripts/setup.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
py=.venv/bin/python
echo "== ruff"
$py -m ruff check .
echo "== mypy"
$py -m mypy
echo "== pytest"
$py -m pytest -q -p no:cacheprovider "$@"
