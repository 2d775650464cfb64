"""Logging set-up.

The command line configures structlog once at its entry point (``configure``: JSON lines or
console lines, to stderr). A library prints nothing on stdout: when cdcd is embedded (``import
cdcd`` without the CLI) and the application has not configured structlog itself,
``configure_library`` routes cdcd's log events through the standard ``logging`` module, loggers
``cdcd.*``, which carry a ``NullHandler`` as the logging guide asks of libraries: an application
with logging handlers of its own gets them there, at its levels (set the ``cdcd`` logger's level
to see more or less); one without any hears only warnings and errors, on stderr.
"""

from __future__ import annotations

import logging
import re
import sys
import time
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


def configure(log_format: LogFormat = "json", level: str = "info") -> None:
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
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


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
    sys.stderr.write(f"{stamp} {method_name.upper()} {logger.name}: {text}\n")
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
