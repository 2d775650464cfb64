"""``cdcd demo`` / ``make run``: a node with a sample load, the daemon, the Spark lake sink."""

from __future__ import annotations

import asyncio
import shutil
import sys
import threading
import time
from pathlib import Path

import click
import structlog

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.lake import spark as spark_session
from cdcd.lake.compact import compact
from cdcd.lake.ops import show
from cdcd.lake.report import print_demo_ending, print_show, print_verify
from cdcd.lake.verify import verify
from cdcd.node.load import LoadGenerator
from cdcd.node.node import Node
from cdcd.node.snapshot import NodeSnapshot
from cdcd.sinks.lake import LakeConsumer, LakeOptions

log = structlog.get_logger("cdcd.demo")


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
    try:
        daemon.start()
        daemon_thread.start()
        load.start()
        started = time.monotonic()
        tty = sys.stdout.isatty()
        while not stop.wait(1.0):
            elapsed = time.monotonic() - started
            if seconds and elapsed >= seconds:
                break
            pos = daemon.state.position
            line = (
                f"{elapsed:6.0f}s  written {load.written:>9,}  landed {consumer.rows_written:>9,}  "
                f"WAL {node.wal_position}  daemon at {pos or '-'}"
            )
            click.echo(("\r" + line) if tty else line, nl=not tty)
        if tty:
            click.echo()
        stopping = time.monotonic()
        load.stop()
        end = node.wal_position
        node.force_archive()
        pos = daemon.state.position
        behind = end.segment + 1 - (pos.segment if pos is not None else 0)
        click.echo(f"stopping: load stopped at WAL {end} ({load.written:,} entries); catching up {behind} segment(s)")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pos = daemon.state.position
            if pos is not None and pos.segment > end.segment - (1 if end.offset == 0 else 0):
                break
            time.sleep(0.2)
        daemon.stop()
        daemon_thread.join()
        daemon.close()
        node.close()
        phase = time.monotonic()
        click.echo(f"caught up in {phase - stopping:.1f} s ({consumer.rows_written:,} rows landed); compacting {lake}")
        spark = spark_session.acquire(spark_master, "cdcd-demo-compact", {})
        spark.sparkContext.setLogLevel("ERROR")  # Spark's own warnings are not the demo's output
        try:
            done = compact(spark, lake)
            click.echo(
                f"compacted in {time.monotonic() - phase:.1f} s ({done.keys:,} keys into state and "
                f"{len(done.tables)} typed table(s)); verifying against the node"
            )
            with NodeSnapshot(node_dir) as snapshot:
                checks = verify(lake, [snapshot])
            verified = all(c.ok for c in checks)
            print_show(show(lake))
            print_verify(checks)
            print_demo_ending(spark, lake, checks, stopping)
        finally:
            spark_session.release()
    finally:
        load.stop()
        daemon.stop()
        if daemon_thread.is_alive():
            daemon_thread.join()
        daemon.close()
        node.close()
        loop.close()
    return verified
