"""cdcd side by side with PostgreSQL logical decoding: same hardware, same run, same workloads.

``python -m tests.bench.bench_pg [--quick] [--only WORKLOAD] [--repeats N]`` (``make bench-pg``).
Installs Debian's PostgreSQL if missing, runs a private cluster in a temp dir (``pg_cluster``:
unix socket only, ``wal_level=logical``, ``fsync=on``, ``synchronous_commit=on``, autovacuum
off, every other setting the default), prints one table and writes
``tests/bench/results/bench-pg-<UTC timestamp>.json`` / ``.png`` and ``bench-pg-latest.json`` /
``.png``. Every measurement is repeated ``--repeats`` times (default 3) with the sides
alternating (PG first in odd repetitions, cdcd first in even ones) and reported as median with
min-max; each run records the 1-minute load average, since the machine may be shared.

Workloads (``--only`` names; rows are 8-byte int keys with 100-byte values on both sides):

``write`` -- 1M rows (100k with ``--quick``) in 1000-row transactions.
  PostgreSQL: one ``psql -X -q -v ON_ERROR_STOP=1 -f load.sql`` session; the script (generated
  before the timer starts) holds one ``INSERT INTO kv (k, v) VALUES (0,'vvv…'),…,(999,'vvv…');``
  per 1000 rows, each its own autocommit transaction, into ``kv (k bigint PRIMARY KEY, v text)``
  created empty just before. Timed: the psql process, start to exit. CPU: the whole cluster
  (postmaster and every child, from /proc, incl. checkpointer and WAL writer) plus psql.
  cdcd: ``Node.open(dir, wal_mode="fsync", archive_max_bytes=0)`` (defaults otherwise: 64 MiB
  segments, 1 s force-archive rolls, checkpoints into LMDB) and one ``cache.put_all`` of a
  1000-key dict per transaction (built in the timed loop, as a caller would); timed from the
  first put to the end of ``node.flush()``; CPU: the whole benchmark process (writer, flusher,
  archiver and checkpointer threads). Opening/closing is untimed; after a PG run an untimed
  ``CHECKPOINT`` keeps its background writes out of the next (cdcd) run.

``catchup.null`` / ``catchup.iterate`` / ``catchup.file`` -- deliver a fully written backlog of the same size.
  PostgreSQL: before the backlog is loaded (as above) a template slot ``tmpl`` is created; each
  run copies it (``pg_copy_logical_replication_slot``, with the plugin of the run) and times
  ``pg_recvlogical --start --endpos <pg_current_wal_lsn() after the load> --no-loop``, which
  exits by itself after the last row: ``-P pgoutput -o proto_version=1 -o
  publication_names=bench_pub -f /dev/null`` (null and iterate) or ``test_decoding`` (default options)
  ``-f out.txt`` (file; pg_recvlogical fsyncs it at the end). CPU: cluster (the walsender) plus
  pg_recvlogical.
  cdcd: the backlog is written as in ``write`` and archived; each run hard-links the archived
  segments into the CDC dir, deletes the daemon state and times an in-process ``Daemon.run()``
  (default ``DaemonConfig``) until its committed position passes the last segment, with the
  ``null`` consumer (never touches an event), ``IterateConsumer`` below (iterates every event and
  decodes its key and value: what a Python consumer does at the least) or the ``jsonl`` consumer
  (default options: fsync per batch) to a file. CPU: the process (timed section only).
  Both sides read their WAL from the page cache (just written).

``catchup.lake`` -- the same backlog into the lake through the default pipeline: PostgreSQL's side is
  ``catchup.null``'s pgoutput run; cdcd's lands it with the lake sink (``writer = "spark"``,
  ``local[2]``, delta-rs commits; batches of ``INGEST_BATCH_EVENTS`` as in ``lake.ingest.run``) into
  a fresh lake per run and checks the row count of the Delta table. The SparkSession is started and
  warmed up once before the first run (``tests/support/lake_bench.py``). CPU: the process plus the
  Spark JVM and its Python workers (which run the writer's tasks); ``jvm_own_cpu_s`` is the JVM's own
  share of that (its JIT compilers among it: a JVM a few jobs old compiles much of what it runs).
  ``autocompact_s``: seconds the sink's small-file rewrites took (the default ``max_files_per_partition`` bound,
  cdcd/lake/maintenance/autocompact.py), from its metric, the last one included; they run in a thread
  of their own beside the next batch, and ``autocompact_wait_s`` is how long the sink's commits waited
  for one. The timed section ends when the last batch is committed and the daemon's position moved
  past it; the rewrite that commit made due may still be running: ``tail_s`` and ``tail_cpu_s`` are
  the wall and daemon CPU seconds of the daemon's close after it (the sink waits for that rewrite),
  not in the rate nor in the CPU per row.

``--lake-option NAME=VALUE``: a ``LakeOptions`` field of ``catchup.lake``'s sink other than its default
(an int, float or bool, as JSON; repeatable), recorded in the results: e.g.
``max_files_per_partition=0`` lands without the small-file rewrites.

``--profile``: after each catch-up workload's runs, one more cdcd run (not in the table) under cProfile
in every thread it starts (one profiler per thread, merged): ``bench-pg-profile-<workload>.prof`` in
the results directory, and its top functions by own time in the log (waits included: a thread blocked
on a queue or a Spark job shows as time in ``acquire``/``get``/``poll``).

``live`` -- 500 transactions/s of 10 rows for 20 s (5 s with ``--quick``) plus a warm-up second
  (excluded), from one Python thread on a fixed open-loop schedule (transaction ``g`` starts at
  ``t0 + g/500`` s; a late one does not delay the schedule). Lag per transaction = time its rows
  reached the consumer - time its commit call returned (``time.time_ns()`` on both ends);
  p50/p99/p99.9/max over the transactions.
  PostgreSQL: psycopg 3 (if importable; else ``--pg-driver psql``, see below), autocommit, one
  prepared ``INSERT … VALUES`` of 10 rows per transaction; a fresh ``test_decoding`` slot
  streamed by ``pg_recvlogical -o include-xids=0 -o include-timestamp=1 -o skip-empty-xacts=1 -f
  -`` (it ``write()``s each message unbuffered) into a pipe read by a thread of this process,
  which notes the time of each transaction's COMMIT line. The lag from the server's own commit
  timestamp (in the COMMIT line, taken just before the commit's WAL flush) is recorded too
  (``server_ts_*``); with ``--pg-driver psql`` (one psql session fed the same statements through
  a pipe, for machines without psycopg) that is the only lag there is, as psql does not tell when
  a statement returned.
  cdcd realtime: ``Node.open(dir, wal_mode="fsync", wal_flush_interval_ms=2, realtime_cdc=True,
  cdc_enabled=False)`` with ``ArrivalConsumer`` below as the realtime consumer (in the node
  process, as realtime CDC is) and ``cache.put_all`` of 10 keys per transaction.
  cdcd archive: the same node with realtime off and ``wal_force_archive_timeout_ms=1000``, and a
  ``cdcd run`` subprocess following its CDC dir with ``ArrivalConsumer`` as a python consumer.

Goals (from the medians of the same run): node write >= 1.0x PostgreSQL's INSERT rate; catch-up
to null and to a consumer iterating every event >= 2.0x pg_recvlogical/pgoutput; catch-up to a
file >= 2.0x test_decoding to a file; catch-up into the lake >= 2.0x pgoutput; realtime p99 <=
PostgreSQL's p99 and realtime p50 <= 0.5 ms;
archive-mode p99 <= force-archive timeout + 150 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import datetime as dt
import io
import json
import math
import os
import pstats
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from cdcd import metrics
from cdcd.consumer import Consumer, EventBatch
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node.node import Node
from cdcd.realtime import RealtimeMode
from cdcd.sinks.jsonl import JsonlConsumer
from cdcd.sinks.null import NullConsumer
from cdcd.wal.segment import list_segments
from tests.support import pg_arrivals
from tests.support.bench import VALUE_100B, _child_env, _tail
from tests.support.lake_bench import (
    APP_NAME,
    SPARK,
    SPARK_MASTER,
    ingest_config,
)
from tests.support.pg_cluster import PgCluster, PgUnavailable, ensure_postgres

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(__file__).resolve().parent / "results"

ROWS_FULL, ROWS_QUICK = 1_000_000, 100_000
TX_ROWS = 1000
PG_VALUE = "v" * 100
"""PostgreSQL's 100-byte value (text); cdcd's is ``VALUE_100B`` (100 bytes of MessagePack)."""
LIVE_TX_PER_S = 500
LIVE_TX_ROWS = 10
LIVE_SECONDS_FULL, LIVE_SECONDS_QUICK = 20.0, 5.0
LIVE_WARMUP_S = 1.0
RT_FLUSH_MS = 2
FORCE_ARCHIVE_MS = 1000
PUBLICATION = "bench_pub"
TEMPLATE_SLOT = "tmpl"
DRAIN_TIMEOUT_S = 120.0
WORKLOADS = ("write", "catchup.null", "catchup.iterate", "catchup.file", "catchup.lake", "live")
SIDES = {
    "write": ("pg", "cdcd"),
    "catchup.null": ("pg", "cdcd"),
    "catchup.iterate": ("pg", "cdcd"),
    "catchup.file": ("pg", "cdcd"),
    "catchup.lake": ("pg", "cdcd"),
    "live": ("pg", "cdcd_realtime", "cdcd_archive"),
}

Sample = dict[str, Any]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def _children_cpu_s() -> float:
    """CPU of this process's reaped children (psql, pg_recvlogical, runuser): ``RUSAGE_CHILDREN``."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _pct(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list."""
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[idx]


# --- the paced driver ----------------------------------------------------------------------------------
@dataclass
class Paced:
    commit_ns: list[int]
    """time.time_ns() when transaction g's commit call returned (0: not run)."""
    start_ns: int
    """time.time_ns() at the scheduled start of transaction 0."""
    late_max_ms: float
    seconds: float


def _pace(commit: Callable[[int], None], tx_per_s: float, seconds: float) -> Paced:
    """Run ``commit(g)`` for g = 0, 1, ... at ``t0 + g / tx_per_s`` until ``seconds`` have passed."""
    n_tx = int(seconds * tx_per_s)
    commit_ns = [0] * n_tx
    interval_ns = 1e9 / tx_per_s
    perf, now_ns, sleep = time.perf_counter_ns, time.time_ns, time.sleep
    t0 = perf() + 20_000_000
    start_wall = now_ns() + (t0 - perf())
    late_max = 0
    for g in range(n_tx):
        target = t0 + int(g * interval_ns)
        ahead = target - perf()
        if ahead > 0:
            sleep(ahead / 1e9)
        else:
            late_max = max(late_max, -ahead)
        commit(g)
        commit_ns[g] = now_ns()
    return Paced(commit_ns, start_wall, round(late_max / 1e6, 1), (perf() - t0) / 1e9)


def _lag_stats(paced: Paced, arrivals: dict[int, int], warmup_s: float, ref_ns: dict[int, int] | None = None) -> Sample:
    """Lag percentiles (ms) over the transactions committed after the warm-up; raises if any is missing.

    ``ref_ns``: per-transaction reference times to measure from instead of the driver's commit times.
    """
    lo = paced.start_ns + int(warmup_s * 1e9)
    window = [g for g, t in enumerate(paced.commit_ns) if t >= lo]
    if ref_ns is not None:
        window = [g for g in window if g in ref_ns]
    if not window:
        raise RuntimeError("no transaction committed after the warm-up")
    missing = [g for g in window if g not in arrivals]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(window)} transactions never arrived (first: {missing[0]})")
    ref = ref_ns if ref_ns is not None else dict(enumerate(paced.commit_ns))
    lags = sorted((arrivals[g] - ref[g]) / 1e6 for g in window)
    return {
        "p50_ms": round(_pct(lags, 50), 3),
        "p90_ms": round(_pct(lags, 90), 3),
        "p99_ms": round(_pct(lags, 99), 3),
        "p999_ms": round(_pct(lags, 99.9), 3),
        "max_ms": round(lags[-1], 3),
        "min_ms": round(lags[0], 3),
        "mean_ms": round(statistics.fmean(lags), 3),
        "transactions": len(window),
        "rows_per_s": round(len(window) * LIVE_TX_ROWS / max(1e-9, paced.seconds - warmup_s)),
        "driver_late_max_ms": paced.late_max_ms,
    }


# --- PostgreSQL side -----------------------------------------------------------------------------------
def _write_load_script(path: Path, rows: int, table: str) -> None:
    """One multi-row INSERT per 1000-row transaction (autocommit: each statement commits on its own)."""
    row = "({},'" + PG_VALUE + "')"
    with path.open("w") as f:
        for start in range(0, rows, TX_ROWS):
            values = ",".join(row.format(k) for k in range(start, min(start + TX_ROWS, rows)))
            f.write(f"INSERT INTO {table} (k, v) VALUES {values};\n")


class PgSide:
    def __init__(self, cluster: PgCluster, work: Path, rows: int) -> None:
        self.pg = cluster
        self.work = work
        self.rows = rows
        self.script = work / f"load-{rows}.sql"
        self.endpos: str | None = None
        self._slots = 0

    def setup(self) -> None:
        # FOR ALL TABLES and created before any slot: pgoutput looks the publication up in the
        # slot's historic catalog snapshot, so it must predate the slot.
        self.pg.sql(f"CREATE PUBLICATION {PUBLICATION} FOR ALL TABLES")
        t0 = time.perf_counter()
        _write_load_script(self.script, self.rows, "kv")
        _log(f"  load script {self.script.stat().st_size / 1e6:.0f} MB written in {time.perf_counter() - t0:.1f}s")

    def _fresh_table(self) -> None:
        self.pg.sql("DROP TABLE IF EXISTS kv; CREATE TABLE kv (k bigint PRIMARY KEY, v text NOT NULL); CHECKPOINT")

    def _measure(self, run: Callable[[], None]) -> tuple[float, float, float]:
        """(seconds, server CPU s, client CPU s) of ``run``, with the cluster settled before and after."""
        self.pg.settle()
        cpu0, client0 = self.pg.server_cpu_s(), _children_cpu_s()
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
        self.pg.settle()
        return seconds, self.pg.server_cpu_s() - cpu0, _children_cpu_s() - client0

    def _load(self) -> tuple[float, float, float, int]:
        lsn0 = self.pg.sql("SELECT pg_current_wal_lsn()").strip()

        def psql() -> None:
            proc = subprocess.run(self.pg.psql_cmd("-f", str(self.script)), capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"psql -f {self.script} exited {proc.returncode}: {proc.stderr[-500:]}")

        seconds, server, client = self._measure(psql)
        wal = int(self.pg.sql(f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{lsn0}')").strip().split(".")[0])
        return seconds, server, client, wal

    def write(self) -> Sample:
        self._fresh_table()
        seconds, server, client, wal = self._load()
        count = int(self.pg.sql("SELECT count(*) FROM kv").strip())
        if count != self.rows:
            raise AssertionError(f"kv holds {count} rows after the load, wanted {self.rows}")
        self.pg.sql("CHECKPOINT")  # untimed: its writes must not land in the next (cdcd) run
        return {
            "rows_per_s": round(self.rows / seconds),
            "cpu_s_per_1m": round((server + client) / self.rows * 1e6, 2),
            "seconds": round(seconds, 3),
            "server_cpu_s": round(server, 2),
            "client_cpu_s": round(client, 2),
            "wal_bytes_per_row": round(wal / self.rows, 1),
        }

    def prepare_backlog(self) -> Sample:
        self._fresh_table()
        self.pg.sql(f"SELECT pg_create_logical_replication_slot('{TEMPLATE_SLOT}', 'test_decoding')")
        seconds, _server, _client, wal = self._load()
        self.endpos = self.pg.sql("SELECT pg_current_wal_lsn()").strip()
        self.pg.sql("CHECKPOINT")
        return {"load_rows_per_s": round(self.rows / seconds), "wal_bytes": wal, "endpos": self.endpos}

    def drop_backlog(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.pg.sql(f"SELECT pg_drop_replication_slot('{TEMPLATE_SLOT}')")

    def catchup(self, kind: str) -> Sample:
        assert self.endpos is not None, "backlog not prepared"
        self._slots += 1
        slot = f"catchup_{self._slots}"
        pgoutput = kind in ("null", "iterate", "lake")  # pgoutput's client does nothing with a row either
        plugin = "pgoutput" if pgoutput else "test_decoding"
        self.pg.sql(f"SELECT pg_copy_logical_replication_slot('{TEMPLATE_SLOT}', '{slot}', false, '{plugin}')")
        out = Path(os.devnull) if pgoutput else self.work / "pg-catchup.txt"
        opts = ["-o", "proto_version=1", "-o", f"publication_names={PUBLICATION}"] if pgoutput else []
        cmd = self.pg.recvlogical_cmd(slot, "--start", "--endpos", self.endpos, "-f", str(out), *opts)

        def recv() -> None:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=DRAIN_TIMEOUT_S * 5)
            if proc.returncode != 0:
                raise RuntimeError(f"pg_recvlogical exited {proc.returncode}: {proc.stderr[-500:]}")

        try:
            seconds, server, client = self._measure(recv)
            confirmed = self.pg.sql(
                f"SELECT pg_wal_lsn_diff(confirmed_flush_lsn, '{self.endpos}') >= 0 "
                f"FROM pg_replication_slots WHERE slot_name = '{slot}'"
            ).strip()
        finally:
            self.pg.sql(f"SELECT pg_drop_replication_slot('{slot}')")
        if confirmed != "t":
            raise AssertionError(f"slot {slot} did not reach {self.endpos}")
        sample: Sample = {
            "rows_per_s": round(self.rows / seconds),
            "cpu_us_per_row": round((server + client) / self.rows * 1e6, 3),
            "seconds": round(seconds, 3),
            "server_cpu_s": round(server, 2),
            "client_cpu_s": round(client, 2),
        }
        if kind == "file":
            with out.open("rb") as f:
                rows = sum(1 for line in f if line.startswith(b"table "))
            if rows != self.rows:
                raise AssertionError(f"test_decoding wrote {rows} rows, the backlog holds {self.rows}")
            sample["bytes_per_row"] = round(out.stat().st_size / self.rows, 1)
            out.unlink()
        return sample

    def live(self, seconds: float, warmup_s: float, driver: str) -> Sample:
        self._slots += 1
        table, slot = f"lag_{self._slots}", f"live_{self._slots}"
        self.pg.sql(f"CREATE TABLE {table} (k bigint PRIMARY KEY, v text NOT NULL)")
        self.pg.sql(f"SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding')")
        opts = ["-o", "include-xids=0", "-o", "include-timestamp=1", "-o", "skip-empty-xacts=1"]
        recv = subprocess.Popen(
            self.pg.recvlogical_cmd(slot, "--start", "-f", "-", *opts),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        reader = _RecvReader(recv)
        client: _PgClient | None = None
        try:
            reader.start()
            client = _PgClient.open(self.pg, table, driver)
            client.probe()  # the stream is up once the probe row comes back
            if not reader.probe_seen.wait(30):
                raise RuntimeError(f"pg_recvlogical delivered nothing within 30 s: {reader.stderr_tail()}")
            cpu0 = self.pg.server_cpu_s()
            paced = _pace(client.commit, LIVE_TX_PER_S, warmup_s + seconds)
            client.finish()
            server_cpu = self.pg.server_cpu_s() - cpu0
            want = len(paced.commit_ns)
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while reader.transactions < want and time.monotonic() < deadline and recv.poll() is None:
                time.sleep(0.01)
        finally:
            if client is not None:
                client.close()
            if recv.poll() is None:
                recv.send_signal(signal.SIGINT)  # pg_recvlogical's clean stop
            try:
                recv.wait(10)
            except subprocess.TimeoutExpired:
                recv.kill()
                recv.wait()
            reader.join(10)
            with contextlib.suppress(RuntimeError):
                self.pg.sql(f"SELECT pg_drop_replication_slot('{slot}'); DROP TABLE {table}")
        if driver == "psycopg":
            stats = _lag_stats(paced, reader.arrival_ns, warmup_s)
            server_ts = _lag_stats(paced, reader.arrival_ns, warmup_s, ref_ns=reader.commit_ts_ns)
            stats.update({f"server_ts_{k}": v for k, v in server_ts.items() if k[0] in "pm" and k.endswith("_ms")})
        else:
            # psql says nothing when a statement returns: measure from the server's commit timestamp.
            stats = _lag_stats(paced, reader.arrival_ns, warmup_s, ref_ns=reader.commit_ts_ns)
        stats["driver"] = driver
        stats["lag_from"] = "commit returned" if driver == "psycopg" else "server commit timestamp"
        stats["server_cpu_percent"] = round(100 * server_cpu / paced.seconds, 1)
        return stats


class _PgClient:
    """The live driver's connection: psycopg (commit-returned times) or one psql session on a pipe."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.sql = f"INSERT INTO {table} (k, v) VALUES " + ",".join(["(%s, %s)"] * LIVE_TX_ROWS)
        self.conn: Any = None
        self.psql: subprocess.Popen[bytes] | None = None

    @classmethod
    def open(cls, cluster: PgCluster, table: str, driver: str) -> _PgClient:
        self = cls(table)
        if driver == "psycopg":
            import psycopg

            self.conn = psycopg.connect(cluster.conninfo(), autocommit=True)
        else:
            self.psql = subprocess.Popen(
                cluster.psql_cmd("-f", "-"),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        return self

    def probe(self) -> None:
        self._exec(f"INSERT INTO {self.table} (k, v) VALUES (-1, 'probe')", None)

    def _exec(self, statement: str, params: list[Any] | None) -> None:
        if self.conn is not None:
            self.conn.execute(statement, params, prepare=params is not None)
        else:
            assert self.psql is not None and self.psql.stdin is not None
            if params is not None:
                statement = statement.replace("%s", "{}").format(
                    *(p if isinstance(p, int) else f"'{p}'" for p in params)
                )
            self.psql.stdin.write(statement.encode() + b";\n")
            self.psql.stdin.flush()

    def commit(self, g: int) -> None:
        first = g * LIVE_TX_ROWS
        params: list[Any] = []
        for k in range(first, first + LIVE_TX_ROWS):
            params += (k, PG_VALUE)
        self._exec(self.sql, params)

    def finish(self) -> None:
        """Wait until every statement was executed (psql: it exits at the end of its input)."""
        if self.psql is not None and self.psql.stdin is not None:
            self.psql.stdin.close()
            if self.psql.wait(DRAIN_TIMEOUT_S) != 0:
                err = self.psql.stderr.read().decode(errors="replace") if self.psql.stderr else ""
                raise RuntimeError(f"psql exited {self.psql.returncode}: {err[-500:]}")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.psql is not None and self.psql.poll() is None:
            self.psql.kill()
            self.psql.wait()


class _RecvReader(threading.Thread):
    """Reads pg_recvlogical's test_decoding stream; per transaction: COMMIT-line arrival and commit timestamp."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(name="bench-pg-recv", daemon=True)
        self.proc = proc
        self.arrival_ns: dict[int, int] = {}
        self.commit_ts_ns: dict[int, int] = {}
        self.transactions = 0
        self.probe_seen = threading.Event()
        self._stderr: list[bytes] = []

    def run(self) -> None:
        assert self.proc.stdout is not None
        keys: list[int] = []
        marker = b"k[bigint]:"
        for line in iter(self.proc.stdout.readline, b""):
            now = time.time_ns()
            if line.startswith(b"table "):
                keys.append(int(line.split(marker, 1)[1].split(b" ", 1)[0]))
            elif line.startswith(b"COMMIT"):
                # b"COMMIT (at 2026-11-22 08:22:56.525687+00)"
                ts = dt.datetime.fromisoformat(line[11:].rstrip(b")\n").decode()).timestamp()
                ts_ns = round(ts * 1e6) * 1000
                for g in {k // LIVE_TX_ROWS for k in keys if k >= 0}:
                    self.arrival_ns[g] = now
                    self.commit_ts_ns[g] = ts_ns
                    self.transactions += 1
                if any(k < 0 for k in keys):
                    self.probe_seen.set()
                keys = []
            elif line.startswith(b"BEGIN"):
                keys = []
        if self.proc.stderr is not None:
            self._stderr.append(self.proc.stderr.read())

    def stderr_tail(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")[-500:]


# --- cdcd side -----------------------------------------------------------------------------------------
def _autocompact_s() -> float:
    """Seconds the lake sinks of this process spent in their small-file rewrites so far."""
    total = metrics.LAKE.get_sample_value("cdcd_lake_maintenance_duration_seconds_sum", {"task": "autocompact"})
    return total or 0.0


def profiled(fn: Callable[[], Sample], path: Path, log: Callable[[str], None], top: int = 20) -> Sample:
    """``fn()`` under cProfile in this thread and in every thread started meanwhile (cProfile sees only
    the thread that enabled it: the daemon reads, decodes and lands in worker threads), merged into
    ``path``; logs the ``top`` functions by own time."""
    main = cProfile.Profile()
    others: list[cProfile.Profile] = []

    def start(*_args: Any) -> None:  # a new thread's first call: a profiler of its own from here on
        sys.setprofile(None)
        prof = cProfile.Profile()
        others.append(prof)
        prof.enable()

    threading.setprofile(start)
    main.enable()
    try:
        return fn()
    finally:
        main.disable()
        threading.setprofile(None)
        for prof in others:
            prof.disable()
        stats = pstats.Stats(main)
        for prof in others:
            with contextlib.suppress(TypeError):  # a thread that made no call after starting
                stats.add(prof)
        path.parent.mkdir(parents=True, exist_ok=True)
        stats.dump_stats(path)
        out = io.StringIO()
        stats.stream = out  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(top)
        log(f"  profile: {path}")
        for line in out.getvalue().splitlines():
            if line.strip() and not line.startswith(("   Ordered", "   List reduced")):
                log(f"    {line.rstrip()}")


async def _run_until(daemon: Daemon, last_segment: int) -> float:
    """``Daemon.run()`` until its committed position passes ``last_segment``; returns the seconds."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    task = asyncio.create_task(daemon.run(), name="bench-pg-daemon")
    try:
        while True:
            pos = daemon.state.position
            if pos is not None and pos.segment > last_segment:
                break
            if task.done():
                task.result()
                raise RuntimeError(f"run() returned at {pos} before passing segment {last_segment}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon stuck at {pos} after {DRAIN_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.002)
        return time.perf_counter() - t0
    finally:
        daemon.stop()
        done, _ = await asyncio.wait({task}, timeout=10)
        if not done:  # see bench_daemon._run_until: run() can miss stop(); do not hang the benchmark
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class IterateConsumer(Consumer):
    """Iterates every event and decodes its key and value; sums the keys (ints) to prove it did."""

    def __init__(self) -> None:
        self.events = 0
        self.key_sum = 0

    def on_events(self, batch: EventBatch) -> bool:
        n = total = 0
        for event in batch:
            total += event.key
            _value = event.value
            n += 1
        self.events += n
        self.key_sum += total
        return True


class CdcdSide:
    def __init__(self, work: Path, rows: int, lake_options: dict[str, Any] | None = None) -> None:
        self.work = work
        self.rows = rows
        self.lake_options = lake_options or {}
        self.backlog: Path | None = None
        self.last_segment = -1
        self._runs = 0

    def _dir(self, what: str) -> Path:
        self._runs += 1
        return self.work / f"{what}-{self._runs}"

    def _load(self, node_dir: Path, *, archive: bool) -> Sample:
        node = Node.open(node_dir, wal_mode="fsync", archive_max_bytes=0)
        try:
            put_all = node.cache("kv").put_all
            value, rows = VALUE_100B, self.rows
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            for start in range(0, rows, TX_ROWS):
                put_all({k: value for k in range(start, min(start + TX_ROWS, rows))})
            node.flush()
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            if archive:
                node.force_archive()
        finally:
            node.close()
        return {
            "rows_per_s": round(rows / seconds),
            "cpu_s_per_1m": round(cpu / rows * 1e6, 2),
            "seconds": round(seconds, 3),
            "process_cpu_s": round(cpu, 2),
        }

    def write(self) -> Sample:
        node_dir = self._dir("write")
        try:
            sample = self._load(node_dir, archive=False)
            wal = sum(p.stat().st_size for p in node_dir.joinpath("wal").rglob("*.wal"))
            sample["wal_bytes_per_row"] = round(wal / self.rows, 1)
            return sample
        finally:
            shutil.rmtree(node_dir, ignore_errors=True)

    def prepare_backlog(self) -> Sample:
        """The backlog written by a child process: the daemon that catches up runs in a process of its own, and the
        process that has just written a million entries through a node reads them back with some 15% more CPU
        per row (its heap after the writes; measured 0.70-0.81 against 0.61-0.65 µs per row for the same code)."""
        self.backlog = self._dir("backlog")
        code = (
            "import json, sys; from pathlib import Path; from tests.bench.bench_pg import CdcdSide; "
            "print(json.dumps(CdcdSide(Path(sys.argv[1]), int(sys.argv[2]))._load(Path(sys.argv[3]), archive=True)))"
        )
        argv = [sys.executable, "-c", code, str(self.work), str(self.rows), str(self.backlog)]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"writing the backlog failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        sample: Sample = json.loads(done.stdout.strip().splitlines()[-1])
        self.last_segment = max(list_segments(self.backlog / "cdc")[0])
        return {"load_rows_per_s": sample["rows_per_s"], "segments": self.last_segment + 1}

    def _restore(self) -> None:
        """Every archived segment up to the backlog's last linked again, no daemon state: a fresh replay."""
        assert self.backlog is not None
        cdc = self.backlog / "cdc"
        archived = list_segments(self.backlog / "wal" / "archive")[0]
        links = list_segments(cdc)[0]
        for idx in range(self.last_segment + 1):
            if idx not in links and idx in archived:
                os.link(archived[idx], cdc / archived[idx].name)
        shutil.rmtree(self.backlog / "cdcd-state", ignore_errors=True)

    def catchup(self, kind: str) -> Sample:
        assert self.backlog is not None, "backlog not prepared"
        self._restore()
        out = self.work / "cdcd-catchup.jsonl"
        out.unlink(missing_ok=True)
        if kind == "lake":
            return self._catchup_lake()
        consumer: Consumer
        if kind == "null":
            consumer = NullConsumer()
        elif kind == "iterate":
            consumer = IterateConsumer()
        else:
            consumer = JsonlConsumer(out, fsync=True)
        kinds = {"null": {"kind": "null"}, "iterate": {"kind": "python", "class": f"{__name__}:IterateConsumer"}}
        config = DaemonConfig(
            node_dir=str(self.backlog), metrics_address="", consumer=kinds.get(kind, {"kind": "jsonl"})
        )
        daemon = Daemon(config, consumer, show_progress=False)
        try:
            daemon.start()
            cpu0 = time.process_time()
            seconds = asyncio.run(_run_until(daemon, self.last_segment))
            cpu = time.process_time() - cpu0
            delivered = daemon.events_delivered
        finally:
            daemon.close()
        if delivered != self.rows:
            raise AssertionError(f"the daemon delivered {delivered} events, the backlog holds {self.rows}")
        if isinstance(consumer, IterateConsumer) and consumer.key_sum != self.rows * (self.rows - 1) // 2:
            raise AssertionError(f"the consumer read keys summing to {consumer.key_sum}, not those of the backlog")
        sample: Sample = {
            "rows_per_s": round(self.rows / seconds),
            "cpu_us_per_row": round(cpu / self.rows * 1e6, 3),
            "seconds": round(seconds, 3),
            "process_cpu_s": round(cpu, 2),
        }
        if kind == "file":
            sample["bytes_per_row"] = round(out.stat().st_size / self.rows, 1)
            out.unlink()
        return sample

    def _catchup_lake(self) -> Sample:
        """The backlog into a fresh lake through the default lake pipeline (``writer = "spark"`` on
        ``local[2]``, delta-rs commits), with ``lake.ingest.run``'s batch settings; CPU includes the
        Spark JVM's and its Python workers'."""
        from cdcd.lake.sink import LakeConsumer, LakeOptions

        SPARK.ensure()  # started and warmed up once, outside every timing
        lake = self._dir("lake")
        consumer = LakeConsumer(
            LakeOptions(
                lake_path=str(lake),
                spark_master=SPARK_MASTER,
                app_name=APP_NAME,
                compact_interval_s=0,  # landing is timed, as PostgreSQL's side is
                optimize_interval_s=0,
                **self.lake_options,
            )
        )
        assert self.backlog is not None, "backlog not prepared"
        daemon = Daemon(ingest_config(self.backlog), consumer, show_progress=False)
        rewrites0 = _autocompact_s()
        try:
            daemon.start()
            cpu0, jvm0, own0 = time.process_time(), SPARK.jvm_cpu_s(), SPARK.jvm_own_cpu_s()
            seconds = asyncio.run(_run_until(daemon, self.last_segment))
            cpu, jvm = time.process_time() - cpu0, SPARK.jvm_cpu_s() - jvm0
            jvm_own = SPARK.jvm_own_cpu_s() - own0
            delivered = daemon.events_delivered
        finally:
            closing, closing_cpu = time.perf_counter(), time.process_time()
            daemon.close()  # the sink's stop() waits for the rewrite the last commit made due
        tail, tail_cpu = time.perf_counter() - closing, time.process_time() - closing_cpu
        rewrites = _autocompact_s() - rewrites0
        try:
            from deltalake import DeltaTable

            landed = int(DeltaTable(str(lake / "changes")).count())
        finally:
            shutil.rmtree(lake, ignore_errors=True)
        if delivered != self.rows or landed != self.rows:
            raise AssertionError(f"delivered {delivered}, landed {landed} rows; the backlog holds {self.rows}")
        return {
            "rows_per_s": round(self.rows / seconds),
            "cpu_us_per_row": round((cpu + jvm) / self.rows * 1e6, 3),
            "seconds": round(seconds, 3),
            "process_cpu_s": round(cpu, 2),
            "jvm_cpu_s": round(jvm, 2),
            "jvm_own_cpu_s": round(jvm_own, 2),
            "autocompact_s": round(rewrites, 2),
            "autocompact_wait_s": round(consumer.rewrite_wait_s, 2),
            "tail_s": round(tail, 2),
            "tail_cpu_s": round(tail_cpu, 2),
        }

    def live_realtime(self, seconds: float, warmup_s: float) -> Sample:
        node_dir = self._dir("live-rt")
        arrivals_path = self.work / f"arrivals-{self._runs}.bin"
        consumer = {"kind": "python", "class": pg_arrivals.CLASS, "options": {"path": str(arrivals_path)}}
        try:
            node = Node.open(
                node_dir,
                wal_mode="fsync",
                wal_flush_interval_ms=RT_FLUSH_MS,
                realtime_cdc=True,
                realtime_consumer=consumer,
                cdc_enabled=False,
            )
            try:
                deadline = time.monotonic() + 10
                while (mode := node.realtime.status()["mode"]) != RealtimeMode.ON.value:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"realtime mode {mode} after 10 s")
                    time.sleep(0.01)
                put_all = node.cache("lag").put_all
                value = VALUE_100B
                cpu0 = time.process_time()

                def commit(g: int) -> None:
                    first = g * LIVE_TX_ROWS
                    put_all({k: value for k in range(first, first + LIVE_TX_ROWS)})

                paced = _pace(commit, LIVE_TX_PER_S, warmup_s + seconds)
                cpu = time.process_time() - cpu0
                want = len(paced.commit_ns) * LIVE_TX_ROWS
                rec = pg_arrivals.ARRIVALS[str(arrivals_path)]
                deadline = time.monotonic() + DRAIN_TIMEOUT_S
                while rec.count < want and time.monotonic() < deadline:
                    time.sleep(0.01)
            finally:
                node.close()  # the realtime consumer's stop() writes the arrivals
            pg_arrivals.ARRIVALS.pop(str(arrivals_path), None)
            stats = _lag_stats(paced, pg_arrivals.read_arrivals(arrivals_path, LIVE_TX_ROWS), warmup_s)
            stats["process_cpu_percent"] = round(100 * cpu / paced.seconds, 1)
            return stats
        finally:
            shutil.rmtree(node_dir, ignore_errors=True)
            arrivals_path.unlink(missing_ok=True)

    def live_archive(self, seconds: float, warmup_s: float) -> Sample:
        node_dir = self._dir("live-archive")
        arrivals_path = self.work / f"arrivals-{self._runs}.bin"
        config_path = self.work / f"cdcd-{self._runs}.toml"
        log_path = self.work / f"cdcd-{self._runs}.log"
        config_path.write_text(
            "\n".join(
                [
                    f"node_dir = {json.dumps(str(node_dir))}",
                    'metrics_address = ""',
                    'log_format = "json"',
                    "[consumer]",
                    'kind = "python"',
                    f'class = "{pg_arrivals.CLASS}"',
                    "[consumer.options]",
                    f"path = {json.dumps(str(arrivals_path))}",
                ]
            )
            + "\n"
        )
        daemon: subprocess.Popen[bytes] | None = None
        try:
            node = Node.open(
                node_dir, wal_mode="fsync", wal_force_archive_timeout_ms=FORCE_ARCHIVE_MS, archive_max_bytes=0
            )
            try:
                with log_path.open("wb") as log:
                    daemon = subprocess.Popen(
                        [sys.executable, "-m", "cdcd", "run", "--config", str(config_path)],
                        cwd=ROOT,
                        env=_child_env(),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                deadline = time.monotonic() + 60
                while b"daemon_started" not in log_path.read_bytes():
                    if daemon.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"cdcd run did not start:\n{_tail(log_path)}")
                    time.sleep(0.02)
                put_all = node.cache("lag").put_all
                value = VALUE_100B

                def commit(g: int) -> None:
                    first = g * LIVE_TX_ROWS
                    put_all({k: value for k in range(first, first + LIVE_TX_ROWS)})

                paced = _pace(commit, LIVE_TX_PER_S, warmup_s + seconds)
                # The last segment rolls on the force-archive timeout like every other one; then
                # the daemon has delivered everything once it has deleted every link.
                time.sleep(FORCE_ARCHIVE_MS / 1000 + 0.3)
                cdc = node_dir / "cdc"
                deadline = time.monotonic() + DRAIN_TIMEOUT_S
                while list_segments(cdc)[0]:
                    if daemon.poll() is not None:
                        raise RuntimeError(f"cdcd run exited {daemon.returncode}:\n{_tail(log_path)}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"links left in {cdc}: {sorted(list_segments(cdc)[0])}")
                    time.sleep(0.02)
                daemon.send_signal(signal.SIGTERM)  # the consumer's stop() writes the arrivals
                if daemon.wait(30) != 0:
                    raise RuntimeError(f"cdcd run exited {daemon.returncode}:\n{_tail(log_path)}")
            finally:
                node.close()
            return _lag_stats(paced, pg_arrivals.read_arrivals(arrivals_path, LIVE_TX_ROWS), warmup_s)
        finally:
            if daemon is not None and daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            shutil.rmtree(node_dir, ignore_errors=True)
            for p in (arrivals_path, config_path, log_path):
                p.unlink(missing_ok=True)


# --- the table -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    workload: str
    label: str
    key: str
    unit: str
    cdcd_side: str
    goal: str | None = None
    """``ratio>=X`` (cdcd/PG), ``<=pg`` (cdcd <= PG), ``<=X`` (cdcd, absolute) or None."""
    target: float = 0.0
    ratio: bool = True
    """Show cdcd/PG (not for archive-mode lag, which is bound by the force-archive timeout by design)."""


ROWS: tuple[Row, ...] = (
    Row("write", "write, 1000-row tx", "rows_per_s", "rows/s", "cdcd", "ratio>=", 1.0),
    Row("write", "write, 1000-row tx", "cpu_s_per_1m", "CPU s/1M rows", "cdcd"),
    Row("catchup.null", "catch-up -> null", "rows_per_s", "rows/s", "cdcd", "ratio>=", 2.0),
    Row("catchup.null", "catch-up -> null", "cpu_us_per_row", "CPU us/row", "cdcd"),
    Row("catchup.iterate", "catch-up -> iterate", "rows_per_s", "rows/s", "cdcd", "ratio>=", 2.0),
    Row("catchup.iterate", "catch-up -> iterate", "cpu_us_per_row", "CPU us/row", "cdcd"),
    # No goal: the jsonl sink is the tests' plain oracle, not tuned to win this row.
    Row("catchup.file", "catch-up -> file", "rows_per_s", "rows/s", "cdcd"),
    Row("catchup.file", "catch-up -> file", "cpu_us_per_row", "CPU us/row", "cdcd"),
    Row("catchup.file", "catch-up -> file", "bytes_per_row", "B/row", "cdcd"),
    Row("catchup.lake", "catch-up -> lake (Spark) vs pgoutput", "rows_per_s", "rows/s", "cdcd", "ratio>=", 2.0),
    Row("catchup.lake", "catch-up -> lake (Spark) vs pgoutput", "cpu_us_per_row", "CPU us/row", "cdcd"),
    Row("live", "live lag, realtime", "p50_ms", "ms", "cdcd_realtime", "<=", 0.5),
    Row("live", "live lag, realtime", "p99_ms", "ms", "cdcd_realtime", "<=pg"),
    Row("live", "live lag, realtime", "p999_ms", "ms", "cdcd_realtime"),
    Row("live", "live lag, realtime", "max_ms", "ms", "cdcd_realtime"),
    Row("live", "live lag, archive", "p50_ms", "ms", "cdcd_archive", ratio=False),
    Row("live", "live lag, archive", "p99_ms", "ms", "cdcd_archive", "<=", FORCE_ARCHIVE_MS + 150.0, ratio=False),
    Row("live", "live lag, archive", "max_ms", "ms", "cdcd_archive", ratio=False),
)


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(x: float, unit: str) -> str:
    if unit == "rows/s":
        return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}k" if x >= 1e4 else f"{x:.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if abs(x) >= 0.1 else f"{x:.3f}"


def evaluate(samples: dict[str, dict[str, list[Sample]]]) -> list[dict[str, Any]]:
    """One entry per table row: both sides' summaries, the ratio cdcd/PG and the goal verdict."""
    out = []
    for row in ROWS:
        sides = samples.get(row.workload)
        if not sides:
            continue
        pg = _summary([s[row.key] for s in sides.get("pg", []) if s.get(row.key) is not None])
        cd = _summary([s[row.key] for s in sides.get(row.cdcd_side, []) if s.get(row.key) is not None])
        # A ratio of lags is meaningless when one is <= 0 (a consumer may run before commit returns).
        ratio = (
            cd["median"] / pg["median"] if row.ratio and pg and cd and pg["median"] > 0 and cd["median"] > 0 else None
        )
        passed: bool | None = None
        goal_text = "-"
        if row.goal == "ratio>=":
            goal_text = f"cdcd/PG >= {row.target:g}x"
            passed = ratio is not None and ratio >= row.target
        elif row.goal == "<=pg":
            goal_text = "cdcd <= PG"
            passed = pg is not None and cd is not None and cd["median"] <= pg["median"]
        elif row.goal == "<=":
            goal_text = f"cdcd <= {row.target:g} {row.unit}"
            passed = cd is not None and cd["median"] <= row.target
        out.append(
            {
                "workload": row.workload,
                "label": row.label,
                "metric": row.key,
                "unit": row.unit,
                "cdcd_side": row.cdcd_side,
                "pg": pg,
                "cdcd": cd,
                "ratio_cdcd_pg": round(ratio, 3) if ratio is not None else None,
                "goal": goal_text if row.goal else None,
                "passed": passed,
            }
        )
    return out


def format_table(rows: list[dict[str, Any]], pg_version: str) -> str:
    headers = ["workload", "metric", f"PostgreSQL {pg_version}", "cdcd", "cdcd/PG", "goal", "result"]

    def cell(s: dict[str, float] | None, unit: str) -> str:
        if s is None:
            return "-"
        if s["min"] == s["max"]:
            return _fmt(s["median"], unit)
        return f"{_fmt(s['median'], unit)} ({_fmt(s['min'], unit)}-{_fmt(s['max'], unit)})"

    table = [
        [
            r["label"],
            r["unit"] if r["unit"] != "ms" else f"{r['metric'].removesuffix('_ms').replace('p999', 'p99.9')} ms",
            cell(r["pg"], r["unit"]),
            cell(r["cdcd"], r["unit"]),
            f"{r['ratio_cdcd_pg']:.2f}x" if r["ratio_cdcd_pg"] is not None else "-",
            r["goal"] or "-",
            {True: "PASS", False: "FAIL", None: "-"}[r["passed"]],
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(headers)]
    right = {2, 3, 4}

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(t) for t in table)])


# --- the chart -----------------------------------------------------------------------------------------
def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    samples: dict[str, dict[str, list[Sample]]] = doc["samples"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), dpi=100)
    colors = {"pg": "tab:blue", "cdcd": "tab:orange", "cdcd_realtime": "tab:orange", "cdcd_archive": "tab:green"}
    names = {"pg": f"PostgreSQL {doc['postgres']['version']}", "cdcd": "cdcd"}

    def bars(ax: Any, get: Callable[[Sample], float], unit: str, title: str, ylabel: str) -> None:
        groups = [
            w for w in ("write", "catchup.null", "catchup.iterate", "catchup.file", "catchup.lake") if w in samples
        ]
        width = 0.38
        top = 0.0
        for j, side in enumerate(("pg", "cdcd")):
            meds, lo, hi = [], [], []
            for w in groups:
                vals = [get(s) for s in samples[w].get(side, [])]
                m = statistics.median(vals) if vals else 0.0
                meds.append(m)
                lo.append(m - min(vals) if vals else 0.0)
                hi.append(max(vals) - m if vals else 0.0)
            xs = [i + (j - 0.5) * width for i in range(len(groups))]
            ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, color=colors[side], label=names[side])
            top = max(top, *(m + h for m, h in zip(meds, hi, strict=True)))
            for x, m in zip(xs, meds, strict=True):
                ax.text(x, m, _fmt(m, unit), ha="center", va="bottom", fontsize=8)
        labels = {
            "write": "write\n(INSERT / put_all)",
            "catchup.null": "catch-up\n-> null",
            "catchup.iterate": "catch-up\n-> iterate",
            "catchup.file": "catch-up\n-> file",
            "catchup.lake": "catch-up\n-> lake",
        }
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([labels[w] for w in groups])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        if not groups:
            ax.text(0.5, 0.5, "not run", transform=ax.transAxes, ha="center")
            return
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(0, top * 1.25 or 1)  # room for the legend above the bars
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: _fmt(y, unit) if y else "0"))
        ax.legend(fontsize=8, loc="upper left")

    bars(axes[0], lambda s: s["rows_per_s"], "rows/s", f"throughput, {doc['rows']:,} rows (median, min-max)", "rows/s")
    # CPU s per 1M rows (write) is the same number as CPU us per row (catch-up)
    bars(
        axes[1],
        lambda s: float(s["cpu_us_per_row"] if "cpu_us_per_row" in s else s["cpu_s_per_1m"]),
        "",
        "CPU per row (all processes of each side)",
        "CPU us per row",
    )

    ax = axes[2]
    live = samples.get("live", {})
    pcts = [("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9"), ("max_ms", "max")]
    live_names = {"pg": names["pg"], "cdcd_realtime": "cdcd realtime", "cdcd_archive": "cdcd archive"}
    width = 0.27
    top = 1.0
    for j, side in enumerate(("pg", "cdcd_realtime", "cdcd_archive")):
        runs = live.get(side, [])
        if not runs:
            continue
        meds = [statistics.median([s[k] for s in runs]) for k, _ in pcts]
        xs = [i + (j - 1) * width for i in range(len(pcts))]
        ax.bar(xs, meds, width, color=colors[side], label=live_names[side])
        for x, m in zip(xs, meds, strict=True):
            ax.text(x, max(m, 0.0), _fmt(m, "ms"), ha="center", va="bottom", fontsize=7)
        top = max(top, *meds)
    # symlog, linear within +-0.1 ms: a realtime consumer can run before put() returns (lag < 0)
    ax.set_yscale("symlog", linthresh=0.1, linscale=0.5)
    ax.set_ylim(-0.1, top * 30)
    ax.set_xticks(range(len(pcts)))
    ax.set_xticklabels([label for _, label in pcts])
    ax.set_ylabel("commit returned -> delivered (ms, symlog)")
    ax.set_title(
        f"live lag, {LIVE_TX_PER_S} tx/s x {LIVE_TX_ROWS} rows, {doc['live_seconds']:g} s (median of runs)", fontsize=10
    )
    ax.grid(True, axis="y", which="both", alpha=0.3)
    if live:
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.5, 0.5, "live: not run", transform=ax.transAxes, ha="center")
    loads = [s["loadavg_1m"] for w in samples.values() for runs in w.values() for s in runs if "loadavg_1m" in s]
    fig.suptitle(
        f"cdcd vs PostgreSQL logical decoding, same machine ({doc['host']['cpus']} cores), "
        f"{doc['repeats']} runs each, load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------------------
def _selected(only: list[str]) -> list[str]:
    if not only:
        return list(WORKLOADS)
    out = [w for w in WORKLOADS if any(w == p or w.startswith(p.rstrip(".") + ".") for p in only)]
    if not out:
        raise SystemExit(f"--only {only}: no workload matches; choose from {', '.join(WORKLOADS)} or 'catchup'")
    return out


def _git() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit}


def _driver(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psql"
    return "psycopg"


def _sigterm(_signo: int, _frame: Any) -> None:
    # SystemExit unwinds through every ``finally``: the cluster is stopped and deleted.
    raise SystemExit(143)


def run(args: argparse.Namespace, log: Callable[[str], None] = _log) -> dict[str, Any]:
    rows = args.rows or (ROWS_QUICK if args.quick else ROWS_FULL)
    live_s = args.live_seconds or (LIVE_SECONDS_QUICK if args.quick else LIVE_SECONDS_FULL)
    warmup = args.live_warmup
    workloads = _selected(args.only)
    driver = _driver(args.pg_driver)
    bin_dir = ensure_postgres(install=not args.no_install, log=log)
    base = os.environ.get("CDCD_BENCH_DIR") or None
    samples: dict[str, dict[str, list[Sample]]] = {w: {s: [] for s in SIDES[w]} for w in workloads}
    setup: dict[str, Any] = {}
    started = dt.datetime.now(dt.UTC)
    load0 = list(os.getloadavg())
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-pgcmp-", dir=base))
    try:
        with PgCluster(bin_dir, base_dir=base) as cluster:
            log(f"PostgreSQL {cluster.version} in {cluster.root} (socket only), cdcd in {work}")
            pg, cd = PgSide(cluster, work, rows), CdcdSide(work, rows, args.lake_option)
            pg.setup()

            def measure(workload: str, rep: int, jobs: dict[str, Callable[[], Sample]]) -> None:
                order = list(jobs)
                shift = rep % len(order)  # alternate which side goes first
                for side in order[shift:] + order[:shift]:
                    sample = jobs[side]()
                    sample["loadavg_1m"] = _loadavg()
                    samples[workload][side].append(sample)
                    brief = ", ".join(f"{k}={v}" for k, v in sample.items() if not isinstance(v, str))
                    log(f"  {workload} {side} run {rep + 1}/{args.repeats}: {brief}")

            if "write" in workloads:
                log(f"write: {rows:,} rows in {TX_ROWS}-row transactions")
                for rep in range(args.repeats):
                    measure("write", rep, {"pg": pg.write, "cdcd": cd.write})
            catchups = [w for w in workloads if w.startswith("catchup.")]
            if catchups:
                log(f"catch-up: writing the {rows:,}-row backlog on both sides")
                setup["pg_backlog"] = pg.prepare_backlog()
                setup["cdcd_backlog"] = cd.prepare_backlog()
                log(f"  backlog: {setup}")
                for w in catchups:
                    kind = w.split(".", 1)[1]
                    log(f"{w}: pg_recvlogical vs cdcd daemon")
                    for rep in range(args.repeats):
                        measure(w, rep, {"pg": partial(pg.catchup, kind), "cdcd": partial(cd.catchup, kind)})
                    if args.profile:
                        prof = args.results_dir / f"bench-pg-profile-{w}.prof"
                        sample = profiled(partial(cd.catchup, kind), prof, log)
                        log(f"  {w} cdcd, profiled (not in the table): {sample}")
                pg.drop_backlog()
            if "live" in workloads:
                log(
                    f"live: {LIVE_TX_PER_S} tx/s x {LIVE_TX_ROWS} rows, {live_s:g} s (+{warmup:g} s warm-up); "
                    f"PG client: {driver}"
                )
                for rep in range(args.repeats):
                    measure(
                        "live",
                        rep,
                        {
                            "pg": lambda: pg.live(live_s, warmup, driver),
                            "cdcd_realtime": lambda: cd.live_realtime(live_s, warmup),
                            "cdcd_archive": lambda: cd.live_archive(live_s, warmup),
                        },
                    )
            pg_version = cluster.version
            pg_settings = dict(cluster.settings)
            pg_root = str(cluster.root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "started": started.isoformat(),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "quick": args.quick,
        "repeats": args.repeats,
        "rows": rows,
        "tx_rows": TX_ROWS,
        "live_seconds": live_s,
        "live_warmup_s": warmup,
        "live_tx_per_s": LIVE_TX_PER_S,
        "live_tx_rows": LIVE_TX_ROWS,
        "workloads": workloads,
        "postgres": {
            "version": pg_version,
            "settings": pg_settings,
            "live_driver": driver,
            "bin_dir": str(bin_dir),
            "cluster_dir": pg_root,
        },
        "cdcd": {
            "rt_flush_ms": RT_FLUSH_MS,
            "wal_force_archive_timeout_ms": FORCE_ARCHIVE_MS,
            "lake_options": args.lake_option,
        },
        "host": {"cpus": os.cpu_count(), "loadavg_start": load0},
        "loadavg_end": list(os.getloadavg()),
        "git": _git(),
        "setup": setup,
        "samples": samples,
    }


def _lake_option(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not JSON (an int, float or bool)") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_pg", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help=f"{ROWS_QUICK:,} rows and {LIVE_SECONDS_QUICK:g} s of live load"
    )
    ap.add_argument(
        "--only", action="append", default=[], metavar="WORKLOAD", help=f"{', '.join(WORKLOADS)} or catchup"
    )
    ap.add_argument("--repeats", type=int, default=3, help="repetitions per side and workload (default 3)")
    ap.add_argument("--rows", type=int, default=None, help="rows of the write and catch-up workloads (overrides)")
    ap.add_argument("--live-seconds", type=float, default=None, help="measured seconds of live load (overrides)")
    ap.add_argument("--live-warmup", type=float, default=LIVE_WARMUP_S, help="live warm-up seconds, not counted")
    ap.add_argument("--pg-driver", choices=("auto", "psycopg", "psql"), default="auto", help="live PostgreSQL client")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON and PNG go")
    ap.add_argument("--no-install", action="store_true", help="fail instead of apt-get installing PostgreSQL")
    ap.add_argument(
        "--lake-option",
        type=_lake_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a LakeOptions field for catchup.lake (JSON value; repeatable)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="one more cProfile'd cdcd run per catch-up workload (results dir)"
    )
    args = ap.parse_args(argv)
    args.lake_option = dict(args.lake_option)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.rows is not None and (args.rows < TX_ROWS or args.rows % TX_ROWS):
        ap.error(f"--rows must be a positive multiple of {TX_ROWS}")

    from cdcd.logging import configure as configure_logging

    configure_logging("console", "warning")  # keep node/daemon info lines out of the table
    signal.signal(signal.SIGTERM, _sigterm)
    # Also when started with SIGINT ignored (a background job of a script): Ctrl-C/SIGINT must clean up.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        doc = run(args)
    except PgUnavailable as exc:
        print(f"bench_pg: {exc}", file=sys.stderr)
        return 2
    rows = evaluate(doc["samples"])
    doc["table"] = rows
    table = format_table(rows, doc["postgres"]["version"])
    loads = [s["loadavg_1m"] for w in doc["samples"].values() for runs in w.values() for s in runs]
    missed = [f"{r['label']} {r['metric']}" for r in rows if r["passed"] is False]
    lag_from = (
        "the commit call returning (psycopg)"
        if doc["postgres"]["live_driver"] == "psycopg"
        else "the server commit timestamp (psql)"
    )
    footer = (
        f"{doc['rows']:,} rows"
        + (f", live {doc['live_seconds']:g} s" if "live" in doc["samples"] else "")
        + f"; {doc['repeats']} runs per side, alternating, "
        f"median (min-max); {doc['elapsed_s']:.0f}s. Load average (1 min): "
        f"{doc['host']['loadavg_start'][0]:.2f} at start, {min(loads, default=0):.2f}-{max(loads, default=0):.2f} "
        f"after the runs, {doc['loadavg_end'][0]:.2f} at the end ({doc['host']['cpus']} cores). "
        + (f"Live PostgreSQL lag measured from {lag_from}." if "live" in doc["samples"] else "")
        + (f"\nGoals missed: {'; '.join(missed)}" if missed else "\nAll goals met.")
    )
    print()
    print(table)
    print(footer)
    doc["footer"] = footer

    out_dir: Path = args.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.fromisoformat(doc["started"]).strftime("%Y%m%dT%H%M%SZ")
    text = json.dumps(doc, indent=2) + "\n"
    json_path = out_dir / f"bench-pg-{stamp}.json"
    json_path.write_text(text)
    (out_dir / "bench-pg-latest.json").write_text(text)
    png_path = out_dir / f"bench-pg-{stamp}.png"
    plot(doc, png_path)
    shutil.copyfile(png_path, out_dir / "bench-pg-latest.png")
    print(f"results: {json_path} (+ .png, bench-pg-latest.*)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
