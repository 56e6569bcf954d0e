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
# The default tier (CI) leaves out the tests marked `long`; `--long` as the first argument runs
# those alone instead (tests/conftest.py lists them). Two phases: the tests not marked `alone`
# two at a time (pytest-xdist), then those that bound a duration one at a time; each lists its
# 15 slowest tests. Both always run; the script fails if either does. Exit status 5 (no test
# selected, when arguments pick tests of one phase only) is not a failure.
tier="not long"
if [ "${1:-}" = "--long" ]; then
  tier="long"
  shift
fi
status=0
phase() {
  local rc=0
  $py -m pytest -q -p no:cacheprovider --durations=15 "$@" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
}
echo "== pytest ($tier), two at a time"
phase -n 2 -m "$tier and not alone" "$@"
echo "== pytest ($tier), one at a time"
phase -m "$tier and alone" "$@"
exit $status
