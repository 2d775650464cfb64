"""The CDC daemon: backlog replay throughput, live lag in archive mode, and peak memory.

The backlog (setup, untimed, shared by the replay and memory benchmarks): one node dir
(``$CDCD_BENCH_DIR`` or the system temp dir) written by a ``Node`` in background mode with 16 MiB
segments, ``wal_force_archive_timeout_ms=0`` (segments roll only when full) and
``archive_max_bytes=0`` (the archive keeps every segment): fresh int keys, 100-byte values,
``put_all`` transactions of 10 entries, then ``force_archive()`` and ``close()``. The 1M backlog
(200k with ``--quick``) is written once; the memory benchmark grows the same node to 5M (1M) and
remembers which segments hold the first part. Before every repetition the CDC links (hard links
of ``wal/archive/*.wal``, which the daemon deletes as it commits) are restored and the daemon's
state dir (``<node>/cdcd-state``) is deleted, so each run replays the same backlog from scratch
(PASSIVE until the node's Stop record, then ACTIVE). The segments were just written and are in
the page cache. The daemon runs with ``DaemonConfig`` defaults (batch 50k events / 16 MiB,
queues of 2, 1024-record read chunks).

- ``daemon.replay.null``: ``Daemon.run()`` in-process as an asyncio task, timed from its start
  until ``state.position.segment`` passes the last link (polled every 5 ms), to the ``null``
  consumer. ``daemon.replay.null.sync_once`` is the same through ``sync_once()``. A run after
  which ``run()`` did not return on ``stop()`` (a cdcd bug, see ``_run_until``) says
  ``stop_hung=True``; its time is unaffected.
- ``daemon.replay.jsonl``: ``run()`` to the ``jsonl`` consumer (a temp file, fsync per batch).
- ``daemon.lag.archive``: a writer subprocess (this module's ``lag-writer``: a node with
  ``wal_mode=fsync``, ``wal_force_archive_timeout_ms=1000``, ``put_all`` of 10 fresh keys at a
  fixed rate of 5k entries/s) and a ``cdcd run`` subprocess whose python consumer
  (``LagConsumer`` below) records ``time.time_ns() - event.commit_ts_ns`` of every event when its
  batch is handed over. The writer writes for 20 s (6 s with ``--quick``), then idles 2.5 s so the
  last segment rolls on the timeout as any other; once the daemon has consumed every link it is
  stopped. Events committed in the first 3 s (2 s) are dropped (start-up). p50/p99/max in ms.
- ``daemon.rss``: peak RSS (``VmHWM``) of a ``cdcd run`` subprocess (null consumer, no metrics
  endpoint) replaying the small and the big backlog, and how far apart the two are.

Run as a script, this module is the lag benchmark's writer:
``python -m tests.bench.bench_daemon lag-writer --node-dir D --rate 5000 --seconds 20 --out F``.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import atexit
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
from pathlib import Path
from typing import Any

from cdcd.consumer import Consumer, EventBatch
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node.node import Node
from cdcd.sinks.jsonl import JsonlConsumer
from cdcd.sinks.null import NullConsumer
from cdcd.wal.segment import list_segments
from tests.support.bench import (
    DRAIN_TIMEOUT_S,
    ROOT,
    VALUE_100B,
    Bench,
    Measurement,
    Metric,
    _child_env,
    _links,
    _percentile,
    _run_until,
    _stop,
    _tail,
)
from tests.support.pacing import Pacer
from tests.support.procs import reap

SEGMENT_BYTES = 16 << 20
TX_SIZE = 10
REPLAY_GOAL = 500_000.0
LAG_RATE = 5000
LAG_FORCE_ARCHIVE_MS = 1000
LAG_GOAL_MS = LAG_FORCE_ARCHIVE_MS + 150.0
LAG_IDLE_S = 2.5
RSS_GOAL_MB = 150.0
RSS_GROWTH_GOAL_PCT = 10.0


def _bench_dir() -> str | None:
    return os.environ.get("CDCD_BENCH_DIR") or None


def _label(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k"


# --- the backlog ----------------------------------------------------------------------------------
BACKLOG_NODE_SETTINGS: dict[str, Any] = {
    "wal_mode": "background",
    "wal_segment_size_bytes": SEGMENT_BYTES,
    "wal_force_archive_timeout_ms": 0,
    "archive_max_bytes": 0,
}


class Backlog:
    """One node whose archive holds ``written`` entries; ``marks[n]`` is the last segment of the first ``n``.

    Grown on demand (``ensure``); ``restore(n)`` makes the CDC dir hold exactly the links of the
    first ``n`` entries' segments and deletes the daemon's state.
    """

    def __init__(self) -> None:
        self.root: Path | None = None
        self.written = 0
        self.marks: dict[int, int] = {}
        self.write_seconds: dict[int, float] = {}

    @property
    def node_dir(self) -> Path:
        assert self.root is not None, "backlog not written"
        return self.root / "node"

    @property
    def cdc_dir(self) -> Path:
        return self.node_dir / "cdc"

    @property
    def archive_dir(self) -> Path:
        return self.node_dir / "wal" / "archive"

    @property
    def state_dir(self) -> Path:
        return self.node_dir / "cdcd-state"

    def ensure(self, entries: int) -> None:
        if self.root is not None and entries in self.marks:
            return
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-daemon-", dir=_bench_dir()))
            self.written, self.marks = 0, {}
            atexit.register(self.cleanup)
        if entries < self.written:
            raise ValueError(f"backlog already holds {self.written:,} entries, cannot mark {entries:,}")
        t0 = time.perf_counter()
        node = Node.open(self.node_dir, **BACKLOG_NODE_SETTINGS)
        try:
            put_all = node.cache("bench").put_all
            value = VALUE_100B
            for start in range(self.written, entries, TX_SIZE):
                put_all({k: value for k in range(start, min(start + TX_SIZE, entries))})
            node.force_archive()
        finally:
            node.close()
        self.write_seconds[entries] = time.perf_counter() - t0
        self.written = entries
        self.marks[entries] = max(_links(self.cdc_dir))

    def restore(self, entries: int) -> int:
        """CDC links for the first ``entries`` entries, no daemon state; returns the last linked segment."""
        last = self.marks[entries]
        archived = list_segments(self.archive_dir)[0]
        links = _links(self.cdc_dir)
        for idx, path in links.items():
            if idx > last:
                path.unlink()
        for idx in range(last + 1):
            if idx not in links:
                os.link(archived[idx], self.cdc_dir / archived[idx].name)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        return last

    def params(self, entries: int) -> dict[str, Any]:
        return {
            "entries": entries,
            "segments": self.marks[entries] + 1 if entries in self.marks else None,
            "write_s": round(self.write_seconds[entries], 1) if entries in self.write_seconds else None,
        }

    def cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            self.marks = {}
            self.written = 0


BACKLOG = Backlog()


def run_replay(*, entries: int, form: str, consumer_kind: str) -> Measurement:
    last = BACKLOG.restore(entries)
    assert BACKLOG.root is not None
    out_path = BACKLOG.root / "events.jsonl"
    out_path.unlink(missing_ok=True)
    consumer: Consumer = NullConsumer() if consumer_kind == "null" else JsonlConsumer(out_path, fsync=True)
    config = DaemonConfig(node_dir=str(BACKLOG.node_dir), metrics_address="", consumer={"kind": consumer_kind})
    daemon = Daemon(config, consumer, show_progress=False)
    try:
        daemon.start()
        cpu0 = time.process_time()
        stop_hung = False
        if form == "run":
            seconds, stop_hung = asyncio.run(_run_until(daemon, last))
        else:
            t0 = time.perf_counter()
            daemon.sync_once()
            seconds = time.perf_counter() - t0
            pos = daemon.state.position
            if pos is None or pos.segment <= last:
                raise RuntimeError(f"sync_once() stopped at {pos} before passing segment {last}")
        cpu = time.process_time() - cpu0
        delivered = daemon.events_delivered
        commits = daemon.state.commits
    finally:
        daemon.close()
    if delivered != entries:
        raise AssertionError(f"delivered {delivered:,} events, the backlog holds {entries:,}")
    extra: dict[str, Any] = {
        "segments": last + 1,
        "commits": commits,
        "process_cpu_us_per_entry": round(cpu / entries * 1e6, 2),
    }
    if stop_hung:
        extra["stop_hung"] = True
    if isinstance(consumer, NullConsumer):
        extra["batches"] = consumer.batches
    else:
        extra["jsonl_mib"] = round(out_path.stat().st_size / (1 << 20), 1)
        out_path.unlink()
    return Measurement(delivered, seconds, extra)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for anything a temp path holds
    raise TypeError(f"no TOML for {v!r}")


def _write_daemon_config(path: Path, node_dir: Path, consumer: dict[str, Any]) -> None:
    lines = [
        f"node_dir = {_toml_value(str(node_dir))}",
        'metrics_address = ""',
        'log_format = "json"',
        "",
        "[consumer]",
    ]
    tables: dict[str, dict[str, Any]] = {}
    for k, v in consumer.items():
        if isinstance(v, dict):
            tables[k] = v
        else:
            lines.append(f"{json.dumps(k)} = {_toml_value(v)}")
    for name, table in tables.items():
        lines += ["", f"[consumer.{name}]"]
        lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")


def _start_daemon(config_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "cdcd", "run", "--config", str(config_path)],
            cwd=ROOT,
            env=_child_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _wait_links_gone(cdc_dir: Path, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    """Until the daemon has consumed (deleted) every link; raises if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while _links(cdc_dir):
        if proc.poll() is not None:
            raise RuntimeError(f"cdcd run exited {proc.returncode}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"links left in {cdc_dir} after {timeout_s:.0f}s: {sorted(_links(cdc_dir))}")
        time.sleep(0.02)


def _vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


# --- peak RSS of `cdcd run` -----------------------------------------------------------------------
def _rss_once(entries: int, work: Path) -> tuple[float, float]:
    """Replay the first ``entries`` with ``cdcd run`` (null consumer); returns (peak RSS in MB, seconds)."""
    BACKLOG.restore(entries)
    config_path = work / "cdcd.toml"
    log_path = work / f"daemon-rss-{entries}.log"
    log_path.unlink(missing_ok=True)
    _write_daemon_config(config_path, BACKLOG.node_dir, {"kind": "null"})
    t0 = time.perf_counter()
    proc = _start_daemon(config_path, log_path)
    try:
        _wait_links_gone(BACKLOG.cdc_dir, proc, log_path, DRAIN_TIMEOUT_S)
        seconds = time.perf_counter() - t0
        peak_kib = _vm_kib(proc.pid, "VmHWM")
    except BaseException:
        reap(proc)
        raise
    _stop(proc, log_path)
    return peak_kib * 1024 / 1e6, seconds


def run_rss(*, small: int, big: int) -> Measurement:
    assert BACKLOG.root is not None
    work = BACKLOG.root
    rss_small, s_small = _rss_once(small, work)
    rss_big, s_big = _rss_once(big, work)
    growth = abs(rss_big - rss_small) / rss_small * 100
    extra = {
        f"rss_{_label(small)}_mb": round(rss_small, 1),
        f"rss_{_label(big)}_mb": round(rss_big, 1),
        "growth_pct": round(growth, 1),
        f"rate_{_label(small)}_incl_startup": round(small / s_small),
        f"rate_{_label(big)}_incl_startup": round(big / s_big),
    }
    return Measurement(small + big, s_small + s_big, extra, value=rss_small)


# --- live lag in archive mode ---------------------------------------------------------------------
class LagConsumer(Consumer):
    """Records (commit_ts_ns, now_ns - commit_ts_ns) of every event; written to ``path`` at ``stop()``.

    ``now_ns`` is taken once per batch, when the daemon hands it over. The file holds native int64
    pairs.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.samples = array.array("q")

    def on_events(self, batch: EventBatch) -> bool:
        now = time.time_ns()
        append = self.samples.append
        for event in batch:
            ts = event.commit_ts_ns
            append(ts)
            append(now - ts)
        return True

    def stop(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            self.samples.tofile(f)
        os.replace(tmp, self.path)


def _lag_writer(node_dir: str, rate: int, seconds: float, idle_s: float, out: str) -> None:
    """Write ``rate`` entries/s (``put_all`` of 10 fresh keys on a fixed schedule) for ``seconds``."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = Node.open(
        node_dir,
        wal_mode="fsync",
        wal_segment_size_bytes=SEGMENT_BYTES,
        wal_force_archive_timeout_ms=LAG_FORCE_ARCHIVE_MS,
        archive_max_bytes=0,
    )
    written = behind_max = 0.0
    try:
        put_all = node.cache("lag").put_all
        value = VALUE_100B
        pacer = Pacer(rate, TX_SIZE, seconds, stop.is_set)
        for key in pacer:
            put_all({k: value for k in range(key, key + TX_SIZE)})
        written, elapsed, behind_max = pacer.written, pacer.elapsed_s, pacer.behind_max_s
        stop.wait(idle_s)  # the last segment rolls on the force-archive timeout, as every other one did
    finally:
        node.close()
    Path(out).write_text(
        json.dumps({"written": written, "seconds": elapsed, "behind_max_ms": round(behind_max * 1000, 1)})
    )


def run_lag(*, seconds: float, drop_s: float, rate: int) -> Measurement:
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-lag-", dir=_bench_dir()))
    try:
        node_dir = work / "node"
        lag_path = work / "lag.bin"
        writer_out = work / "writer.json"
        writer_log = work / "writer.log"
        daemon_log = work / "daemon.log"
        config_path = work / "cdcd.toml"
        _write_daemon_config(
            config_path,
            node_dir,
            {"kind": "python", "class": f"{__name__}:LagConsumer", "options": {"path": str(lag_path)}},
        )
        with writer_log.open("wb") as wlog:
            writer = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.bench.bench_daemon",
                    "lag-writer",
                    "--node-dir",
                    str(node_dir),
                    "--rate",
                    str(rate),
                    "--seconds",
                    str(seconds),
                    "--idle-seconds",
                    str(LAG_IDLE_S),
                    "--out",
                    str(writer_out),
                ],
                cwd=ROOT,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=wlog,
                stderr=subprocess.STDOUT,
            )
        daemon: subprocess.Popen[bytes] | None = None
        try:
            deadline = time.monotonic() + 30
            while not (node_dir / "cdc").is_dir():
                if writer.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"lag writer did not open its node:\n{_tail(writer_log)}")
                time.sleep(0.01)
            daemon = _start_daemon(config_path, daemon_log)
            if writer.wait(seconds + LAG_IDLE_S + 60) != 0:
                raise RuntimeError(f"lag writer exited {writer.returncode}:\n{_tail(writer_log)}")
            _wait_links_gone(node_dir / "cdc", daemon, daemon_log, 30)
        except BaseException:
            reap(writer)
            reap(daemon)
            raise
        _stop(daemon, daemon_log)  # consumer.stop() writes the samples
        stats = json.loads(writer_out.read_text())
        raw = array.array("q")
        raw.frombytes(lag_path.read_bytes())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ts, lags = raw[0::2], raw[1::2]
    if len(ts) != stats["written"]:
        raise AssertionError(f"daemon delivered {len(ts):,} events, the writer wrote {stats['written']:,}")
    cutoff = min(ts) + int(drop_s * 1e9)
    kept = sorted(lag for t, lag in zip(ts, lags, strict=True) if t >= cutoff)
    if not kept:
        raise AssertionError("no events after the start-up window")
    window_s = (max(ts) - cutoff) / 1e9
    ms = 1e6
    p50, p99 = _percentile(kept, 50) / ms, _percentile(kept, 99) / ms
    extra = {
        "p50_ms": round(p50, 1),
        "p90_ms": round(_percentile(kept, 90) / ms, 1),
        "p99_ms": round(p99, 1),
        "max_ms": round(kept[-1] / ms, 1),
        "min_ms": round(kept[0] / ms, 1),
        "mean_ms": round(statistics.fmean(kept) / ms, 1),
        "written": stats["written"],
        "write_rate": round(stats["written"] / stats["seconds"]),
        "writer_behind_max_ms": stats["behind_max_ms"],
    }
    return Measurement(len(kept), window_s, extra, value=p50)


# --- registration ---------------------------------------------------------------------------------
def benchmarks(quick: bool) -> list[Bench]:
    small, big = (200_000, 1_000_000) if quick else (1_000_000, 5_000_000)
    lag_seconds, lag_drop_s = (6.0, 2.0) if quick else (20.0, 3.0)
    shape = {"tx_size": TX_SIZE, "value_bytes": len(VALUE_100B) + 2, "wal_segment_size_bytes": SEGMENT_BYTES}

    def replay(name: str, description: str, form: str, kind: str, goal: float | None) -> Bench:
        params = {"entries": small, "form": form, "consumer": kind, **shape}
        return Bench(
            name=name,
            description=description,
            run_once=lambda: run_replay(entries=small, form=form, consumer_kind=kind),
            goal=goal,
            setup=lambda: BACKLOG.ensure(small),
            params=params,
            max_repeats=3 if kind == "jsonl" else None,  # ~8 s a run at 1M
        )

    def rss_setup() -> None:
        BACKLOG.ensure(small)
        BACKLOG.ensure(big)

    n = f"{small:,}"
    return [
        replay(
            "daemon.replay.null",
            f"Daemon.run() over a {n}-entry backlog to the null consumer",
            "run",
            "null",
            REPLAY_GOAL,
        ),
        replay(
            "daemon.replay.null.sync_once",
            f"Daemon.sync_once() over a {n}-entry backlog to the null consumer",
            "sync_once",
            "null",
            None,
        ),
        replay(
            "daemon.replay.jsonl",
            f"Daemon.run() over a {n}-entry backlog to the jsonl consumer (fsync)",
            "run",
            "jsonl",
            None,
        ),
        Bench(
            name="daemon.lag.archive",
            description=(
                f"lag of a cdcd run process behind a node writing {LAG_RATE} entries/s "
                f"(fsync, force-archive {LAG_FORCE_ARCHIVE_MS} ms), {lag_seconds:.0f}s"
            ),
            run_once=lambda: run_lag(seconds=lag_seconds, drop_s=lag_drop_s, rate=LAG_RATE),
            metric="p50",
            unit="ms",
            max_repeats=3,
            more=(
                Metric("p99", "p99_ms", "ms", LAG_GOAL_MS, lower_is_better=True),
                Metric("max", "max_ms", "ms"),
            ),
            params={
                "rate": LAG_RATE,
                "seconds": lag_seconds,
                "dropped_s": lag_drop_s,
                "wal_force_archive_timeout_ms": LAG_FORCE_ARCHIVE_MS,
                **shape,
            },
        ),
        Bench(
            name="daemon.rss",
            description=f"peak RSS of cdcd run (null consumer) replaying {_label(small)} and {_label(big)} backlogs",
            run_once=lambda: run_rss(small=small, big=big),
            metric=f"peak_rss.{_label(small)}",
            unit="MB",
            goal=RSS_GOAL_MB,
            lower_is_better=True,
            max_repeats=3,
            setup=rss_setup,
            teardown=BACKLOG.cleanup,
            more=(
                Metric(f"peak_rss.{_label(big)}", f"rss_{_label(big)}_mb", "MB", RSS_GOAL_MB, lower_is_better=True),
                Metric("rss_growth", "growth_pct", "%", RSS_GROWTH_GOAL_PCT, lower_is_better=True),
            ),
            params={"entries_small": small, "entries_big": big, **shape},
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_daemon")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("lag-writer", help="the lag benchmark's writer process")
    w.add_argument("--node-dir", required=True)
    w.add_argument("--rate", type=int, default=LAG_RATE)
    w.add_argument("--seconds", type=float, default=20.0)
    w.add_argument("--idle-seconds", type=float, default=LAG_IDLE_S)
    w.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from cdcd.logging import configure as configure_logging

    configure_logging("json", "warning")
    _lag_writer(args.node_dir, args.rate, args.seconds, args.idle_seconds, args.out)


if __name__ == "__main__":
    main()
