#!/usr/bin/env bash
# Run the test suite while other processes keep every core busy (issue: no test may depend on
# timing luck). Extra arguments go to pytest, e.g. scripts/test-under-load.sh -k realtime.
set -euo pipefail
cd "$(dirname "$0")/.."
cores=$(nproc)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq "$cores"); do
    # Pure CPU burners at normal priority: they compete with the suite for every core.
    python3 -c 'while True: pass' &
    pids+=($!)
done
echo "test-under-load: $cores busy loop(s) running (pids ${pids[*]})" >&2
.venv/bin/pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
