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
# Two phases: the tests not marked `alone` two at a time (pytest-xdist), then those that bound
# a duration one at a time; each lists its 15 slowest tests. Both always run; the script fails
# if either does. Exit status 5 (no test selected, when arguments pick tests of one phase
# only) is not a failure.
status=0
phase() {
  local rc=0
  $py -m pytest -q -p no:cacheprovider --durations=15 "$@" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
}
echo "== pytest, two at a time"
phase -n 2 -m "not alone" "$@"
echo "== pytest, one at a time"
phase -m alone "$@"
exit $status
