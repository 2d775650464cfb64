"""A node as a process (``cdcd node run``): open it, keep it running until asked to stop, tell
systemd it lives only while it can write."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from cdcd import failpoints
from cdcd.logging import describe
from cdcd.node.load import LoadFailed, LoadGenerator
from cdcd.node.node import Node
from cdcd.node.wal_log import WalFailed

log = structlog.get_logger("cdcd.node")


class Supervisor(Protocol):
    """systemd's side (``cdcd.daemon.sdnotify.Notifier``): readiness, watchdog pings, stopping."""

    watchdog_interval_s: float | None

    def ready(self, status: str = "") -> None: ...
    def watchdog(self) -> None: ...
    def stopping(self) -> None: ...


def run_node(
    node: Node,
    supervisor: Supervisor,
    stop: threading.Event,
    *,
    seconds: float = 0,
    load: LoadGenerator | None = None,
    tick_s: float = 0.2,
    on_tick: Callable[[], None] | None = None,
    on_closing: Callable[[BaseException | None], None] | None = None,
) -> None:
    """Serve ``node`` until ``stop`` is set or ``seconds`` (0: no limit) have passed, then close it.

    Raises ``WalFailed`` when the node refuses writes for good (its WAL flusher died, or a
    checkpoint failed for a reason other than a full disk), ``LoadFailed`` when the load generator
    died. A flusher that has not passed for a watchdog interval is stuck (an fsync hanging): no ping
    then, and systemd's watchdog ends the process. ``on_closing`` hears that closing begins (with
    the failure that ends the run, if one does): ``cdcd node run`` bounds the close from there."""
    started = time.monotonic()
    next_ping = 0.0
    if load is not None:
        load.start()
    supervisor.ready(f"node {node.config.node_dir} open")
    try:
        while not stop.wait(tick_s):
            now = time.monotonic()
            if seconds and now - started >= seconds:
                break
            failure = node.failure
            if failure is not None:
                # No more watchdog pings, and exit 1: a node that refuses writes for good says so.
                what = f"{type(failure).__name__}: {failure}".splitlines()[0]
                log.error("node_failed", error=what)
                raise WalFailed(f"{node.config.node_dir}: the node refuses writes: {what}")
            if load is not None and load.failure is not None:
                what = describe(load.failure)
                raise LoadFailed(f"{node.config.node_dir}: the load generator failed: {what}")
            interval = supervisor.watchdog_interval_s
            if interval is not None and now >= next_ping and now - node.wal.flusher_pass_monotonic < interval:
                supervisor.watchdog()
                next_ping = now + interval
            if on_tick is not None:
                on_tick()
    finally:
        if on_closing is not None:
            on_closing(sys.exc_info()[1])
        failpoints.hit("node.run.closing")  # tests: a close that hangs
        supervisor.stopping()
        if load is not None:
            load.stop()
        node.close()
