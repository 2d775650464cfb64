"""``cdcd demo`` / ``make run``: a node with a sample load, the daemon, the Spark lake sink."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import structlog
from rich.console import Console
from rich.live import Live

from cdcd import metrics
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.lake import spark as spark_session
from cdcd.lake.maintenance.autocompact import files_per_partition
from cdcd.lake.maintenance.compact import compact
from cdcd.lake.maintenance.ops import LakeInfo, show
from cdcd.lake.reading.report import print_demo_ending, print_show, print_verify
from cdcd.lake.reading.verify import verify
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.lake.table import CHANGES, STATE, TABLES
from cdcd.lake.typed.layout import list_tables
from cdcd.node.load import LoadGenerator
from cdcd.node.node import Node
from cdcd.node.snapshot import NodeSnapshot
from cdcd.top import DeliverySince
from cdcd.top.snapshot import Rates, Snapshot, collect, rates, read_registries, running_state
from cdcd.top.view import render, status_line

log = structlog.get_logger("cdcd.demo")

LIVE_EVERY_S = 1.0
PLAIN_EVERY_S = 2.0
"""Without a terminal (CI, a pipe) a line every this often: fewer than a screen needs."""


def most_files(lake: Path) -> dict[str, int]:
    """The most live data files in one partition of ``changes``, of ``state`` and of any typed table
    (``tables``), from their Delta logs: what the bound of ``max_files_per_partition`` holds at every moment.
    A table not there yet is left out."""
    out: dict[str, int] = {}
    for name, path in ((CHANGES, lake / CHANGES), (STATE, lake / STATE)):
        counts = files_per_partition(path)
        if counts:
            out[name] = max(counts.values())
    for table in list_tables(lake).values():
        out[TABLES] = max(out.get(TABLES, 0), max(files_per_partition(table).values(), default=0))
    return out


def files_line(most: dict[str, int], *, each: bool = True) -> str:
    """``files/partition max 7 (changes 7, state 1, tables 1)``: the figure of the live view (``each``: with the
    tables' own; the screen's header line has room for the most alone)."""
    if not most:
        return "files/partition max -"
    tables = ", ".join(f"{name} {n}" for name, n in most.items())
    return f"files/partition max {max(most.values())}" + (f" ({tables})" if each else "")


class _Watch:
    """``cdcd top``'s figures of this process's node and daemon: the full screen on a terminal, else one
    plain line every ``PLAIN_EVERY_S``. The daemon's state and the metrics are read in process; the most
    files in one partition of every table of the lake from their logs (top's figure is the sink's, of
    ``changes`` alone)."""

    def __init__(self, node_dir: Path, daemon: Daemon, lake: Path) -> None:
        self.node_dir = node_dir
        self.daemon = daemon
        self.config = daemon.config
        self.lake = lake
        self.previous: Snapshot | None = None
        self.last_line = ""
        self.most: dict[str, int] = {}
        self.since = DeliverySince(time.time())

    def _most_files(self) -> dict[str, int]:
        try:
            return most_files(self.lake)
        except Exception as exc:  # a table being created or rewritten this moment: the next refresh reads it
            log.debug("demo_files_unread", error=str(exc))
            return self.most

    def _state(self, config: DaemonConfig) -> tuple[dict[str, Any] | None, int | None, str]:
        return running_state(config, self.daemon.state, "lake"), os.getpid(), "ok"

    def read(self) -> tuple[Snapshot, Rates | None]:
        snap = collect(
            self.node_dir,
            self.config,
            "",
            state_reader=self._state,
            node_metrics=lambda: read_registries(metrics.NODE),
            daemon_metrics=lambda: read_registries(metrics.DAEMON, metrics.LAKE),
        )
        r = rates(self.previous, snap) if self.previous is not None else None
        self.previous = snap
        self.most = self._most_files()
        self.last_line = f"{status_line(snap, r)}  {files_line(self.most)}"
        return snap, r

    def run(self, stop: threading.Event, seconds: float) -> float:
        """Show the figures until ``stop`` is set or ``seconds`` pass (0: no limit); the seconds it ran."""
        started = time.monotonic()

        def done() -> bool:
            return stop.is_set() or bool(seconds and time.monotonic() - started >= seconds)

        if not sys.stdout.isatty():
            while not done():
                self.read()
                click.echo(f"{time.monotonic() - started:6.0f}s  {self.last_line}")
                stop.wait(PLAIN_EVERY_S)
            return time.monotonic() - started
        with Live(console=Console(), screen=True, auto_refresh=False, redirect_stderr=False) as live:
            while not done():
                snap, r = self.read()
                view = render(
                    snap,
                    r,
                    node_dir=str(self.node_dir),
                    since=self.since.see(snap),
                    interval_ms=int(LIVE_EVERY_S * 1000),
                    title=f"make run  {time.monotonic() - started:.0f}s  {files_line(self.most, each=False)}",
                    keys="Ctrl-C: stop, catch up, compact, verify",
                )
                live.update(view, refresh=True)
                stop.wait(LIVE_EVERY_S)
        return time.monotonic() - started


def _rows(info: LakeInfo, table: str) -> int:
    return next((t.rows for t in info.tables if t.name == table), 0)


def change_rows(info: LakeInfo) -> int:
    """Rows of the lake's ``changes`` table: one per WAL entry delivered."""
    return _rows(info, "changes")


def state_rows(info: LakeInfo) -> int:
    """Rows of the lake's ``state`` table: one per live key of every cache."""
    return _rows(info, "state")


def counts_line(wal_entries: int, changes: int, node_keys: int, state: int) -> str:
    """The run's counts side by side, each pair that must agree joined by ``=`` (``≠`` if it does not):
    what the node logged and what landed, what the node holds and what state holds."""

    def pair(left: str, a: int, right: str, b: int) -> str:
        return f"{left} {a:,} {'=' if a == b else '≠'} {right} {b:,}"

    return (
        f"counts: {pair('WAL entries', wal_entries, 'change rows', changes)}; "
        f"{pair('node keys', node_keys, 'state rows', state)}"
    )


def run_demo(*, var: Path, seconds: float, rate: int, spark_master: str, fresh: bool, stop: threading.Event) -> bool:
    """Run until ``seconds`` pass (0: until ``stop``), then catch up, compact, verify; True if verified."""
    if fresh:
        shutil.rmtree(var / "demo", ignore_errors=True)
    node_dir, lake = var / "demo" / "node", var / "demo" / "lake"
    node = Node.open(
        node_dir,
        wal_mode="background",
        wal_segment_size_bytes=4 << 20,
        wal_force_archive_timeout_ms=1000,
        archive_max_bytes=256 << 20,
    )
    # Compaction on a schedule while the load runs: the stop then folds only the last interval's changes.
    consumer = LakeConsumer(LakeOptions(lake_path=str(lake), spark_master=spark_master, compact_interval_s=20))
    daemon = Daemon(
        DaemonConfig(node_dir=str(node_dir), metrics_address="", batch_max_delay_ms=1000, check_interval_ms=250),
        consumer,
        show_progress=False,
    )
    load = LoadGenerator(node, rate, keyspace=20_000)
    loop = asyncio.new_event_loop()
    daemon_thread = threading.Thread(target=loop.run_until_complete, args=(daemon.run(),), name="cdcd-demo-daemon")
    verified = False
    spark_held = False
    try:
        click.echo(f"starting: a node in {node_dir}, the daemon, its lake sink into {lake} (a Spark JVM)")
        daemon.start()
        daemon_thread.start()
        load.start()
        watch = _Watch(node_dir, daemon, lake)
        elapsed = watch.run(stop, seconds)
        stopping = time.monotonic()
        load.stop()
        end = node.wal_position
        node.force_archive()
        watch.read()
        click.echo(f"{elapsed:.0f}s  {watch.last_line}")
        pos = daemon.state.position
        behind = end.segment + 1 - (pos.segment if pos is not None else 0)
        logged = sum(node.stats.entries.values())  # a fresh node: its WAL's entries are this run's
        click.echo(
            f"stopping: load stopped; the node logged {logged:,} entries in its WAL (up to {end}); "
            f"catching up {behind} segment(s)"
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pos = daemon.state.position
            if pos is not None and pos.segment > end.segment - (1 if end.offset == 0 else 0):
                break
            time.sleep(0.2)
        caught = time.monotonic()
        # Cancels a scheduled compaction in flight (the one below folds its changes too) and stops the sink's
        # SparkSession: a maintenance run that outlived its stop timeout must not write state beside the
        # compaction below (Delta refuses one of the two commits), so the session is not kept for it.
        daemon.stop()
        daemon_thread.join()
        daemon.close()
        node.close()
        spark = spark_session.acquire(spark_master, "cdcd-demo-compact", {})
        spark_held = True
        phase = time.monotonic()
        click.echo(
            f"caught up in {caught - stopping:.1f} s: {consumer.rows_written:,} change rows landed of the WAL's "
            f"{logged:,} entries; daemon stopped in {phase - caught:.1f} s; compacting {lake}"
        )
        spark.sparkContext.setLogLevel("ERROR")  # Spark's own warnings are not the demo's output
        done = compact(spark, lake)
        info = show(lake)
        click.echo(
            f"compacted in {time.monotonic() - phase:.1f} s: changes versions {done.from_version}..{done.to_version} "
            f"({done.keys:,} keys changed) merged into state, which holds {state_rows(info):,} rows; "
            f"{len(done.tables)} typed table(s); verifying against the node"
        )
        with NodeSnapshot(node_dir) as snapshot:
            checks = verify(lake, [snapshot])
        verified = all(c.ok for c in checks)
        print_show(info)
        print_verify(checks)
        click.echo(counts_line(logged, change_rows(info), sum(c.node_rows for c in checks), state_rows(info)))
        print_demo_ending(spark, lake, checks, stopping)
    finally:
        if spark_held:
            spark_session.release()
        load.stop()
        daemon.stop()
        if daemon_thread.is_alive():
            daemon_thread.join()
        daemon.close()
        node.close()
        loop.close()
    return verified
