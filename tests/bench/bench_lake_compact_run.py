"""One JVM-free compaction's cost at the hour's shape (issue 43: seconds per maintenance run, p99 <= 5 s).

- ``lake.compact.run.<variant>``: a lake whose ``state`` and typed tables hold 1M keys over 4 caches
  (values as ``lake.files.bounded`` writes them: ``{"i": n, "pad": 64 x "x"}``, the cache ``key % 4``),
  compacted once in setup (untimed); then ``RUNS`` consecutive compactions with ``compact(None, lake)``,
  each of one interval's new changes (10 s x 5k/s = 50k; ``BENCH_COMPACT_CHANGES`` to change it, e.g.
  300000 for the sink's default 60 s), 1% of them deletes, timed one by one: p50 and p99 (over so few
  runs: the slowest) seconds per run, and the process's CPU seconds per run (p50: what a run costs a
  loaded machine). Variants: ``uniform``, keys uniform over the 1M; ``skewed``, 90% of the changes on a
  hot set of 1% of the keys (random ones), the rest uniform; ``cycling``, the next keys of a cycle
  through the 1M (``lake.files.bounded``'s ``n % 1M``: a contiguous run of keys per interval).
- Baseline, in the same process on the same lake: the seconds to read one interval's changes from
  ``changes`` (``read_feed``) and to write the whole ``state`` (1M rows) once with pyarrow: what a run
  costs at least, and what a run that rewrites all of ``state`` costs at least.

Per run also the files and bytes a run removed (read and rewrote) from ``state`` and the typed tables, summed
over their commits (the Delta log's ``remove`` actions, the tables' own bin-packing and clustering
included): with key-range clustered files (``compact_file_rows``) they track the changed keys' ranges, not
the table. ``BENCH_COMPACT_KEYS`` (default 1M) sets the table's size, ``BENCH_COMPACT_FILE_ROWS`` the rows
per clustered file (default: the sink's).

``BENCH_COMPACT_PROFILE=path``: the first timed run of each variant under cProfile, written to
``path.<variant>.prof`` (``python -m pstats``).
"""

from __future__ import annotations

import atexit
import cProfile
import json
import os
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from cdcd.lake.maintenance.clustered import FILE_ROWS
from tests.bench.bench_lake_merge import _bench_dir, append, change_table, state_count
from tests.support.bench import Bench, Measurement, Metric

KEYS = 1_000_000
CACHES = 4
INTERVAL_CHANGES = 50_000
"""One ``compact_interval_s`` of 10 s at 5k entries/s."""
RUNS = 10
GOAL_S = 5.0
HOT_KEYS = KEYS // 100
HOT_SHARE = 0.9


def _value(k: int, order: int) -> str:
    return f'{{"i":{order},"pad":"{"x" * 64}"}}'


def _changes(keys: list[int], first_order: int, deletes: float = 0.0, rng: random.Random | None = None) -> pa.Table:
    ops = ["update"] * len(keys)
    if deletes and rng is not None:
        ops = ["delete" if rng.random() < deletes else "update" for _ in keys]
    return change_table([f"live-{k % CACHES}" for k in keys], keys, ops, first_order, _value)


def _removed(table: Path, after: int) -> tuple[int, int]:
    """(files, bytes) the commits of the Delta table at ``table`` after version ``after`` removed."""
    files = size = 0
    dt = DeltaTable(str(table))
    for version in range(after + 1, dt.version() + 1):
        log = table / "_delta_log" / f"{version:020d}.json"
        for line in log.read_text().splitlines():
            if '"remove"' in line:
                action = json.loads(line).get("remove")
                if action is not None:
                    files += 1
                    size += int(action.get("size") or 0)
    return files, size


def _versions(lake: Path) -> dict[Path, int]:
    from cdcd.lake.typed.layout import list_tables

    tables = [lake / "state", *list_tables(lake).values()]
    return {t: DeltaTable(str(t)).version() for t in tables}


class Lake:
    """1M keys compacted once (``base``); each variant works on a copy of it."""

    def __init__(self, keys: int, changes: int, runs: int, file_rows: int = FILE_ROWS) -> None:
        self.keys, self.changes, self.runs, self.file_rows = keys, changes, runs, file_rows
        self.root: Path | None = None
        self.initial_s = 0.0
        self.next_order = 0

    def ensure(self) -> None:
        from cdcd.lake.maintenance.compact import compact

        if self.root is not None:
            return
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-compact-run-", dir=_bench_dir()))
        atexit.register(self.cleanup)
        base = self.root / "base"
        step = 250_000
        for start in range(0, self.keys, step):
            keys = list(range(start, min(self.keys, start + step)))
            append(
                base, change_table([f"live-{k % CACHES}" for k in keys], keys, ["create"] * len(keys), start, _value)
            )
        self.next_order = self.keys
        t0 = time.perf_counter()
        compact(None, base, file_rows=self.file_rows)
        self.initial_s = time.perf_counter() - t0
        if state_count(base) != self.keys:
            raise AssertionError(f"initial state: {state_count(base):,} rows, expected {self.keys:,}")

    def cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_s() -> float:
    """This process's CPU seconds (all its threads: delta-rs's and pyarrow's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _baseline(lake: Path, first: int, last: int) -> tuple[float, float]:
    """Seconds to read changes ``first..last`` (the feed), and to write all of ``state`` once with pyarrow."""
    import pyarrow.parquet as pq

    from cdcd.lake.maintenance.feed import read_feed

    t0 = time.perf_counter()
    read_feed(lake / "changes", first, last)
    read_s = time.perf_counter() - t0
    rows = DeltaTable(str(lake / "state")).to_pyarrow_table()
    out = lake.parent / "baseline.parquet"
    t0 = time.perf_counter()
    pq.write_table(rows, out, compression="zstd")
    write_s = time.perf_counter() - t0
    out.unlink()
    return read_s, write_s


def run_variant(lake_spec: Lake, variant: str) -> Measurement:
    from cdcd.lake.maintenance.compact import compact

    assert lake_spec.root is not None
    lake = lake_spec.root / variant
    shutil.rmtree(lake, ignore_errors=True)
    shutil.copytree(lake_spec.root / "base", lake)
    rng = random.Random(43)
    order = lake_spec.next_order
    hot = rng.sample(range(lake_spec.keys), max(1, lake_spec.keys // 100))
    seconds: list[float] = []
    cpu: list[float] = []
    load: list[float] = []
    removed_files: list[int] = []
    removed_bytes: list[int] = []
    profile = os.environ.get("BENCH_COMPACT_PROFILE")
    live = lake_spec.keys
    deleted: set[int] = set()
    for run in range(lake_spec.runs):
        if variant == "cycling":
            start = (run * lake_spec.changes) % lake_spec.keys
            keys = [(start + i) % lake_spec.keys for i in range(lake_spec.changes)]
        elif variant == "skewed":
            keys = [
                rng.choice(hot) if rng.random() < HOT_SHARE else rng.randrange(lake_spec.keys)
                for _ in range(lake_spec.changes)
            ]
        else:
            keys = [rng.randrange(lake_spec.keys) for _ in range(lake_spec.changes)]
        changes = _changes(keys, order, deletes=0.01, rng=rng)
        order += changes.num_rows
        # The expected count: a key's last change in this batch decides whether it lives.
        last_op = dict(zip(keys, changes.column("op").to_pylist(), strict=True))
        for k, op in last_op.items():
            if op == "delete" and k not in deleted:
                deleted.add(k)
                live -= 1
            elif op != "delete" and k in deleted:
                deleted.discard(k)
                live += 1
        append(lake, changes)
        load.append(os.getloadavg()[0])
        prof = cProfile.Profile() if profile and run == 0 else None
        before = _versions(lake)
        c0 = _cpu_s()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        compact(None, lake, file_rows=lake_spec.file_rows)
        if prof is not None:
            prof.disable()
        seconds.append(time.perf_counter() - t0)
        cpu.append(_cpu_s() - c0)
        gone = [_removed(t, v) for t, v in before.items()]
        removed_files.append(sum(f for f, _ in gone))
        removed_bytes.append(sum(b for _, b in gone))
        if prof is not None:
            prof.dump_stats(f"{profile}.{variant}.prof")
        if state_count(lake) != live:
            raise AssertionError(f"run {run}: {state_count(lake):,} state rows, expected {live:,}")
    last = DeltaTable(str(lake / "changes")).version()
    read_s, write_s = _baseline(lake, last, last)
    extra = {
        "p50_s": round(_pct(seconds, 0.5), 2),
        "p99_s": round(_pct(seconds, 0.99), 2),
        "runs_s": [round(s, 2) for s in seconds],
        "cpu_p50_s": round(_pct(cpu, 0.5), 2),
        "baseline_read_changes_s": round(read_s, 2),
        "baseline_write_state_s": round(write_s, 2),
        "initial_s": round(lake_spec.initial_s, 1),
        "load": [round(x, 1) for x in load],
        "state_files": len(DeltaTable(str(lake / "state")).file_uris()),
        "table_files": sum(len(DeltaTable(str(t)).file_uris()) for t in _versions(lake)),
        "removed_files_p50": int(_pct([float(x) for x in removed_files], 0.5)),
        "removed_mib_p50": round(_pct([float(x) for x in removed_bytes], 0.5) / (1 << 20), 1),
        "removed_files_runs": removed_files,
    }
    shutil.rmtree(lake, ignore_errors=True)
    return Measurement(lake_spec.changes * lake_spec.runs, sum(seconds), extra, value=extra["p99_s"])


def benchmarks(quick: bool) -> list[Bench]:
    changes = int(os.environ.get("BENCH_COMPACT_CHANGES", 5_000 if quick else INTERVAL_CHANGES))
    keys = int(os.environ.get("BENCH_COMPACT_KEYS", 100_000 if quick else KEYS))
    file_rows = int(os.environ.get("BENCH_COMPACT_FILE_ROWS", FILE_ROWS))
    lake = Lake(keys, changes, 3 if quick else RUNS, file_rows)
    params = {
        "keys": lake.keys,
        "caches": CACHES,
        "changes_per_run": lake.changes,
        "runs": lake.runs,
        "engine": "deltalake",
        "file_rows": file_rows,
        "hot": f"{HOT_SHARE:.0%} of changes on 1% of keys",
    }
    more = (
        Metric("p50", "p50_s", "s", GOAL_S, lower_is_better=True),
        Metric("cpu_p50", "cpu_p50_s", "s", lower_is_better=True),
        Metric("removed_files_p50", "removed_files_p50", "files", lower_is_better=True),
        Metric("removed_mib_p50", "removed_mib_p50", "MiB", lower_is_better=True),
        Metric("baseline_read_changes", "baseline_read_changes_s", "s", lower_is_better=True),
        Metric("baseline_write_state", "baseline_write_state_s", "s", lower_is_better=True),
    )
    return [
        Bench(
            name=f"lake.compact.run.{variant}",
            description=f"compact(None): {lake.runs} runs of {lake.changes:,} {variant} changes, {lake.keys:,} keys",
            run_once=lambda variant=variant: run_variant(lake, variant),  # type: ignore[misc]
            metric="p99",
            unit="s",
            goal=GOAL_S,
            lower_is_better=True,
            setup=lake.ensure,
            teardown=None,
            max_repeats=1,
            more=more,
            params={**params, "variant": variant},
        )
        for variant in ("uniform", "skewed", "cycling")
    ]
