"""Files per partition sampled through a live run (issue 43 item 1), not only counted at the end.

- ``lake.files.bounded``: a node (a subprocess) writes ``BENCH_BOUNDED_RATE`` entries/s (5k) over 4 caches, keys
  cycling through 1M, archiving a segment every second, for ``BENCH_BOUNDED_S`` seconds (the hour issue 43 asks for:
  ``BENCH_BOUNDED_S=3600``; ``--quick``: 2 minutes; default 10 minutes); an in-process daemon lands it with the
  JVM-free writer and the lake sink's defaults (the bound of 20 files per partition, compaction every 20 s on
  delta-rs, no JVM; ``BENCH_BOUNDED_ENGINE=spark``: on Spark ``local[2]``; the optimize lane every 10 s). A sampler
  process reads every table's log every 2 s (a process of its own: not the daemon's CPU): per sample the most files
  in one partition of ``changes``, of ``state`` and of any typed table. Reports p50/p99/max over the samples (goal:
  p99 <= 20, max <= 30), seconds per maintenance run (each compaction and optimize run timed exactly from the sink's
  metrics read every 2 s: p50/p99/max; the writer's rewrites, many a second: mean and the p99 bucket of
  ``cdcd_lake_maintenance_duration_seconds``), this process's CPU per entry (the daemon; the JVM is a child and
  reported apart), and the first ``GROUP BY`` read of ``state`` and of a typed table at the end, in DuckDB and in a
  fresh Spark session; and the disk at the end: the data files the tables' snapshots name (``disk_live_mb``)
  against every data file under them (``disk_data_mb``: replaced files stay until a vacuum), of which the typed
  tables' change data feed (``disk_change_feed_mb``).
- ``lake.files.bounded.realtime``: the same load landed by the node's realtime worker (its ``[realtime_consumer]``
  is the lake, JVM-free writer, the bound of 20), switched on as an operator does (``cdcd control --node-dir DIR
  realtime on``) while the daemon sits PASSIVE and maintains the lake (compaction and the optimize lane, its sink's
  defaults). The same figures (the writer's rewrites timed in the node, where they run now), the node's CPU per
  entry beside the daemon's (the landing moved there), and the
  realtime lag p50/p99 from the node's ``cdcd_node_realtime_lag_seconds`` (WAL commit to the lake's commit,
  per batch), read every 2 s in the node's process (goal: p99 <= 300 ms), and the same lag from each batch's
  first entry (``lag_first_*``, exact). The node's process first writes the same load for ``BENCH_BASELINE_S``
  (20) seconds into a node without a consumer (``node_baseline_cpu_us_per_entry``); ``BENCH_PROFILE=<file>``
  appends where its CPU went (per thread, sampled Python stacks: ``tests/bench/thread_profile.py``);
  ``BENCH_RT_BATCH_MIN_INTERVAL_MS`` and ``BENCH_MAINTENANCE_NICE`` set the node's pacing and the daemon's
  maintenance priority.
"""

from __future__ import annotations

import itertools
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.bench.bench_lake_caches import LIVE_KEYS as KEYS
from tests.bench.bench_lake_caches import live_writer
from tests.bench.thread_profile import ThreadProfile
from tests.support.bench import Bench, Measurement, Metric

RATE = int(os.environ.get("BENCH_BOUNDED_RATE") or 5_000)
CACHES = 4
FULL_S = 600.0
QUICK_S = 120.0
SAMPLE_EVERY_S = 2.0
MASTER = "local[2]"
P99_GOAL = 20
MAX_GOAL = 30
RUN_P99_GOAL_S = 5.0


def _most_files(lake: Path) -> dict[str, int]:
    from cdcd.lake.maintenance.autocompact import files_per_partition
    from cdcd.lake.table import PARTITION_BY

    out: dict[str, int] = {}
    for name, parts in (("changes", PARTITION_BY), ("state", PARTITION_BY)):
        counts = files_per_partition(lake / name, parts)
        if counts:
            out[name] = max(counts.values())
    tables = lake / "tables"
    for path in sorted(tables.glob("*")) if tables.is_dir() else []:
        try:
            n = max(files_per_partition(path).values(), default=0)
        except Exception:  # being created this moment: the next sample reads it
            continue
        out["tables"] = max(out.get("tables", 0), n)
    return out


def file_sampler(lake: str, out: str) -> None:
    """Every ``SAMPLE_EVERY_S``, one JSON line of ``_most_files`` to ``out``, until killed: in a process of its
    own, so that opening every table's log (whose cost grows with the logs) is neither the daemon's CPU nor
    held against its GIL."""
    import json

    with open(out, "a") as sink:
        while True:
            time.sleep(SAMPLE_EVERY_S)
            try:
                sample = _most_files(Path(lake))
                sample["log_files"] = len(os.listdir(Path(lake) / "changes" / "_delta_log"))
            except Exception:  # a table created this very moment: the next sample reads it
                continue
            sink.write(json.dumps(sample) + "\n")
            sink.flush()


def _read_samples(path: Path) -> list[dict[str, int]]:
    import json

    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


class RunTimes:
    """Each scheduled maintenance run's exact seconds, read from the sink's metrics at every sample: a new run is
    ``cdcd_lake_maintenance_duration_seconds_count`` grown by one, its seconds the last-duration gauge (runs that
    ended two in one sample are counted in ``missed``, not timed: both took under a sample's interval)."""

    def __init__(self, tasks: tuple[str, ...] = ("compact", "optimize")) -> None:
        self.tasks = tasks
        self.count = dict.fromkeys(tasks, 0.0)
        self.seconds: dict[str, list[float]] = {t: [] for t in tasks}
        self.missed = dict.fromkeys(tasks, 0)

    def sample(self) -> None:
        from cdcd import metrics

        counts: dict[str, float] = {}
        last: dict[str, float] = {}
        for family in metrics.LAKE.collect():
            for s in family.samples:
                task = s.labels.get("task")
                if task not in self.count:
                    continue
                if s.name == "cdcd_lake_maintenance_duration_seconds_count":
                    counts[task] = s.value
                elif s.name == "cdcd_lake_last_maintenance_duration_seconds":
                    last[task] = s.value
        for task in self.tasks:
            grown = int(counts.get(task, 0.0) - self.count[task])
            if grown >= 1 and task in last:
                self.seconds[task].append(last[task])
                self.missed[task] += grown - 1
            self.count[task] = counts.get(task, self.count[task])

    def figures(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {}
        for task in self.tasks:
            runs = sorted(round(s, 3) for s in self.seconds[task])
            at = (lambda q: runs[min(len(runs) - 1, int(q * len(runs)))]) if runs else (lambda q: None)
            out |= {
                f"{task}_p50_s": at(0.5),
                f"{task}_p99_s": at(0.99),
                f"{task}_max_s": runs[-1] if runs else None,
                f"{task}_timed": len(runs),
                f"{task}_untimed": self.missed[task],
            }
        return out


def _pct(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0


def _run_seconds(task: str) -> dict[str, float | None]:
    """Mean and p99 bucket bound of ``cdcd_lake_maintenance_duration_seconds{task}`` in this process (the lake
    sink's registry: the daemon exports it to the default one only with a metrics address)."""
    from cdcd import metrics

    buckets: list[tuple[float, float]] = []
    count = total = 0.0
    failures = 0.0
    for family in metrics.LAKE.collect():
        if family.name == "cdcd_lake_maintenance_failures":
            failures += sum(
                s.value for s in family.samples if s.labels.get("task") == task and s.name.endswith("_total")
            )
        if family.name != "cdcd_lake_maintenance_duration_seconds":
            continue
        for s in family.samples:
            if s.labels.get("task") != task:
                continue
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
    p99 = next((le for le, n in sorted(buckets) if count and n >= 0.99 * count), None)
    return {
        "runs": count,
        "failures": failures,
        "mean_s": round(total / count, 3) if count else None,
        "p99_bucket_s": p99,
    }


def _first_reads(lake: Path) -> dict[str, float]:
    """The first GROUP BY of state and of one typed table: DuckDB (a new connection) and Spark (a new session)."""
    from cdcd.lake import spark as spark_session
    from cdcd.lake.reading.readers import duckdb_connect
    from cdcd.lake.typed.layout import list_tables

    table = next(iter(sorted(list_tables(lake).items())))[1]
    out: dict[str, float] = {}
    con = duckdb_connect()
    t0 = time.perf_counter()
    con.sql(f"SELECT cache, count(*) FROM delta_scan('{lake / 'state'}') GROUP BY cache").fetchall()
    out["duckdb_state_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    con.sql(f"SELECT _source_node, count(*) FROM delta_scan('{table}') GROUP BY ALL").fetchall()
    out["duckdb_table_s"] = round(time.perf_counter() - t0, 2)
    spark = spark_session.acquire(MASTER, "cdcd-bench-reader", {})
    try:
        t0 = time.perf_counter()
        spark.read.format("delta").load(str(lake / "state")).groupBy("cache").count().collect()
        out["spark_state_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        spark.read.format("delta").load(str(table)).groupBy("_source_node").count().collect()
        out["spark_table_s"] = round(time.perf_counter() - t0, 2)
    finally:
        spark_session.release()
    return out


def _disk(lake: Path) -> dict[str, float]:
    """Megabytes on disk at the end: the data files every table's snapshot names (live), every data file under the
    tables (files replaced by rewrites, compaction's MERGEs and OPTIMIZE stay until a vacuum), and of that the
    typed tables' change data feed (``_change_data``)."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from cdcd.lake.typed.layout import list_tables

    tables = [lake / "changes", lake / "state", *(Path(str(p)) for p in list_tables(lake).values())]
    live = on_disk = feed = 0
    for table in tables:
        live += sum(pa.table(DeltaTable(str(table)).get_add_actions(flatten=True)).column("size_bytes").to_pylist())
        for path in table.rglob("*.parquet"):
            if "_delta_log" not in path.parts:
                size = path.stat().st_size
                on_disk += size
                feed += size if "_change_data" in path.parts else 0
    mb = 1 << 20
    return {
        "disk_live_mb": round(live / mb, 1),
        "disk_data_mb": round(on_disk / mb, 1),
        "disk_change_feed_mb": round(feed / mb, 1),
    }


LAG_P99_GOAL_MS = 300.0
PACE_MS = os.environ.get("BENCH_RT_BATCH_MIN_INTERVAL_MS")
"""The node's ``realtime_batch_min_interval_ms`` (unset: its default)."""
NICE = os.environ.get("BENCH_MAINTENANCE_NICE")
"""The daemon's sink's ``maintenance_nice`` (unset: its default)."""
COMPACT_INTERVAL_S = os.environ.get("BENCH_COMPACT_INTERVAL_S")
"""The daemon's sink's ``compact_interval_s`` (unset: its default)."""
BASELINE_S = float(os.environ.get("BENCH_BASELINE_S") or 20.0)
"""The realtime writer first writes this long into a node without a consumer: the node's own CPU per entry."""
REALTIME_START_S = 600.0
"""How long the realtime writer waits for its worker to be on (the PASSIVE switch waits for a daemon's sync)."""


def realtime_writer(node_dir: str, lake: str, seconds: float, rate: int, caches: int) -> None:
    """The node of ``lake.files.bounded.realtime`` (a process of its own): the live writer's node and load with the
    lake as its ``[realtime_consumer]``. It waits until ``cdcd control ... realtime on`` has turned its worker on,
    then writes, and every ``SAMPLE_EVERY_S`` records the cumulative buckets of ``cdcd_node_realtime_lag_seconds``
    and whether the worker is still on (``lag.json``); its own CPU seconds go to ``cpu``."""
    import json

    from cdcd import metrics
    from cdcd.node import Node
    from cdcd.realtime.machine import RealtimeMode

    consumer = {"kind": "lake", "lake_path": lake, "writer": "deltalake", "max_files_per_partition": P99_GOAL}
    samples: list[dict[str, Any]] = []
    profile_to = os.environ.get("BENCH_PROFILE")
    if BASELINE_S:
        _baseline(Path(node_dir).with_name("baseline"), BASELINE_S, rate, caches, profile_to)

    def lag_buckets() -> dict[str, float]:
        return {
            s.labels["le"]: s.value
            for family in metrics.RT_LAG_SECONDS.collect()
            for s in family.samples
            if s.name.endswith("_bucket")
        }

    # The node's histogram times each batch from its first (oldest) entry, in buckets: time the same exactly, per
    # batch, in this process (bench instrumentation around the worker's hook).
    from cdcd.realtime import deliver

    first_lag_s: list[float] = []
    delivered = deliver.Deliverer.delivered

    def timed(self: Any, taken: Any, events: Any, took: int, ok: bool) -> None:
        if took:
            first_lag_s.append((time.time_ns() - taken[0].record.commit_ts_ns) / 1e9)
        delivered(self, taken, events, took, ok)

    deliver.Deliverer.delivered = timed  # type: ignore[method-assign]

    def confirmed() -> int:
        return int(sum(s.value for f in metrics.RT_EVENTS.collect() for s in f.samples if s.name.endswith("_total")))

    with Node.open(
        node_dir,
        wal_force_archive_timeout_ms=1000,
        wal_mode="background",
        realtime_consumer=consumer,
        **({"realtime_batch_min_interval_ms": int(PACE_MS)} if PACE_MS is not None else {}),
    ) as node:
        worker: Any = node.realtime
        deadline = time.monotonic() + REALTIME_START_S
        while worker.mode is not RealtimeMode.ON:
            if time.monotonic() > deadline:
                raise SystemExit(f"realtime did not come on within {REALTIME_START_S:.0f} s")
            time.sleep(0.05)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        profile = ThreadProfile() if profile_to else None
        if profile is not None:
            profile.start()
        handles = [node.cache(f"live-{i}") for i in range(caches)]
        written = 0
        t0 = time.monotonic()
        next_sample = 0.0
        while (now := time.monotonic() - t0) < seconds:
            if now >= next_sample:
                samples.append({"t": round(now, 2), "on": worker.mode is RealtimeMode.ON, "buckets": lag_buckets()})
                next_sample += SAMPLE_EVERY_S
            due = int(now * rate)
            while written < due:
                handles[written % caches].put(written % KEYS, {"i": written, "pad": "x" * 64})
                written += 1
            time.sleep(0.01)
        node.force_archive()
        load_s = time.monotonic() - t0
        if profile is not None and profile_to:
            report = profile.report(profile.stop(), written)
            with open(profile_to, "a") as out:
                out.write(f"\n##### realtime on, the lake as [realtime_consumer]\n{report}\n")
        first_lags = sorted(first_lag_s)
        # Closing with batches still buffered would cut the drain short at realtime_close_timeout_ms: wait for the
        # worker to confirm every entry (its events counter) while it stays on, and report how long that took.
        while confirmed() < written and worker.mode is RealtimeMode.ON and time.monotonic() - t0 < seconds * 3 + 60:
            time.sleep(0.05)
        samples.append(
            {
                "t": round(time.monotonic() - t0, 2),
                "on": worker.mode is RealtimeMode.ON,
                "buckets": lag_buckets(),
                "drain_s": round(time.monotonic() - t0 - load_s, 2),
                "unconfirmed": written - confirmed(),
            }
        )
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    (Path(node_dir) / "lag.json").write_text(json.dumps(samples))
    (Path(node_dir) / "first_lag.json").write_text(json.dumps(first_lags))
    (Path(node_dir) / "autocompact.json").write_text(json.dumps(_run_seconds("autocompact")))
    (Path(node_dir) / "cpu").write_text(f"{cpu_s:.3f}")
    (Path(node_dir) / "written").write_text(str(written))


def _baseline(node_dir: Path, seconds: float, rate: int, caches: int, profile_to: str | None) -> None:
    """The same load into a node without a realtime consumer (the daemon does not read it): what the node's put
    path and WAL cost alone, per entry, as ``baseline_cpu`` beside the bench's node directory."""
    from cdcd.node import Node

    with Node.open(str(node_dir), wal_force_archive_timeout_ms=1000, wal_mode="background") as node:
        handles = [node.cache(f"live-{i}") for i in range(caches)]
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        profile = ThreadProfile() if profile_to else None
        if profile is not None:
            profile.start()
        written = 0
        t0 = time.monotonic()
        while (now := time.monotonic() - t0) < seconds:
            due = int(now * rate)
            while written < due:
                handles[written % caches].put(written % KEYS, {"i": written, "pad": "x" * 64})
                written += 1
            time.sleep(0.01)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        if profile is not None and profile_to:
            report = profile.report(profile.stop(), written)
            with open(profile_to, "a") as out:
                out.write(f"\n##### baseline: no realtime consumer\n{report}\n")
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    (node_dir.parent / "baseline_cpu").write_text(f"{cpu_s / max(written, 1) * 1e6:.2f}")
    shutil.rmtree(node_dir, ignore_errors=True)


def _quantile(q: float, buckets: dict[str, float]) -> float | None:
    """``histogram_quantile`` as Prometheus computes it: linear within the bucket the rank falls in (None: no
    observations; the highest finite bound when the rank is in ``+Inf``)."""
    ordered = sorted((float(le), n) for le, n in buckets.items())
    total = ordered[-1][1] if ordered else 0.0
    if not total:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le, n in ordered:
        if n >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / (n - below) if n > below else 1.0)
        lower, below = le, n
    return lower


def _lag_figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Realtime lag p50/p99 over the run (the last sample's buckets less the first's), the worst p99 of one
    sampling window, and in how many samples the worker was not on (then the daemon delivered)."""

    def minus(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {le: n - b.get(le, 0.0) for le, n in a.items()}

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    if len(samples) < 2:
        return {"lag_p50_ms": None, "lag_p99_ms": None, "lag_window_p99_max_ms": None, "realtime_off_samples": 0}
    run = minus(samples[-1]["buckets"], samples[0]["buckets"])
    batches = max(run.values(), default=0.0)
    finite = max((n for le, n in run.items() if float(le) != float("inf")), default=0.0)
    windows = [_quantile(0.99, minus(b["buckets"], a["buckets"])) for a, b in itertools.pairwise(samples)]
    # Per ten minutes (the samples every 2 s): does the tail grow with the run?
    tens = [s for s in samples if "t" in s and int(s["t"]) % 600 < SAMPLE_EVERY_S] + [samples[-1]]
    by_ten = [_quantile(0.99, minus(b["buckets"], a["buckets"])) for a, b in itertools.pairwise(tens)]
    return {
        "lag_p50_ms": ms(_quantile(0.5, run)),
        "lag_p99_ms": ms(_quantile(0.99, run)),
        "lag_p99_by_10min_ms": [ms(v) for v in by_ten],
        "lag_window_p99_max_ms": ms(max((w for w in windows if w is not None), default=None)),
        "lag_batches": int(batches),
        # Past the highest bucket the quantile is that bucket's bound: how many batches lay beyond it.
        "lag_over_top_bucket": int(batches - finite),
        "realtime_off_samples": sum(1 for s in samples if not s["on"]),
        "drain_s": samples[-1].get("drain_s"),
        "unconfirmed_at_close": samples[-1].get("unconfirmed"),
    }


def _switch_realtime_on(node_dir: Path, stop: threading.Event) -> None:
    """``cdcd control --node-dir DIR realtime on`` until the node takes it (its control socket may not be up yet);
    the node's worker comes on once the daemon has passed the TryStart record."""
    from tests.support.bench import _child_env

    while not stop.is_set():
        done = subprocess.run(
            [sys.executable, "-m", "cdcd", "control", "--node-dir", str(node_dir), "realtime", "on"],
            env=_child_env(),
            capture_output=True,
            timeout=120,
            check=False,
        )
        if done.returncode == 0:
            return
        stop.wait(1.0)


def run_bounded(duration_s: float, *, realtime: bool = False) -> Measurement:
    import json

    from cdcd.daemon import Daemon, DaemonConfig
    from cdcd.lake.sink import LakeConsumer, LakeOptions
    from tests.support.bench import _child_env
    from tests.support.procs import reap

    var = Path(__file__).resolve().parents[2] / "var"
    var.mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="cdcd-bench-lake-bounded-", dir=str(var)))
    proc: subprocess.Popen[bytes] | None = None
    stop = threading.Event()
    samples: list[dict[str, int]] = []
    try:
        node_dir, lake = root / "node", root / "lake"
        # The sink's defaults: compaction on delta-rs, no JVM (BENCH_BOUNDED_ENGINE=spark: on Spark local[2]).
        engine = os.environ.get("BENCH_BOUNDED_ENGINE") or "deltalake"
        master = {"spark_master": MASTER} if engine == "spark" else {}
        tuned: dict[str, float] = {"maintenance_nice": int(NICE)} if NICE is not None else {}
        if COMPACT_INTERVAL_S is not None:
            tuned["compact_interval_s"] = float(COMPACT_INTERVAL_S)
        consumer = {"kind": "lake", "lake_path": str(lake), "writer": "deltalake", **master, **tuned}
        sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **master, **tuned))  # type: ignore[arg-type]
        args = [str(node_dir), *([str(lake)] if realtime else []), str(duration_s), str(RATE), str(CACHES)]
        writer = "realtime-writer" if realtime else "live-writer"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.bench_lake_small_files", writer, *args], env=_child_env()
        )
        deadline = time.monotonic() + 60 + (BASELINE_S if realtime else 0.0)
        while not (node_dir / "cdc").is_dir():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"the live writer did not start (exit {proc.poll()})")
            time.sleep(0.1)

        times = RunTimes()

        def sample_runs() -> None:
            while not stop.wait(SAMPLE_EVERY_S):
                times.sample()

        samples_at = root / "samples.jsonl"
        sampler_proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.bench_lake_small_files", "sampler", str(lake), str(samples_at)],
            env=_child_env(),
        )
        sampler = threading.Thread(target=sample_runs, daemon=True)
        sampler.start()
        switch = threading.Thread(target=_switch_realtime_on, args=(node_dir, stop), daemon=True)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        with Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address="", consumer=consumer), sink) as daemon:
            if realtime:
                switch.start()
            while proc.poll() is None:
                if daemon.sync_once() == 0:
                    time.sleep(0.05)
            if proc.returncode != 0 and not (node_dir / "written").exists():
                raise AssertionError(f"the live writer exited {proc.returncode}")
            while daemon.sync_once() > 0:
                pass
            stop.set()
            sampler.join(30)
            times.sample()
            reap(sampler_proc)
            samples = _read_samples(samples_at)
        elapsed = time.monotonic() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        written = int((node_dir / "written").read_text())
        cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        log_files = [s.pop("log_files") for s in samples if "log_files" in s]
        per_sample = [max(s.values(), default=0) for s in samples if s]
        extra: dict[str, Any] = {
            "samples": len(per_sample),
            "p50_files": _pct(per_sample, 50),
            "p99_files": _pct(per_sample, 99),
            "max_files": max(per_sample, default=0),
            "changes_max_files": max((s.get("changes", 0) for s in samples), default=0),
            "state_max_files": max((s.get("state", 0) for s in samples), default=0),
            "tables_max_files": max((s.get("tables", 0) for s in samples), default=0),
            "daemon_cpu_us_per_entry": round(cpu_s / max(written, 1) * 1e6, 2),
            "changes_log_files_max": max(log_files, default=0),
            "changes_log_files_last": log_files[-1] if log_files else 0,
        }
        if realtime:
            # The node's process lands now: its CPU (the load it writes included) is the landing's cost.
            node_cpu_s = float((node_dir / "cpu").read_text())
            extra["node_cpu_us_per_entry"] = round(node_cpu_s / max(written, 1) * 1e6, 2)
            baseline = root / "baseline_cpu"
            if baseline.exists():  # the same load into a node without a consumer, before
                extra["node_baseline_cpu_us_per_entry"] = float(baseline.read_text())
            extra |= _lag_figures(json.loads((node_dir / "lag.json").read_text()))
            first = json.loads((node_dir / "first_lag.json").read_text())
            for q in (50, 99):  # per batch, from its first (oldest) entry: exact, not bucketed
                extra[f"lag_first_p{q}_ms"] = (
                    round(first[min(len(first) - 1, len(first) * q // 100)] * 1000, 1) if first else None
                )
            extra["writer_exit"] = proc.returncode  # its figures are written before the node closes
        for task in ("autocompact", "compact", "optimize"):
            for k, v in _run_seconds(task).items():
                extra[f"{task}_{k}"] = v
        extra |= times.figures()
        if realtime:
            # The writer's rewrites run where it writes: in the node's realtime worker, not in the daemon.
            for k, v in json.loads((node_dir / "autocompact.json").read_text()).items():
                extra[f"autocompact_{k}"] = v
        extra |= _disk(lake)
        extra |= _first_reads(lake)
        return Measurement(written, elapsed, extra, value=extra["p99_files"])
    finally:
        stop.set()
        reap(proc)
        if not os.environ.get("BENCH_KEEP_LAKE"):
            shutil.rmtree(root, ignore_errors=True)


def _files_metrics() -> tuple[Metric, ...]:
    return (
        Metric("p50_files", "p50_files", "files", lower_is_better=True),
        Metric("max_files", "max_files", "files", MAX_GOAL, lower_is_better=True),
        Metric("autocompact_p99", "autocompact_p99_bucket_s", "s", RUN_P99_GOAL_S, lower_is_better=True),
        Metric("compact_p99", "compact_p99_s", "s", RUN_P99_GOAL_S, lower_is_better=True),
        Metric("compact_max", "compact_max_s", "s", lower_is_better=True),
        Metric("cpu_per_entry", "daemon_cpu_us_per_entry", "us", lower_is_better=True),
        Metric("disk_live", "disk_live_mb", "MiB", lower_is_better=True),
        Metric("disk_data", "disk_data_mb", "MiB", lower_is_better=True),
        Metric("duckdb_state_read", "duckdb_state_s", "s", lower_is_better=True),
        Metric("spark_state_read", "spark_state_s", "s", lower_is_better=True),
        Metric("duckdb_table_read", "duckdb_table_s", "s", lower_is_better=True),
        Metric("spark_table_read", "spark_table_s", "s", lower_is_better=True),
    )


def benchmarks(quick: bool) -> list[Bench]:
    seconds = float(os.environ.get("BENCH_BOUNDED_S") or (QUICK_S if quick else FULL_S))
    what = f"files per partition sampled every {SAMPLE_EVERY_S:g} s, {seconds:.0f} s live at {RATE:,}/s"
    engine = os.environ.get("BENCH_BOUNDED_ENGINE") or "deltalake"
    params = {"rate": RATE, "caches": CACHES, "keys": KEYS, "seconds": seconds, "writer": "deltalake", "engine": engine}
    if PACE_MS is not None:
        params["realtime_batch_min_interval_ms"] = int(PACE_MS)
    if NICE is not None:
        params["maintenance_nice"] = int(NICE)
    if COMPACT_INTERVAL_S is not None:
        params["compact_interval_s"] = float(COMPACT_INTERVAL_S)
    return [
        Bench(
            name="lake.files.bounded",
            description=what,
            run_once=lambda: run_bounded(seconds),
            metric="p99_files",
            unit="files",
            goal=P99_GOAL,
            lower_is_better=True,
            max_repeats=1,
            more=_files_metrics(),
            params=params,
        ),
        Bench(
            name="lake.files.bounded.realtime",
            description=f"{what}, landed by the node's realtime worker (daemon PASSIVE, maintaining)",
            run_once=lambda: run_bounded(seconds, realtime=True),
            metric="p99_files",
            unit="files",
            goal=P99_GOAL,
            lower_is_better=True,
            max_repeats=1,
            more=(
                *_files_metrics(),
                Metric("node_cpu_per_entry", "node_cpu_us_per_entry", "us", lower_is_better=True),
                Metric("node_baseline_cpu_per_entry", "node_baseline_cpu_us_per_entry", "us", lower_is_better=True),
                Metric("lag_p50", "lag_p50_ms", "ms", lower_is_better=True),
                Metric("lag_p99", "lag_p99_ms", "ms", LAG_P99_GOAL_MS, lower_is_better=True),
                Metric("lag_window_p99_max", "lag_window_p99_max_ms", "ms", lower_is_better=True),
                Metric("lag_first_p50", "lag_first_p50_ms", "ms", lower_is_better=True),
                Metric("lag_first_p99", "lag_first_p99_ms", "ms", LAG_P99_GOAL_MS, lower_is_better=True),
            ),
            params={**params, "mode": "realtime"},
        ),
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["live-writer"]:
        node_dir, seconds, rate, caches = sys.argv[2:6]
        live_writer(node_dir, float(seconds), int(rate), int(caches))
    elif sys.argv[1:2] == ["sampler"]:
        file_sampler(*sys.argv[2:4])
    elif sys.argv[1:2] == ["realtime-writer"]:
        node_dir, lake, seconds, rate, caches = sys.argv[2:7]
        realtime_writer(node_dir, lake, float(seconds), int(rate), int(caches))
    else:
        raise SystemExit(
            "usage: python -m tests.bench.bench_lake_small_files live-writer NODE_DIR SECONDS RATE CACHES\n"
            "       python -m tests.bench.bench_lake_small_files realtime-writer NODE_DIR LAKE SECONDS RATE CACHES\n"
            "       python -m tests.bench.bench_lake_small_files sampler LAKE OUT_JSONL"
        )
