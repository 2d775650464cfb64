"""What ``cdcd top`` shows, read from the three places that already expose it.

Sources, all read-only: the node's control socket (``{"cmd": "status"}``), the daemon's state
(``show_state``: LMDB opened read-only, the CDC dir listed) with the daemon's lock file read for its pid
(never locked), and the Prometheus endpoints of the node and the daemon. A source that is missing or
fails is recorded in ``Snapshot.sources`` as a short line; nothing here raises for a missing source.

None of them is trusted to behave: each is read in a thread of its own, within an overall deadline
(``SOURCE_DEADLINE_S`` for connect, request, answer and parse together: a server that trickles one
byte a second cannot reset it as it would a per-recv timeout) and a size limit; an answer that breaks
either, or is not what the source should say, becomes that source's one line (and one of
``Snapshot.source_problems``). A read still running when the deadline passes (a state dir on a hung
file system) is not started again until it ends.

``build_snapshot`` is pure (raw answers in, frozen snapshot out); ``collect`` does the reading, and
``rates`` compares two consecutive snapshots.
"""

from __future__ import annotations

import math
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import lmdb
import msgspec
from prometheus_client import CollectorRegistry, generate_latest

from cdcd.control import ControlReplyError, request_within
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.ops import show_state
from cdcd.daemon_state import DaemonState, StateRefused, delivered_by
from cdcd.wal.segment import list_segments

# Prefixes of the consumer's own figures on the daemon's endpoint (lake, Kafka, replication).
CONSUMER_PREFIXES = ("cdcd_lake_", "cdcd_kafka_", "cdcd_replication_")
# Metric names holding one of these words count as trouble: retries, stalls, dead letters.
PROBLEM_WORDS = ("retries", "stall", "dead_letter", "refused", "rejected", "conflicts", "aborts")
SOURCE_DEADLINE_S = 2.0
"""Every read of a source ends within this (``--once`` reads twice: see ``ONCE_READING_S``)."""
ONCE_READING_S = 3.5
"""``--once``: both reads together end within this (the interval between them apart)."""
MAX_STATUS_BYTES = 1 << 20
"""The control socket's status reply: a few KiB from a real node."""
MAX_METRICS_BYTES = 8 << 20
"""A metrics answer: far above what a node or a daemon serves, and parsed well within the deadline."""
MAX_HEAD_BYTES = 64 << 10
MAX_LOCK_BYTES = 64
"""``cdcd.lock`` holds a pid and a newline."""
LINE_MAX_CHARS = 300
"""A source's line is cut here (the view cuts it further in its header)."""

MetricsReader = Callable[[], tuple[dict[str, float] | None, str]]
"""One read of an endpoint: its samples (``name{labels}``: value) and ``ok``, or None and why not."""
StateReader = Callable[[DaemonConfig], tuple[dict[str, Any] | None, int | None, str]]
"""The daemon's state as ``cdcd state show`` gives it, the daemon's pid, and ``ok`` or why not."""


class NodeFigures(msgspec.Struct, frozen=True, kw_only=True):
    """From the control socket's status (plus the node's metrics where noted)."""

    node_id: str
    writes: str
    """``ok``, ``waiting for disk space`` or ``failed: ...`` (as the node says it)."""
    wal_position: str
    wal_segment: int
    wal_offset: int
    cdc: str
    delivering: str
    """``node`` or ``daemon`` (normalised by ``who_delivers``)."""
    realtime_mode: str
    buffer_used_bytes: int | None
    buffer_max_bytes: int | None
    buffer_max_used_bytes: int | None
    realtime_stops: dict[str, int]
    lag_segments: int | None
    lag_ms: float | None
    wal_bytes_total: float | None = None
    """Node metrics: bytes written to the WAL since the node started."""
    entries_total: float | None = None
    """Node metrics: entries (create, update, delete) since the node started."""


class DaemonFigures(msgspec.Struct, frozen=True, kw_only=True):
    """From the daemon's state, its CDC dir, its lock file and (where noted) its metrics."""

    pid: int | None
    """The running daemon's pid (from ``<node_dir>/cdcd.lock``), None when none runs."""
    fresh: bool
    """No state yet: the daemon never committed."""
    mode: str
    position: str | None
    position_parts: list[int] | None
    updated: str | None
    commits: int
    backlog_segments: int
    """Links in the CDC dir: segments the daemon has not consumed (or, in PASSIVE, not dropped) yet."""
    first_link: int | None
    last_link: int | None
    consumer_kind: str
    events_total: float | None = None
    lag_seconds: float | None = None
    segments_pending: float | None = None
    last_commit_unix_s: float | None = None


class LakeFigures(msgspec.Struct, frozen=True, kw_only=True):
    """The lake sink's own figures, from the daemon's metrics (None where the sink has not set one yet:
    a maintenance task that never succeeded has no sample)."""

    table_version: int | None
    rows_written: float | None
    files_per_partition_max: int | None
    last_compaction_unix_s: float | None
    """End of the last successful scheduled compaction."""
    last_compaction_seconds: float | None
    """How long that compaction ran."""
    last_optimize_unix_s: float | None
    last_optimize_seconds: float | None
    last_vacuum_unix_s: float | None = None
    """End of the last successful scheduled vacuum (docs/lake.md "Disk over time")."""
    last_vacuum_seconds: float | None = None


class ConsumerFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One consumer of the daemon (``[consumer]`` is the one named ``default``): from the daemon's state
    (``state show``'s ``consumers``) and, where noted, the daemon's metrics labelled with its name."""

    name: str
    kind: str
    delivered_by: str
    """``realtime`` (the node's realtime worker) or ``daemon`` (from the archive)."""
    realtime: bool
    """The consumer the node's realtime worker stands in for (the daemon's ``realtime_consumer``)."""
    state: str
    """``delivering``, ``retrying``, ``stopped`` or ``invalidated`` (``metrics.CONSUMER_STATES``)."""
    why: str
    """Why it is not delivering, in one line ("" while it delivers)."""
    position: str | None
    position_parts: list[int] | None
    lag_segments: int | None = None
    """The node's WAL segment minus the consumer's (None without a node or a position)."""
    lag_bytes: int | None = None
    """Bytes of CDC links from its position on: what it has still to deliver, the node's active segment apart."""
    lag_seconds: float | None = None
    """Metrics: now minus the commit time of the oldest entry it has not confirmed."""
    events_total: float | None = None
    """Metrics: events it confirmed since the daemon started."""
    last_commit_unix_s: float | None = None


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    taken_unix_s: float
    sources: dict[str, str]
    """``control_socket``, ``daemon_state``, ``node_metrics``, ``daemon_metrics``: ``ok``, ``off`` or why not."""
    node: NodeFigures | None
    daemon: DaemonFigures | None
    consumer: dict[str, float]
    """The consumer's own metrics, one entry per sample (``name{labels}``)."""
    problems: dict[str, float]
    """Retries, stalls, dead letters and refusals from both endpoints, one entry per sample."""
    lake: LakeFigures | None = None
    """Read out of ``consumer`` when the daemon's consumer is a lake sink (None otherwise)."""
    consumers: tuple[ConsumerFigures, ...] = ()
    """Every consumer of the daemon, in config order (none when its state says none)."""
    slow: frozenset[str] = frozenset()
    """The sources that ran out of time (``--once`` does not read them a second time)."""
    source_problems: tuple[str, ...] = ()
    """``source: line`` of each source that answered badly or not in time (not of one that is merely
    not there: a stopped node, no metrics address)."""


class Rates(msgspec.Struct, frozen=True, kw_only=True):
    """Per second, between two snapshots (None where either lacks the figure)."""

    wal_bytes_per_s: float | None
    wal_segments_per_s: float | None
    node_entries_per_s: float | None
    daemon_events_per_s: float | None
    daemon_segments_per_s: float | None
    consumer_events_per_s: dict[str, float | None] = msgspec.field(default_factory=dict)
    """Per consumer, by name: events it confirmed per second."""


# --- reading ------------------------------------------------------------------------------------
class SourceFailed(Exception):
    """A source that answered badly or not at all; the message is its line (without the source's name)."""

    def __init__(self, message: str, *, slow: bool = False, bad: bool = True) -> None:
        super().__init__(message)
        self.slow = slow
        """It ran out of time (``--once`` does not ask it again)."""
        self.bad = bad
        """A problem (a bad answer, no answer in time), not just a source that is not there."""


class Answer(msgspec.Struct, frozen=True):
    """One source's read: what it gave (None: nothing usable), ``ok``/``off`` or its one line, whether
    it ran out of time, and whether the line is a problem (``bad``) or says the source is not there
    (a stopped node or daemon: no problem)."""

    value: Any
    line: str
    slow: bool = False
    bad: bool = False


def one_line(text: str, limit: int = LINE_MAX_CHARS) -> str:
    """``text`` as one printable line of at most ``limit`` characters: what a hostile source says is
    shown, never obeyed (no newline, no terminal escape)."""
    cut = text[: limit + 1]
    clean = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in cut)
    return clean if len(clean) <= limit and len(text) <= limit else clean[: limit - 3] + "..."


def who_delivers(status: Mapping[str, Any]) -> str:
    """``node`` or ``daemon`` from the status's ``delivering`` field.

    The one place that reads it: the field's vocabulary is being renamed (``node``/``daemon`` may
    become ``NODE_ACTIVE``/``DAEMON_ACTIVE``); anything else is shown as it is."""
    raw = str(status.get("delivering", ""))
    low = raw.lower()
    if "node" in low:
        return "node"
    if "daemon" in low:
        return "daemon"
    return raw or "unknown"


class _RealtimeReply(msgspec.Struct, kw_only=True):
    mode: str = "unknown"
    buffer_used_bytes: int | None = None
    buffer_max_bytes: int | None = None
    buffer_max_used_bytes: int | None = None
    stops: dict[str, int] | None = None


class StatusReply(msgspec.Struct, kw_only=True):
    """The fields of the node's status that top reads, with the types it needs (the rest is ignored)."""

    wal_position: str
    node_id: str = ""
    writes: str = "unknown"
    cdc: str = "unknown"
    delivering: str = ""
    realtime: _RealtimeReply | None = None
    lag_segments: int | None = None
    lag_ms: float | None = None


_POSITION = re.compile(r"([0-9]{1,18}):([0-9]{1,18})(?:#[0-9]{1,18})?")


def parse_status(reply: Any) -> StatusReply:
    """The status reply checked; ValueError naming what is wrong with it."""
    if not isinstance(reply, dict):
        raise ValueError(f"status reply is a JSON {type(reply).__name__}, not an object")
    try:
        status = msgspec.convert(reply, StatusReply)
    except msgspec.ValidationError as exc:
        raise ValueError(f"status reply: {exc}") from None
    if not _POSITION.fullmatch(status.wal_position):
        raise ValueError(f"status reply: wal_position {status.wal_position!r} is not SEGMENT:OFFSET")
    return status


def _node_dir_missing(node_dir: Path) -> str | None:
    """Why ``node_dir`` is no node dir (it does not exist, or is no directory), None when it is one."""
    try:
        mode = os.stat(node_dir).st_mode
    except FileNotFoundError:
        return f"node dir {node_dir} does not exist"
    except OSError as exc:
        return f"node dir {node_dir}: {exc.strerror or exc}"
    return None if stat.S_ISDIR(mode) else f"node dir {node_dir} is not a directory"


def _read_status(socket_path: Path, deadline_s: float) -> Answer:
    try:
        reply = request_within(socket_path, {"cmd": "status"}, deadline_s=deadline_s, max_bytes=MAX_STATUS_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        missing = _node_dir_missing(socket_path.parent)
        if missing is not None:
            return Answer(None, f"{socket_path}: no control socket ({missing})", bad=True)
        return Answer(None, f"{socket_path}: no control socket (node not running)")
    except ConnectionRefusedError:
        return Answer(None, f"{socket_path}: nobody answers (node not running)")
    except TimeoutError as exc:
        return Answer(None, f"{socket_path}: {exc}", slow=True, bad=True)
    except ControlReplyError as exc:
        return Answer(None, f"{socket_path}: {exc}", bad=True)
    except OSError as exc:
        return Answer(None, f"{socket_path}: {type(exc).__name__}: {exc}", bad=True)
    if isinstance(reply, dict) and reply.get("ok") is False:
        return Answer(None, f"{socket_path}: the node refused: {reply.get('error') or 'no reason given'}", bad=True)
    if isinstance(reply, dict) and reply.get("ok") is not True:
        return Answer(None, f'{socket_path}: status reply without "ok": true', bad=True)
    try:
        parse_status(reply)
    except ValueError as exc:
        return Answer(None, f"{socket_path}: {exc}", bad=True)
    return Answer(reply, "ok")


def _lock_pid(path: Path) -> int | None:
    """The pid in the daemon's lock file, read as no more than a pid: a FIFO or a device there
    neither blocks nor floods the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, MAX_LOCK_BYTES).strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(text) if text.isdigit() and len(text) < 10 else None


def read_state(config: DaemonConfig) -> tuple[dict[str, Any] | None, int | None, str]:
    """``cdcd state show``'s dict, the running daemon's pid, and ``ok`` or why the state is unreadable."""
    node_dir = Path(config.node_dir)
    pid = _lock_pid(node_dir / "cdcd.lock")
    if pid is not None and not os.path.exists(f"/proc/{pid}"):
        pid = None  # a SIGKILLed daemon leaves its pid in the file
    missing = _node_dir_missing(node_dir)
    if missing is not None and not os.path.exists(config.state_path):
        return None, pid, f"{missing} (no daemon state)"
    try:
        return show_state(config), pid, "ok"
    except (StateRefused, OSError, lmdb.Error) as exc:  # shown in the view; read again next time
        return None, pid, f"{type(exc).__name__}: {exc}"


def _split_address(address: str) -> tuple[str, int]:
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SourceFailed(f"{address}: not HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _head(head: bytes, address: str) -> dict[str, str]:
    """The response's headers (lower-case names), after checking its status line says 200."""
    lines = head.decode("latin-1").split("\r\n")
    status = re.fullmatch(r"HTTP/\d(?:\.\d)? (\d{3})(?: (.*))?", lines[0])
    if status is None:
        raise SourceFailed(f"{address}: not HTTP (it answered {lines[0][:40]!r})")
    if status[1] != "200":
        raise SourceFailed(f"{address}: HTTP {status[1]} {status[2] or ''}".rstrip())
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise SourceFailed(f"{address}: bad HTTP header line {line[:40]!r}")
        headers[name.strip().lower()] = value.strip()
    return headers


def http_get(address: str, path: str, *, deadline: float, max_bytes: int) -> bytes:
    """The body of ``GET http://address/path`` (status 200, not compressed), read by hand: the whole
    exchange ends by ``deadline`` (``time.monotonic()``) and reads at most ``max_bytes`` of body, which
    urllib's per-recv timeout cannot promise. HTTP/1.0, so never a chunked answer. Raises SourceFailed
    naming the address."""
    host, port = _split_address(address)
    within = f"{max(0.0, deadline - time.monotonic()):.1f} s"

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SourceFailed(f"{address}: no full answer within {within} ({len(data)} bytes by then)", slow=True)
        return remaining

    data = bytearray()
    headers: dict[str, str] | None = None
    body_at = 0
    length: int | None = None
    request = (
        f"GET {path} HTTP/1.0\r\nHost: {address}\r\nAccept: text/plain\r\nAccept-Encoding: identity\r\n"
        "User-Agent: cdcd-top\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection((host, port), timeout=left()) as sock:
            sock.settimeout(left())
            sock.sendall(request)
            while True:
                sock.settimeout(left())
                part = sock.recv(1 << 18)
                if not part:
                    break
                data += part
                if headers is None:
                    if len(data) >= 5 and not data.startswith(b"HTTP/"):
                        raise SourceFailed(f"{address}: not HTTP (it answered {bytes(data[:40])!r})")
                    end = data.find(b"\r\n\r\n")
                    if end < 0:
                        if len(data) > MAX_HEAD_BYTES:
                            raise SourceFailed(f"{address}: no end of the HTTP header in {MAX_HEAD_BYTES} bytes")
                        continue
                    headers, body_at = _head(bytes(data[:end]), address), end + 4
                    length = _content_length(headers, address, max_bytes)
                if len(data) - body_at > max_bytes:
                    raise SourceFailed(f"{address}: answer over {max_bytes} bytes")
                if length is not None and len(data) - body_at >= length:
                    break  # a server keeping the connection open after its body is not waited for
    except TimeoutError:
        raise SourceFailed(
            f"{address}: no full answer within {within} ({len(data)} bytes by then)", slow=True
        ) from None
    except ConnectionRefusedError:
        raise SourceFailed(f"{address}: nobody answers (not running)", bad=False) from None
    except OSError as exc:
        raise SourceFailed(f"{address}: {exc.strerror or exc}") from None
    if headers is None:
        raise SourceFailed(
            f"{address}: closed after {len(data)} bytes, before an HTTP header"
            if data
            else f"{address}: closed without answering"
        )
    body = bytes(data[body_at:])
    if length is not None:
        if len(body) < length:
            raise SourceFailed(f"{address}: answer cut short: {len(body)} of {length} bytes (Content-Length)")
        body = body[:length]
    for header in ("content-encoding", "transfer-encoding"):
        if headers.get(header, "identity").lower() != "identity":
            raise SourceFailed(f"{address}: {header} {headers[header][:20]!r}, asked for none")
    return body


def _content_length(headers: Mapping[str, str], address: str, max_bytes: int) -> int | None:
    raw = headers.get("content-length")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise SourceFailed(f"{address}: bad Content-Length {raw[:20]!r}")
    if int(raw) > max_bytes:
        raise SourceFailed(f"{address}: answer of {int(raw)} bytes, over {max_bytes}")
    return int(raw)


def _scrape(address: str, deadline_s: float) -> Answer:
    if not address:
        return Answer(None, "off")
    deadline = time.monotonic() + deadline_s
    try:
        body = http_get(address, "/metrics", deadline=deadline, max_bytes=MAX_METRICS_BYTES)
        try:
            text = body.decode()
        except UnicodeDecodeError as exc:
            raise SourceFailed(f"{address}: not Prometheus text (not UTF-8 at byte {exc.start})") from None
        try:
            return Answer(parse_metrics(text, deadline=deadline), "ok")
        except ValueError as exc:
            raise SourceFailed(f"{address}: not Prometheus text ({exc})") from None
        except TimeoutError as exc:
            raise SourceFailed(f"{address}: {exc}", slow=True) from None
    except SourceFailed as exc:
        return Answer(None, str(exc), slow=exc.slow, bad=exc.bad)


def scrape(address: str, deadline_s: float = SOURCE_DEADLINE_S) -> tuple[dict[str, float] | None, str]:
    """One scrape of ``http://address/metrics`` as ``{"name{labels}": value}``, or None and why not."""
    answer = _scrape(address, deadline_s)
    return answer.value, one_line(answer.line)


_SAMPLE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[^"}\\]|"(?:[^"\\]|\\.)*")*)\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*'
)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_UNESCAPE = re.compile(r"\\(.)")
_DEADLINE_EVERY = 4096
"""Lines parsed between two looks at the clock."""


def _labels(text: str, line_no: int) -> str:
    pairs: list[tuple[str, str]] = []
    at = 0
    while at < len(text):
        m = _LABEL.match(text, at)
        if m is None or m.end() == at:
            raise ValueError(f"line {line_no}: bad labels {text[at : at + 40]!r}")
        value = _UNESCAPE.sub(lambda e: "\n" if e[1] == "n" else e[1], m[2])
        pairs.append((m[1], value))
        at = m.end()
    return ",".join(f'{k}="{v}"' for k, v in sorted(pairs))


def parse_metrics(text: str, *, deadline: float | None = None) -> dict[str, float]:
    """Prometheus text as ``{"name{labels}": value}`` (labels sorted; ``_created`` and ``_bucket``
    samples left out). ValueError naming the first line that is no sample; TimeoutError when
    ``deadline`` (``time.monotonic()``) passes."""
    samples: dict[str, float] = {}
    for line_no, raw in enumerate(text.split("\n"), 1):
        if deadline is not None and line_no % _DEADLINE_EVERY == 0 and time.monotonic() > deadline:
            raise TimeoutError(f"still parsing line {line_no} at the deadline")
        line = raw.rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise ValueError(f"line {line_no} is no sample: {line[:40]!r}")
        name = m[1]
        if name.endswith(("_created", "_bucket")):
            continue
        try:
            value = float(m[3])
        except ValueError:
            raise ValueError(f"line {line_no}: value {m[3][:20]!r} is no number") from None
        labels = _labels(m[2], line_no) if m[2] else ""
        samples[f"{name}{{{labels}}}" if labels else name] = value
    return samples


def metric(samples: Mapping[str, float] | None, name: str) -> float | None:
    """The sum of every sample named ``name`` (any labels), None when there is none."""
    if samples is None:
        return None
    found = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    return sum(found) if found else None


def read_registries(*registries: CollectorRegistry) -> tuple[dict[str, float] | None, str]:
    """What a metrics listener would serve of ``registries``: for a node or daemon in this process."""
    samples: dict[str, float] = {}
    for registry in registries:
        samples.update(parse_metrics(generate_latest(registry).decode()))
    return samples, "ok"


def running_state(config: DaemonConfig, state: DaemonState, consumer_kind: str) -> dict[str, Any]:
    """What ``read_state`` gives (the keys top reads) for a daemon running in this process: LMDB refuses
    a second open of an environment in one process, so its state comes from the daemon itself."""
    links, _ = list_segments(config.cdc_path)
    pos = state.position
    one = {
        "delivered_by": delivered_by(state.mode),
        "mode": state.mode.value,
        "position": str(pos) if pos else None,
        "position_parts": msgspec.to_builtins(pos) if pos else None,
        "realtime": True,
        "consumer": {"kind": consumer_kind},
    }
    return {
        "consumers": {next(iter(config.named_consumers())): one},
        "fresh": state.commits == 0,
        "mode": state.mode.value,
        "position": str(pos) if pos else None,
        "position_parts": msgspec.to_builtins(pos) if pos else None,
        "updated": datetime.fromtimestamp(state.updated_ns / 1e9, UTC).isoformat() if state.updated_ns else None,
        "commits": state.commits,
        "links": len(links),
        "first_link": min(links) if links else None,
        "last_link": max(links) if links else None,
        "consumer": {"kind": consumer_kind},
    }


class _Read:
    """One source's read in a daemon thread (a hung one never keeps the process from exiting)."""

    def __init__(self, key: tuple[str, ...], read: Callable[[], Answer]) -> None:
        self.key = key
        self.started = time.monotonic()
        self.done = threading.Event()
        self.answer = Answer(None, "not read")
        self._read = read
        threading.Thread(target=self._run, name=f"cdcd-top-{key[0]}", daemon=True).start()

    def _run(self) -> None:
        try:
            self.answer = self._read()
        except Exception as exc:  # a reader's bug: shown as the source's line, never a dead screen
            self.answer = Answer(None, f"unexpected {type(exc).__name__}: {exc}", bad=True)
        finally:
            with _READS_LOCK:
                if _READS.get(self.key) is self:
                    del _READS[self.key]
            self.done.set()


_READS: dict[tuple[str, ...], _Read] = {}
"""Reads still running, by source: the next collect waits on one of these instead of starting another."""
_READS_LOCK = threading.Lock()
GRACE_S = 0.25
"""How long past its deadline a read is waited for (a reader checks its deadline between steps)."""


def _start(key: tuple[str, ...], read: Callable[[], Answer]) -> _Read:
    with _READS_LOCK:
        running = _READS.get(key)
        if running is None:
            running = _READS[key] = _Read(key, read)
        return running


def _finish(job: _Read, until: float) -> Answer:
    if job.done.wait(max(0.0, until - time.monotonic())):
        return job.answer
    waited = time.monotonic() - job.started
    return Answer(None, f"no answer within {waited:.1f} s (still reading)", slow=True, bad=True)


def collect(
    node_dir: Path,
    config: DaemonConfig,
    node_metrics_address: str,
    *,
    state_reader: StateReader = read_state,
    node_metrics: MetricsReader | None = None,
    daemon_metrics: MetricsReader | None = None,
    deadline_s: float = SOURCE_DEADLINE_S,
    skip: Mapping[str, str] | None = None,
) -> Snapshot:
    """Read the sources once, side by side, within ``deadline_s``. A node or daemon in this process
    (``make run``) is read through ``state_reader`` and the metrics readers instead of its LMDB file
    and its listeners. ``skip``: sources not read this time, with the line to show for each."""
    skip = skip or {}
    taken = time.time()
    until = time.monotonic() + deadline_s + GRACE_S
    where = str(node_dir)

    def state() -> Answer:
        got, pid, line = state_reader(config)
        return Answer((got, pid), line, bad=line != "ok")

    def metrics(reader: MetricsReader | None, address: str) -> Callable[[], Answer]:
        if reader is None:
            return lambda: _scrape(address, deadline_s)

        def read() -> Answer:
            got, line = reader()
            return Answer(got, line, bad=line not in ("ok", "off"))

        return read

    reads: dict[str, tuple[tuple[str, ...], Callable[[], Answer]]] = {
        "control_socket": (("control", where), lambda: _read_status(node_dir / "control.sock", deadline_s)),
        "daemon_state": (("state", where, str(config.state_path), "own" if state_reader is read_state else ""), state),
        "node_metrics": (
            ("node_m", where, node_metrics_address, "own" if node_metrics is None else ""),
            metrics(node_metrics, node_metrics_address),
        ),
        "daemon_metrics": (
            ("daemon_m", where, config.metrics_address, "own" if daemon_metrics is None else ""),
            metrics(daemon_metrics, config.metrics_address),
        ),
    }
    jobs = {name: _start(key, read) for name, (key, read) in reads.items() if name not in skip}
    answers = {
        name: _finish(jobs[name], until) if name in jobs else Answer(None, skip[name], slow=True, bad=True)
        for name in reads
    }
    status, state_answer = answers["control_socket"], answers["daemon_state"]
    got_state, pid = state_answer.value if state_answer.value is not None else (None, None)
    sources = {name: one_line(a.line) for name, a in answers.items()}
    return build_snapshot(
        taken,
        sources=sources,
        status=status.value,
        state=got_state,
        daemon_pid=pid,
        node_m=answers["node_metrics"].value,
        daemon_m=answers["daemon_metrics"].value,
        slow=frozenset(name for name, a in answers.items() if a.slow),
        source_problems=tuple(f"{name}: {sources[name]}" for name, a in answers.items() if a.bad),
    )


# --- building -----------------------------------------------------------------------------------
def _position_parts(text: str) -> tuple[int, int]:
    """(segment, offset) of a position as status prints it (``5:40`` or ``79:0#0``)."""
    seg, _, rest = text.partition(":")
    return int(seg), int(rest.partition("#")[0] or 0)


def _node_figures(reply: Mapping[str, Any], node_m: Mapping[str, float] | None) -> NodeFigures:
    status = parse_status(reply)
    rt = status.realtime or _RealtimeReply()
    segment, offset = _position_parts(status.wal_position)
    return NodeFigures(
        node_id=status.node_id,
        writes=status.writes,
        wal_position=status.wal_position,
        wal_segment=segment,
        wal_offset=offset,
        cdc=status.cdc,
        delivering=who_delivers(reply),
        realtime_mode=rt.mode,
        buffer_used_bytes=rt.buffer_used_bytes,
        buffer_max_bytes=rt.buffer_max_bytes,
        buffer_max_used_bytes=rt.buffer_max_used_bytes,
        realtime_stops=dict(rt.stops or {}),
        lag_segments=status.lag_segments,
        lag_ms=status.lag_ms,
        wal_bytes_total=metric(node_m, "cdcd_node_wal_bytes_total"),
        entries_total=metric(node_m, "cdcd_node_entries_total"),
    )


def _daemon_figures(state: Mapping[str, Any], pid: int | None, daemon_m: Mapping[str, float] | None) -> DaemonFigures:
    parts = state.get("position_parts")
    return DaemonFigures(
        pid=pid,
        fresh=bool(state.get("fresh")),
        mode=str(state.get("mode")),
        position=state.get("position"),
        position_parts=list(parts) if parts is not None else None,
        updated=state.get("updated"),
        commits=int(state.get("commits", 0)),
        backlog_segments=int(state.get("links", 0)),
        first_link=state.get("first_link"),
        last_link=state.get("last_link"),
        consumer_kind=str((state.get("consumer") or {}).get("kind", "")),
        events_total=metric(daemon_m, "cdcd_daemon_events_total"),
        lag_seconds=metric(daemon_m, "cdcd_daemon_lag_seconds"),
        segments_pending=metric(daemon_m, "cdcd_daemon_segments_pending"),
        last_commit_unix_s=metric(daemon_m, "cdcd_daemon_last_commit_timestamp_seconds"),
    )


def _int(value: float | None) -> int | None:
    return int(value) if value is not None and math.isfinite(value) else None


def _lake_figures(consumer: Mapping[str, float]) -> LakeFigures | None:
    if not any(k.startswith("cdcd_lake_") for k in consumer):
        return None

    def task(name: str, which: str) -> float | None:
        return consumer.get(f'cdcd_lake_{name}{{task="{which}"}}')

    return LakeFigures(
        table_version=_int(metric(consumer, "cdcd_lake_table_version")),
        rows_written=metric(consumer, "cdcd_lake_rows_written_total"),
        files_per_partition_max=_int(metric(consumer, "cdcd_lake_files_per_partition_max")),
        last_compaction_unix_s=task("last_maintenance_timestamp_seconds", "compact"),
        last_compaction_seconds=task("last_maintenance_duration_seconds", "compact"),
        last_optimize_unix_s=task("last_maintenance_timestamp_seconds", "optimize"),
        last_optimize_seconds=task("last_maintenance_duration_seconds", "optimize"),
        last_vacuum_unix_s=task("last_maintenance_timestamp_seconds", "vacuum"),
        last_vacuum_seconds=task("last_maintenance_duration_seconds", "vacuum"),
    )


class _Record(msgspec.Struct):
    """``stopped.json`` or ``invalidated.json`` as top reads it (any other shape: no reason given)."""

    error: str = ""
    exit_code: int | None = None


class _ConsumerState(msgspec.Struct, kw_only=True):
    """One consumer of ``state show``'s ``consumers``, the fields top reads, typed (the rest is ignored)."""

    delivered_by: str = ""
    mode: str = ""
    position: str | None = None
    position_parts: list[int] | None = None
    realtime: bool = False
    consumer: dict[str, Any] = msgspec.field(default_factory=dict)
    stopped: Any = None
    invalidated: Any = None
    retained_bytes: int | None = None


def _why(record: Any, default: str) -> str:
    """The one line of a stop record (``stopped.json``, ``invalidated.json``), ``default`` when it has none."""
    try:
        found = msgspec.convert(record, _Record)
    except msgspec.ValidationError:
        return default
    line = found.error or default
    return one_line(f"exit {found.exit_code}: {line}" if found.exit_code is not None else line)


def _labelled(samples: Mapping[str, float] | None, name: str, consumer: str, **more: str) -> float | None:
    """The sample ``name`` of ``consumer`` (and ``more`` labels), None when there is none."""
    if samples is None:
        return None
    labels = ",".join(f'{k}="{v}"' for k, v in sorted({"consumer": consumer, **more}.items()))
    return samples.get(f"{name}{{{labels}}}")


def consumer_state(
    info: _ConsumerState, name: str, pid: int | None, daemon_m: Mapping[str, float] | None
) -> tuple[str, str]:
    """(state, why) of one consumer: its state dir's records first (they outlive the daemon), then whether a
    daemon runs at all, then what the daemon's metrics say of it."""
    if info.invalidated:
        return "invalidated", _why(info.invalidated, "invalidated (max_retained_bytes)")
    if info.stopped:
        return "stopped", _why(info.stopped, "stopped for good")
    if pid is None:
        return "stopped", "daemon not running"
    for state, why in (
        ("invalidated", "invalidated (max_retained_bytes)"),
        ("stopped", "stopped for good (cdcd state show says why)"),
        ("retrying", "retrying a transient failure (its consumer_retrying lines carry the error)"),
    ):
        if _labelled(daemon_m, "cdcd_daemon_consumer_state", name, state=state) == 1:
            return state, why
    return "delivering", ""


def _consumer_figures(
    state: Mapping[str, Any], pid: int | None, daemon_m: Mapping[str, float] | None, wal_segment: int | None
) -> tuple[ConsumerFigures, ...]:
    raw = state.get("consumers")
    if not isinstance(raw, dict):
        return ()
    out = []
    for key, one in raw.items():
        try:
            info = msgspec.convert(one, _ConsumerState)
        except msgspec.ValidationError:
            info = _ConsumerState()
        name = str(key)
        parts = info.position_parts
        seg = parts[0] if parts else None
        lag_bytes = info.retained_bytes
        if lag_bytes is not None and parts and len(parts) > 1:
            lag_bytes = max(0, lag_bytes - parts[1])  # its first link is read up to its offset
        what, why = consumer_state(info, name, pid, daemon_m)
        kind = info.consumer.get("kind")
        out.append(
            ConsumerFigures(
                name=name,
                kind=str(kind) if kind is not None else "",
                delivered_by=info.delivered_by or ("realtime" if info.mode == "PASSIVE" else "daemon"),
                realtime=info.realtime,
                state=what,
                why=why,
                position=info.position,
                position_parts=parts,
                lag_segments=max(0, wal_segment - seg) if wal_segment is not None and seg is not None else None,
                lag_bytes=lag_bytes,
                lag_seconds=_labelled(daemon_m, "cdcd_daemon_consumer_lag_seconds", name),
                events_total=_labelled(daemon_m, "cdcd_daemon_consumer_events_total", name),
                last_commit_unix_s=_labelled(daemon_m, "cdcd_daemon_consumer_last_commit_timestamp_seconds", name),
            )
        )
    return tuple(out)


def build_snapshot(
    taken_unix_s: float,
    *,
    sources: dict[str, str],
    status: Mapping[str, Any] | None,
    state: Mapping[str, Any] | None,
    daemon_pid: int | None,
    node_m: Mapping[str, float] | None,
    daemon_m: Mapping[str, float] | None,
    slow: frozenset[str] = frozenset(),
    source_problems: tuple[str, ...] = (),
) -> Snapshot:
    """The snapshot of raw answers (None for a source that did not answer; a status reply checked by
    ``parse_status`` first: this raises ValueError for one that fails it)."""
    consumer = {k: v for k, v in (daemon_m or {}).items() if k.startswith(CONSUMER_PREFIXES)}
    problems = {
        k: v
        for samples in (node_m or {}, daemon_m or {})
        for k, v in samples.items()
        # A counter at zero is no problem (unlabelled ones are exported from the start).
        if v and any(word in k.partition("{")[0] for word in PROBLEM_WORDS)
    }
    node = _node_figures(status, node_m) if status is not None else None
    return Snapshot(
        taken_unix_s=taken_unix_s,
        sources=dict(sources),
        node=node,
        daemon=_daemon_figures(state, daemon_pid, daemon_m) if state is not None else None,
        consumer=consumer,
        problems=problems,
        lake=_lake_figures(consumer),
        consumers=_consumer_figures(state, daemon_pid, daemon_m, node.wal_segment if node else None)
        if state is not None
        else (),
        slow=slow,
        source_problems=source_problems,
    )


def daemon_lag_segments(snap: Snapshot) -> int | None:
    """Segments between the node's WAL and the daemon's committed position."""
    if snap.node is None or snap.daemon is None or not snap.daemon.position_parts:
        return None
    return max(0, snap.node.wal_segment - snap.daemon.position_parts[0])


def _per_s(new: float | None, old: float | None, dt_s: float) -> float | None:
    if new is None or old is None or dt_s <= 0:
        return None
    return max(0.0, (new - old) / dt_s)


def rates(old: Snapshot, new: Snapshot) -> Rates:
    """Rates between two consecutive snapshots (a counter that went back, a restart, reads as 0)."""
    dt = new.taken_unix_s - old.taken_unix_s
    on, nn, od, nd = old.node, new.node, old.daemon, new.daemon
    before = {c.name: c for c in old.consumers}
    old_seg = od.position_parts[0] if od is not None and od.position_parts else None
    new_seg = nd.position_parts[0] if nd is not None and nd.position_parts else None
    return Rates(
        wal_bytes_per_s=_per_s(nn.wal_bytes_total if nn else None, on.wal_bytes_total if on else None, dt),
        wal_segments_per_s=_per_s(nn.wal_segment if nn else None, on.wal_segment if on else None, dt),
        node_entries_per_s=_per_s(nn.entries_total if nn else None, on.entries_total if on else None, dt),
        daemon_events_per_s=_per_s(nd.events_total if nd else None, od.events_total if od else None, dt),
        daemon_segments_per_s=_per_s(new_seg, old_seg, dt),
        consumer_events_per_s={
            c.name: _per_s(c.events_total, before[c.name].events_total if c.name in before else None, dt)
            for c in new.consumers
        },
    )
