"""``cdcd top``: one live terminal view of a node dir and its daemon (read-only).

``top_command`` is the command's body (the CLI wires it); ``snapshot`` reads the sources and
``view`` draws them. ``--once --json`` prints ``snapshot_dict``: a stable dict documented in
docs/operations.md ("cdcd top").
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import msgspec
from rich.console import Console
from rich.live import Live
from rich.text import Text

from cdcd.config import ConfigError
from cdcd.daemon.config import DaemonConfig, load_daemon_config
from cdcd.top.snapshot import (
    GRACE_S,
    ONCE_READING_S,
    SOURCE_DEADLINE_S,
    Rates,
    Snapshot,
    collect,
    daemon_lag_segments,
    one_line,
    rates,
)
from cdcd.top.view import render, render_once

__all__ = ["DeliverySince", "snapshot_dict", "top_command"]

EXIT_BAD_INPUT = 2
MIN_INTERVAL_MS = 100


def snapshot_dict(snap: Snapshot, r: Rates | None, node_dir: Path, read_s: float | None = None) -> dict[str, Any]:
    """What ``--once --json`` prints (keys documented in docs/operations.md); ``read_s``: how long the two reads
    took, the interval between them included (what top waited for beyond its own start)."""
    daemon: dict[str, Any] | None = None
    if snap.daemon is not None:
        daemon = {**msgspec.to_builtins(snap.daemon), "lag_segments": daemon_lag_segments(snap)}
    return {
        "taken_at": datetime.fromtimestamp(snap.taken_unix_s, UTC).isoformat(),
        "node_dir": str(node_dir),
        "sources": snap.sources,
        "node": msgspec.to_builtins(snap.node) if snap.node is not None else None,
        "daemon": daemon,
        # Each consumer's rate is in its own entry of ``consumers``.
        "rates": {k: v for k, v in msgspec.to_builtins(r).items() if k != "consumer_events_per_s"} if r else None,
        "lake": msgspec.to_builtins(snap.lake) if snap.lake is not None else None,
        "consumers": [
            {**msgspec.to_builtins(c), "events_per_s": r.consumer_events_per_s.get(c.name) if r else None}
            for c in snap.consumers
        ],
        "consumer": snap.consumer,
        "problems": snap.problems,
        "source_problems": list(snap.source_problems),
        "read_s": None if read_s is None else round(read_s, 3),
    }


class DeliverySince:
    """When the current deliverer was first seen delivering (top watches; the node does not say)."""

    def __init__(self, started_unix_s: float) -> None:
        self._started = started_unix_s
        self._who: str | None = None
        self._since: str = ""

    def see(self, snap: Snapshot) -> str:
        who = snap.node.delivering if snap.node is not None else None
        if who != self._who:
            first = self._who is None
            self._who = who
            clock = datetime.fromtimestamp(self._started if first else snap.taken_unix_s, UTC).strftime("%H:%M:%S")
            self._since = f"before {clock}" if first else clock
        return self._since


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], bool]]:
    """``wait(timeout_s) -> quit?``: waits for a key on a terminal stdin (cbreak mode, restored on exit)."""
    if not sys.stdin.isatty():

        def sleep(timeout_s: float) -> bool:
            time.sleep(max(0.0, timeout_s))
            return False

        yield sleep
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)  # keys arrive one by one; Ctrl-C still raises KeyboardInterrupt

    def wait(timeout_s: float) -> bool:
        # stdin is looked at even when no time is left: a refresh that takes longer than the interval (a
        # source answering at its deadline) must not leave the q a user typed meanwhile unread for ever.
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            left = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if ready and os.read(fd, 64).lower().count(b"q"):
                return True
            if not left:
                return False

    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through Live and _keys, which restore the terminal


def _live(node_dir: Path, config: DaemonConfig, node_metrics: str, interval_ms: int) -> int:
    since = DeliverySince(time.time())
    previous: Snapshot | None = None
    old_handler = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        with _keys() as wait, Live(console=Console(), screen=True, auto_refresh=False) as live:
            next_draw = time.monotonic()
            while True:
                snap = collect(node_dir, config, node_metrics)
                r = rates(previous, snap) if previous is not None else None
                try:
                    view = render(snap, r, node_dir=str(node_dir), since=since.see(snap), interval_ms=interval_ms)
                    live.update(view, refresh=True)
                except Exception as exc:  # a figure the view cannot draw: said on the screen, and top keeps watching
                    line = one_line(f"cdcd top: cannot draw this refresh: {type(exc).__name__}: {exc}")
                    live.update(Text(line, style="bold red"), refresh=True)
                previous = snap
                # On a fixed grid: a draw that ran late (a busy machine) does not push the next one
                # back by its delay; one a whole interval late is drawn at once and the grid restarts.
                next_draw = max(next_draw + interval_ms / 1000, time.monotonic())
                if wait(next_draw - time.monotonic()):
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, old_handler)


def read_twice(node_dir: Path, config: DaemonConfig, node_metrics: str, interval_ms: int) -> tuple[Snapshot, Snapshot]:
    """Two snapshots ``interval_ms`` apart (from start to start: the rates need both), reading for
    ``ONCE_READING_S`` at most in all: a source that ran out of time in the first read is not asked
    again, and the second read gets what time is left."""
    started = time.monotonic()
    first = collect(node_dir, config, node_metrics)
    reading = time.monotonic() - started
    time.sleep(max(0.0, started + interval_ms / 1000 - time.monotonic()))
    # A source never gets less than this: one that answers in time on a busy machine is still read.
    deadline_s = max(0.5, min(SOURCE_DEADLINE_S, ONCE_READING_S - GRACE_S - reading))
    skip = {name: first.sources[name] for name in first.slow}
    return first, collect(node_dir, config, node_metrics, deadline_s=deadline_s, skip=skip)


def _error(message: str) -> int:
    print(f"cdcd: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def top_command(
    node_dir: Path | None,
    config_path: Path | None,
    interval_ms: int,
    once: bool,
    as_json: bool,
    *,
    node_metrics: str = "",
) -> int:
    """``cdcd top``; returns the exit code (0, or 2 for bad options or a bad config)."""
    if as_json and not once:
        return _error("--json needs --once (the live view is for a terminal)")
    if interval_ms < MIN_INTERVAL_MS:
        return _error(f"--interval-ms {interval_ms}: must be at least {MIN_INTERVAL_MS}")
    if config_path is not None:
        try:
            config = load_daemon_config(config_path)
        except ConfigError as exc:
            return _error(str(exc))
    elif node_dir is not None:
        # No daemon config: its state and CDC dir at their defaults, its metrics address unknown.
        config = DaemonConfig(node_dir=str(node_dir), metrics_address="", consumer={})
    else:
        return _error("give --node-dir DIR or --config DAEMON_TOML")
    node_dir = node_dir if node_dir is not None else Path(config.node_dir)
    if not once:
        return _live(node_dir, config, node_metrics, interval_ms)
    reading_from = time.monotonic()
    first, snap = read_twice(node_dir, config, node_metrics, interval_ms)
    read_s = time.monotonic() - reading_from
    r = rates(first, snap)
    if as_json:
        sys.stdout.write(msgspec.json.encode(snapshot_dict(snap, r, node_dir, read_s)).decode() + "\n")
    else:
        since = DeliverySince(first.taken_unix_s).see(snap)
        Console().print(render_once(snap, r, node_dir=str(node_dir), since=since, interval_ms=interval_ms))
    return 0
