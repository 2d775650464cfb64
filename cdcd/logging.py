"""Logging set-up.

The command line configures structlog once at its entry point (``configure``: JSON lines or
console lines, to stderr). A library prints nothing on stdout: when cdcd is embedded (``import
cdcd`` without the CLI) and the application has not configured structlog itself,
``configure_library`` routes cdcd's log events through the standard ``logging`` module, loggers
``cdcd.*``, which carry a ``NullHandler`` as the logging guide asks of libraries: an application
with logging handlers of its own gets them there, at its levels (set the ``cdcd`` logger's level
to see more or less); one without any hears only warnings and errors, on stderr.

Writing a log line never fails the thread that logs (the WAL flusher, the checkpointer, the
archiver, a daemon's pipeline): a line that cannot be written (the reader of a pipe gone, a full
disk, a closed stderr, a reader that stopped reading for ``STUCK_WAIT_S``) is dropped and counted
(``lines_lost``, exported as ``cdcd_node_log_lines_lost_total`` and
``cdcd_daemon_log_lines_lost_total``). A long-running command asks ``watch_reader`` to learn when
the reader of its log pipe has gone, and stops then.
"""

from __future__ import annotations

import io
import logging
import os
import re
import select
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import structlog
from structlog.typing import EventDict

from cdcd.secrets import mask_log_event

LogFormat = Literal["json", "console"]

_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
"""Terminal escape sequences: CSI (colours, cursor), OSC (titles, links) and the two-byte ones."""
_CAUSE_MARK = re.compile(r"^[\s\u21b3|>-]*(?:caused by:?\s*)?", re.IGNORECASE)
"""What libraries put in front of a cause on its own line (delta-rs' "↳", Java's "Caused by:")."""
_FRAME = re.compile(r"^(?:at [\w$.<>]+\(|\.\.\. \d+ more$|File \"|Traceback \(most recent call last\))")
"""Stack frames (Java's and Python's) inside an error's text: the log line keeps the messages only."""
CHAIN = " <- "
MAX_LINE_CHARS = 2000


def one_line(text: str) -> str:
    """``text`` as one log-safe line: terminal escapes and stack frames removed, its lines (a library's
    causes, one per line) joined with " <- ", at most ``MAX_LINE_CHARS``."""
    text = _ANSI.sub("", text)
    if "\n" not in text and "\r" not in text:
        joined = text.strip()
    else:
        lines = [_CAUSE_MARK.sub("", line).strip() for line in text.splitlines()]
        joined = CHAIN.join(line for line in lines if line and not _FRAME.match(line))
    return joined if len(joined) <= MAX_LINE_CHARS else joined[: MAX_LINE_CHARS - 1] + "\u2026"


def describe(exc: BaseException) -> str:
    """An exception and what caused it (``__cause__``, else ``__context__`` unless suppressed), one
    line: "Outer: text <- Inner: text"."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = one_line(str(current))
        parts.append(f"{type(current).__name__}: {text}" if text else type(current).__name__)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return CHAIN.join(parts)


def one_line_event(_logger: Any, _method_name: str, event: EventDict) -> EventDict:
    """Every log line is one line: an exception (``exc_info``) becomes ``error`` (its chain, see
    ``describe``) and ``error_type`` instead of a traceback; string values lose terminal escapes
    and line breaks."""
    exc_info = event.pop("exc_info", None)
    if exc_info:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc_info, tuple):
            exc = exc_info[1]
        if exc is not None:
            event.setdefault("error_type", type(exc).__name__)
            event["error"] = describe(exc) if "error" not in event else f"{event['error']}{CHAIN}{describe(exc)}"
    for key, value in event.items():
        if isinstance(value, str) and ("\n" in value or "\x1b" in value or "\r" in value):
            event[key] = one_line(value)
    return event


STUCK_WAIT_S = 1.0
"""How long a log line waits for a reader that does not read (a full pipe, a terminal stopped with
Ctrl-S); while it stays so, later lines are dropped at once."""

_lost_lock = threading.RLock()  # reentrant: a signal handler that logs may run while its thread holds it
_lost = 0


def lines_lost() -> int:
    """Log lines (and other stderr writes) this process could not write."""
    return _lost


def _count_lost(lines: int = 1) -> None:
    global _lost
    with _lost_lock:
        _lost += lines


class _Stderr(io.RawIOBase):
    """File descriptor 2 for the command line's log lines and error lines: a write never raises and
    never waits more than ``STUCK_WAIT_S`` for the reader; what it cannot write is counted lost."""

    def __init__(self, fd: int, usable: bool) -> None:
        super().__init__()
        self._fd = fd
        self._usable = usable
        """False when the process started with the descriptor closed: lines go nowhere, counted."""
        # Reentrant: a signal handler that logs (the daemon's on SIGTERM) runs on the main thread,
        # maybe while that thread is inside a write; a plain lock would deadlock it on itself.
        self._lock = threading.RLock()
        self._stuck = False
        self.gone = threading.Event()
        """Set once the reader of the pipe or socket has gone (EPIPE, or the pipe's error state)."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return self._usable and os.isatty(self._fd)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if not self._write_all(view):
            _count_lost(max(1, bytes(view).count(b"\n")))
        return size

    def write_bounded(self, data: bytes, wait_s: float) -> bool:
        """``data`` if the descriptor takes it within about ``wait_s``, whoever else is writing."""
        if not self._lock.acquire(timeout=wait_s):
            return False
        try:
            return self._write_locked(memoryview(data), min(wait_s, STUCK_WAIT_S))
        finally:
            self._lock.release()

    def _write_all(self, view: memoryview) -> bool:
        if not self._usable or self.gone.is_set():
            return False
        with self._lock:
            return self._write_locked(view, 0.0 if self._stuck else STUCK_WAIT_S)

    def _write_locked(self, view: memoryview, wait_s: float) -> bool:
        while view:
            # A blocking write to a reader that does not read would hold the logging thread (the
            # WAL flusher) with it: write only once the descriptor takes data.
            poll = select.poll()  # one per call: a nested write (that signal handler) may poll meanwhile
            poll.register(self._fd, select.POLLOUT)
            events = poll.poll(wait_s * 1000)
            if not events:
                self._stuck = True
                return False
            if events[0][1] & (select.POLLERR | select.POLLHUP) and not events[0][1] & select.POLLOUT:
                self.gone.set()
                return False
            try:
                written = os.write(self._fd, view)
            except BrokenPipeError:
                self.gone.set()
                return False
            except OSError:  # ENOSPC, EIO, EBADF, EAGAIN: this line is lost, the next may pass
                return False
            view = view[written:]
        self._stuck = False
        return True


class _StreamLogger:
    """structlog's logger for the command line: one rendered line per call into ``stream``, lost
    (counted) rather than raised when the stream fails."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        stream = self._stream
        try:
            if isinstance(stream, _Stderr):
                stream.write((message + "\n").encode("utf-8", "backslashreplace"))
            else:
                stream.write(message + "\n")
                stream.flush()
        except Exception:  # a stream of the embedding application's (a test's capture) failing
            _count_lost()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


_stderr: _Stderr | None = None
"""The process's own stderr once ``configure`` took it over."""


def _reserve_std_fds() -> bool:
    """Open /dev/null on a standard descriptor the process started without, so that no file of
    ours (a WAL segment) gets its number and log lines into it; True if 2 was open."""
    had_stderr = True
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            had_stderr = had_stderr and fd != 2
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # a lower one was free too: it is taken in its own turn
                os.dup2(null, fd)
                os.close(null)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the process's stdout, never closed)
    return had_stderr


def _own_stderr() -> _Stderr | None:
    """The process's stderr as a ``_Stderr`` (also ``sys.stderr`` from then on, so error lines and
    tracebacks cannot raise either), or None when something else stands in for it (a test runner's
    capture), which is written to as it is."""
    global _stderr
    if _stderr is not None and sys.stderr is _stderr_text:
        return _stderr
    if sys.stderr is not sys.__stderr__:
        return None
    usable = _reserve_std_fds()
    _stderr = _Stderr(2, usable)
    _set_stderr_text(_stderr)
    return _stderr


_stderr_text: Any = None


def _set_stderr_text(raw: _Stderr) -> None:
    global _stderr_text
    encoding = getattr(sys.__stderr__, "encoding", None) or "utf-8"
    _stderr_text = io.TextIOWrapper(
        raw, encoding=encoding, errors="backslashreplace", line_buffering=True, write_through=True
    )
    sys.stderr = _stderr_text


def watch_reader(on_gone: Callable[[], None]) -> bool:
    """Call ``on_gone`` (once, on a thread of its own) when the reader of this process's stderr has
    gone: the pipe's other end closed (``cdcd node run 2>&1 | head -3`` after ``head`` exits) or
    the socket's peer. False (nothing watched) unless stderr is a pipe or a socket ``configure``
    took over: a file or a terminal has no reader that could go."""
    raw = _stderr
    if raw is None or not raw._usable:
        return False
    try:
        mode = os.fstat(raw.fileno()).st_mode
    except OSError:
        return False
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return False

    def watch() -> None:
        poll = select.poll()
        poll.register(raw.fileno(), 0)  # no events asked: poll reports only the error or hang-up state
        while not raw.gone.is_set():
            if poll.poll(1000):  # the timeout only for a socket whose EPIPE a write saw first
                raw.gone.set()
        on_gone()

    threading.Thread(target=watch, name="cdcd-log-reader-watch", daemon=True).start()
    return True


def last_words(line: str, wait_s: float = STUCK_WAIT_S) -> None:
    """``line`` on stderr before the process leaves at once (``os._exit``): never waits longer than
    about ``wait_s``, whoever holds stderr meanwhile."""
    data = (line + "\n").encode("utf-8", "backslashreplace")
    raw = _stderr
    if raw is not None:
        if not raw._usable or raw.gone.is_set() or not raw.write_bounded(data, wait_s):
            _count_lost()
        return
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        _count_lost()


def configure(log_format: LogFormat = "json", level: str = "info") -> None:
    """The command line's logging: one line per event on stderr, JSON lines or console lines. A
    line that cannot be written is dropped and counted, never raised (see the module's doc)."""
    own = _own_stderr()
    stream: Any = own if own is not None else sys.stderr
    renderer: structlog.typing.Processor
    if log_format == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            one_line_event,
            mask_log_event,
            renderer,
        ],
        wrapper_class=_never_raising(structlog.make_filtering_bound_logger(logging.getLevelName(level.upper()))),
        logger_factory=lambda *_args: _StreamLogger(stream),
        cache_logger_on_first_use=False,
    )


def _never_raising(cls: type[Any]) -> type[Any]:
    """``cls`` whose log calls count an event they could not render (a processor failing) as a lost
    line instead of raising it into the thread that logs."""

    class NeverRaising(cls):  # type: ignore[misc,valid-type]
        def _proxy_to_logger(self, method_name: str, event: str | None = None, **event_kw: Any) -> Any:
            try:
                return super()._proxy_to_logger(method_name, event, **event_kw)
            except Exception:
                _count_lost()
                return None

    return NeverRaising


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "msg": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}
_logfmt = structlog.processors.LogfmtRenderer(key_order=["event"])


def _app_handlers(logger: logging.Logger) -> bool:
    """True if the application gave ``logger`` or an ancestor a handler (cdcd's NullHandler aside)."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def _app_levels_or_warnings(logger: logging.Logger, method_name: str, event: EventDict) -> EventDict:
    """With handlers of the application's: its levels decide. Without: warnings and up."""
    level = _LEVELS.get(method_name, logging.INFO)
    enabled = logger.isEnabledFor(level) if _app_handlers(logger) else level >= logging.WARNING
    if not enabled:
        raise structlog.DropEvent
    return event


def _to_app_or_stderr(logger: logging.Logger, method_name: str, event: EventDict) -> str:
    text = _logfmt(logger, method_name, event)
    if _app_handlers(logger):
        return text  # the stdlib logger hands it to the application's handlers
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        sys.stderr.write(f"{stamp} {method_name.upper()} {logger.name}: {text}\n")
    except Exception:  # the application's stderr failing must not fail cdcd's thread that logs
        _count_lost()
    raise structlog.DropEvent


def configure_library() -> None:
    """Embedded use (done on ``import cdcd``); leaves a structlog set-up of the application alone."""
    library_logger = logging.getLogger("cdcd")
    if not any(isinstance(h, logging.NullHandler) for h in library_logger.handlers):
        library_logger.addHandler(logging.NullHandler())
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[
            _app_levels_or_warnings,  # type: ignore[list-item]
            structlog.contextvars.merge_contextvars,
            structlog.processors.StackInfoRenderer(),
            one_line_event,
            mask_log_event,
            _to_app_or_stderr,  # type: ignore[list-item]
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
