"""cdcd -> Kafka side by side with Debezium's PostgreSQL connector (Debezium Server) -> Kafka: same
machine, same run, same broker.

``python -m tests.bench.bench_debezium [--quick] [--repeats N] [--only backlog,live,to_node]
[--warmup-rows N] [--rows N] [--keep] [--tuned-producer K=V,...]`` (``make bench-kafka``;
``scripts/ensure-debezium.sh`` fetches Debezium Server into var/debezium). Writes
``tests/bench/results/bench-kafka-<UTC timestamp>.json`` and ``bench-kafka-latest.json`` and prints one table.
Every run records the 1-minute load average (the machine may be shared).

One local Apache Kafka broker (``tests.support.kafka.Broker``, 127.0.0.1) with the Kafka distribution's own JVM
and thread settings (``scripts/kafka.sh --profile standard``: the test suite's quick-start broker, without the C2
JIT and with two request threads, held back Debezium's many small produce requests: 1,878 against 2,557 rows/s
with its defaults). Every topic is
created before its run with 16 partitions. Rows: 8-byte integer keys, 100-byte values, on both sides.

PostgreSQL: ``tests.support.pg_cluster`` (as ``bench_pg``: ``wal_level=logical``, fsync and
synchronous_commit on), here also listening on 127.0.0.1 (a free port, ``trust``: the JDBC driver
Debezium uses has no unix sockets). Debezium Server 2.7 (see ``scripts/ensure-debezium.sh``):
PostgreSQL connector with ``pgoutput``, a publication of the one table, ``snapshot.mode=no_data``
on a slot made before the rows (the backlog is what the slot holds), JSON key and value without
embedded schemas (as cdcd's default), HTTP on 127.0.0.1 only, ``poll.interval.ms=10`` (default 500:
an idle connector would sleep that long before it looks for new changes, which only adds lag; the
backlog is unaffected). Two configurations of it, each in its own runs:

- ``debezium`` -- everything else its default: the connector's queue (``max.batch.size`` 2048,
  ``max.queue.size`` 8192), Kafka's producer defaults (Kafka 3.7's client: ``linger.ms`` 0, 16 KiB
  batches, no compression, ``acks=all`` with idempotence), the JVM's defaults.
- ``debezium_tuned`` -- ``DEBEZIUM_TUNED`` and ``DEBEZIUM_TUNED_JVM``: as Debezium's documentation
  advises for throughput, larger connector batches with a queue well above them, offsets flushed once a
  minute, a fixed 2 GiB heap with the throughput collector. The producer keeps Kafka's batching
  defaults: with ``linger.ms`` and larger batches, as Kafka's documentation advises, Debezium Server
  2.7's producer stopped delivering in this rig (``DEBEZIUM_TUNED`` says what was tried). ``acks=all``
  and idempotence stay: cdcd's producer has both (and transactions).

Debezium's Kafka sink is at-least-once; cdcd's sink is exactly once (Kafka transactions carrying its
position), so cdcd does more work per batch.

``backlog`` -- 1.1M rows (160k with ``--quick``) in 1000-row transactions, already written, delivered
  into Kafka by each of the three (Debezium with its defaults, Debezium tuned, cdcd), the order rotated
  from repeat to repeat. PostgreSQL: one psql session of 1000-row ``INSERT``s into ``kv (k bigint primary
  key, v text)`` after a template slot was made; each run copies the template slot and starts Debezium
  Server on it. cdcd: ``Node.open`` + ``put_all`` of 1000 keys per transaction, archived; each run
  links the archive into the CDC dir again and starts ``cdcd run`` (a subprocess, like Debezium
  Server) with ``[consumer] kind = "kafka"``. Rows counted from here every 50 ms (Debezium: the topic's
  end offsets; cdcd: its sent-events metric, counted after each Kafka commit; a transactional topic's end
  offsets also count commit markers).
  Steady state: the first 100k rows (60k with ``--quick``; ``--warmup-rows``) warm each process up (a
  fresh JVM interprets, then compiles its hot paths); the window runs from the first count at or past
  them to the count that reaches every row, and its rate is the rows counted between the two over the
  time between them (at least the 1M measured rows, ``--rows``). Its CPU per row: the process's
  user+system time from /proc over the window, and for Debezium also PostgreSQL's walsender serving the
  slot (logical decoding, which cdcd does inside its own process).
  Whole run: rows / (last row in Kafka - first row in Kafka); ``wall_s`` adds process start (JVM/Quarkus
  for Debezium, Python for cdcd); ``cpu_s`` the process's CPU time, start included.

``live`` -- 500 transactions/s of 10 rows (5k rows/s) for 20 s (5 s with ``--quick``) after 5 s
  of warm-up (excluded: a fresh JVM compiles its hot paths first), open loop from one thread
  (transaction g starts at t0 + g/500 s). Lag per transaction = time its last row is read from
  the topic by a consumer in this process (assigned to every partition, ``fetch.wait.max.ms=5``,
  read_committed) - time its commit call returned.
  PostgreSQL: psycopg, autocommit, one 10-row ``INSERT`` per transaction, Debezium Server streaming.
  cdcd realtime: ``Node.open(wal_mode="fsync", wal_flush_interval_ms=2, realtime_cdc=True,
  cdc_enabled=False)`` with the kafka sink as the realtime consumer (in the node process).
  cdcd archive: the node with realtime off and ``wal_force_archive_timeout_ms=1000`` and a
  ``cdcd run`` subprocess following its CDC dir (lag bounded by the roll, by design).

``to_node`` -- ``cdcd kafka-to-node`` (2 threads) applies the cdcd backlog topic to a fresh node
  process through its replication endpoint (process start included).

``live`` runs Debezium with its defaults (poll interval aside): the tuned configuration trades latency
for batch size.

Goals (medians of the same run): cdcd's steady-state backlog rate >= 3x tuned Debezium's (the claim; the
ratio against the defaults is reported beside it); cdcd realtime p99 < Debezium's p99.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from prometheus_client.parser import text_string_to_metric_families

from cdcd.node import Node
from cdcd.realtime import RealtimeMode
from cdcd.wal.segment import list_segments
from tests.support.bench import _child_env, _tail
from tests.support.cpu import cpu_s
from tests.support.kafka import LIBS, ROOT, Broker, apply_topic_to_node
from tests.support.pg_cluster import PgCluster, ensure_postgres
from tests.support.ports import free_port

DEBEZIUM = ROOT / "var" / "debezium" / "debezium-server"
RESULTS = ROOT / "tests" / "bench" / "results"
PARTITIONS = 16
TX_ROWS = 1000
WARMUP_ROWS = 100_000
"""Backlog rows a process delivers before the steady-state window opens (JIT, caches, first batches)."""
MEASURED_ROWS = 1_000_000
"""Backlog rows in the steady-state window, after the warm-up rows."""
QUICK_WARMUP_ROWS, QUICK_MEASURED_ROWS = 60_000, 100_000
"""``--quick``: the warm-up is more than one of cdcd's batches (``batch_max_events`` 50k), so that its window
starts at a later commit than its first."""

DEBEZIUM_TUNED: dict[str, str] = {
    # The connector's queue: the PostgreSQL connector's reader fills it, the engine hands the sink up to
    # max.batch.size records per call, and Debezium Server's Kafka sink waits for every record of a call to
    # be acknowledged before it takes the next. Larger calls amortise that wait (the docs' throughput
    # advice: raise max.batch.size, with max.queue.size well above it so the reader never stalls).
    "debezium.source.max.batch.size": "16384",  # default 2048
    "debezium.source.max.queue.size": "65536",  # default 8192
    # Offsets are flushed to a file; once a minute instead of once a second (a restart may resend more,
    # which at-least-once allows anyway).
    "debezium.source.offset.flush.interval.ms": "60000",
    # The producer keeps Kafka's batching (linger.ms 0, 16 KiB batches, no compression): with linger.ms 5
    # or 10 and 64 or 512 KiB batches (lz4 or none), as Kafka's docs advise for throughput, Debezium
    # Server 2.7's producer (Kafka client 3.7) stopped delivering in this rig after about 10k records, the
    # sink waiting for acknowledgements (three quick runs with the test broker, one with the standard one;
    # --tuned-producer tries such settings again). acks=all and idempotence are Kafka's defaults
    # and stay: cdcd's transactional producer has both.
    "debezium.sink.kafka.producer.acks": "all",
    "debezium.sink.kafka.producer.enable.idempotence": "true",
}
"""Debezium Server tuned for throughput (the ``debezium_tuned`` runs). JSON without embedded schemas and
``poll.interval.ms=10`` are in both configurations (``DebeziumSide._start``)."""
DEBEZIUM_TUNED_JVM = ["-Xms2g", "-Xmx2g", "-XX:+UseParallelGC"]
"""A fixed 2 GiB heap (no resizing; the queue holds 64k records) and the throughput collector, as the JVM's GC
tuning guide advises for batch throughput. The default runs leave the JVM at its defaults (G1, a quarter of RAM)."""
LIVE_TX_ROWS = 10
LIVE_TX_PER_S = 500
WARMUP_S = 5.0
FORCE_ARCHIVE_MS = 1000
DRAIN_TIMEOUT_S = 120
POLL_S = 0.05
STALL_S = 180.0
"""A backlog run whose count stops moving this long (once rows flow) fails, naming where it stopped."""
VALUE = "v" * 100
"""The value of every row on both sides: 100 characters of text (a PostgreSQL `text`, a cdcd `str`)."""

Sample = dict[str, Any]


def _log(msg: str) -> None:
    print(f"[{dt.datetime.now(dt.UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _pct(values: list[float], q: float) -> float:
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


class Kafka:
    def __init__(self, broker: Broker) -> None:
        self.bootstrap = broker.bootstrap
        self.admin = AdminClient({"bootstrap.servers": self.bootstrap})
        self.probe = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "bench-probe"})

    def create(self, topic: str) -> None:
        fs = self.admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
        fs[topic].result(60)
        deadline = time.monotonic() + 60
        while True:  # until every partition has a leader that answers
            try:
                self.end_offsets(topic)
                return
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def end_offsets(self, topic: str) -> int:
        return sum(
            self.probe.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
            for p in range(PARTITIONS)
        )

    def close(self) -> None:
        self.probe.close()


class Arrivals(threading.Thread):
    """Reads ``topic`` from the start; notes when each live transaction's last row arrived."""

    def __init__(self, bootstrap: str, topic: str, tx_of: Callable[[bytes], int]) -> None:
        super().__init__(daemon=True)
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"arrivals-{topic}",
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 5,
                "enable.auto.commit": False,
            }
        )
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        self.tx_of = tx_of
        self.rows: dict[int, int] = {}
        self.last_ns: dict[int, int] = {}
        self.count = 0
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                for m in self.consumer.consume(1000, 0.05):
                    if m.error() is not None or m.value() is None:
                        continue
                    now = time.time_ns()
                    g = self.tx_of(m.key() or b"")
                    self.rows[g] = self.rows.get(g, 0) + 1
                    self.last_ns[g] = now
                    self.count += 1
        except BaseException as e:  # reported by the caller
            self.error = e
        finally:
            self.consumer.close()

    def complete(self) -> dict[int, int]:
        return {g: t for g, t in self.last_ns.items() if self.rows[g] >= LIVE_TX_ROWS}


def _pace(commit: Callable[[int], None], seconds: float) -> tuple[list[int], int, float]:
    """``commit(g)`` at ``t0 + g / LIVE_TX_PER_S``; returns commit-return times, t0 (wall ns), late max ms."""
    n_tx = int(seconds * LIVE_TX_PER_S)
    commit_ns = [0] * n_tx
    interval_ns = 1e9 / LIVE_TX_PER_S
    t0 = time.perf_counter_ns() + 20_000_000
    start_wall = time.time_ns() + (t0 - time.perf_counter_ns())
    late_max = 0
    for g in range(n_tx):
        ahead = t0 + int(g * interval_ns) - time.perf_counter_ns()
        if ahead > 0:
            time.sleep(ahead / 1e9)
        else:
            late_max = max(late_max, -ahead)
        commit(g)
        commit_ns[g] = time.time_ns()
    return commit_ns, start_wall, round(late_max / 1e6, 1)


def _live_lags(commit: Callable[[int], None], arrivals: Arrivals, seconds: float) -> Sample:
    commit_ns, start_wall, late_max_ms = _pace(commit, WARMUP_S + seconds)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    want = len(commit_ns)
    while len(arrivals.complete()) < want and time.monotonic() < deadline:
        if arrivals.error is not None:
            raise arrivals.error
        time.sleep(0.05)
    arrivals.halt.set()
    arrivals.join(30)
    got = arrivals.complete()
    lo = start_wall + int(WARMUP_S * 1e9)
    window = [g for g, t in enumerate(commit_ns) if t >= lo]
    missing = [g for g in window if g not in got]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(window)} transactions never arrived (first: {missing[0]})")
    lags = sorted((got[g] - commit_ns[g]) / 1e6 for g in window)
    return {
        "p50_ms": round(_pct(lags, 50), 2),
        "p99_ms": round(_pct(lags, 99), 2),
        "max_ms": round(lags[-1], 2),
        "mean_ms": round(statistics.fmean(lags), 2),
        "transactions": len(window),
        "rows_per_s": round(len(window) * LIVE_TX_ROWS / seconds),
        "driver_late_max_ms": late_max_ms,
    }


def _node_live_lags(node: Node, arrivals: Arrivals, seconds: float) -> Sample:
    """``_live_lags`` of ``LIVE_TX_ROWS``-row transactions put into ``node``'s cache ``kv``."""
    arrivals.start()
    put_all = node.cache("kv").put_all

    def commit(g: int) -> None:
        put_all({k: VALUE for k in range(g * LIVE_TX_ROWS, (g + 1) * LIVE_TX_ROWS)})

    return _live_lags(commit, arrivals, seconds)


class Mark(NamedTuple):
    t: float
    """perf_counter when the count was read."""
    rows: int
    cpu: dict[str, float]


def _watch_steady(
    count: Callable[[], float],
    warmup: int,
    total: int,
    cpu: Callable[[], dict[str, float]],
    proc: subprocess.Popen[bytes],
    log: Path,
    timeout_s: float,
    first: Callable[[], bool] | None = None,
) -> tuple[float, Mark, Mark]:
    """Polls ``count()`` every POLL_S: the time the first row is in, then a mark (time, rows counted, CPU
    seconds of the processes ``cpu()`` reads) at the first read at or past ``warmup`` rows and at ``total``.
    The steady-state window runs from mark to mark: the rows are the counts read, not the thresholds (cdcd
    counts a whole Kafka transaction at once). ``first()``: whether the first row is in, when ``count()``
    says so late."""
    t_first: float | None = None
    warm: Mark | None = None
    deadline = time.monotonic() + timeout_s
    last_n, moved = -1, time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.pid} exited {proc.returncode}:\n{_tail(log, 15)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done after {timeout_s:.0f} s:\n{_tail(log, 15)}")
        now, n = time.perf_counter(), int(count())
        if n != last_n:
            last_n, moved = n, time.monotonic()
        elif n > 0 and time.monotonic() - moved > STALL_S:
            raise TimeoutError(f"stalled: {n:,} of {total:,} rows, none more for {STALL_S:.0f} s:\n{_tail(log, 15)}")
        if t_first is None and (first() if first is not None else n > 0):
            t_first = now
        if t_first is not None and warm is None and n >= warmup:
            warm = Mark(now, n, cpu())
        if t_first is not None and warm is not None and n >= total:
            return t_first, warm, Mark(now, n, cpu())
        time.sleep(POLL_S)


def _backlog_sample(rows: int, t0: float, t_first: float, warm: Mark, done: Mark, messages: int) -> Sample:
    """The whole run (first row to last, process start included in ``wall_s``) and its steady state."""
    steady_rows, steady_s = done.rows - warm.rows, done.t - warm.t
    sample: Sample = {
        "rows_per_s": round(rows / (done.t - t_first)),
        "seconds": round(done.t - t_first, 2),
        "wall_s": round(done.t - t0, 2),
        "cpu_s": round(done.cpu["process"], 2),
        "messages": messages,
        "steady_rows": steady_rows,
        "steady_s": round(steady_s, 2),
        "steady_rows_per_s": round(steady_rows / steady_s) if steady_s > 0 else None,
    }
    for name in done.cpu:
        sample[f"steady_{name}_cpu_us_per_row"] = (
            round((done.cpu[name] - warm.cpu[name]) / steady_rows * 1e6, 1) if steady_rows else None
        )
    return sample


# --- Debezium ------------------------------------------------------------------------------------------
class DebeziumSide:
    def __init__(self, work: Path, kafka: Kafka, pg: PgCluster, pg_port: int) -> None:
        self.work = work
        self.kafka = kafka
        self.pg = pg
        self.pg_port = pg_port
        self.runs = 0
        self.rows = 0

    def load_backlog(self, rows: int) -> None:
        pg = self.pg
        pg.sql("CREATE TABLE kv (k bigint PRIMARY KEY, v text)")
        pg.sql("CREATE PUBLICATION dbz_kv FOR TABLE kv")
        pg.sql("SELECT pg_create_logical_replication_slot('tmpl', 'pgoutput')")
        script = self.work / "load.sql"
        with script.open("w") as f:
            for start in range(0, rows, TX_ROWS):
                vals = ",".join(f"({k},'{VALUE}')" for k in range(start, min(start + TX_ROWS, rows)))
                f.write(f"INSERT INTO kv (k, v) VALUES {vals};\n")
        subprocess.run(pg.psql_cmd("-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", str(script)), check=True)
        script.unlink()
        pg.sql("CHECKPOINT")
        self.rows = rows

    def _start(
        self, prefix: str, slot: str, publication: str, table: str, tuned: bool = False
    ) -> tuple[subprocess.Popen[bytes], Path]:
        self.runs += 1
        run_dir = self.work / f"dbz-{self.runs}"
        conf = run_dir / "conf"
        conf.mkdir(parents=True)
        props = {
            "debezium.sink.type": "kafka",
            "debezium.sink.kafka.producer.bootstrap.servers": self.kafka.bootstrap,
            "debezium.sink.kafka.producer.key.serializer": "org.apache.kafka.common.serialization.StringSerializer",
            "debezium.sink.kafka.producer.value.serializer": "org.apache.kafka.common.serialization.StringSerializer",
            "debezium.source.connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "debezium.source.offset.storage.file.filename": str(run_dir / "offsets.dat"),
            "debezium.source.offset.flush.interval.ms": "1000",
            "debezium.source.database.hostname": "127.0.0.1",
            "debezium.source.database.port": str(self.pg_port),
            "debezium.source.database.user": "postgres",
            "debezium.source.database.password": "unused-trust-auth",
            "debezium.source.database.dbname": "postgres",
            "debezium.source.topic.prefix": prefix,
            "debezium.source.table.include.list": f"public.{table}",
            "debezium.source.plugin.name": "pgoutput",
            "debezium.source.slot.name": slot,
            "debezium.source.publication.name": publication,
            "debezium.source.publication.autocreate.mode": "disabled",
            "debezium.source.snapshot.mode": "no_data",
            "debezium.source.poll.interval.ms": "10",
            "debezium.format.key": "json",
            "debezium.format.value": "json",
            "debezium.format.key.schemas.enable": "false",
            "debezium.format.value.schemas.enable": "false",
            "quarkus.http.host": "127.0.0.1",
            "quarkus.http.port": str(free_port()),
            "quarkus.log.level": "INFO",
            **(DEBEZIUM_TUNED if tuned else {}),
        }
        (conf / "application.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        runner = next(DEBEZIUM.glob("debezium-server-dist-*-runner.jar"))
        classpath = os.pathsep.join([str(runner), str(conf), str(DEBEZIUM / "lib" / "*")])
        log = run_dir / "debezium.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["java", *(DEBEZIUM_TUNED_JVM if tuned else []), "-cp", classpath, "io.debezium.server.Main"],
                cwd=run_dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return proc, log

    def backlog(self, warmup: int, tuned: bool = False) -> Sample:
        """The backlog from a copy of the template slot; the steady state after ``warmup`` rows. Besides
        Debezium's process, the CPU of PostgreSQL's walsender serving its slot (logical decoding runs there)."""
        slot, prefix = f"dbz_{self.runs + 1}", f"dbz{self.runs + 1}"
        self.pg.sql(f"SELECT pg_copy_logical_replication_slot('tmpl', '{slot}')")
        topic = f"{prefix}.public.kv"
        self.kafka.create(topic)
        rows = self.rows
        walsender: list[int] = []
        t0 = time.perf_counter()
        proc, log = self._start(prefix, slot, "dbz_kv", "kv", tuned=tuned)

        def in_topic() -> int:
            n = self.kafka.end_offsets(topic)
            if n and not walsender:  # Debezium streams from the slot now
                walsender.append(
                    int(self.pg.sql(f"SELECT active_pid FROM pg_replication_slots WHERE slot_name = '{slot}'"))
                )
            return n

        def cpu() -> dict[str, float]:
            return {"process": cpu_s(proc.pid), "walsender": cpu_s(walsender[0])}

        try:
            t_first, warm, done = _watch_steady(in_topic, warmup, rows, cpu, proc, log, DRAIN_TIMEOUT_S * 10)
        finally:
            _stop(proc)
            self.pg.sql(f"SELECT pg_drop_replication_slot('{slot}')")
        return _backlog_sample(rows, t0, t_first, warm, done, self.kafka.end_offsets(topic))

    def live(self, seconds: float) -> Sample:
        n = self.runs + 1
        table, slot, pub, prefix = f"live{n}", f"dbzlive_{n}", f"dbz_live{n}", f"dbzlive{n}"
        pg = self.pg
        pg.sql(f"CREATE TABLE {table} (k bigint PRIMARY KEY, v text)")
        pg.sql(f"CREATE PUBLICATION {pub} FOR TABLE {table}")
        pg.sql(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
        topic = f"{prefix}.public.{table}"
        self.kafka.create(topic)
        import psycopg

        arrivals = Arrivals(self.kafka.bootstrap, topic, lambda key: int(json.loads(key)["k"]) // LIVE_TX_ROWS)
        proc, log = self._start(prefix, slot, pub, table)
        try:
            deadline = time.monotonic() + 120
            while pg.sql(f"SELECT active FROM pg_replication_slots WHERE slot_name = '{slot}'").strip() != "t":
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Debezium Server did not start streaming:\n{_tail(log, 15)}")
                time.sleep(0.1)
            arrivals.start()
            stmt = f"INSERT INTO {table} (k, v) VALUES " + ",".join(["(%s, %s)"] * LIVE_TX_ROWS)
            with psycopg.connect(pg.conninfo(), autocommit=True) as conn:
                cur = conn.cursor()

                def commit(g: int) -> None:
                    args: list[Any] = []
                    for k in range(g * LIVE_TX_ROWS, (g + 1) * LIVE_TX_ROWS):
                        args += (k, VALUE)
                    cur.execute(stmt, args, prepare=True)

                return _live_lags(commit, arrivals, seconds)
        finally:
            arrivals.halt.set()
            _stop(proc)
            pg.sql(f"SELECT pg_drop_replication_slot('{slot}')")


# --- cdcd ----------------------------------------------------------------------------------------------
def _metric(port: int, names: tuple[str, ...]) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name in names)


def _toml(v: Any) -> str:
    return json.dumps(v)


class CdcdSide:
    def __init__(self, work: Path, kafka: Kafka) -> None:
        self.work = work
        self.kafka = kafka
        self.runs = 0
        self.rows = 0
        self.node_dir = work / "cdcd-node"
        self.last_topic = ""

    def load_backlog(self, rows: int) -> None:
        with Node.open(
            self.node_dir,
            wal_segment_size_bytes=64 << 20,
            wal_force_archive_timeout_ms=0,
            archive_max_bytes=0,
            partitions=1024,
        ) as node:
            put_all = node.cache("kv").put_all
            for start in range(0, rows, TX_ROWS):
                put_all({k: VALUE for k in range(start, min(start + TX_ROWS, rows))})
            node.force_archive()
        self.rows = rows

    def _sink(self, topic: str) -> dict[str, Any]:
        return {
            "kind": "kafka",
            "bootstrap_servers": self.kafka.bootstrap,
            "topic": topic,
            "offsets_topic": f"{topic}.offsets",  # each run starts with nothing stored
            "metadata_topic": f"{topic}.metadata",
            "topic_partitions": PARTITIONS,
        }

    def _daemon(self, node_dir: Path, topic: str, metrics_port: int) -> tuple[subprocess.Popen[bytes], Path]:
        config = self.work / f"cdcd-{self.runs}.toml"
        lines = [
            f"node_dir = {_toml(str(node_dir))}",
            f'metrics_address = "127.0.0.1:{metrics_port}"',
            'log_format = "json"',
            "[consumer]",
        ]
        lines += [f"{k} = {_toml(v)}" for k, v in self._sink(topic).items()]
        config.write_text("\n".join(lines) + "\n")
        log = self.work / f"cdcd-{self.runs}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cdcd", "run", "--config", str(config)],
                cwd=ROOT,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return proc, log

    def backlog(self, warmup: int) -> Sample:
        cdc = self.node_dir / "cdc"
        present = {p.name for p in cdc.iterdir()}
        for path in list_segments(self.node_dir / "wal" / "archive")[0].values():
            if path.name not in present:
                os.link(path, cdc / path.name)
        shutil.rmtree(self.node_dir / "cdcd-state", ignore_errors=True)
        self.runs += 1
        topic = f"cdcd{self.runs}.kv"
        self.kafka.create(topic)
        rows = self.rows
        port = free_port()
        sent = ("cdcd_kafka_sent_events_total",)
        t0 = time.perf_counter()
        proc, log = self._daemon(self.node_dir, topic, port)
        try:
            # Counted once a Kafka transaction committed; the first row is in when the topic has any.
            t_first, warm, done = _watch_steady(
                lambda: max(0.0, _metric(port, sent)),
                warmup,
                rows,
                lambda: {"process": cpu_s(proc.pid)},
                proc,
                log,
                DRAIN_TIMEOUT_S * 10,
                first=lambda: self.kafka.end_offsets(topic) > 0,
            )
        finally:
            _stop(proc)
        self.last_topic = topic
        return _backlog_sample(rows, t0, t_first, warm, done, self.kafka.end_offsets(topic))

    def _live_topic(self) -> tuple[str, Arrivals]:
        self.runs += 1
        topic = f"cdcdlive{self.runs}.kv"
        self.kafka.create(topic)
        arrivals = Arrivals(self.kafka.bootstrap, topic, lambda key: int(json.loads(key)["key"]) // LIVE_TX_ROWS)
        return topic, arrivals

    def live_realtime(self, seconds: float) -> Sample:
        topic, arrivals = self._live_topic()
        node_dir = self.work / f"live-rt-{self.runs}"
        node = Node.open(
            node_dir,
            wal_mode="fsync",
            wal_flush_interval_ms=2,
            realtime_cdc=True,
            realtime_consumer=self._sink(topic),
            cdc_enabled=False,
        )
        try:
            deadline = time.monotonic() + 60
            while node.realtime.mode is not RealtimeMode.ON:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"realtime mode {node.realtime.mode.value} after 60 s")
                time.sleep(0.01)
            return _node_live_lags(node, arrivals, seconds)
        finally:
            arrivals.halt.set()
            node.close()
            shutil.rmtree(node_dir, ignore_errors=True)

    def live_archive(self, seconds: float) -> Sample:
        topic, arrivals = self._live_topic()
        node_dir = self.work / f"live-archive-{self.runs}"
        node = Node.open(node_dir, wal_mode="fsync", wal_force_archive_timeout_ms=FORCE_ARCHIVE_MS, archive_max_bytes=0)
        proc: subprocess.Popen[bytes] | None = None
        try:
            port = free_port()
            proc, log = self._daemon(node_dir, topic, port)
            deadline = time.monotonic() + 60
            while _metric(port, ()) < 0:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"cdcd run did not start:\n{_tail(log, 15)}")
                time.sleep(0.05)
            return _node_live_lags(node, arrivals, seconds)
        finally:
            arrivals.halt.set()
            _stop(proc)
            node.close()
            shutil.rmtree(node_dir, ignore_errors=True)

    def to_node(self) -> Sample:
        """``cdcd kafka-to-node`` (2 threads) applies the last backlog topic to a fresh node process."""
        self.runs += 1
        work = self.work / f"k2n-{self.runs}"
        seconds = apply_topic_to_node(work, self.kafka.bootstrap, self.last_topic, f"bench-k2n-{self.runs}", self.rows)
        shutil.rmtree(work, ignore_errors=True)
        return {"rows_per_s": round(self.rows / seconds), "seconds": round(seconds, 2)}


# --- the run -------------------------------------------------------------------------------------------
def _median(samples: list[Sample], key: str) -> float:
    return float(statistics.median(s[key] for s in samples))


def _num(x: float) -> str:
    if x >= 10_000:
        return f"{x / 1000:,.1f}k"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


BACKLOG = ("debezium.backlog", "debezium_tuned.backlog", "cdcd.backlog")
LIVE = ("debezium.live", "cdcd.live_realtime", "cdcd.live_archive")
COLUMNS = {
    "debezium": "Debezium Server 2.7, defaults",
    "debezium_tuned": "Debezium Server 2.7, tuned",
    "cdcd": "cdcd (backlog: `cdcd run`; live: realtime)",
    "cdcd_archive": "cdcd archive daemon",
}


def _column(name: str) -> str:
    side = name.partition(".")[0]
    return "cdcd_archive" if name.endswith("archive") else side


def _table(results: dict[str, list[Sample]]) -> str:
    rows = [
        ("steady-state rows/s (after the warm-up)", "steady_rows_per_s", BACKLOG),
        ("steady-state CPU µs/row, the process", "steady_process_cpu_us_per_row", BACKLOG),
        ("steady-state CPU µs/row, PostgreSQL's walsender", "steady_walsender_cpu_us_per_row", BACKLOG),
        ("backlog rows/s (first row to last)", "rows_per_s", BACKLOG),
        ("backlog wall s (incl. start)", "wall_s", BACKLOG),
        ("backlog process CPU s", "cpu_s", BACKLOG),
        ("live lag p50 ms", "p50_ms", LIVE),
        ("live lag p99 ms", "p99_ms", LIVE),
        ("live lag max ms", "max_ms", LIVE),
        ("kafka-to-node rows/s", "rows_per_s", ("cdcd.to_node",)),
    ]
    out = ["| measure | " + " | ".join(COLUMNS.values()) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for label, key, names in rows:
        cells = dict.fromkeys(COLUMNS, "")
        for name in names:
            vals = [s[key] for s in results.get(name, []) if s.get(key) is not None]
            if not vals:
                continue
            txt = _num(statistics.median(vals))
            if len(vals) > 1:
                txt += f" ({_num(min(vals))}-{_num(max(vals))})"
            cells[_column(name)] = txt
        if any(cells.values()):
            out.append(f"| {label} | " + " | ".join(cells.values()) + " |")
    return "\n".join(out)


def _ratios(results: dict[str, list[Sample]]) -> dict[str, Any]:
    """cdcd's steady-state rate against each Debezium configuration; the claim stands against the tuned one."""
    goals: dict[str, Any] = {}
    if not results.get("cdcd.backlog"):
        return goals
    ours = _median(results["cdcd.backlog"], "steady_rows_per_s")
    for peer, key in (
        ("debezium_tuned.backlog", "steady_ratio_vs_tuned"),
        ("debezium.backlog", "steady_ratio_vs_defaults"),
    ):
        if results.get(peer):
            ratio = ours / _median(results[peer], "steady_rows_per_s")
            goals[key] = {"value": round(ratio, 2), "goal": ">= 3", "met": ratio >= 3}
    return goals


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not LIBS.is_dir():
        raise SystemExit(f"{LIBS} missing: run `make install` first")
    if not (DEBEZIUM / "run.sh").exists():
        raise SystemExit(f"{DEBEZIUM} missing: run scripts/ensure-debezium.sh (make bench-kafka does)")
    warmup = args.warmup_rows if args.warmup_rows is not None else QUICK_WARMUP_ROWS if args.quick else WARMUP_ROWS
    measured = args.rows if args.rows is not None else QUICK_MEASURED_ROWS if args.quick else MEASURED_ROWS
    rows = warmup + measured
    live_s = 5.0 if args.quick else 20.0
    only = set(args.only.split(",")) if args.only else {"backlog", "live", "to_node"}
    bin_dir = ensure_postgres(install=True)
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-kafka-"))
    broker = Broker(work / "broker", profile="standard")
    pg_port = free_port()
    pg = PgCluster(bin_dir, port=pg_port)
    pg.settings["listen_addresses"] = "'127.0.0.1'"
    results: dict[str, list[Sample]] = {}
    kafka: Kafka | None = None

    def record(name: str, fn: Callable[[], Sample]) -> None:
        load = _loadavg()
        _log(f"{name} ...")
        sample = fn()
        sample["loadavg_1m"] = load
        _log(f"{name}: {sample}")
        results.setdefault(name, []).append(sample)

    try:
        broker.start()
        pg.start()
        kafka = Kafka(broker)
        dbz = DebeziumSide(work, kafka, pg, pg_port)
        cd = CdcdSide(work, kafka)
        if only & {"backlog", "to_node"}:
            _log(f"loading {rows:,} rows ({warmup:,} warm-up + {measured:,}) into PostgreSQL and into a cdcd node")
            dbz.load_backlog(rows)
            cd.load_backlog(rows)
        for r in range(args.repeats):
            if "backlog" in only or ("to_node" in only and r == 0):
                trio = [
                    ("debezium.backlog", lambda: dbz.backlog(warmup)),
                    ("debezium_tuned.backlog", lambda: dbz.backlog(warmup, tuned=True)),
                    ("cdcd.backlog", lambda: cd.backlog(warmup)),
                ]
                for name, fn in trio[r % 3 :] + trio[: r % 3]:  # each goes first once in three repeats
                    record(name, fn)
            if "live" in only:
                trio = [
                    ("debezium.live", lambda: dbz.live(live_s)),
                    ("cdcd.live_realtime", lambda: cd.live_realtime(live_s)),
                    ("cdcd.live_archive", lambda: cd.live_archive(live_s)),
                ]
                for name, fn in trio if r % 2 == 0 else trio[::-1]:
                    record(name, fn)
            if "to_node" in only:
                record("cdcd.to_node", cd.to_node)
    finally:
        if kafka is not None:
            kafka.close()
        pg.close()
        broker.stop()
        if args.keep:
            _log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    doc: dict[str, Any] = {
        "bench": "bench_kafka_debezium",
        "utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "params": {
            "rows": rows,
            "warmup_rows": warmup,
            "measured_rows": measured,
            "tx_rows": TX_ROWS,
            "value_bytes": 100,
            "topic_partitions": PARTITIONS,
            "live_rows_per_s": LIVE_TX_ROWS * LIVE_TX_PER_S,
            "live_tx_rows": LIVE_TX_ROWS,
            "live_seconds": live_s,
            "repeats": args.repeats,
            "postgres": pg.version,
            "debezium_server": next(DEBEZIUM.glob("debezium-server-dist-*-runner.jar")).name,
            "debezium_tuned": DEBEZIUM_TUNED,
            "debezium_tuned_jvm": DEBEZIUM_TUNED_JVM,
            "broker_profile": broker.profile,
            "cpus": os.cpu_count(),
        },
        "results": results,
    }
    goals = _ratios(results)
    if results.get("debezium.live") and results.get("cdcd.live_realtime"):
        d99 = _median(results["debezium.live"], "p99_ms")
        c99 = _median(results["cdcd.live_realtime"], "p99_ms")
        goals["realtime_p99_below_debezium"] = {"value": [c99, d99], "goal": "cdcd < debezium", "met": c99 < d99}
    doc["goals"] = goals
    doc["table"] = _table(results)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="60k + 100k backlog rows, 5 s of live load")
    ap.add_argument("--warmup-rows", type=int, help=f"backlog rows before the steady state (default {WARMUP_ROWS:,})")
    ap.add_argument("--rows", type=int, help=f"backlog rows measured in the steady state (default {MEASURED_ROWS:,})")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs of every process)")
    ap.add_argument("--only", default="", help="comma list of backlog, live, to_node")
    ap.add_argument(
        "--tuned-producer",
        default="",
        metavar="K=V,...",
        help="Kafka producer settings added to the tuned configuration (e.g. linger.ms=5,batch.size=262144)",
    )
    args = ap.parse_args(argv)
    for item in filter(None, args.tuned_producer.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            ap.error(f"--tuned-producer: {item!r} is not K=V")
        DEBEZIUM_TUNED[f"debezium.sink.kafka.producer.{key.strip()}"] = value.strip()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    doc = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    for name in (f"bench-kafka-{stamp}.json", "bench-kafka-latest.json"):
        (RESULTS / name).write_text(json.dumps(doc, indent=2) + "\n")
    print(doc["table"])
    print(json.dumps(doc["goals"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
