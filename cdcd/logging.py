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
import sys
import time
from typing import Literal

import structlog
from structlog.typing import EventDict

from cdcd.secrets import mask_log_event

LogFormat = Literal["json", "console"]


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
            structlog.processors.format_exc_info,
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
            structlog.processors.format_exc_info,
            mask_log_event,
            _to_app_or_stderr,  # type: ignore[list-item]
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
