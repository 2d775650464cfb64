"""The Spark JVM's output as log events: one ``spark_jvm`` event per log4j record, its stack trace folded in.

A JVM that fails a job (or is stopped in the middle of one) prints a log4j line followed by the exception,
its causes and a hundred or more ``at …`` frames. Forwarded line by line that was a hundred error events for
one error. ``JvmRecords`` (pure: lines in, records out) folds the exception and cause lines into the record
they follow and counts the frames instead of keeping them; ``forward`` drives it from the JVM's stdout and
emits a record when the next one starts, when the JVM has been quiet for a moment, or at the end.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Iterable
from typing import Any

import msgspec

LOG4J_LEVELS = {"FATAL": "error", "ERROR": "error", "WARN": "info"}
"""log4j's level -> the level of cdcd's event: Spark's warnings are about Spark's set-up (the hostname, a
task's size), not the pipeline's health, which cdcd reports itself; everything else is debug."""

_KNOWN_LEVELS = frozenset(("FATAL", "ERROR", "WARN", "INFO", "DEBUG", "TRACE"))
_FRAME = re.compile(r"^\s*(?:at \S|\.\.\. \d+ more\s*$)")
"""A stack frame (``at pkg.Class.method(File.java:12)``) or the ``... 42 more`` that ends a cause's frames."""
_TRACE_TEXT = re.compile(r"^(?:\s|Caused by:|Suppressed:|[\w$.]+(?:Exception|Error|Throwable)\b)")
"""A line of a stack trace that is text: the exception's class and message, a cause, a suppressed one, or
an indented continuation of a multi-line message."""
MAX_TRACE_LINES = 20
"""Text lines kept per record (the exception and its causes); frames are only counted. Bounds the memory
of a record whatever the JVM prints."""
QUIET_FLUSH_S = 0.25
"""How long the JVM is silent before the record in hand is emitted (its trace has ended)."""


class JvmRecord(msgspec.Struct, frozen=True):
    """One log4j record (or one line the JVM printed outside log4j) with its trace."""

    level: str
    text: str
    """The record's line, then the trace's text lines, newline-separated."""
    frames: int = 0
    """Stack frames (and trace lines past ``MAX_TRACE_LINES``) left out."""


class JvmRecords:
    """Lines in, records out: ``feed`` returns the record that a new one completes, ``flush`` the one in hand."""

    def __init__(self) -> None:
        self._level = "debug"
        self._lines: list[str] = []
        self._frames = 0

    def feed(self, line: str) -> JvmRecord | None:
        words = line.split(" ", 3)
        if words[2:3] and words[2] in _KNOWN_LEVELS:
            done = self.flush()
            self._level = LOG4J_LEVELS.get(words[2], "debug")
            self._lines = [line]
            return done
        if self._lines and _FRAME.match(line):
            self._frames += 1
            return None
        if self._lines and _TRACE_TEXT.match(line):
            if len(self._lines) <= MAX_TRACE_LINES:
                self._lines.append(line.strip())
            else:
                self._frames += 1
            return None
        # A line of its own (VACUUM's "Deleted N files"): a record at the level of the log4j line before it.
        done = self.flush()
        self._lines = [line]
        return done

    def flush(self) -> JvmRecord | None:
        if not self._lines:
            return None
        record = JvmRecord(self._level, "\n".join(self._lines), self._frames)
        self._lines, self._frames = [], 0
        return record


def emit(log: Any, record: JvmRecord) -> None:
    fields: dict[str, Any] = {"line": record.text}
    if record.frames:
        fields["frames"] = record.frames
    getattr(log, record.level)("spark_jvm", **fields)


def forward(stream: Iterable[bytes], log: Any, quiet_s: float = QUIET_FLUSH_S) -> None:
    """Emit the JVM's output on ``log`` until ``stream`` ends (the JVM closed it). The reading goes on in
    this thread; a second one assembles and emits, so a record is emitted even while no line comes."""
    lines: queue.Queue[str | None] = queue.Queue(maxsize=10_000)  # full: the JVM waits on its pipe

    def assemble() -> None:
        records = JvmRecords()
        while True:
            try:
                line = lines.get(timeout=quiet_s)
            except queue.Empty:
                done = records.flush()
            else:
                if line is None:
                    if (last := records.flush()) is not None:
                        emit(log, last)
                    return
                done = records.feed(line)
            if done is not None:
                emit(log, done)

    emitter = threading.Thread(target=assemble, name="cdcd-spark-jvm-records", daemon=True)
    emitter.start()
    try:
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                lines.put(line)
    finally:
        lines.put(None)
        emitter.join()
