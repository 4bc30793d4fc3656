#!/usr/bin/env bash
# The tests, as CI runs them (.ci/run):   bash scripts/test.sh [pytest options]
#  1. tests/unit, the fast loop (no server, no network), on two processes (a module on one, so
#     that its module-scoped models load once), within its time budget: it is the loop run after
#     every change, so a slow unit test fails CI rather than slowing every change;
#  2. tests/e2e on two processes, a module on one, the longest modules first
#     (tests/conftest.py's LONGEST_FIRST: xdist hands out modules in collection order), and beside
#     them the static checks (scripts/check.sh: docs, style, types; ~30 s of one core). Not beside
#     the unit tests: there they once took those from 38 s to 57 s, near their budget.
set -euo pipefail
cd "$(dirname "$0")/.."
budget_s=${HOSTED_TINKER_UNIT_BUDGET_S:-60}
start=$SECONDS
.venv/bin/python -m pytest tests/unit -q -p no:cacheprovider -n 2 --dist loadfile "$@"
took=$((SECONDS - start))
if ((took > budget_s)); then
  echo "tests/unit took ${took} s, over its budget of ${budget_s} s (\$HOSTED_TINKER_UNIT_BUDGET_S)" >&2
  exit 1
fi
echo "tests/unit took ${took} s (budget ${budget_s} s)"
checks_log=$(mktemp)
bash scripts/check.sh > "$checks_log" 2>&1 &
checks=$!
failed=0
.venv/bin/python -m pytest tests/e2e -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder "$@" || failed=1
if ! wait "$checks"; then
  cat "$checks_log" >&2
  echo "scripts/check.sh failed: its output is above" >&2
  failed=1
fi
exit "$failed"
