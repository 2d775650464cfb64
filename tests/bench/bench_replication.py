"""Node-to-node replication (``kind = "replication"``): catch-up throughput and live apply latency.

Node B, the target, is always a separate ``python -m cdcd node run`` process (``cluster_id = 2``,
``replication_listen = "127.0.0.1:0"``, the port read from its ``replication_listening`` log line,
``cdc_enabled = false``, ``archive_max_bytes = 0``, otherwise node defaults: ``wal_mode = "fsync"``),
started fresh for every repetition, so its CPU is its own and it never holds the keys already.

- ``replication.catchup``: node A (cluster 1, written in setup, untimed, by a ``Node`` in this
  process in background mode with 16 MiB segments, then ``force_archive()`` and ``close()``) holds
  a backlog of 500k entries (50k with ``--quick``): fresh int keys, 100-byte values, ``put_all``
  transactions of 1000. Each repetition replays it twice from scratch as ``bench_daemon`` does
  (CDC links restored, daemon state deleted, ``Daemon.run()`` in this process timed until the
  committed position passes the last segment): first to the ``null`` consumer (the baseline), then
  to the ``replication`` consumer (defaults: 1024-entry requests, 4 in flight) pointed at B. A
  batch is confirmed only once B made every request of it durable, so that time is "B has applied
  everything". Checked: the consumer sent and B applied every entry, and B's cache holds exactly
  the backlog's keys (a ``NodeSnapshot`` of the stopped B). Rows: entries/s, the null baseline,
  replication as % of it, and CPU of this process (sender: reader, decoder, consumer) and of B's
  process over the replication run, in % of one core (``runs`` also give us/entry).
- ``replication.live``: node A in a writer subprocess (this module's ``writer``: ``wal_mode =
  "fsync"``, ``wal_force_archive_timeout_ms = 200``, ``put_all`` of 10 fresh keys at 5k
  entries/s; each value is 8 bytes of ``time.time_ns()`` taken just before its ``put_all``, padded
  to 100 bytes) and ``Daemon.run()`` in a thread of this process replicating to B. The writer
  writes for 12 s (3 s with ``--quick``), idles 1 s (the last segment rolls on the timeout), closes
  the node; the run waits until the consumer has sent every entry, stops the daemon and B, then
  reads B's WAL: apply latency of an entry = ``commit_ts_ns`` of the DataRecord that holds it on B
  (taken when B appended it; B's fsync follows before B answers) minus the origin time in its
  value. Entries written in the first 2 s (1 s) are dropped. p50 (the row's value), p99, max;
  the JSON ``runs`` add p90, ``newest_in_record_p50_ms`` (per DataRecord on B, the latency of its
  newest entry: roughly what the pipeline adds once an entry is out of A's open segment), A's
  commit latency and the CPU of sender and receiver.
- ``replication.live.realtime``: the same with node A's realtime mode (``realtime_cdc = true``,
  ``cdc_enabled = false``, ``realtime_consumer`` = the replication consumer table): the node's
  worker sends each flushed chunk, no segment roll, no daemon.

Both live rows also give ``cdcd_replication_apply_seconds`` of the sender (this process for the
daemon, the writer for realtime): its mean and the upper bound of the bucket holding its p99.

Run as a script, this module is the live benchmark's writer:
``python -m tests.bench.bench_replication writer --node-dir D --rate 5000 --seconds 12 --out F``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from cdcd import metrics
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node.node import Node
from cdcd.node.snapshot import NodeSnapshot
from cdcd.sinks import load_consumer
from cdcd.sinks.null import NullConsumer
from cdcd.sinks.replication import ReplicationConsumer
from cdcd.wal.reader import WalReader
from cdcd.wal.records import CacheRecord, DataRecord
from cdcd.wal.segment import list_segments
from tests.support.bench import (
    VALUE_100B,
    Bench,
    Measurement,
    Metric,
    _child_env,
    _percentile,
    _run_until,
    _stop,
    _tail,
)
from tests.support.cpu import cpu_s
from tests.support.pacing import Pacer
from tests.support.procs import reap

ROOT = Path(__file__).resolve().parents[2]
SEGMENT_BYTES = 16 << 20
CACHE = "bench"
TOKEN = "bench-replication-token-0123456789"
SOURCE_CLUSTER, TARGET_CLUSTER = 1, 2
CATCHUP_TX = 1000
LIVE_RATE = 5000
LIVE_TX = 10
LIVE_FORCE_ARCHIVE_MS = 200
LIVE_IDLE_S = 1.0
PAD = b"v" * (len(VALUE_100B) - 8)
"""Live values: 8 bytes of origin time + this = 98 bytes, 100 as MessagePack, like ``VALUE_100B``."""
START_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 60.0


def _bench_dir() -> str | None:
    return os.environ.get("CDCD_BENCH_DIR") or None


def _tmpdir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_bench_dir()))


def _toml(settings: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        return json.dumps(str(v))  # a TOML basic string for anything a temp path holds

    return "".join(f"{k} = {value(v)}\n" for k, v in settings.items())


def _token_file(work: Path) -> Path:
    path = work / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(TOKEN + "\n")
    return path


# --- node B: the target process -------------------------------------------------------------------
class Target:
    """``python -m cdcd node run`` of a fresh node B listening for replication on a free port."""

    def __init__(self, work: Path, token_file: Path) -> None:
        self.node_dir = work / "node-b"
        self.log_path = work / "node-b.log"
        config = work / "node-b.toml"
        config.write_text(
            _toml(
                {
                    "node_dir": str(self.node_dir),
                    "cluster_id": TARGET_CLUSTER,
                    "replication_listen": "127.0.0.1:0",
                    "replication_token_file": str(token_file),
                    "cdc_enabled": False,
                    "archive_max_bytes": 0,
                }
            )
        )
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cdcd", "node", "run", "--config", str(config), "--log-format", "json"],
                cwd=ROOT,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self.address = self._wait_listening()
        except BaseException:
            reap(self.proc)
            raise

    def _wait_listening(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if '"replication_listening"' in line:
                    return str(json.loads(line)["address"])
            if self.proc.poll() is not None:
                raise RuntimeError(f"node B exited {self.proc.returncode}:\n{_tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node B not listening after {START_TIMEOUT_S:.0f}s:\n{_tail(self.log_path)}")
            time.sleep(0.02)

    def cpu_s(self) -> float:
        return cpu_s(self.proc.pid)

    def stop(self) -> None:
        _stop(self.proc, self.log_path)

    def kill(self) -> None:
        reap(self.proc)


def _consumer(target: Target, token_file: Path) -> ReplicationConsumer:
    consumer = load_consumer({"kind": "replication", "target": target.address, "token_file": str(token_file)}).consumer
    assert isinstance(consumer, ReplicationConsumer)
    return consumer


class ApplyHistogram:
    """``cdcd_replication_apply_seconds`` of this process: a snapshot, and what was observed since."""

    def __init__(self) -> None:
        self.buckets, self.count, self.sum = self._read()

    @staticmethod
    def _read() -> tuple[dict[float, float], float, float]:
        buckets: dict[float, float] = {}
        count = total = 0.0
        for family in metrics.REPL_APPLY_SECONDS.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    buckets[float(s.labels["le"])] = s.value
                elif s.name.endswith("_count"):
                    count = s.value
                elif s.name.endswith("_sum"):
                    total = s.value
        return buckets, count, total

    def since(self) -> dict[str, Any]:
        """Requests, mean ms, and the upper bound (ms) of the bucket holding the p50 / p99."""
        buckets, count, total = self._read()
        n = count - self.count
        if n <= 0:
            return {"apply_requests": 0}
        out: dict[str, Any] = {"apply_requests": int(n), "apply_mean_ms": round((total - self.sum) / n * 1000, 2)}
        for q in (50, 99):
            le = next(le for le in sorted(buckets) if buckets[le] - self.buckets.get(le, 0.0) >= n * q / 100)
            out[f"apply_p{q}_le_ms"] = le * 1000
        return out


# --- replication.catchup --------------------------------------------------------------------------
class Backlog:
    """Node A with ``entries`` archived entries; ``restore()`` relinks them and forgets the daemon's state."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.entries = 0
        self.last = -1
        self._atexit = False

    @property
    def node_dir(self) -> Path:
        assert self.root is not None, "backlog not written"
        return self.root / "node-a"

    def ensure(self, entries: int) -> None:
        if self.root is not None and self.entries == entries:
            return
        self.cleanup()
        self.root = _tmpdir("cdcd-bench-repl-")
        if not self._atexit:
            atexit.register(self.cleanup)
            self._atexit = True
        node = Node.open(
            self.node_dir,
            cluster_id=SOURCE_CLUSTER,
            wal_mode="background",
            wal_segment_size_bytes=SEGMENT_BYTES,
            wal_force_archive_timeout_ms=0,
            archive_max_bytes=0,
        )
        try:
            put_all = node.cache(CACHE).put_all
            for start in range(0, entries, CATCHUP_TX):
                put_all(dict.fromkeys(range(start, min(start + CATCHUP_TX, entries)), VALUE_100B))
            node.force_archive()
        finally:
            node.close()
        self.entries = entries
        self.last = max(list_segments(self.node_dir / "cdc")[0])

    def restore(self) -> int:
        cdc = self.node_dir / "cdc"
        archived = list_segments(self.node_dir / "wal" / "archive")[0]
        links = list_segments(cdc)[0]
        for idx in range(self.last + 1):
            if idx not in links:
                os.link(archived[idx], cdc / archived[idx].name)
        shutil.rmtree(self.node_dir / "cdcd-state", ignore_errors=True)
        return self.last

    def cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            self.entries = 0


BACKLOG = Backlog()


def _replay(consumer: Any, last: int) -> tuple[float, float, int]:
    """``Daemon.run()`` until the committed position passes ``last``: (seconds, CPU seconds of this process, events)."""
    config = DaemonConfig(node_dir=str(BACKLOG.node_dir), metrics_address="")
    daemon = Daemon(config, consumer, show_progress=False)
    try:
        daemon.start()
        cpu0 = time.process_time()
        seconds, stop_hung = asyncio.run(_run_until(daemon, last))
        cpu = time.process_time() - cpu0
        delivered = daemon.events_delivered
    finally:
        daemon.close()
    if stop_hung:
        raise RuntimeError("Daemon.run() did not return after stop()")
    return seconds, cpu, delivered


def _count_target(node_dir: Path, entries: int) -> int:
    """Keys B's cache holds, checked to be exactly 0..entries-1."""
    with NodeSnapshot(node_dir) as snap:
        keys = {k for k, _v in snap.raw_items(CACHE)}
    encode = msgspec.msgpack.Encoder(order="deterministic").encode  # the node's key encoding
    want = {encode(i) for i in range(entries)}
    if keys != want:
        raise AssertionError(f"node B holds {len(keys):,} keys, {len(want - keys):,} of the backlog's missing")
    return len(keys)


def run_catchup(entries: int) -> Measurement:
    last = BACKLOG.restore()
    null_s, null_cpu, null_n = _replay(NullConsumer(), last)
    if null_n != entries:
        raise AssertionError(f"null: delivered {null_n:,} events, the backlog holds {entries:,}")

    last = BACKLOG.restore()
    work = _tmpdir("cdcd-bench-repl-b-")
    try:
        token = _token_file(work)
        target = Target(work, token)
        try:
            consumer = _consumer(target, token)
            hist = ApplyHistogram()
            b_cpu0 = target.cpu_s()
            seconds, cpu, delivered = _replay(consumer, last)
            b_cpu = target.cpu_s() - b_cpu0
            apply = hist.since()
        except BaseException:
            target.kill()
            raise
        target.stop()
        held = _count_target(target.node_dir, entries)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if delivered != entries or consumer.sent != entries or consumer.applied != entries:
        raise AssertionError(
            f"delivered {delivered:,}, sent {consumer.sent:,}, applied {consumer.applied:,} "
            f"(rejected {consumer.rejected:,}, duplicates {consumer.duplicates:,}) of {entries:,}"
        )
    rate, null_rate = entries / seconds, entries / null_s
    extra: dict[str, Any] = {
        "null_rate": round(null_rate),
        "kept_pct": round(100 * rate / null_rate, 1),
        "sender_cpu_pct": round(100 * cpu / seconds, 1),
        "receiver_cpu_pct": round(100 * b_cpu / seconds, 1),
        "sender_cpu_us_per_entry": round(cpu / entries * 1e6, 2),
        "receiver_cpu_us_per_entry": round(b_cpu / entries * 1e6, 2),
        "null_cpu_us_per_entry": round(null_cpu / entries * 1e6, 2),
        "target_keys": held,
        "segments": last + 1,
        **apply,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    return Measurement(entries, seconds, extra)


# --- replication.live -----------------------------------------------------------------------------
def _writer(args: argparse.Namespace) -> None:
    """Write ``rate`` entries/s (``put_all`` of LIVE_TX fresh keys, origin time in each value) for ``seconds``."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    realtime = bool(args.realtime_target)
    consumer = {"kind": "replication", "target": args.realtime_target, "token_file": args.token_file}
    hist = ApplyHistogram()
    cpu0 = time.process_time()
    node = Node.open(
        args.node_dir,
        cluster_id=SOURCE_CLUSTER,
        wal_mode="fsync",
        wal_segment_size_bytes=SEGMENT_BYTES,
        wal_force_archive_timeout_ms=args.force_archive_ms,
        archive_max_bytes=0,
        realtime_cdc=realtime,
        realtime_consumer=consumer if realtime else {},
        cdc_enabled=not realtime,
    )
    commit_ns: list[int] = []
    behind_max = elapsed = 0.0
    key = 0
    try:
        if realtime:
            from cdcd.realtime import RealtimeMode

            deadline = time.monotonic() + 10
            while node.realtime.mode is not RealtimeMode.ON:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"realtime mode still {node.realtime.mode.value} after 10 s")
                time.sleep(0.01)
        put_all = node.cache(CACHE).put_all
        pack, pad, tx = struct.Struct(">q").pack, PAD, LIVE_TX
        pacer = Pacer(args.rate, tx, args.seconds, stop.is_set)
        for key in pacer:
            t0 = time.time_ns()
            value = pack(t0) + pad
            put_all(dict.fromkeys(range(key, key + tx), value))
            commit_ns.append(time.time_ns() - t0)
        key, elapsed, behind_max = pacer.written, pacer.elapsed_s, pacer.behind_max_s
        stop.wait(args.idle_seconds)  # the last segment rolls on the force-archive timeout, as every other one did
    finally:
        node.close()  # realtime: drains the worker's buffer first
    commit_ns.sort()
    out = {
        "written": key,
        "seconds": elapsed,
        "behind_max_ms": round(behind_max * 1000, 1),
        "commit_p50_ms": round(_percentile(commit_ns, 50) / 1e6, 2) if commit_ns else None,
        "commit_p99_ms": round(_percentile(commit_ns, 99) / 1e6, 2) if commit_ns else None,
        "cpu_s": time.process_time() - cpu0,
        **(hist.since() if realtime else {}),
    }
    Path(args.out).write_text(json.dumps(out))


def _target_latencies(node_dir: Path) -> tuple[list[int], list[int], list[int]]:
    """Origin time (ns) and apply latency (ns) of every entry of CACHE in a stopped node B's WAL,
    and per DataRecord the latency of its newest entry (what the pipeline adds after a segment roll)."""
    wal = node_dir / "wal"
    work = list_segments(wal)[0]
    origin: list[int] = []
    lag: list[int] = []
    newest: list[int] = []
    unpack = struct.Struct(">q").unpack_from
    cache_id = None
    for _ptr, rec in WalReader([wal / "archive", wal], active_segment=max(work) if work else None):
        if type(rec) is CacheRecord and rec.name == CACHE:
            cache_id = rec.cache_id
        elif type(rec) is DataRecord:
            ts = rec.commit_ts_ns
            latest = 0
            for e in rec.entries:
                if e.cache_id == cache_id:
                    raw = bytes(e.value)  # bin8: 0xc4, length, then the writer's bytes
                    (t,) = unpack(raw, 2)
                    origin.append(t)
                    lag.append(ts - t)
                    latest = max(latest, t)
            if latest:
                newest.append(ts - latest)
    return origin, lag, newest


def _wait_sent(consumer: ReplicationConsumer, want: int, daemon_error: list[BaseException]) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while consumer.sent < want:
        if daemon_error:
            raise RuntimeError(f"daemon failed: {daemon_error[0]!r}") from daemon_error[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon sent {consumer.sent:,} of {want:,} entries in {DRAIN_TIMEOUT_S:.0f}s")
        time.sleep(0.02)


def run_live(*, realtime: bool, seconds: float, drop_s: float, rate: int) -> Measurement:
    work = _tmpdir("cdcd-bench-repl-live-")
    try:
        token = _token_file(work)
        node_a = work / "node-a"
        writer_out, writer_log = work / "writer.json", work / "writer.log"
        target = Target(work, token)
        writer: subprocess.Popen[bytes] | None = None
        daemon: Daemon | None = None
        daemon_thread: threading.Thread | None = None
        daemon_error: list[BaseException] = []
        consumer: ReplicationConsumer | None = None
        hist = ApplyHistogram()
        cpu0 = time.process_time()
        try:
            b_cpu0 = target.cpu_s()
            cmd = [
                sys.executable, "-m", "tests.bench.bench_replication", "writer",
                "--node-dir", str(node_a), "--rate", str(rate), "--seconds", str(seconds),
                "--idle-seconds", str(LIVE_IDLE_S), "--force-archive-ms", str(LIVE_FORCE_ARCHIVE_MS),
                "--out", str(writer_out),
            ]  # fmt: skip
            if realtime:
                cmd += ["--realtime-target", target.address, "--token-file", str(token)]
            with writer_log.open("wb") as wlog:
                writer = subprocess.Popen(
                    cmd, cwd=ROOT, env=_child_env(), stdin=subprocess.DEVNULL, stdout=wlog, stderr=subprocess.STDOUT
                )
            t_start = time.perf_counter()
            if not realtime:
                deadline = time.monotonic() + START_TIMEOUT_S
                while not (node_a / "cdc").is_dir():
                    if writer.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"writer did not open node A:\n{_tail(writer_log)}")
                    time.sleep(0.01)
                consumer = _consumer(target, token)
                daemon = Daemon(DaemonConfig(node_dir=str(node_a), metrics_address=""), consumer, show_progress=False)
                daemon.start()

                def main(d: Daemon = daemon) -> None:
                    try:
                        asyncio.run(d.run())
                    except BaseException as exc:
                        daemon_error.append(exc)

                daemon_thread = threading.Thread(target=main, name="bench-repl-daemon", daemon=True)
                daemon_thread.start()
            if writer.wait(seconds + LIVE_IDLE_S + START_TIMEOUT_S + 30) != 0:
                raise RuntimeError(f"writer exited {writer.returncode}:\n{_tail(writer_log)}")
            stats = json.loads(writer_out.read_text())
            if consumer is not None:
                _wait_sent(consumer, stats["written"], daemon_error)
            wall_s = time.perf_counter() - t_start
            b_cpu = target.cpu_s() - b_cpu0
            sender_cpu = time.process_time() - cpu0 if not realtime else stats["cpu_s"]
            apply = hist.since() if not realtime else {k: v for k, v in stats.items() if k.startswith("apply_")}
        except BaseException:
            reap(writer)
            target.kill()
            raise
        finally:
            if daemon is not None:
                daemon.stop()
                if daemon_thread is not None:
                    daemon_thread.join(10)
                daemon.close()
        if daemon_error:
            raise RuntimeError(f"daemon failed: {daemon_error[0]!r}") from daemon_error[0]
        target.stop()
        origin, lags, newest = _target_latencies(target.node_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len(origin) != stats["written"]:
        raise AssertionError(f"node B holds {len(origin):,} entries, the writer wrote {stats['written']:,}")
    cutoff = min(origin) + int(drop_s * 1e9)
    kept = sorted(lag for t, lag in zip(origin, lags, strict=True) if t >= cutoff)
    if not kept:
        raise AssertionError("no entries after the start-up window")
    window_s = (max(origin) - cutoff) / 1e9
    ms = 1e6
    extra: dict[str, Any] = {
        "p50_ms": round(_percentile(kept, 50) / ms, 2),
        "p90_ms": round(_percentile(kept, 90) / ms, 2),
        "p99_ms": round(_percentile(kept, 99) / ms, 2),
        "max_ms": round(kept[-1] / ms, 2),
        "min_ms": round(kept[0] / ms, 2),
        "newest_in_record_p50_ms": round(_percentile(sorted(newest), 50) / ms, 2),
        "target_records": len(newest),
        "written": stats["written"],
        "write_rate": round(stats["written"] / stats["seconds"]),
        "writer_behind_max_ms": stats["behind_max_ms"],
        "commit_p50_ms": stats["commit_p50_ms"],
        "commit_p99_ms": stats["commit_p99_ms"],
        **apply,
        "sender_cpu_pct": round(100 * sender_cpu / wall_s, 1),
        "receiver_cpu_pct": round(100 * b_cpu / wall_s, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    return Measurement(len(kept), window_s, extra, value=extra["p50_ms"])


# --- registration ---------------------------------------------------------------------------------
def benchmarks(quick: bool) -> list[Bench]:
    entries = 50_000 if quick else 500_000
    live_seconds, live_drop_s = (3.0, 1.0) if quick else (12.0, 2.0)
    shape = {"value_bytes": len(VALUE_100B) + 2, "wal_segment_size_bytes": SEGMENT_BYTES}
    live_params = {
        "rate": LIVE_RATE,
        "tx_size": LIVE_TX,
        "seconds": live_seconds,
        "dropped_s": live_drop_s,
        "wal_mode": "fsync",
        **shape,
    }
    live_rows = (
        Metric("p99", "p99_ms", "ms", lower_is_better=True),
        Metric("max", "max_ms", "ms", lower_is_better=True),
        Metric("sender apply_seconds mean", "apply_mean_ms", "ms", lower_is_better=True),
        Metric("achieved rate", "write_rate", "entries/s"),
    )

    def live(realtime: bool) -> Bench:
        how = "node A's realtime worker" if realtime else f"Daemon.run(), force-archive {LIVE_FORCE_ARCHIVE_MS} ms"
        return Bench(
            name="replication.live.realtime" if realtime else "replication.live",
            description=f"apply latency A->B under {LIVE_RATE:,} entries/s, {how}, {live_seconds:g}s",
            run_once=lambda: run_live(realtime=realtime, seconds=live_seconds, drop_s=live_drop_s, rate=LIVE_RATE),
            metric="p50",
            unit="ms",
            lower_is_better=True,
            max_repeats=3,
            more=live_rows,
            params={
                **live_params,
                "realtime": realtime,
                **({} if realtime else {"wal_force_archive_timeout_ms": LIVE_FORCE_ARCHIVE_MS}),
            },
        )

    return [
        Bench(
            name="replication.catchup",
            description=f"Daemon.run() replicating a {entries:,}-entry backlog from node A to node B (a process)",
            run_once=lambda: run_catchup(entries),
            setup=lambda: BACKLOG.ensure(entries),
            teardown=BACKLOG.cleanup,
            max_repeats=3,
            more=(
                Metric("null consumer, same backlog", "null_rate", "entries/s"),
                Metric("replication vs null", "kept_pct", "%"),
                Metric("sender cpu (daemon process)", "sender_cpu_pct", "%"),
                Metric("receiver cpu (node B process)", "receiver_cpu_pct", "%"),
            ),
            params={"entries": entries, "tx_size": CATCHUP_TX, "max_batch_size": 1024, "max_in_flight": 4, **shape},
        ),
        live(False),
        live(True),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_replication")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer", help="the live benchmark's node A")
    w.add_argument("--node-dir", required=True)
    w.add_argument("--rate", type=int, default=LIVE_RATE)
    w.add_argument("--seconds", type=float, default=12.0)
    w.add_argument("--idle-seconds", type=float, default=LIVE_IDLE_S)
    w.add_argument("--force-archive-ms", type=int, default=LIVE_FORCE_ARCHIVE_MS)
    w.add_argument("--realtime-target", default="", help="host:port of node B: realtime mode, no CDC links")
    w.add_argument("--token-file", default="")
    w.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from cdcd.logging import configure as configure_logging

    configure_logging("json", "warning")
    _writer(args)


if __name__ == "__main__":
    main()
