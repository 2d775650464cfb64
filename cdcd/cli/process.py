"""What every long-running command sets up the same way: its log format, its stop signals (and
the bound on its way out), its metrics endpoint."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import click

from cdcd.config import ConfigError, deprecations_loggable, split_host_port
from cdcd.logging import configure as configure_logging
from cdcd.logging import last_words, watch_reader

LogFormat = Literal["json", "console"]


def log_to_stderr(fmt: str | None = None, level: str = "info") -> None:
    """Log lines on stderr: ``fmt`` when given, else console on a terminal and JSON lines otherwise."""
    chosen: LogFormat = "console" if fmt == "console" or (fmt is None and sys.stderr.isatty()) else "json"
    configure_logging(chosen, level=level)
    deprecations_loggable()  # a config read before this told its deprecated spellings on stderr only


STOP_BOUND_S = 30.0
"""How long ``cdcd node run`` and ``cdcd run`` take at most from a stop request to their exit
(``--stop-timeout``): below systemd's TimeoutStopSec in the shipped units, above a clean close
(a realtime drain takes up to ``realtime_close_timeout_ms``, 10 s by default)."""

_LOG_READER_GONE = "its log reader gone"
_START = 0
"""The byte that starts the bound for a stop that is no signal (signals write their number)."""


class Stops:
    """What asked a long-running command to stop, and the bound on its way out.

    With a bound, the first stop request (SIGTERM, SIGINT, the log reader gone, or ``start_clock``
    for a failure or the end of a run) starts a clock on a thread of its own, woken by the
    interpreter's signal wake-up descriptor, so it runs even while the main thread is stuck (in a
    join, an fsync, a consumer's close) and the Python-level handler cannot: when the bound passes,
    the process leaves at once (``os._exit``) with one line. Nothing acknowledged is lost then: a
    node recovers from its WAL, a daemon resumes from its last commit, as after a kill."""

    def __init__(self, stop: Callable[[signal.Signals], None], bound_s: float | None, what: str, hint: str) -> None:
        self.received: list[signal.Signals] = []
        self.log_reader_gone = False
        self._stop = stop
        self._what = what
        self._hint = hint
        self._reason: tuple[str, int] | None = None
        """(what started the clock, the exit code if the bound passes)."""
        self._lock = threading.Lock()
        self._wake_w = -1
        if bound_s is not None:
            read_fd, self._wake_w = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(self._wake_w, False)  # a signal handler never blocks on it
            with contextlib.suppress(ValueError):  # not the main thread: the handler's own byte starts the clock
                signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
            threading.Thread(target=self._bound, args=(read_fd, bound_s), name="cdcd-stop-bound", daemon=True).start()

    @property
    def exit_code(self) -> int:
        """0 after a stop signal; 128 + SIGPIPE when the log reader went first (not a clean stop
        to systemd, so ``Restart=on-failure`` starts the process again with a new log stream)."""
        return 128 + signal.SIGPIPE if self.log_reader_gone and not self.received else 0

    def start_clock(self, reason: str, code: int) -> None:
        """Start the bound (if none runs yet): ``reason`` ends the process's line if it passes."""
        with self._lock:
            if self._reason is None:
                self._reason = (reason, code)
        self._wake(_START)

    def _wake(self, byte: int) -> None:
        if self._wake_w < 0:
            return
        with contextlib.suppress(OSError):  # full: the clock has long been woken
            os.write(self._wake_w, bytes([byte]))

    def on_signal(self, signum: int, _frame: object) -> None:
        if self.received:
            os._exit(128 + signum)
        sig = signal.Signals(signum)
        self.received.append(sig)
        if self._reason is None:  # no lock in a signal handler: a failure's reason may win the race, fine
            self._reason = (sig.name, 128 + signum)
        self._wake(signum)  # in case someone else took the wake-up descriptor
        self._stop(sig)

    def on_log_reader_gone(self) -> None:
        self.log_reader_gone = True
        self.start_clock(_LOG_READER_GONE, 128 + signal.SIGPIPE)
        self._stop(signal.SIGPIPE)

    def _bound(self, read_fd: int, bound_s: float) -> None:
        first = None
        while first is None:
            data = os.read(read_fd, 64)
            if not data:
                return
            for byte in data:
                if byte in (_START, signal.SIGTERM, signal.SIGINT):
                    first = byte
                    break
        deadline = time.monotonic() + bound_s
        while (left := deadline - time.monotonic()) > 0:
            if select.select([read_fd], [], [], left)[0]:
                os.read(read_fd, 64)
        reason, code = self._reason or (signal.Signals(first).name, 128 + first)
        line = f"{self._what} did not stop within {bound_s:g} s of {reason}: left without closing"
        for stack in thread_stacks():  # what it was stuck in, for the report: the cause of a hang is a stack
            last_words(stack)
        last_words(f"cdcd: error: {line} ({self._hint})" if self._hint else f"cdcd: error: {line}")
        os._exit(code)


STACK_FRAMES = 12
"""Frames shown per thread when the stop bound passes (innermost first)."""


def thread_stacks() -> list[str]:
    """One line per live thread but this one: its name and where it is, innermost frame first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    here = threading.get_ident()
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident == here:
            continue
        frames = traceback.extract_stack(frame)[::-1][:STACK_FRAMES]
        where = " < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in frames)
        lines.append(f"cdcd: thread {names.get(ident, ident)} at the stop bound: {where}")
    return lines


def _short(path: str) -> str:
    """``cdcd/node/node.py`` rather than the whole install path; other files by their last two parts."""
    parts = Path(path).parts
    if "cdcd" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("cdcd") :])
    return "/".join(parts[-2:])


def on_stop_signals(
    stop: Callable[[signal.Signals], None],
    *,
    bound_s: float | None = None,
    what: str = "cdcd",
    hint: str = "",
    when_log_reader_gone: bool = False,
) -> Stops:
    """SIGTERM and SIGINT call ``stop`` (from the signal handler: it must be signal-safe); a second
    one leaves at once with exit code 128 + its number, as a shell reports a process it killed.

    ``bound_s``: the process leaves at most this long after the first stop request, closed or not
    (see ``Stops``; ``what`` and ``hint`` word its line then). ``when_log_reader_gone``: the reader
    of stderr going away (a closed pipe, ``| head``) is a stop request too, ``stop(SIGPIPE)`` from
    a thread, and the command exits ``Stops.exit_code``."""
    stops = Stops(stop, bound_s, what, hint)
    signal.signal(signal.SIGTERM, stops.on_signal)
    signal.signal(signal.SIGINT, stops.on_signal)
    if when_log_reader_gone:
        watch_reader(stops.on_log_reader_gone)
    return stops


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


stop_timeout_option = click.option(
    "--stop-timeout",
    type=click.FloatRange(0.1),
    default=STOP_BOUND_S,
    show_default=True,
    help="Seconds from a stop request (or a failure) to the exit, closed or not.",
)
"""``--stop-timeout`` of the long-running commands (``node run``, ``run``, ``kafka-to-node``)."""
