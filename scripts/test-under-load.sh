#!/usr/bin/env bash
# Run the test suite while other processes keep every core busy (issue: no test may depend on
# timing luck). Extra arguments go to pytest, e.g. scripts/test-under-load.sh -k realtime.
# BUSY_PROCESSES=8 runs eight busy loops whatever the core count (make test-under-load-8: four per
# core on a 2-core machine); the default is one per core.
set -euo pipefail
cd "$(dirname "$0")/.."
cores=$(nproc)
busy=${BUSY_PROCESSES:-$cores}
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq "$busy"); do
    # Pure CPU burners at normal priority: they compete with the suite for every core.
    python3 -c 'while True: pass' &
    pids+=($!)
done
echo "test-under-load: $busy busy loop(s) on $cores core(s) (pids ${pids[*]})" >&2
.venv/bin/pytest -q -n "${PYTEST_WORKERS:-3}" --dist loadfile "$@"
