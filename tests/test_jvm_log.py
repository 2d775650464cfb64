"""The Spark JVM's output as log events (cdcd/lake/jvm_log.py): one event per log4j record with its stack trace
folded in, from output a real Spark 4 JVM printed for a failing task (tests/data/spark-jvm-task-failure.txt:
a Python UDF raising, the executor's ERROR with the trace, the task set manager's WARN with it again)."""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

import structlog
from structlog.testing import LogCapture

from cdcd.lake import jvm_log
from cdcd.lake.jvm_log import JvmRecord, JvmRecords
from cdcd.logging import one_line_event
from tests.support.procs import wait_for

OUTPUT = Path(__file__).parent / "data" / "spark-jvm-task-failure.txt"
FRAME = re.compile(r"^\t(?:at |\.\.\. \d+ more)")


def records_of(lines: list[str]) -> list[JvmRecord]:
    records = JvmRecords()
    out = [r for line in lines if (r := records.feed(line)) is not None]
    last = records.flush()
    return out + ([last] if last else [])


def test_a_task_failure_is_three_error_and_warning_events_not_a_hundred() -> None:
    """Every log4j record is one record; the exception, its message lines and its causes stay in it as text,
    every frame is counted (none is lost, none is text), and a line printed outside log4j is its own record."""
    lines = [x for x in OUTPUT.read_text().splitlines() if x]
    records = records_of(lines)
    assert [(r.level, r.text.split("\n", 1)[0][:40]) for r in records] == [
        ("debug", "Using Spark's default log4j profile: org"),
        ("info", "26/11/27 08:50:54 WARN Utils: Your hostn"),
        ("info", "26/11/27 08:50:54 WARN Utils: Set SPARK_"),
        ("info", "Using Spark's default log4j profile: org"),  # printed outside log4j: the level before it
        ("info", 'Setting default log level to "WARN".'),
        ("info", "To adjust logging level use sc.setLogLev"),
        ("info", "26/11/27 08:50:56 WARN NativeCodeLoader:"),
        ("error", "26/11/27 08:51:15 ERROR Executor: Except"),
        ("info", "26/11/27 08:51:15 WARN TaskSetManager: L"),
        ("error", "26/11/27 08:51:15 ERROR TaskSetManager: "),
    ]
    executor = records[7]
    assert executor.text.splitlines()[1:] == [
        "org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown from the Python "
        "worker: Traceback (most recent call last):",
        'File "/tmp/trace.py", line 7, in boom',
        'raise ValueError("boom at %d" % x)',
        "ValueError: boom at 0",
        "SQLSTATE: 38000",
    ]
    assert sum(r.frames for r in records) == sum(1 for x in lines if FRAME.match(x)) > 50
    assert not any(FRAME.match(t) for r in records for t in r.text.splitlines())
    assert sum(len(r.text.splitlines()) for r in records) + sum(r.frames for r in records) == len(lines)


def test_an_endless_trace_keeps_a_bounded_record() -> None:
    """However many lines a trace has, a record keeps at most MAX_TRACE_LINES of text; the rest are counted."""
    lines = ["26/11/27 08:51:15 ERROR Executor: x", *(f"Caused by: java.io.IOException: {i}" for i in range(10_000))]
    (record,) = records_of(lines)
    assert len(record.text.splitlines()) == jvm_log.MAX_TRACE_LINES + 1
    assert record.frames == 10_000 - jvm_log.MAX_TRACE_LINES


def test_forward_emits_a_record_once_the_jvm_is_quiet_and_the_log_line_is_one_line() -> None:
    """Through a real pipe: the executor's record is emitted while the pipe is still open (the JVM went quiet
    after it), the rest at its end; the rendered event is one line, the error's messages joined."""
    lines = OUTPUT.read_text().splitlines(keepends=True)
    first_warn = next(i for i, x in enumerate(lines) if " WARN TaskSetManager" in x)
    read_fd, write_fd = os.pipe()
    # A logger of its own at debug level: whatever another test configured structlog to (the CLI's
    # configure() filters below info), this one sees every event.
    capture = LogCapture()
    log = structlog.wrap_logger(
        None, processors=[capture], wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG)
    )
    events = capture.entries
    with os.fdopen(read_fd, "rb") as stream, os.fdopen(write_fd, "wb") as sink:
        forwarder = threading.Thread(target=jvm_log.forward, args=(stream, log))
        forwarder.start()
        sink.write("".join(lines[:first_warn]).encode())
        sink.flush()
        wait_for(lambda: any(e["log_level"] == "error" for e in events), 60, "the executor's record, pipe open")
        assert [e["log_level"] for e in events] == ["debug", "info", "info", "info", "info", "info", "info", "error"]
        sink.write("".join(lines[first_warn:]).encode())
        sink.close()
        forwarder.join(60)
        assert not forwarder.is_alive()
    assert [e["log_level"] for e in events][-2:] == ["info", "error"] and len(events) == 10
    assert all(e["event"] == "spark_jvm" for e in events)
    rendered = one_line_event(None, "error", dict(events[7]))
    assert rendered["line"] == (
        "26/11/27 08:51:15 ERROR Executor: Exception in task 0.0 in stage 0.0 (TID 0) <- "
        "org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown from the Python "
        'worker: Traceback (most recent call last): <- raise ValueError("boom at %d" % x) <- '
        "ValueError: boom at 0 <- SQLSTATE: 38000"
    )
    assert rendered["frames"] == 28
