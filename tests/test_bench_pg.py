"""End-to-end smoke test of ``make bench-pg`` (``tests.bench.bench_pg``) at a tiny size.

PostgreSQL is installed outside pytest (``scripts/ensure-postgres.sh``, run by ``.ci/run`` and ``make bench-pg``):
missing, the test fails in CI (``CI=true``) and is skipped elsewhere, with the reason in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.bench_pg import SIDES, WORKLOADS
from tests.support.pg_cluster import PgUnavailable, ensure_postgres

ROOT = Path(__file__).resolve().parents[1]

POSITIVE = {
    "write": ("rows_per_s", "cpu_s_per_1m"),
    "catchup.null": ("rows_per_s", "cpu_us_per_row"),
    "catchup.iterate": ("rows_per_s", "cpu_us_per_row"),
    "catchup.file": ("rows_per_s", "cpu_us_per_row", "bytes_per_row"),
    "catchup.lake": ("rows_per_s", "cpu_us_per_row"),
    # a realtime consumer may run before put() returns, so its lag percentiles may be <= 0: only max must be > 0
    "live": ("max_ms", "rows_per_s", "transactions"),
}


def test_bench_pg_tiny_run_reports_every_workload_for_both_sides(tmp_path: Path) -> None:
    """A 5k-row, 2 s, 1-repeat run writes JSON with both sides of every workload, positive figures, no cluster left."""
    try:
        ensure_postgres(install=False)
    except PgUnavailable as exc:
        reason = f"PostgreSQL unavailable: {exc}; run scripts/ensure-postgres.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.bench.bench_pg",
            "--rows",
            "5000",
            "--live-seconds",
            "2",
            "--live-warmup",
            "0.5",
            "--repeats",
            "1",
            "--results-dir",
            str(tmp_path),
            "--no-install",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads((tmp_path / "bench-pg-latest.json").read_text())
    assert (tmp_path / "bench-pg-latest.png").stat().st_size > 10_000

    assert doc["rows"] == 5000 and doc["repeats"] == 1
    assert set(doc["samples"]) == set(WORKLOADS)
    for workload, sides in SIDES.items():
        assert set(doc["samples"][workload]) == set(sides), workload
        for side in sides:
            runs = doc["samples"][workload][side]
            assert len(runs) == 1, (workload, side)
            for key in POSITIVE[workload]:
                assert runs[0][key] > 0, (workload, side, key, runs[0])
            if workload == "live":
                assert all(isinstance(runs[0][k], float | int) for k in ("p50_ms", "p99_ms", "p999_ms")), runs[0]
    # Every table row has both columns filled; the goal rows carry a verdict.
    assert doc["table"] and all(r["pg"] and r["cdcd"] for r in doc["table"])
    assert {r["metric"] for r in doc["table"] if r["passed"] is not None} >= {"rows_per_s", "p50_ms", "p99_ms"}
    # The private cluster was stopped and deleted: no server runs on its data dir.
    cluster = doc["postgres"]["cluster_dir"]
    assert not Path(cluster).exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert cluster not in ps
