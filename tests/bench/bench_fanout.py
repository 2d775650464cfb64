"""Several consumers of one daemon (issue 45): the read is shared, and one consumer's outage holds back no other.

- ``fanout.read_once``: a backlog of ``$BENCH_FANOUT_ENTRIES`` entries (default 200k, 50k with ``--quick``;
  the issue's goal is stated for ``BENCH_FANOUT_ENTRIES=1000000``), written once (untimed) by a ``Node`` in
  this process in background mode with 16 MiB segments: fresh int keys, 100-byte values, ``put_all`` of 10.
  Each repetition replays it twice with a ``cdcd run`` process: one ``null`` consumer, then
  three (``[consumers.<name>]`` tables), each time from an empty daemon state. The daemon is
  started on an empty CDC dir and left to settle, its CPU (utime + stime of ``/proc/<pid>/stat``, every
  thread) read, then every archived segment is linked into the CDC dir at once and the CPU read again once
  the daemon has consumed (deleted) every link: start-up and imports are not counted. The row is the CPU per
  entry with three consumers over the CPU per entry with one (goal <= 1.5: the segments are read and
  decoded once, not three times); the JSON ``runs`` add both in us/entry, the wall times and the daemon's
  shared-read hits and misses (its ``daemon_stopped`` line).
- ``fanout.outage``: one daemon process with three consumers of a live node: ``lake`` (``writer =
  "deltalake"``, compaction and optimize off), ``kafka`` (a real broker, scripts/kafka.sh, ``--profile
  standard``, 3 partitions, ``retry_timeout_s`` far past the outage) and ``replica`` (``kind =
  "replication"`` to a separate ``cdcd node run`` process, cluster 2, ``cdc_enabled = false``). The node is
  this module's ``writer`` subprocess (``wal_mode = "fsync"``, ``wal_force_archive_timeout_ms = 200``,
  ``put_all`` of 10 fresh keys at ``$BENCH_FANOUT_RATE`` entries/s, default 2000; the issue's goal is
  stated for 5000). After ``$BENCH_FANOUT_WARMUP_S`` (default 10 s) the broker is stopped (``kafka.sh
  stop``) for ``$BENCH_FANOUT_OUTAGE_S`` (default 30 s; the issue's goal is stated for 120), then started
  again; the writer writes 5 s more and stops, and the run waits until every consumer's committed position
  (``cdcd state show --json``) is at the end of the WAL. Lag of an entry, for entries whose node commit
  falls inside the outage:

  * lake: the modification time of the Delta log file (``changes/_delta_log/<version>.json``) of the
    commit that added the entry's row, minus the row's ``commit_ts`` (the node's commit);
  * replica: the ``commit_ts_ns`` of the DataRecord holding the key on the replica (taken when it appended
    it) minus the ``commit_ts_ns`` of the DataRecord holding it on the source.

  p50 (the row's value), p99 (goal <= 2000 ms each) and max; in the JSON also the p99 of each phase of the
  outage (``stopping``: ``kafka.sh stop`` running, ``down``, ``starting``: ``kafka.sh start`` running, until
  the broker answers) and of Kafka's catch-up after it (``catchup``, outside the row's window);
  ``*_before_p99_ms``: the p99 of the entries
  committed in the second half of the warm-up, the broker up (what the machine gives without the outage).
  Checked afterwards: the topic (read_committed) holds every WAL entry exactly once, the lake's rows are every
  WAL entry once, the replica holds every key. ``kafka_catchup_s``: from the broker's return until Kafka's
  position reached where the lake was then.

  ``$BENCH_FANOUT_BACKLOG`` entries (default 0; the issue's row: 1000000) are written by the writer before the
  daemon starts (background mode, as fast as the node takes them, keys apart from the live ones); then the live
  writes begin and the daemon starts: the three consumers catch up over the backlog while the node writes.
  ``<name>_caught_up_s``: from the daemon's start until the consumer's position is past the backlog and at the
  newest archived segment. With ``BENCH_FANOUT_OUTAGE_S=0`` the broker is not stopped and the row's window is
  the ``$BENCH_FANOUT_WARMUP_S`` of live writes once every consumer caught up (``*_before_p99_ms``: its second
  half); the exactly-once checks are the same.

Run as a script, this module is the outage benchmark's writer:
``python -m tests.bench.bench_fanout writer --node-dir D --rate 2000 --out F [--backlog N]`` (until SIGTERM).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from cdcd.node.node import Node
from cdcd.wal import CacheRecord, DataRecord
from cdcd.wal.segment import list_segments
from tests.bench.bench_replication import Target
from tests.support.bench import (
    ROOT,
    VALUE_100B,
    Bench,
    Measurement,
    Metric,
    _child_env,
    _links,
    _percentile,
    _stop,
    _tail,
)
from tests.support.config import NO_MAINTENANCE
from tests.support.cpu import cpu_s
from tests.support.kafka import LIBS, Broker, read_topic
from tests.support.kafka import positions_of as kafka_positions
from tests.support.lake import toml_value
from tests.support.pacing import Pacer
from tests.support.procs import reap
from tests.support.wal import wal_records

SEGMENT_BYTES = 16 << 20
TX_SIZE = 10
CACHE = "bench"
READ_ONCE_GOAL = 1.5
LAG_GOAL_MS = 2000.0
FORCE_ARCHIVE_MS = 200
AFTER_S = 5.0
SETTLE_S = 2.0
DRAIN_TIMEOUT_S = 600.0
TOKEN = "bench-fanout-token-0123456789abcdef"
POSITION_COLUMNS = ("wal_segment", "wal_offset", "wal_index")
BACKLOG_KEY_BASE = 1 << 40
"""The backlog's keys start here: apart from the live writer's, which start at 0."""
BACKLOG_TIMEOUT_S = 1800.0


def _bench_dir() -> str | None:
    return os.environ.get("CDCD_BENCH_DIR") or None


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def _write_config(path: Path, node_dir: Path, consumers: dict[str, dict[str, Any]], **settings: Any) -> Path:
    """A daemon config of ``[consumers.<name>]`` tables."""
    values = {"node_dir": str(node_dir), "metrics_address": "", "log_format": "json", **settings}
    lines = [f"{k} = {toml_value(v)}" for k, v in values.items()]
    for name, table in consumers.items():
        lines.append(f"[consumers.{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _start_daemon(config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "cdcd", "run", "--config", str(config)],
            cwd=ROOT,
            env=_child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


def _log_events(path: Path, name: str) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            event = json.loads(line)
            if event.get("event") == name:
                out.append(event)
    return out


def _wait(pred: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if proc.poll() is not None:
            raise RuntimeError(f"cdcd run exited {proc.returncode} waiting for {what}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f}s:\n{_tail(log)}")
        time.sleep(0.02)


# --- fanout.read_once -----------------------------------------------------------------------------
class Backlog:
    """A closed node whose archive holds the backlog; its CDC dir is emptied between runs."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.entries = 0

    @property
    def node_dir(self) -> Path:
        assert self.root is not None, "backlog not written"
        return self.root / "node"

    def ensure(self, entries: int) -> None:
        if self.root is not None and self.entries == entries:
            return
        self.cleanup()
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-fanout-", dir=_bench_dir()))
        atexit.register(self.cleanup)
        _put_backlog(self.node_dir, 0, entries)
        self.entries = entries

    def empty(self) -> None:
        """No link in the CDC dir and no daemon state: a run starts from nothing."""
        for path in _links(self.node_dir / "cdc").values():
            path.unlink()
        shutil.rmtree(self.node_dir / "cdcd-state", ignore_errors=True)

    def link_all(self) -> int:
        """Every archived segment linked into the CDC dir; returns how many."""
        archived = list_segments(self.node_dir / "wal" / "archive")[0]
        for path in archived.values():
            os.link(path, self.node_dir / "cdc" / path.name)
        return len(archived)

    def cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            self.entries = 0


BACKLOG = Backlog()


def _replay_cpu(consumers: int, work: Path) -> dict[str, Any]:
    """CPU seconds (and wall seconds) of a ``cdcd run`` of ``consumers`` null consumers over the backlog."""
    BACKLOG.empty()
    tables = {f"c{i}": {"kind": "null"} for i in range(consumers)}
    config = _write_config(work / f"fanout-{consumers}.toml", BACKLOG.node_dir, tables, check_interval_ms=50)
    log = work / f"daemon-{consumers}.log"
    log.unlink(missing_ok=True)
    proc = _start_daemon(config, log)
    try:
        _wait(lambda: bool(_log_events(log, "daemon_started")), 60, "daemon_started", proc, log)
        time.sleep(SETTLE_S)  # what the start left (a first scan, a first commit) is not counted
        cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
        segments = BACKLOG.link_all()
        cdc = BACKLOG.node_dir / "cdc"
        _wait(lambda: not _links(cdc), DRAIN_TIMEOUT_S, "every link consumed", proc, log)
        wall = time.perf_counter() - t0
        cpu = cpu_s(proc.pid) - cpu0
    except BaseException:
        reap(proc)
        raise
    _stop(proc, log)
    stopped = _log_events(log, "daemon_stopped")
    reads = stopped[-1].get("shared_reads", {}) if stopped else {}
    return {"cpu_s": cpu, "wall_s": wall, "segments": segments, **reads}


def run_read_once(entries: int) -> Measurement:
    assert BACKLOG.root is not None
    work = BACKLOG.root
    one = _replay_cpu(1, work)
    three = _replay_cpu(3, work)
    ratio = three["cpu_s"] / one["cpu_s"]
    extra = {
        "one_us_per_entry": round(one["cpu_s"] / entries * 1e6, 2),
        "three_us_per_entry": round(three["cpu_s"] / entries * 1e6, 2),
        "one_wall_s": round(one["wall_s"], 2),
        "three_wall_s": round(three["wall_s"], 2),
        "segments": one["segments"],
        "shared_hits": three.get("hits"),
        "shared_misses": three.get("misses"),
    }
    return Measurement(entries, three["wall_s"], extra, value=round(ratio, 3))


def _put_backlog(node_dir: Path, first_key: int, entries: int) -> int | None:
    """``entries`` fresh keys from ``first_key`` in ``put_all`` of TX_SIZE, in background mode as fast as the node
    takes them, then archived; the index of the last segment archived."""
    node = Node.open(
        node_dir,
        wal_mode="background",
        wal_segment_size_bytes=SEGMENT_BYTES,
        wal_force_archive_timeout_ms=0,
        archive_max_bytes=0,
    )
    try:
        put_all = node.cache(CACHE).put_all
        end = first_key + entries
        for start in range(first_key, end, TX_SIZE):
            put_all(dict.fromkeys(range(start, min(start + TX_SIZE, end)), VALUE_100B))
        return node.force_archive()
    finally:
        node.close()


# --- fanout.outage --------------------------------------------------------------------------------
def _write_backlog(node_dir: str, entries: int, out: str) -> None:
    """``entries`` entries (``put_all`` of TX_SIZE fresh keys from BACKLOG_KEY_BASE) as fast as the node takes them,
    in background mode, archived; then ``<out>.backlog`` says where they end (the position after their last
    segment) and how long they took to write."""
    began = time.monotonic()
    last = _put_backlog(Path(node_dir), BACKLOG_KEY_BASE, entries)
    assert last is not None, "the backlog wrote no segment"
    done = {"end": [last + 1, 0, 0], "entries": entries, "seconds": round(time.monotonic() - began, 1)}
    Path(out + ".backlog").write_text(json.dumps(done))


def _writer(node_dir: str, rate: int, out: str, backlog: int = 0) -> None:
    """Write ``backlog`` entries at once (``_write_backlog``), then ``rate`` entries/s (``put_all`` of TX_SIZE fresh
    keys on a fixed schedule) until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if backlog:
        _write_backlog(node_dir, backlog, out)
    node = Node.open(
        node_dir,
        wal_mode="fsync",
        wal_segment_size_bytes=SEGMENT_BYTES,
        wal_force_archive_timeout_ms=FORCE_ARCHIVE_MS,
        archive_max_bytes=0,
    )
    try:
        put_all = node.cache(CACHE).put_all
        pacer = Pacer(rate, TX_SIZE, float("inf"), stop.is_set)
        for key in pacer:
            put_all(dict.fromkeys(range(key, key + TX_SIZE), VALUE_100B))
        stop.wait(FORCE_ARCHIVE_MS * 3 / 1000)  # let the last segment roll on the timeout, as every other
    finally:
        node.close()
    stats = {"written": pacer.written, "seconds": pacer.elapsed_s, "behind_max_ms": round(pacer.behind_max_s * 1e3, 1)}
    Path(out).write_text(json.dumps(stats))


def _positions(config: Path) -> dict[str, tuple[int, int, int] | None]:
    res = subprocess.run(
        [sys.executable, "-m", "cdcd", "state", "show", "--config", str(config), "--json"],
        cwd=ROOT,
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if res.returncode != 0:
        raise RuntimeError(f"cdcd state show exited {res.returncode}: {res.stderr[-2000:]}")
    consumers = json.loads(res.stdout)["consumers"]
    return {n: tuple(c["position_parts"]) if c["position_parts"] else None for n, c in consumers.items()}


def _keyed_commits(node_dir: Path) -> tuple[dict[bytes, int], list[tuple[int, int, int]]]:
    """Per key of CACHE the commit time of the DataRecord holding it, and every data entry's position."""
    names: dict[int, str] = {}
    commit: dict[bytes, int] = {}
    positions: list[tuple[int, int, int]] = []
    for ptr, rec in wal_records(node_dir):
        if type(rec) is CacheRecord:
            names[rec.cache_id] = rec.name
        elif type(rec) is DataRecord:
            for i, e in enumerate(rec.entries):
                positions.append((ptr.segment, ptr.offset, i))
                if names.get(e.cache_id) == CACHE:
                    commit[bytes(e.key)] = rec.commit_ts_ns
    return commit, positions


def _lake_lags(lake: Path) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """(node commit ns, lake commit ns) of every row of ``<lake>/changes``, and the rows' WAL positions."""
    log_dir = lake / "changes" / "_delta_log"
    out: list[tuple[int, int]] = []
    positions: list[tuple[int, int, int]] = []
    for path in sorted(log_dir.glob("*.json")):
        committed = path.stat().st_mtime_ns
        for line in path.read_text().splitlines():
            add = json.loads(line).get("add") if line.strip() else None
            if not add or not add.get("dataChange", True):
                continue
            t = pq.read_table(
                lake / "changes" / add["path"], columns=["commit_ts", "wal_segment", "wal_offset", "wal_index"]
            )
            ts = t.column("commit_ts").cast("int64").to_pylist()  # microseconds
            out += [(us * 1000, committed) for us in ts]
            positions += zip(*(t.column(c).to_pylist() for c in POSITION_COLUMNS), strict=True)
    return out, positions


def _stats_ms(lags_ns: list[int]) -> dict[str, float]:
    if not lags_ns:
        raise AssertionError("no entry was committed in the window")
    lags_ns.sort()
    return {
        "p50_ms": round(_percentile(lags_ns, 50) / 1e6, 1),
        "p99_ms": round(_percentile(lags_ns, 99) / 1e6, 1),
        "max_ms": round(lags_ns[-1] / 1e6, 1),
    }


def run_outage(*, rate: int, warmup_s: float, outage_s: float, backlog: int = 0) -> Measurement:
    if not LIBS.is_dir():
        raise RuntimeError(f"{LIBS} missing: run `make install` first")
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-fanout-outage-", dir=_bench_dir()))
    broker = Broker(work / "broker", profile="standard")
    replica: Target | None = None
    writer: subprocess.Popen[bytes] | None = None
    daemon: subprocess.Popen[bytes] | None = None
    broker_up = False
    try:
        broker.start()
        broker_up = True
        token = work / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        replica = Target(work, token)
        node_dir, lake, topic = work / "node", work / "lake", "fanout"
        config = _write_config(
            work / "fanout.toml",
            node_dir,
            {
                "lake": {"kind": "lake", "lake_path": str(lake), "writer": "deltalake", **NO_MAINTENANCE},
                "kafka": {
                    "kind": "kafka",
                    "bootstrap_servers": broker.bootstrap,
                    "topic": topic,
                    "topic_partitions": 3,
                    "retry_timeout_s": 3600,
                },
                "replica": {"kind": "replication", "target": replica.address, "token_file": str(token)},
            },
        )
        writer_out, writer_log, daemon_log = work / "writer.json", work / "writer.log", work / "daemon.log"
        with writer_log.open("wb") as wlog:
            writer = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    "writer",
                    "--node-dir",
                    str(node_dir),
                    "--rate",
                    str(rate),
                    "--out",
                    str(writer_out),
                    "--backlog",
                    str(backlog),
                ],
                cwd=ROOT,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=wlog,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while not (node_dir / "cdc").is_dir():
            if writer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the writer did not open its node:\n{_tail(writer_log)}")
            time.sleep(0.02)
        backlog_done: dict[str, Any] = {}
        if backlog:
            marker = Path(f"{writer_out}.backlog")
            deadline = time.monotonic() + BACKLOG_TIMEOUT_S
            while not marker.exists():
                if writer.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the writer did not write its backlog:\n{_tail(writer_log)}")
                time.sleep(0.2)
            backlog_done = json.loads(marker.read_text())
        daemon = _start_daemon(config, daemon_log)
        d = daemon
        _wait(lambda: bool(_log_events(daemon_log, "daemon_started")), 120, "daemon_started", d, daemon_log)
        live_ns = time.time_ns() + int(warmup_s / 2 * 1e9)
        caught = _caught_up(config, node_dir, tuple(backlog_done["end"]), d, daemon_log) if backlog else {}
        if backlog:
            live_ns = time.time_ns()
        time.sleep(warmup_s)
        down_ns = stopped_ns = starting_ns = up_ns = time.time_ns()
        up_at = time.monotonic()
        catchup_s = 0.0
        if outage_s > 0:
            broker.stop()
            stopped_ns = time.time_ns()
            broker_up = False
            time.sleep(outage_s)
            starting_ns = time.time_ns()
            broker.start()
            broker_up = True
            up_ns = time.time_ns()
            up_at = time.monotonic()
            catchup_s = _kafka_catchup(config, up_at, d, daemon_log)
        time.sleep(max(0.0, AFTER_S - (time.monotonic() - up_at)))
        writer.send_signal(signal.SIGTERM)
        if writer.wait(60) != 0:
            raise RuntimeError(f"the writer exited {writer.returncode}:\n{_tail(writer_log)}")
        end = (max(list_segments(node_dir / "wal" / "archive")[0]) + 1, 0, 0)
        _wait(
            lambda: set(_positions(config).values()) == {end},
            DRAIN_TIMEOUT_S,
            "every consumer at the end",
            d,
            daemon_log,
        )
        _stop(daemon, daemon_log)
        # catchup_max_share at work: how often each consumer was held back, and for how long in all.
        throttled = Counter(e["consumer"] for e in _log_events(daemon_log, "consumer_catchup_throttled"))
        waited = {e["consumer"]: e.get("waited_s") for e in _log_events(daemon_log, "consumer_catchup_unthrottled")}
        replica_proc = replica.proc
        _stop(replica_proc, replica.log_path)
        written = json.loads(writer_out.read_text())
        source, expected = _keyed_commits(node_dir)
        target, _ = _keyed_commits(replica.node_dir)
        lake_rows, lake_positions = _lake_lags(lake)
        sent = [p for ps in kafka_positions(read_topic(broker.bootstrap, topic)).values() for p in ps]
    finally:
        reap(writer)
        reap(daemon)
        if replica is not None:
            reap(replica.proc)
        if broker_up:
            broker.stop()
        shutil.rmtree(work, ignore_errors=True)
    want = Counter(expected)
    if len(expected) != written["written"] + backlog:
        raise AssertionError(
            f"the WAL holds {len(expected):,} entries, the writer wrote {written['written']:,} and {backlog:,} before"
        )
    if Counter(sent) != want:
        raise AssertionError(f"Kafka: {len(sent):,} messages for {len(expected):,} entries, not each once")
    if Counter(lake_positions) != want:
        raise AssertionError(f"lake: {len(lake_positions):,} rows for {len(expected):,} entries, not each once")
    if set(target) != set(source):
        raise AssertionError(f"replica: {len(target):,} keys, the source {len(source):,}")
    # The row's window: the outage, or without one the live writes once every consumer caught up.
    win = (down_ns, up_ns) if outage_s > 0 else (live_ns, up_ns)
    lake_ms = _stats_ms([done - ts for ts, done in lake_rows if win[0] <= ts <= win[1]])
    replica_ms = _stats_ms([target[k] - ts for k, ts in source.items() if win[0] <= ts <= win[1]])
    # The same over the second half of the warm-up, the broker up: what the machine gives without the outage.
    calm_ns = down_ns - int(warmup_s / 2 * 1e9)
    lake_calm = _stats_ms([done - ts for ts, done in lake_rows if calm_ns <= ts < down_ns])
    replica_calm = _stats_ms([target[k] - ts for k, ts in source.items() if calm_ns <= ts < down_ns])
    # By phase of the outage: the broker's JVM stopping and starting takes much of a small machine's CPU.
    phases = {
        "stopping": (down_ns, stopped_ns),
        "down": (stopped_ns, starting_ns),
        "starting": (starting_ns, up_ns),
        "catchup": (up_ns, up_ns + int(catchup_s * 1e9)),
    }
    by_phase: dict[str, float | None] = {}
    for phase, (a, b) in phases.items() if outage_s > 0 else ():
        lake_in = [done - ts for ts, done in lake_rows if a <= ts < b]
        replica_in = [target[k] - ts for k, ts in source.items() if a <= ts < b]
        by_phase[f"{phase}_s"] = round((b - a) / 1e9, 1)
        by_phase[f"lake_{phase}_p99_ms"] = _stats_ms(lake_in)["p99_ms"] if lake_in else None
        by_phase[f"replica_{phase}_p99_ms"] = _stats_ms(replica_in)["p99_ms"] if replica_in else None
    extra = {
        **{f"lake_{k}": v for k, v in lake_ms.items()},
        **{f"replica_{k}": v for k, v in replica_ms.items()},
        "lake_before_p99_ms": lake_calm["p99_ms"],
        "replica_before_p99_ms": replica_calm["p99_ms"],
        "outage_s": round((up_ns - down_ns) / 1e9, 1),
        **(
            {
                "backlog": backlog_done["entries"],
                "backlog_write_s": backlog_done["seconds"],
                **{f"{name}_caught_up_s": round(s, 1) for name, s in caught.items()},
            }
            if backlog
            else {}
        ),
        **by_phase,
        "kafka_catchup_s": round(catchup_s, 1),
        "throttled": {name: {"times": n, "waited_s": waited.get(name)} for name, n in throttled.items()},
        "written": written["written"],
        "write_rate": round(written["written"] / written["seconds"]),
        "writer_behind_max_ms": written["behind_max_ms"],
    }
    return Measurement(len(expected), (win[1] - win[0]) / 1e9, extra, value=lake_ms["p50_ms"])


def _caught_up(
    config: Path, node_dir: Path, backlog_end: tuple[int, ...], daemon: subprocess.Popen[bytes], log: Path
) -> dict[str, float]:
    """Seconds from now until each consumer is past the backlog and within a segment of the newest archived one."""
    began = time.monotonic()
    caught: dict[str, float] = {}
    archive = node_dir / "wal" / "archive"
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"cdcd run exited {daemon.returncode}:\n{_tail(log)}")
        head = (max(list_segments(archive)[0]), 0, 0)
        positions = _positions(config)
        for name, pos in positions.items():
            if name not in caught and pos is not None and pos >= backlog_end and pos >= head:
                caught[name] = time.monotonic() - began
        if len(caught) == len(positions):
            return caught
        if time.monotonic() - began > BACKLOG_TIMEOUT_S:
            raise TimeoutError(f"not every consumer past the backlog after {BACKLOG_TIMEOUT_S:.0f}s: {positions}")
        time.sleep(0.5)


def _kafka_catchup(config: Path, up_at: float, daemon: subprocess.Popen[bytes], log: Path) -> float:
    """Seconds from the broker's return (``up_at``) until Kafka's position reached where the lake was then."""
    lake_then = _positions(config)["lake"]
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"cdcd run exited {daemon.returncode}:\n{_tail(log)}")
        kafka_now = _positions(config)["kafka"]
        if kafka_now is not None and lake_then is not None and kafka_now >= lake_then:
            return time.monotonic() - up_at
        if time.monotonic() - up_at > DRAIN_TIMEOUT_S:
            raise TimeoutError(f"Kafka at {kafka_now}, not at {lake_then} {DRAIN_TIMEOUT_S:.0f}s after the broker")
        time.sleep(0.2)


# --- registration ---------------------------------------------------------------------------------
def benchmarks(quick: bool) -> list[Bench]:
    entries = int(_env_number("BENCH_FANOUT_ENTRIES", 200_000 if quick else 1_000_000))
    rate = int(_env_number("BENCH_FANOUT_RATE", 2000))
    outage_s = _env_number("BENCH_FANOUT_OUTAGE_S", 10.0 if quick else 30.0)
    warmup_s = _env_number("BENCH_FANOUT_WARMUP_S", 5.0 if quick else 10.0)
    backlog = int(_env_number("BENCH_FANOUT_BACKLOG", 0))
    return [
        Bench(
            name="fanout.read_once",
            description=f"daemon CPU per entry, three null consumers over one, {entries:,}-entry backlog",
            run_once=lambda: run_read_once(entries),
            metric="cpu_ratio",
            unit="x",
            goal=READ_ONCE_GOAL,
            lower_is_better=True,
            max_repeats=3,
            setup=lambda: BACKLOG.ensure(entries),
            teardown=BACKLOG.cleanup,
            more=(
                Metric("cpu.one", "one_us_per_entry", "us/entry", lower_is_better=True),
                Metric("cpu.three", "three_us_per_entry", "us/entry", lower_is_better=True),
            ),
            params={"entries": entries, "tx_size": TX_SIZE, "wal_segment_size_bytes": SEGMENT_BYTES},
        ),
        Bench(
            name="fanout.outage",
            description=(
                f"lake, Kafka, replica from one node at {rate} entries/s"
                + (f" after a {backlog:,}-entry backlog" if backlog else "")
                + (f"; lag while Kafka's broker is down {outage_s:.0f}s" if outage_s > 0 else "; lag once caught up")
            ),
            run_once=lambda: run_outage(rate=rate, warmup_s=warmup_s, outage_s=outage_s, backlog=backlog),
            metric="lake.p50",
            unit="ms",
            lower_is_better=True,
            max_repeats=1,
            more=(
                Metric("lake.p99", "lake_p99_ms", "ms", LAG_GOAL_MS, lower_is_better=True),
                Metric("lake.max", "lake_max_ms", "ms", lower_is_better=True),
                Metric("replica.p50", "replica_p50_ms", "ms", lower_is_better=True),
                Metric("replica.p99", "replica_p99_ms", "ms", LAG_GOAL_MS, lower_is_better=True),
                Metric("replica.max", "replica_max_ms", "ms", lower_is_better=True),
                Metric("lake.before.p99", "lake_before_p99_ms", "ms", lower_is_better=True),
                Metric("replica.before.p99", "replica_before_p99_ms", "ms", lower_is_better=True),
                Metric("kafka.catchup", "kafka_catchup_s", "s", lower_is_better=True),
            ),
            params={
                "rate": rate,
                "outage_s": outage_s,
                "warmup_s": warmup_s,
                "backlog": backlog,
                "tx_size": TX_SIZE,
                "wal_force_archive_timeout_ms": FORCE_ARCHIVE_MS,
            },
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_fanout")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer", help="the outage benchmark's node: writes until SIGTERM")
    w.add_argument("--node-dir", required=True)
    w.add_argument("--rate", type=int, required=True)
    w.add_argument("--out", required=True)
    w.add_argument("--backlog", type=int, default=0)
    args = ap.parse_args(argv)
    from cdcd.logging import configure as configure_logging

    configure_logging("json", "warning")
    _writer(args.node_dir, args.rate, args.out, args.backlog)


if __name__ == "__main__":
    main()
