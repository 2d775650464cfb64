"""The one place that turns an exception into a command's exit code and its error line."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from cdcd.faults import ExitCode, Fault
from cdcd.secrets import mask_value


def fail(message: str, code: int, hint: str = "") -> NoReturn:
    """One line on stderr, ``cdcd: error: <message> (<hint>)``, and exit ``code``."""
    line = f"{message} ({hint})" if hint else message
    click.echo(f"cdcd: error: {mask_value(line)}", err=True)
    sys.exit(code)


def exit_for(exc: BaseException) -> tuple[int, str, str]:
    """(exit code, message, hint) of an exception that ends a command.

    A :class:`Fault` says its own code and hint; an OS error is 1 (naming the file when it has
    one); anything else is unexpected: 1 with its type, so systemd restarts the process."""
    cause = exc.__cause__
    if isinstance(cause, Fault) and cause.exit_code == ExitCode.DAMAGED_LAKE:
        # A consumer that failed on a damaged lake: restarting cannot help, the lake's code says so.
        return cause.exit_code, str(exc), ""
    if isinstance(cause, Fault) and cause.exit_code == ExitCode.FORMAT_TOO_NEW:
        # A consumer that found its target's metadata of a newer cdcd: only an upgrade helps, and the
        # fault's own line names the file or record (which consumer call met it says nothing more).
        return cause.exit_code, str(cause), cause.hint
    if isinstance(exc, Fault):
        message = str(exc)
        return exc.exit_code, message, "" if exc.hint and message.endswith(exc.hint) else exc.hint
    if isinstance(exc, OSError):
        if exc.filename is not None and exc.strerror:
            return ExitCode.FAILED, f"{exc.filename}: {exc.strerror}", ""
        return ExitCode.FAILED, f"{type(exc).__name__}: {exc}", ""
    return ExitCode.FAILED, f"unexpected {type(exc).__name__}: {exc}", ""


def line_for(exc: BaseException, context: str = "", hint: str = "") -> tuple[int, str]:
    """(exit code, the error line without its ``cdcd: error:`` prefix) of ``exc``: ``context`` in
    front of its message, ``hint`` where the exception carries none."""
    code, message, own_hint = exit_for(exc)
    hint = own_hint or hint
    if context:
        message = f"{context}: {message}"
    return code, f"{message} ({hint})" if hint else message


def fail_on(exc: BaseException, context: str = "", hint: str = "") -> NoReturn:
    """Leave with ``exc``'s exit code and its one line (see ``line_for``)."""
    code, line = line_for(exc, context, hint)
    fail(line, code)
