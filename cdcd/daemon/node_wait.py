"""A daemon started before its node: wait for the node's directories (Ignite's ignite-cdc waits for
its node too) instead of exiting, so the order in which units or terminals start does not matter."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from cdcd import metrics
from cdcd.daemon.sdnotify import Notifier

log = structlog.get_logger("cdcd.daemon")

POLL_INTERVAL_S = 0.25
"""How often the directories are looked for: a stat each, and the delay a new node waits for its daemon."""


def wait_for_node(
    node_dir: Path,
    cdc_dir: Path,
    notifier: Notifier,
    stopping: threading.Event,
    *,
    serve: Callable[[], None] | None = None,
) -> bool:
    """Return once ``node_dir`` and ``cdc_dir`` exist (True) or ``stopping`` is set (False). Logs
    ``waiting_for_node`` once; meanwhile systemd hears READY=1 with a status saying so, the
    watchdog pings (a waiting daemon is healthy, and a start timeout would only restart it into the
    same wait), and ``serve()`` (called once, as the wait begins) has the metrics endpoint up, where
    ``cdcd_daemon_waiting_for_node`` is 1 until the node appears."""
    if node_dir.is_dir() and cdc_dir.is_dir():
        return True
    log.info("waiting_for_node", node_dir=str(node_dir), cdc_dir=str(cdc_dir))
    metrics.export(metrics.DAEMON)
    metrics.DAEMON_WAITING_FOR_NODE.set(1)
    if serve is not None:
        serve()
    notifier.ready(f"waiting for node dir {node_dir}")
    interval_s = notifier.watchdog_interval_s
    next_ping = 0.0
    try:
        while not (node_dir.is_dir() and cdc_dir.is_dir()):
            now = time.monotonic()
            if interval_s is not None and now >= next_ping:
                notifier.watchdog()
                next_ping = now + interval_s
            if stopping.wait(POLL_INTERVAL_S):
                return False
    finally:
        metrics.DAEMON_WAITING_FOR_NODE.set(0)
    log.info("node_found", node_dir=str(node_dir))
    return True
