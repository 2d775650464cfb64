"""Run the chaos suite: ``python -m tests.chaos.run [--short] [--only NAME ...] [--seed N]``.

Every scenario is a real multi-process run checked against the WAL (see ``tests/chaos/__init__.py``). Prints one
table (scenario, runs, entries written, delivered, lost, duplicates, result), writes it as JSON to
``var/chaos/latest.json`` (and ``var/chaos/chaos-<UTC timestamp>.json``), and exits 1 if any scenario failed.
``--only`` takes names or shell patterns (``kill-*``); a failed scenario keeps its /tmp dir and prints the command
that repeats it.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chaos import backpressure, cdc_full, clock, consumer_fail, kills, lake_full, neighbours, stalls
from tests.support.chaos import Ctx, Result, run_scenario
from tests.support.procs import ROOT

RESULTS_DIR = ROOT / "var" / "chaos"
DEFAULT_SEED = 1046


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: Callable[[Ctx, Result], None]

    @property
    def about(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0]


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("kill-daemon", kills.kill_daemon),
    Scenario("kill-daemon-lake", kills.kill_daemon_lake),
    Scenario("kill-node", kills.kill_node),
    Scenario("kill-node-realtime", kills.kill_node_realtime),
    Scenario("kill-mixed", kills.kill_mixed),
    Scenario("sigstop-daemon", stalls.sigstop_daemon),
    Scenario("cdc-dir-full", cdc_full.cdc_dir_full),
    Scenario("lake-disk-full", lake_full.lake_disk_full),
    Scenario("clock-jumps", clock.clock_jumps),
    Scenario("slow-consumer", backpressure.slow_consumer),
    Scenario("consumer-raises", consumer_fail.consumer_raises),
    Scenario("lake-neighbours", neighbours.lake_neighbours),
)


def by_name(name: str) -> Scenario:
    for s in SCENARIOS:
        if s.name == name:
            return s
    raise KeyError(f"no scenario {name!r} (one of: {', '.join(s.name for s in SCENARIOS)})")


def select(patterns: list[str]) -> list[Scenario]:
    if not patterns:
        return list(SCENARIOS)
    chosen = [s for s in SCENARIOS if any(s.name == p or fnmatch.fnmatchcase(s.name, p) for p in patterns)]
    if not chosen:
        raise SystemExit(f"--only {patterns}: no such scenario (one of: {', '.join(s.name for s in SCENARIOS)})")
    return chosen


def format_table(results: list[Result]) -> str:
    headers = ["scenario", "runs", "written", "delivered", "lost", "duplicates", "seconds", "result"]
    rows = []
    for r in results:
        dup = f"{r.duplicates}" + (" (must be 0)" if r.duplicates_must_be_zero else "")
        rows.append(
            [
                r.name,
                str(r.runs),
                str(r.written),
                str(r.delivered),
                str(r.lost),
                dup,
                f"{r.seconds:.0f}",
                "PASS" if r.passed else "FAIL",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    right = {1, 2, 3, 4, 6}

    def fmt(cells: list[str]) -> str:
        cols = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(cols).rstrip()

    lines = [fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]
    return "\n".join(lines)


def _git() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit}


def write_json(results: list[Result], *, short: bool, seed: int, seconds: float) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    doc = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": "short" if short else "full",
        "seed": seed,
        "seconds": round(seconds, 1),
        "passed": all(r.passed for r in results),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": list(os.getloadavg())},
        "git": _git(),
        "results": [r.to_json() for r in results],
    }
    text = json.dumps(doc, indent=2) + "\n"
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    (RESULTS_DIR / f"chaos-{stamp}.json").write_text(text)
    latest = RESULTS_DIR / "latest.json"
    latest.write_text(text)
    return latest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.run", description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="fewer runs per scenario (~3 minutes in all)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="scenario name or pattern")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.list:
        for s in SCENARIOS:
            print(f"{s.name:<20} {s.about}")
        return 0
    from cdcd.logging import configure as configure_logging

    configure_logging("json", level="warning")  # in-process nodes (backlogs) log only problems
    chosen = select(args.only)
    t0 = time.monotonic()
    results = []
    for s in chosen:
        print(f"== {s.name}: {s.about}", file=sys.stderr, flush=True)
        r = run_scenario(s.name, s.fn, short=args.short, seed=args.seed)
        status = "PASS" if r.passed else f"FAIL: {r.error}"
        print(f"== {s.name}: {status} ({r.seconds:.0f}s)", file=sys.stderr, flush=True)
        if not r.passed:
            print(r.details.get("traceback", ""), file=sys.stderr)
            mode = " --short" if args.short else ""
            print(
                f"   repeat: .venv/bin/python -m tests.chaos.run{mode} --only {s.name} --seed {args.seed}"
                f"   (files kept in {r.tmp})",
                file=sys.stderr,
            )
        results.append(r)
    seconds = time.monotonic() - t0
    print()
    print(format_table(results))
    for r in results:
        for note in r.notes:
            print(f"  {r.name}: {note}")
        if r.error:
            print(f"  {r.name}: FAILED: {r.error}")
    latest = write_json(results, short=args.short, seed=args.seed, seconds=seconds)
    ok = all(r.passed for r in results)
    print(f"\n{'all passed' if ok else 'FAILURES'} in {seconds:.0f}s; table in {latest.relative_to(ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
