"""What every long-running command sets up the same way: its log format, its stop signals, its
metrics endpoint."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from cdcd.config import ConfigError, deprecations_loggable, split_host_port
from cdcd.logging import configure as configure_logging

LogFormat = Literal["json", "console"]


def log_to_stderr(fmt: str | None = None, level: str = "info") -> None:
    """Log lines on stderr: ``fmt`` when given, else console on a terminal and JSON lines otherwise."""
    chosen: LogFormat = "console" if fmt == "console" or (fmt is None and sys.stderr.isatty()) else "json"
    configure_logging(chosen, level=level)
    deprecations_loggable()  # a config read before this told its deprecated spellings on stderr only


def on_stop_signals(stop: Callable[[signal.Signals], None]) -> None:
    """SIGTERM and SIGINT call ``stop`` (from the signal handler: it must be signal-safe); a second
    one leaves at once with exit code 128 + its number, as a shell reports a process it killed."""
    received: list[signal.Signals] = []

    def on_signal(signum: int, _frame: object) -> None:
        if received:
            os._exit(128 + signum)
        received.append(signal.Signals(signum))
        stop(signal.Signals(signum))

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def serve_metrics(address: str, config_path: Path) -> None:
    """The Prometheus endpoint on ``address`` (the config's ``metrics_address``; "" serves nothing).
    A port in use is a config problem: ``ConfigError`` naming the key (exit 2, not a restart loop)."""
    if not address:
        return
    from prometheus_client import start_http_server

    host, port = split_host_port(address, min_port=0)
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise ConfigError(f"{config_path}: key 'metrics_address': cannot listen on {address}: {exc}") from None
