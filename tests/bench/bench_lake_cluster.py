"""Many nodes, one lake on an object store (issue 16): live lag of three nodes, and backlogs landed
concurrently, against a real MinIO on loopback with one ``cdcd run`` daemon process per node.

- ``lake.cluster.lag``: three node processes (``tests.bench.bench_lake lag-writer``: ``wal_mode =
  fsync``, force-archive 1 s, ``put_all`` of 10 fresh keys at a fixed 5k entries/s each) and three
  ``cdcd run`` daemons (``writer = "deltalake"``, ``batch_max_delay_ms = 200``) landing into one lake
  ``s3://bench/live`` on MinIO. The writers start together and write for 20 s (8 s with ``--quick``);
  lag of a row = its commit's ``commitInfo.timestamp`` (ms, taken by delta-rs just before the
  conditional put that makes it visible) minus the row's ``commit_ts``. Rows of the first 5 s (3 s)
  are dropped. Reported: p50, p99 (goal <= 3 s), max, over the rows of all three nodes.
- ``lake.cluster.backlog``: three nodes' 1M-entry backlogs (written in setup, untimed: ``put_all``
  of 10 entries, 16 MiB segments; 200k with ``--quick``), landed by three daemons started at once
  into one fresh lake (``batch_max_events = 500000``); timed from the daemons' start to the last
  daemon's committed position passing its node's last segment. In the same run, before it, one node
  alone lands its backlog into another fresh lake (``one_node_rows_s``), so the scaling 1 -> 3 nodes
  is measured under the same load (``scaling``: total rows/s of three over one).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from cdcd.lake.storage import LakeLocation, StorageOptions
from cdcd.node.node import Node
from tests.support.bench import Bench, Measurement, Metric, _percentile, _tail
from tests.support.lake import caught_up, position, write_config
from tests.support.lake_bench import lake_value
from tests.support.ports import free_port
from tests.support.servers import MINIO_BIN, MINIO_PASSWORD, MINIO_USER, MinioServer, SparkStandalone

ROOT = Path(__file__).resolve().parents[2]
NODES = 3
LAG_RATE = 5000
LAG_GOAL_MS = 3000.0
LAG_IDLE_S = 2.5
SEGMENT_BYTES = 16 << 20
TX_SIZE = 10
BACKLOG_BATCH_EVENTS = 500_000
DEADLINE_S = 600.0


def _bench_dir() -> str | None:
    return os.environ.get("CDCD_BENCH_DIR") or None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDCD_", "AWS_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = MINIO_USER, MINIO_PASSWORD
    return env


class Store:
    """One MinIO for the module's benchmarks (started in setup, stopped in teardown)."""

    def __init__(self) -> None:
        self.work: Path | None = None
        self.server: MinioServer | None = None

    def ensure(self) -> MinioServer:
        if self.server is None:
            if not MINIO_BIN.exists():
                raise RuntimeError(f"{MINIO_BIN} missing: run `make install`")
            atexit.register(self.cleanup)
            self.work = Path(tempfile.mkdtemp(prefix="cdcd-bench-cluster-", dir=_bench_dir()))
            self.server = MinioServer(self.work / "minio" / "data")
            self.server.start()
            self.server.create_bucket("bench")
        return self.server

    def setup(self) -> None:
        self.ensure()

    def cleanup(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None


STORE = Store()


def _consumer(server: MinioServer, lake: str) -> dict[str, Any]:
    return {
        "kind": "lake",
        "lake_path": lake,
        "writer": "deltalake",
        "storage": {"endpoint": server.endpoint, "path_style": True},
        "compact_interval_s": 0,  # landing is timed, not maintenance
        "optimize_interval_s": 0,
    }


def _start_daemon(config: Path, err: Path) -> subprocess.Popen[bytes]:
    with err.open("ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "cdcd", "run", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=f,
            env=_env(),
            cwd=ROOT,
        )


def _stop(procs: list[subprocess.Popen[bytes]], errs: list[Path]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p, err in zip(procs, errs, strict=True):
        try:
            rc = p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise RuntimeError(f"daemon pid {p.pid} did not stop in 60 s:\n{_tail(err)}") from None
        if rc != 0:
            raise RuntimeError(f"daemon pid {p.pid} exited {rc}:\n{_tail(err)}")


def _location(server: MinioServer, lake: str) -> LakeLocation:
    return LakeLocation(lake, StorageOptions(endpoint=server.endpoint, path_style=True), env=_env())


# --- lake.cluster.lag -----------------------------------------------------------------------------------
def _commit_lags(server: MinioServer, lake: str) -> tuple[list[int], list[int], list[int]]:
    """Per row of the changes table: commit_ts (ms) and lag (its commit's timestamp - commit_ts, ms);
    per commit: the lag of its newest row (the time from the newest row to the commit)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    loc = _location(server, lake)
    fs = loc.filesystem()
    log_dir = loc.fs_path("changes/_delta_log")
    ts_all: list[int] = []
    lags: list[int] = []
    newest: list[int] = []
    infos = fs.get_file_info(pafs.FileSelector(log_dir))
    for info in sorted(i.path for i in infos if i.path.endswith(".json")):
        with fs.open_input_stream(info) as f:
            actions = [json.loads(line) for line in f.read().decode().splitlines() if line]
        commit_ms = next((a["commitInfo"]["timestamp"] for a in actions if "commitInfo" in a), None)
        commit_ts: list[int] = []
        for a in actions:
            if "add" not in a:
                continue
            assert commit_ms is not None, f"{info}: no commitInfo"
            col = pq.read_table(loc.fs_path(f"changes/{a['add']['path']}"), columns=["commit_ts"], filesystem=fs)
            commit_ts += [int(t.timestamp() * 1000) for t in col.column("commit_ts").to_pylist()]
        if commit_ts and commit_ms is not None:
            ts_all += commit_ts
            lags += [commit_ms - t for t in commit_ts]
            newest.append(commit_ms - max(commit_ts))
    return ts_all, lags, newest


def run_lag(*, seconds: float, drop_s: float, rate: int) -> Measurement:
    server = STORE.ensure()
    lake = f"s3://bench/live-{time.monotonic_ns()}"
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-cluster-lag-", dir=_bench_dir()))
    writers: list[subprocess.Popen[bytes]] = []
    daemons: list[subprocess.Popen[bytes]] = []
    errs = [work / f"daemon{i}.err" for i in range(NODES)]
    go = work / "go"
    try:
        for i in range(NODES):
            with (work / f"writer{i}.log").open("wb") as wlog:
                writers.append(
                    subprocess.Popen(
                        [
                            *(sys.executable, "-m", "tests.bench.bench_lake", "lag-writer"),
                            *("--node-dir", str(work / f"n{i}"), "--rate", str(rate), "--seconds", str(seconds)),
                            *(
                                "--idle-seconds",
                                str(LAG_IDLE_S),
                                "--go-file",
                                str(go),
                                "--out",
                                str(work / f"w{i}.json"),
                            ),
                        ],
                        cwd=ROOT,
                        env=_env(),
                        stdin=subprocess.DEVNULL,
                        stdout=wlog,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + 60
        while not all((work / f"n{i}" / "cdc").is_dir() for i in range(NODES)):
            if any(w.poll() is not None for w in writers) or time.monotonic() > deadline:
                raise RuntimeError(f"a lag writer did not open its node:\n{_tail(work / 'writer0.log')}")
            time.sleep(0.05)
        ports = [free_port() for _ in range(NODES)]
        configs = [
            write_config(
                work / f"cdcd{i}.toml",
                work / f"n{i}",
                _consumer(server, lake),
                batch_max_delay_ms=200,
                metrics_address=f"127.0.0.1:{ports[i]}",
            )
            for i in range(NODES)
        ]
        daemons = [_start_daemon(c, e) for c, e in zip(configs, errs, strict=True)]
        deadline = time.monotonic() + 120
        while not all(e.exists() and b"daemon_started" in e.read_bytes() for e in errs):
            if any(d.poll() is not None for d in daemons) or time.monotonic() > deadline:
                raise RuntimeError(f"a daemon did not start:\n{_tail(errs[0])}")
            time.sleep(0.05)
        go.touch()
        deadline = time.monotonic() + seconds + DEADLINE_S
        for w in writers:
            if w.wait(max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"lag writer exited {w.returncode}")
        for i, c in enumerate(configs):
            until = caught_up(work / f"n{i}")
            while position(c) != until:
                if daemons[i].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"daemon {i} did not land {until}:\n{_tail(errs[i])}")
                time.sleep(0.1)
        scraped = [_scrape(p) for p in ports]
        _stop(daemons, errs)
        written = sum(json.loads((work / f"w{i}.json").read_text())["written"] for i in range(NODES))
        behind = max(json.loads((work / f"w{i}.json").read_text())["behind_max_ms"] for i in range(NODES))
        ts, lags, newest = _commit_lags(server, lake)
    finally:
        for p in [*writers, *daemons]:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)
    if len(ts) != written:
        raise AssertionError(f"the lake holds {len(ts):,} rows, the writers wrote {written:,}")
    cutoff = min(ts) + int(drop_s * 1000)
    kept = sorted(lag for t, lag in zip(ts, lags, strict=True) if t >= cutoff)
    if not kept:
        raise AssertionError("no rows after the start-up window")
    extra = {
        "p50_ms": _percentile(kept, 50),
        "p99_ms": _percentile(kept, 99),
        "max_ms": float(kept[-1]),
        "mean_ms": round(statistics.fmean(kept), 1),
        "written": written,
        "commits": len(newest),
        "rows_per_commit": round(len(ts) / len(newest)) if newest else 0,
        "newest_row_p50_ms": _percentile(sorted(newest), 50) if newest else None,
        "newest_row_p99_ms": _percentile(sorted(newest), 99) if newest else None,
        "writer_behind_max_ms": behind,
        **_daemon_totals(scraped),
        "loadavg": list(os.getloadavg()),
    }
    return Measurement(len(kept), (max(ts) - cutoff) / 1000, extra, value=extra["p99_ms"])


def _scrape(port: int) -> dict[str, float]:
    """The daemon's Prometheus metrics (samples without labels summed by name)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _daemon_totals(scraped: list[dict[str, float]]) -> dict[str, Any]:
    """Where a batch's time went, over the three daemons: the sink's on_events (files + commit), its
    file writing alone, and ``cdcd_lake_log_conflicts_total`` (batches filtered again after another
    writer moved their source's mark; a lost version race that only re-commits is not counted)."""

    def total(name: str) -> float:
        return sum(m.get(name, 0.0) for m in scraped)

    calls = total("cdcd_daemon_consumer_call_seconds_count")
    writes = total("cdcd_lake_spark_write_seconds_count")
    return {
        "batches": int(calls),
        "on_events_ms_mean": round(total("cdcd_daemon_consumer_call_seconds_sum") / calls * 1e3, 1) if calls else None,
        "file_write_ms_mean": round(total("cdcd_lake_spark_write_seconds_sum") / writes * 1e3, 1) if writes else None,
        "commit_conflicts": int(total("cdcd_lake_log_conflicts_total")),
    }


# --- lake.cluster.backlog -------------------------------------------------------------------------------
class Backlogs:
    """``NODES`` node dirs, each with its own node id and an archive of ``entries`` entries."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.entries = 0

    def ensure(self, entries: int) -> None:
        STORE.ensure()
        if self.root is not None and self.entries == entries:
            return
        self.cleanup()
        atexit.register(self.cleanup)
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-cluster-backlog-", dir=_bench_dir()))
        for i in range(NODES):
            node = Node.open(
                self.root / f"n{i}",
                wal_mode="background",
                wal_segment_size_bytes=SEGMENT_BYTES,
                wal_force_archive_timeout_ms=0,
                archive_max_bytes=0,
            )
            try:
                put_all = node.cache("bench").put_all
                for start in range(0, entries, TX_SIZE):
                    put_all({k: lake_value(k) for k in range(start, start + TX_SIZE)})
                node.force_archive()
            finally:
                node.close()
        self.entries = entries

    def copy(self, i: int, to: Path) -> Path:
        """A fresh copy of node ``i`` (its CDC links as files: the daemon deletes them as it goes)."""
        assert self.root is not None
        shutil.copytree(self.root / f"n{i}", to)
        return to

    def cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            self.entries = 0


BACKLOGS = Backlogs()


def _land(
    nodes: list[int], lake: str, work: Path, consumer: dict[str, Any] | None = None
) -> tuple[float, list[float], float]:
    """Daemons for copies of ``nodes`` started at once into ``lake``: (seconds to the last caught up,
    each's, seconds until the last daemon had started: its sink, Spark session included)."""
    assert BACKLOGS.root is not None
    server = STORE.ensure()
    dirs = [BACKLOGS.copy(i, work / f"n{i}") for i in nodes]
    configs = [
        write_config(
            work / f"cdcd{i}.toml",
            d,
            {**_consumer(server, lake), **(consumer or {})},
            batch_max_events=BACKLOG_BATCH_EVENTS,
            batch_max_bytes=1 << 30,
        )
        for i, d in zip(nodes, dirs, strict=True)
    ]
    errs = [work / f"daemon{i}.err" for i in nodes]
    until = [caught_up(d) for d in dirs]
    t0 = time.perf_counter()
    daemons = [_start_daemon(c, e) for c, e in zip(configs, errs, strict=True)]
    done: list[float | None] = [None] * len(nodes)
    started: list[float | None] = [None] * len(nodes)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while None in done:
            for k, c in enumerate(configs):
                if started[k] is None and errs[k].exists() and b"daemon_started" in errs[k].read_bytes():
                    started[k] = time.perf_counter() - t0
                if done[k] is None and position(c) == until[k]:
                    done[k] = time.perf_counter() - t0
                if daemons[k].poll() is not None and done[k] is None:
                    raise RuntimeError(f"daemon {k} exited {daemons[k].returncode}:\n{_tail(errs[k])}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"backlogs not landed in {DEADLINE_S:.0f} s")
            time.sleep(0.05)
        _stop(daemons, errs)
    finally:
        for p in daemons:
            if p.poll() is None:
                p.kill()
                p.wait()
    each = [float(s) for s in done if s is not None]
    return max(each), each, max(float(s) for s in started if s is not None)


def _lake_rows(lake: str) -> int:
    from deltalake import DeltaTable

    loc = _location(STORE.ensure(), lake)
    dt = DeltaTable(loc.uri("changes"), storage_options=loc.delta_options)
    return int(dt.to_pyarrow_dataset().count_rows())


def run_backlog() -> Measurement:
    entries = BACKLOGS.entries
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-cluster-land-", dir=_bench_dir()))
    try:
        stamp = time.monotonic_ns()
        one_lake, three_lake = f"s3://bench/one-{stamp}", f"s3://bench/three-{stamp}"
        (work / "one").mkdir()
        (work / "three").mkdir()
        one_s, _, _ = _land([0], one_lake, work / "one")
        three_s, each, _ = _land(list(range(NODES)), three_lake, work / "three")
        rows_one, rows_three = _lake_rows(one_lake), _lake_rows(three_lake)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if rows_one != entries or rows_three != NODES * entries:
        raise AssertionError(
            f"lakes hold {rows_one:,} and {rows_three:,} rows, expected {entries:,} and {NODES * entries:,}"
        )
    one_rate = entries / one_s
    three_rate = NODES * entries / three_s
    extra = {
        "one_node_rows_s": round(one_rate),
        "one_node_s": round(one_s, 1),
        "three_nodes_s": round(three_s, 1),
        "each_node_s": [round(s, 1) for s in each],
        "scaling": round(three_rate / one_rate, 2),
        "loadavg": list(os.getloadavg()),
    }
    return Measurement(NODES * entries, three_s, extra)


class Cluster:
    """A Spark standalone master and two one-core workers (started in setup, stopped in teardown)."""

    def __init__(self) -> None:
        self.work: Path | None = None
        self.cluster: SparkStandalone | None = None

    def setup(self) -> None:
        if self.cluster is None:
            atexit.register(self.cleanup)
            self.work = Path(tempfile.mkdtemp(prefix="cdcd-bench-spark-", dir=_bench_dir()))
            self.cluster = SparkStandalone(self.work, workers=2, cores_per_worker=1, memory="1g")
            self.cluster.start()

    def cleanup(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None


CLUSTER = Cluster()
SPARK_WRITER_CONF = {"spark.cores.max": "2", "spark.executor.cores": "1", "spark.executor.memory": "512m"}


def run_backlog_spark() -> Measurement:
    """One node's backlog with ``writer = "spark"`` on the standalone cluster (its tasks write the files)."""
    assert CLUSTER.cluster is not None
    entries = BACKLOGS.entries
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-cluster-spark-", dir=_bench_dir()))
    spark = {"writer": "spark", "spark_master": CLUSTER.cluster.master_url, "spark_conf": SPARK_WRITER_CONF}
    try:
        lake = f"s3://bench/spark-{time.monotonic_ns()}"
        total_s, _, start_s = _land([0], lake, work, spark)
        rows = _lake_rows(lake)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if rows != entries:
        raise AssertionError(f"the lake holds {rows:,} rows, expected {entries:,}")
    extra = {
        "start_s": round(start_s, 1),
        "after_start_rows_s": round(entries / (total_s - start_s)),
        "loadavg": list(os.getloadavg()),
    }
    return Measurement(entries, total_s, extra)


def _teardown() -> None:
    CLUSTER.cleanup()
    BACKLOGS.cleanup()
    STORE.cleanup()


def benchmarks(quick: bool) -> list[Bench]:
    entries = 200_000 if quick else 1_000_000
    seconds, drop_s = (8.0, 3.0) if quick else (20.0, 5.0)

    def spark_setup() -> None:
        BACKLOGS.ensure(entries)
        CLUSTER.setup()

    return [
        Bench(
            name="lake.cluster.lag",
            description=(
                f"lake lag, {NODES} nodes x {LAG_RATE} entries/s live into one lake on MinIO "
                f"(3 daemons, writer = deltalake), {seconds:.0f}s"
            ),
            run_once=lambda: run_lag(seconds=seconds, drop_s=drop_s, rate=LAG_RATE),
            metric="p99",
            unit="ms",
            goal=LAG_GOAL_MS,
            lower_is_better=True,
            setup=STORE.setup,
            max_repeats=1,
            more=(Metric("p50", "p50_ms", "ms"), Metric("max", "max_ms", "ms")),
            params={
                "nodes": NODES,
                "rate_per_node": LAG_RATE,
                "seconds": seconds,
                "dropped_s": drop_s,
                "wal_force_archive_timeout_ms": 1000,
                "batch_max_delay_ms": 200,
                "store": "MinIO, loopback",
            },
        ),
        Bench(
            name="lake.cluster.backlog",
            description=(
                f"{NODES} x {entries // 1000}k-entry backlogs landed concurrently into one lake on MinIO "
                "(3 daemons, writer = deltalake); one node alone in the same run"
            ),
            run_once=run_backlog,
            unit="rows/s",
            setup=lambda: BACKLOGS.ensure(entries),
            max_repeats=1,
            more=(Metric("one_node", "one_node_rows_s", "rows/s"), Metric("scaling_1_to_3", "scaling", "x")),
            params={
                "nodes": NODES,
                "entries_per_node": entries,
                "writer": "deltalake",
                "batch_max_events": BACKLOG_BATCH_EVENTS,
                "tx_size": TX_SIZE,
                "wal_segment_size_bytes": SEGMENT_BYTES,
                "store": "MinIO, loopback",
            },
        ),
        Bench(
            name="lake.cluster.backlog.spark",
            description=(
                f"one node's {entries // 1000}k-entry backlog into the lake on MinIO with writer = spark on a "
                "Spark standalone cluster (2 workers x 1 core; the tasks write the files)"
            ),
            run_once=run_backlog_spark,
            unit="rows/s",
            setup=spark_setup,
            teardown=_teardown,
            max_repeats=1,
            more=(Metric("after_start", "after_start_rows_s", "rows/s"), Metric("start", "start_s", "s")),
            params={
                "entries": entries,
                "writer": "spark",
                "spark_conf": SPARK_WRITER_CONF,
                "batch_max_events": BACKLOG_BATCH_EVENTS,
                "store": "MinIO, loopback",
            },
        ),
    ]
