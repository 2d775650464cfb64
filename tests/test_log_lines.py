"""Every log line is one line (issue 29 item 3): an exception chain is joined with " <- ", terminal escapes and
stack frames are stripped, and librdkafka's own lines come out as JSON events of cdcd's log, never raw."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator

import pytest
import structlog
from confluent_kafka import Producer

from cdcd.kafka.options import KafkaSinkOptions
from cdcd.logging import configure, describe, one_line
from tests.support.ports import free_port

DELTA_RS = (
    "\x1b[31mGeneric S3 error: Error after 10 retries in 6.1s, max_retries:10, retry_timeout:180s\x1b[0m\n"
    "  \x1b[31m\u21b3\x1b[0m error sending request for url (http://127.0.0.1:9000/lake/changes/_delta_log/)\n"
    "  \u21b3 client error (Connect)\n"
    "  \u21b3 tcp connect error: Connection refused (os error 111)"
)


class Captured:
    def __init__(self) -> None:
        self.buf = io.StringIO()

    def read(self) -> str:
        """What was logged since the last read."""
        text = self.buf.getvalue()
        self.buf.seek(0)
        self.buf.truncate()
        return text


@pytest.fixture
def json_log() -> Iterator[Captured]:
    """The CLI's JSON set-up (``configure``), printing into a buffer instead of stderr."""
    saved = structlog.get_config()
    captured = Captured()
    configure("json", "info")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(captured.buf))
    try:
        yield captured
    finally:
        structlog.configure(**saved)


def test_one_line_strips_escapes_and_joins_causes() -> None:
    assert one_line(DELTA_RS) == (
        "Generic S3 error: Error after 10 retries in 6.1s, max_retries:10, retry_timeout:180s <- error sending "
        "request for url (http://127.0.0.1:9000/lake/changes/_delta_log/) <- client error (Connect) <- tcp connect "
        "error: Connection refused (os error 111)"
    )
    java = (
        "An error occurred while calling o112.execute.\n"
        ": io.delta.exceptions.ConcurrentAppendException: Files were added to the root of the table\n"
        "\tat io.delta.exceptions.ConcurrentAppendException$.apply(DeltaErrors.scala:12)\n"
        "\t... 42 more\n"
        "Caused by: java.io.IOException: disk gone\n"
    )
    assert one_line(java) == (
        "An error occurred while calling o112.execute. <- : io.delta.exceptions.ConcurrentAppendException: "
        "Files were added to the root of the table <- java.io.IOException: disk gone"
    )
    assert one_line("x" * 5000).endswith("\u2026") and len(one_line("a\n" + "x" * 5000)) == 2000


def _chained() -> BaseException:
    try:
        try:
            try:
                raise OSError(DELTA_RS)
            except OSError as exc:
                raise RuntimeError("lake /x: commit failed") from exc
        except RuntimeError:
            raise ValueError("while retrying\n\x1b[1mbold\x1b[0m")  # implicit: __context__
    except ValueError as exc:
        return exc
    raise AssertionError


def test_describe_follows_cause_and_context_but_not_a_suppressed_context() -> None:
    text = describe(_chained())
    outer = "ValueError: while retrying <- bold <- RuntimeError: lake /x: commit failed"
    assert text == f"{outer} <- OSError: {one_line(DELTA_RS)}"
    try:
        try:
            raise OSError("hidden")
        except OSError:
            raise KeyError("shown") from None
    except KeyError as exc:
        assert describe(exc) == "KeyError: 'shown'"


def test_a_logged_exception_is_one_json_line(json_log: Captured) -> None:
    log = structlog.get_logger("cdcd.test")
    log.error("lake_maintenance_failed", task="compact", exc_info=_chained())
    try:
        raise _chained()
    except ValueError:
        log.exception("consumer_failed", detail="two\nlines")
    err = json_log.read()
    lines = err.splitlines()
    assert len(lines) == 2 and "\x1b" not in err and "\\u001b" not in err, err
    first, second = map(json.loads, lines)
    assert first["error"] == describe(_chained()) and first["error_type"] == "ValueError"
    assert "exception" not in first and "Traceback" not in err
    assert second["error"] == describe(_chained()) and second["detail"] == "two <- lines"


def test_librdkafka_lines_are_json_events(json_log: Captured) -> None:
    """A real producer pointed at a closed port: librdkafka's connection failures reach stderr only as
    `librdkafka` JSON events (facility, client, message), not as its raw `%7|...|FAIL|...` text."""
    port = free_port()
    opts = KafkaSinkOptions.load({"bootstrap_servers": f"127.0.0.1:{port}", "topic": "t"}, "consumer")
    conf = {**opts.librdkafka("consumer"), "reconnect.backoff.ms": 100, "reconnect.backoff.max.ms": 200}
    producer = Producer(conf)
    seen: list[dict[str, str]] = []
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:
        producer.poll(0.5)
        for line in json_log.read().splitlines():
            event = json.loads(line)  # every line is JSON
            if event["event"] == "librdkafka":
                seen.append(event)
    del producer
    assert seen, "librdkafka logged nothing about the refused connection within 60 s"
    assert any(str(port) in e["message"] and e["facility"] for e in seen), seen
    assert logging.getLogger("cdcd.kafka.librdkafka").propagate is False
