"""`cdcd top` against sources that misbehave: metrics endpoints and a control socket played by the test
(real TCP servers on 127.0.0.1 and a real Unix socket) that answer garbage, too much, too little or too
slowly, and node dirs that are missing or odd. Each case runs `cdcd top --once --json` (or the text view)
as a subprocess: exit 0 within 5 s, no traceback, and the bad source named in one line, in `sources` and
in `source_problems`. One case drives the live view in tmux with such sources."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cdcd.top.snapshot import ONCE_READING_S
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.ports import free_port
from tests.support.procs import CDCD, child_env, wait_for
from tests.support.tmux import Pane

TOP = [*CDCD, "top"]
READ_SLACK_S = 1.0
"""Past ``ONCE_READING_S`` (both reads within 3.5 s in all, 2 s for any one source): a busy machine's late wake-up."""
HANG_S = 30.0
"""The wall-clock bound, only against a hang: it adds the Python start, which a loaded machine stretches. On a quiet
one the whole answer comes within 5 s (docs/operations.md), as ``read_s`` plus the start."""
METRICS_LIMIT = 8 << 20
STATUS_LIMIT = 1 << 20

Behaviour = Callable[[socket.socket, threading.Event], None]
"""What a hostile server does on a connection, once it has read the request."""


# --- the hostile servers --------------------------------------------------------------------------
class Server:
    """Accepts connections on ``sock`` and plays ``behave`` on each after reading the request (up to
    ``request_end``); counts the connections. ``close`` stops every connection's thread."""

    def __init__(self, sock: socket.socket, behave: Behaviour, request_end: bytes) -> None:
        self.sock, self.behave, self.request_end = sock, behave, request_end
        self.stop = threading.Event()
        self.connections = 0
        self.threads: list[threading.Thread] = []
        sock.listen(16)
        sock.settimeout(0.2)  # the accept loop looks at ``stop`` between waits
        self._spawn(self._accept)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # top hanging up on us is what the cases expect
            conn.settimeout(30)
            request = b""
            while self.request_end not in request:
                part = conn.recv(4096)
                if not part:
                    return
                request += part
            self.behave(conn, self.stop)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
        self.sock.close()


def send(data: bytes) -> Behaviour:
    def behave(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(data)

    return behave


def trickle(data: bytes) -> Behaviour:
    """One byte a second (``data`` is longer than any deadline lets through)."""

    def behave(conn: socket.socket, stop: threading.Event) -> None:
        for i in range(len(data)):
            if stop.wait(1.0):
                return
            conn.sendall(data[i : i + 1])

    return behave


def endless(head: bytes, chunk: bytes) -> Behaviour:
    """``head``, then ``chunk`` again and again until the client hangs up."""

    def behave(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(head)
        block = chunk * max(1, (1 << 16) // len(chunk))
        while not stop.is_set():
            conn.sendall(block)

    return behave


def http(body: bytes, *headers: str, status: str = "200 OK", length: int | None = None) -> bytes:
    lines = [f"HTTP/1.0 {status}", "Content-Type: text/plain", *headers]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


GOOD_STATUS = {
    "ok": True,
    "node_id": "n1",
    "writes": "ok",
    "wal_position": "7:4096",
    "cdc": "on",
    "delivering": "daemon",
    "realtime": {"mode": "off", "buffer_used_bytes": 0, "buffer_max_bytes": 1024, "stops": {}},
    "lag_segments": None,
    "lag_ms": None,
}
ODD = "[/bold][red]\x1b[2J\u202e"
"""Rich markup (a closing tag with nothing open raises MarkupError), a terminal escape, a bidi override."""


def status(**changes: Any) -> bytes:
    return json.dumps({**GOOD_STATUS, **changes}).encode() + b"\n"


# --- the cases ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    control: Behaviour | None = None
    """The node's control socket (None: none there)."""
    node_metrics: Behaviour | None = None
    daemon_metrics: Behaviour | None = None
    """Served at the ``metrics_address`` of a daemon config given with ``--config``."""
    node_dir: str = "dir"
    """``dir``, ``missing``, ``file``, ``fifo-lock`` (``cdcd.lock`` a FIFO), ``bad-state`` (garbage LMDB)."""
    says: dict[str, str] = field(default_factory=dict)
    """source -> what its line says (each such source is a problem)."""
    fine: tuple[str, ...] = ()
    """Sources whose line is no problem (not there is not bad)."""
    slow: tuple[str, ...] = ()
    """Sources that run out of time: asked once only (the second read skips them)."""


CASES: dict[str, Case] = {
    # A metrics endpoint (the node's, --node-metrics).
    "metrics-not-http": Case(node_metrics=send(b"SSH-2.0-OpenSSH_9.6\r\n"), says={"node_metrics": "not HTTP"}),
    "metrics-invalid-utf8": Case(
        node_metrics=send(http(b"cdcd_node_entries_total 1\n\xff\xfe 2\n")),
        says={"node_metrics": "not UTF-8 at byte 26"},
    ),
    "metrics-short-body": Case(
        node_metrics=send(http(b"cdcd_node_e", length=1000)), says={"node_metrics": "cut short: 11 of 1000 bytes"}
    ),
    "metrics-trickle": Case(
        node_metrics=trickle(http(b"cdcd_node_entries_total 1\n")),
        says={"node_metrics": "answer within"},
        slow=("node_metrics",),
    ),
    "metrics-endless-body": Case(
        node_metrics=endless(b"HTTP/1.0 200 OK\r\n\r\n", b"cdcd_node_entries_total 1\n"),
        says={"node_metrics": f"answer over {METRICS_LIMIT} bytes"},
    ),
    "metrics-endless-header": Case(
        node_metrics=endless(b"HTTP/1.0 200 OK\r\n", b"X-Pad: aaaaaaaaaaaaaaaa\r\n"),
        says={"node_metrics": "no end of the HTTP header"},
    ),
    "metrics-garbage-text": Case(
        node_metrics=send(http(b"# HELP x\ncdcd_x{cache=unquoted} 1\n")),
        says={"node_metrics": "not Prometheus text (line 2"},
    ),
    "metrics-not-a-number": Case(
        node_metrics=send(http(b"cdcd_x 12abc\n")), says={"node_metrics": "value '12abc' is no number"}
    ),
    "metrics-huge-length": Case(
        node_metrics=send(http(b"", length=10**12)), says={"node_metrics": f"over {METRICS_LIMIT}"}
    ),
    "metrics-http-500": Case(
        node_metrics=send(http(b"boom", status="500 Internal Server Error")), says={"node_metrics": "HTTP 500"}
    ),
    "metrics-gzip": Case(
        node_metrics=send(http(b"\x1f\x8b\x08\x00", "Content-Encoding: gzip")),
        says={"node_metrics": "content-encoding 'gzip'"},
    ),
    "metrics-closes-at-once": Case(node_metrics=send(b""), says={"node_metrics": "closed without answering"}),
    # The node's control socket.
    "control-list": Case(control=send(b"[1]\n"), says={"control_socket": "status reply is a JSON list"}),
    "control-ok-only": Case(
        control=send(b'{"ok":true}\n'), says={"control_socket": "missing required field `wal_position`"}
    ),
    "control-bad-wal-position": Case(
        control=send(status(wal_position="7:x")), says={"control_socket": "wal_position '7:x' is not SEGMENT:OFFSET"}
    ),
    "control-wrong-type": Case(
        control=send(status(realtime={"mode": "on", "buffer_used_bytes": "lots"})),
        says={"control_socket": "$.realtime.buffer_used_bytes"},
    ),
    "control-not-json": Case(control=send(b'{"ok": tru\n'), says={"control_socket": "reply not JSON"}),
    "control-invalid-utf8": Case(control=send(b'{"ok": "\xff"}\n'), says={"control_socket": "reply not JSON"}),
    "control-refuses": Case(control=send(b'{"ok": false}\n'), says={"control_socket": "refused: no reason given"}),
    "control-trickle": Case(control=trickle(status()), says={"control_socket": "within 2"}, slow=("control_socket",)),
    "control-endless": Case(
        control=endless(b"", b'{"ok": true, "pad": "aaaaaaaa'),
        says={"control_socket": f"reply over {STATUS_LIMIT} bytes"},
    ),
    "control-closes-at-once": Case(control=send(b""), says={"control_socket": "closed without a reply"}),
    # Node dirs.
    "node-dir-missing": Case(
        node_dir="missing", says={"control_socket": "does not exist", "daemon_state": "does not exist"}
    ),
    "node-dir-a-file": Case(
        node_dir="file", says={"control_socket": "is not a directory", "daemon_state": "is not a directory"}
    ),
    "lock-file-a-fifo": Case(node_dir="fifo-lock", fine=("daemon_state",)),
    "state-garbage": Case(node_dir="bad-state", says={"daemon_state": "not an LMDB file"}),
    # Not there is no problem: a stopped node, a metrics endpoint nobody serves.
    "nobody-there": Case(fine=("control_socket", "node_metrics")),
    # The daemon's metrics endpoint (the metrics_address of --config).
    "daemon-metrics-endless": Case(
        daemon_metrics=endless(b"HTTP/1.0 200 OK\r\n\r\n", b"cdcd_daemon_events_total 1\n"),
        says={"daemon_metrics": f"answer over {METRICS_LIMIT} bytes"},
    ),
}


def both(first: str, second: str) -> tuple[str, Case]:
    """Two cases on different sources in one run (each subprocess costs a Python start; the sources are
    read side by side, so one's answer must not spoil the other's line)."""
    a, b = CASES[first], CASES[second]
    for part in ("control", "node_metrics", "daemon_metrics"):
        assert getattr(a, part) is None or getattr(b, part) is None, (first, second, part)
    assert a.node_dir == "dir" or b.node_dir == "dir", (first, second)
    merged = Case(
        control=a.control or b.control,
        node_metrics=a.node_metrics or b.node_metrics,
        daemon_metrics=a.daemon_metrics or b.daemon_metrics,
        node_dir=b.node_dir if a.node_dir == "dir" else a.node_dir,
        says={**a.says, **b.says},
        fine=a.fine + b.fine,
        slow=a.slow + b.slow,
    )
    return f"{first}+{second}", merged


def _slow_first(names: list[str]) -> list[str]:
    return sorted(names, key=lambda name: not CASES[name].slow)


CONTROL = _slow_first([name for name in CASES if name.startswith("control-")])
METRICS = _slow_first([name for name in CASES if name.startswith("metrics-")])
RUNS = dict(
    [both(c, m) for c, m in zip(CONTROL, METRICS, strict=False)]
    + [both(m, n) for m, n in zip(METRICS[len(CONTROL) :], ["node-dir-missing", "node-dir-a-file"], strict=True)]
    + [both("state-garbage", "daemon-metrics-endless"), both("lock-file-a-fifo", "nobody-there")]
)
"""Every case runs once: each control-socket case beside a metrics case (the trickling ones side by side:
the run takes one deadline), the metrics cases left over beside the node-dir cases (a node dir that is
not there has no control socket)."""
assert sorted(n for run in RUNS for n in run.split("+")) == sorted(CASES)


@dataclass
class Rig:
    node_dir: Path
    argv: list[str]
    servers: dict[str, Server]


@contextlib.contextmanager
def rig(tmp_path: Path, case: Case) -> Iterator[Rig]:
    node_dir = tmp_path / "node"
    if case.node_dir == "file":
        node_dir.write_text("not a dir\n")
    elif case.node_dir != "missing":
        node_dir.mkdir()
    if case.node_dir == "fifo-lock":
        os.mkfifo(node_dir / "cdcd.lock")  # nobody ever writes it: a plain open and read would block forever
    if case.node_dir == "bad-state":
        (node_dir / "cdcd-state").mkdir()
        (node_dir / "cdcd-state" / "data.mdb").write_bytes(b"\x00garbage" * 1000)
    argv = [*TOP, "--node-dir", str(node_dir), "--interval-ms", "100", "--once"]
    servers: dict[str, Server] = {}
    try:
        if case.control is not None:
            path = node_dir / "control.sock"
            assert len(os.fsencode(path)) < 100, path  # a Unix socket path's limit
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.bind(str(path))
            servers["control_socket"] = Server(unix, case.control, b"\n")
        for name, behave in (("node_metrics", case.node_metrics), ("daemon_metrics", case.daemon_metrics)):
            address = f"127.0.0.1:{free_port()}"
            if behave is not None:
                tcp = socket.socket()
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind(("127.0.0.1", int(address.rpartition(":")[2])))
                servers[name] = Server(tcp, behave, b"\r\n\r\n")
            if name == "node_metrics" and (behave is not None or "node_metrics" in case.fine):
                argv += ["--node-metrics", address]  # in `fine`: a port nobody listens on
            if name == "daemon_metrics" and behave is not None:
                config = write_daemon_config(
                    tmp_path / "daemon.toml", node_dir, jsonl_consumer(tmp_path / "out.jsonl"), metrics_address=address
                )
                argv += ["--config", str(config)]
        yield Rig(node_dir, argv, servers)
    finally:
        for server in servers.values():
            server.close()


def run_top(argv: list[str], *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    env = {**child_env(), "COLUMNS": "200"}
    res = subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=60, env=env)
    return res, time.monotonic() - started


@pytest.mark.parametrize("name", list(RUNS))
def test_a_bad_source_is_one_line_within_the_deadline(tmp_path: Path, name: str) -> None:
    """Exit 0 with the reads ended by their deadline (3.5 s in all), nothing on stderr, each bad source named in
    its one line (in `sources` and in `source_problems`), sources merely not there not counted as problems, and a
    source that ran out of time in the first read not asked again."""
    case = RUNS[name]
    with rig(tmp_path, case) as r:
        res, elapsed = run_top(r.argv, "--json")
        connections = {source: server.connections for source, server in r.servers.items()}
    assert res.returncode == 0 and res.stderr == "", res.stderr
    out = json.loads(res.stdout)
    # The claim is top's own: its reads end by their deadline whatever the sources do. The wall-clock time adds the
    # interpreter's start, which a busy machine stretches as it likes: bounded here only against a hang.
    assert out["read_s"] <= ONCE_READING_S + READ_SLACK_S, f"read for {out['read_s']} s (all in all {elapsed:.1f} s)"
    assert elapsed < HANG_S, f"took {elapsed:.1f} s"
    sources, problems = out["sources"], out["source_problems"]
    for source, says in case.says.items():
        line = sources[source]
        assert says in line, (source, line)
        assert f"{source}: {line}" in problems
        assert "\n" not in line and len(line) <= 300
    assert len(problems) == len(case.says), problems
    for source in case.fine:
        assert f"{source}: {sources[source]}" not in problems
    if "control_socket" in case.says:
        assert out["node"] is None
    for source in case.slow:
        assert connections[source] == 1, connections  # the second read did not ask it again
    if case.node_dir == "fifo-lock":
        assert sources["daemon_state"] == "ok" and out["daemon"]["pid"] is None


def odd_metrics() -> bytes:
    """Valid Prometheus text whose values and labels the view must survive: NaN, infinities, a timestamp
    past the year 9999, markup and an escape in a label."""
    return http(
        b"cdcd_lake_table_version NaN\n"
        b'cdcd_lake_last_maintenance_timestamp_seconds{task="compact"} 1e300\n'
        b'cdcd_lake_last_maintenance_duration_seconds{task="compact"} +Inf\n'
        b"cdcd_lake_files_per_partition_max -Inf\n"
        b"cdcd_daemon_last_commit_timestamp_seconds 1e300\n"
        b'cdcd_kafka_retries_total{cache="[/bold]\\n\\"x\\"\x1b[2J"} 3\n'
    )


def test_odd_values_are_shown_not_obeyed(tmp_path: Path) -> None:
    """Answers that are valid but odd (markup, escapes and bidi overrides in names, NaN and infinite
    figures, a timestamp no clock can show) reach the JSON as they are and the text view as plain text."""
    node_id = f"n{ODD}"
    case = Case(control=send(status(node_id=node_id, writes=ODD)), daemon_metrics=send(odd_metrics()))
    with rig(tmp_path, case) as r:
        res, elapsed = run_top(r.argv, "--json")
        text, text_elapsed = run_top(r.argv)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    out = json.loads(res.stdout)
    assert out["node"]["node_id"] == node_id and out["node"]["writes"] == ODD
    assert out["lake"]["table_version"] is None and out["lake"]["files_per_partition_max"] is None
    assert out["problems"] == {'cdcd_kafka_retries_total{cache="[/bold]\n"x"\x1b[2J"}': 3.0}
    assert out["source_problems"] == []
    assert text.returncode == 0 and text.stderr == "", text.stderr
    assert out["read_s"] <= ONCE_READING_S + READ_SLACK_S and max(elapsed, text_elapsed) < HANG_S
    assert "\x1b[2J" not in text.stdout  # the escape is shown, not sent to the terminal
    assert r"Node n[/bold][red]\x1b[2J" in text.stdout and r'cache="[/bold]\n"x"\x1b[2J"' in text.stdout
    assert "(not a time)" in text.stdout


def test_the_live_view_keeps_drawing(tmp_path: Path, pane: Pane) -> None:
    """The live view in a terminal with a trickling metrics endpoint, a node whose names hold markup and
    escapes and a daemon whose figures are NaN and infinite: it draws, names the bad source in the
    Problems panel, and quits on q."""
    case = Case(
        control=send(status(node_id=f"n{ODD}")),
        node_metrics=trickle(http(b"cdcd_node_entries_total 1\n")),
        daemon_metrics=send(odd_metrics()),
    )
    with pane.conf.open("a") as conf:
        conf.write("set -g default-size 160x45\n")
    with rig(tmp_path, case) as r:
        argv = [a for a in r.argv if a != "--once"]
        rc_file = tmp_path / "top.rc"
        pane.run(argv, rc_file)

        def shown() -> str | None:
            screen = pane.capture()
            return screen if "node_metrics: 127.0.0.1" in screen and "no full answer within" in screen else None

        try:
            screen = wait_for(shown, 30, "the trickling endpoint named in the view", interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the pane shows:\n{pane.last}") from None
        assert "Problems" in screen and r"Node n[/bold][red]\x1b[2J" in screen
        assert "cannot draw" not in screen
        pane.tmux("send-keys", "-t", "top", "q")
        try:
            wait_for(lambda: rc_file.exists() and rc_file.read_text().strip(), 30, "top to exit on q")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the pane shows:\n{pane.capture()}") from None
    assert rc_file.read_text().strip() == "0"


def test_a_hung_read_is_waited_for_once_not_piled_up(tmp_path: Path) -> None:
    """A source whose read does not return (here the state reader of `make run`'s in-process daemon, held
    on an event) costs each refresh its deadline, never more; the next refreshes wait on the same read
    instead of starting another; its answer, once there, is used, and the refresh after reads afresh."""
    from cdcd.daemon.config import DaemonConfig
    from cdcd.top.snapshot import collect

    release, calls = threading.Event(), []

    def hung_state(config: DaemonConfig) -> tuple[dict[str, Any] | None, int | None, str]:
        calls.append(time.monotonic())
        release.wait(60)
        return {"mode": "ACTIVE", "links": 0}, None, "ok"

    config = DaemonConfig(node_dir=str(tmp_path), metrics_address="", consumer={})
    try:
        for _ in range(3):
            started = time.monotonic()
            snap = collect(tmp_path, config, "", state_reader=hung_state, deadline_s=0.3)
            assert time.monotonic() - started < 3.0  # the deadline and its grace, with room for a busy machine
            assert snap.daemon is None and "still reading" in snap.sources["daemon_state"]
            assert snap.source_problems == (f"daemon_state: {snap.sources['daemon_state']}",)
        assert len(calls) == 1
    finally:
        release.set()
    wait_for(
        lambda: collect(tmp_path, config, "", state_reader=hung_state, deadline_s=0.3).sources["daemon_state"] == "ok",
        30,
        "the held read's answer",
    )
    # That refresh used the held read's answer, or (released before it looked) a read of its own.
    held = len(calls)
    assert held in (1, 2)
    assert collect(tmp_path, config, "", state_reader=hung_state, deadline_s=0.3).daemon is not None
    assert len(calls) == held + 1


def test_the_metrics_parser_reads_what_prometheus_client_reads() -> None:
    """top's own parser (it checks its deadline as it goes) gives the keys and values the reference parser
    gives, on every registry cdcd exports plus labels with quotes, backslashes, newlines and markup."""
    import math

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from cdcd import metrics
    from cdcd.top.snapshot import parse_metrics

    odd = CollectorRegistry()
    Counter("x_events", "h", ["cache", "op"], registry=odd).labels('a"b\\c\nd', "[/]").inc(3)
    Gauge("x_seconds", "h", registry=odd).set(float("nan"))
    Gauge("x_inf", "h", registry=odd).set(float("-inf"))
    Histogram("x_run_seconds", "h", ["task"], registry=odd).labels("compact").observe(2)
    for registry in (odd, metrics.NODE, metrics.DAEMON, metrics.LAKE, metrics.REPLICATION_ENDPOINT):
        text = generate_latest(registry).decode()
        reference = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.name.endswith(("_created", "_bucket")):
                    labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                    reference[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        ours = parse_metrics(text)
        assert ours.keys() == reference.keys()
        assert all(ours[k] == v or (math.isnan(ours[k]) and math.isnan(v)) for k, v in reference.items())
