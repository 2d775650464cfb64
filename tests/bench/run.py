"""Run the cdcd benchmark suite: ``python -m tests.bench.run [--quick] [--only NAME ...]``.

Prints one table (median of the repetitions with min-max, goal, pass/fail) and writes
``tests/bench/results/bench-<UTC timestamp>.json`` plus ``tests/bench/results/latest.json``.
Exit status: 0, or 1 if a benchmark raised (or, with ``--strict``, if a goal was missed).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cdcd.logging import configure as configure_logging
from tests.bench import (
    bench_daemon,
    bench_fanout,
    bench_kafka,
    bench_lake,
    bench_lake_caches,
    bench_lake_cluster,
    bench_lake_compact_run,
    bench_lake_merge,
    bench_lake_small_files,
    bench_lake_typed,
    bench_node,
    bench_realtime,
    bench_replication,
    bench_wal_read,
)
from tests.support.bench import Bench, Result, fmt_value, run_bench

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SUITES = (
    bench_node,
    bench_wal_read,
    bench_daemon,
    bench_realtime,
    bench_lake,
    bench_lake_merge,
    bench_lake_compact_run,
    bench_lake_typed,
    bench_lake_cluster,
    bench_lake_caches,
    bench_lake_small_files,
    bench_replication,
    bench_kafka,
    bench_fanout,
)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _selected(name: str, patterns: list[str]) -> bool:
    if not patterns:
        return True
    return any(name == p or name.startswith(p.rstrip(".") + ".") or fnmatch.fnmatchcase(name, p) for p in patterns)


def _git() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit, "dirty": dirty}


def _host() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
    }


def format_table(results: list[Result]) -> str:
    headers = ["name", "metric", "median", "min-max", "unit", "goal", "result"]
    rows = []
    for r in results:
        status = "ERROR" if r.error else {True: "PASS", False: "FAIL", None: "-"}[r.passed]
        rows.append(
            [
                r.name,
                r.metric,
                fmt_value(r.median, r.unit) if r.values else "-",
                f"{fmt_value(r.min, r.unit)}-{fmt_value(r.max, r.unit)}" if r.values else "-",
                r.unit,
                f"{'<=' if r.lower_is_better else '>='} {fmt_value(r.goal, r.unit)}" if r.goal is not None else "-",
                status,
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    right = {2, 3}

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="much smaller runs (a smoke test, about a minute)")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this benchmark: exact name, dotted prefix (node, node.background) or glob; repeatable",
    )
    ap.add_argument("--repeats", type=int, default=None, help="repetitions per benchmark (default 3 quick, 5 full)")
    ap.add_argument("--profile", action="store_true", help="one extra cProfile'd run per benchmark (results/*.prof)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    if repeats < 1:
        ap.error("--repeats must be >= 1")

    configure_logging("console", "warning")  # keep node_opened/segment_archived lines out of the table
    benches: list[Bench] = [b for suite in SUITES for b in suite.benchmarks(args.quick)]
    if args.list:
        for b in benches:
            print(f"{b.name:28} {b.description}")
        return 0
    selected = [b for b in benches if _selected(b.name, args.only)]
    if not selected:
        ap.error(f"no benchmark matches {args.only}; try --list")

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    host = _host()
    t0 = time.perf_counter()
    results = []
    for bench in selected:
        _log(f"{bench.name}: {bench.description}")
        results.extend(run_bench(bench, repeats, _log, RESULTS_DIR if args.profile else None))
    elapsed = time.perf_counter() - t0

    table = format_table(results)
    print()
    print(table)
    failed = list(dict.fromkeys(r.name for r in results if r.passed is False))
    print(
        f"\n{len(selected)} benchmarks, {repeats} repetitions each (or their cap), {elapsed:.0f}s; "
        f"load average {host['loadavg'][0]:.2f} -> {os.getloadavg()[0]:.2f}"
        + (f"; goals missed: {', '.join(failed)}" if failed else "")
    )

    doc = {
        "started": started.isoformat(),
        "elapsed_s": round(elapsed, 1),
        "quick": args.quick,
        "repeats": repeats,
        "only": args.only,
        "host": host,
        "loadavg_end": list(os.getloadavg()),
        "git": _git(),
        "results": [r.to_json() for r in results],
    }
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS_DIR / f"bench-{stamp}.json"
    text = json.dumps(doc, indent=2) + "\n"
    path.write_text(text)
    (RESULTS_DIR / "latest.json").write_text(text)
    print(f"results: {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")

    if any(r.error for r in results):
        return 1
    if args.strict and failed:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
