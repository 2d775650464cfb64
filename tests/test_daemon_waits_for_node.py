"""`cdcd run` started before its node (docs/daemon.md): one `waiting_for_node` line, READY=1 and watchdog pings
while it waits, then the node appears and every event is delivered exactly; SIGTERM while waiting exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.chaos import scrape
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.ports import free_port
from tests.support.procs import child_env, reap, stop_daemon, wait_for
from tests.support.wal import jsonl_lines, read_jsonl, wal_events
from tests.support.writer import make_node

WATCHDOG_USEC = 200_000


def events(err: Path) -> list[str]:
    return [json.loads(line)["event"] for line in err.read_text().splitlines() if line.startswith("{")]


class NotifySocket:
    """The socket systemd would listen on: a thread keeps reading the datagrams a process under it sends, as
    systemd does (a full socket queue would block the sender)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[str] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue

    def pings(self) -> int:
        return sum(m == "WATCHDOG=1" for m in list(self.messages))

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self.sock.close()


def start(config: Path, err: Path, notify: NotifySocket) -> subprocess.Popen[bytes]:
    env = {**child_env(), "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    with err.open("wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "cdcd", "run", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=f, env=env
        )


def test_daemon_waits_for_its_node_then_delivers_exactly(tmp_path: Path) -> None:
    node_dir, out, err = tmp_path / "node", tmp_path / "events.jsonl", tmp_path / "daemon.err"
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out))
    notify = NotifySocket(tmp_path / "notify.sock")
    proc = start(config, err, notify)
    try:
        wait_for(lambda: "waiting_for_node" in events(err) or proc.poll() is not None, 60, "waiting_for_node")
        assert proc.poll() is None, err.read_text()
        # It waits, healthy for systemd: READY=1 saying why, then the watchdog fed (pings at half WATCHDOG_USEC).
        wait_for(lambda: notify.pings() >= 3 or proc.poll() is not None, 60, "three watchdog pings while waiting")
        assert notify.messages[0].startswith("READY=1") and f"waiting for node dir {node_dir}" in notify.messages[0]
        assert not node_dir.exists(), "the daemon made nothing of the node's"

        make_node(node_dir, segments=3, tx_per_segment=20)
        expected = wal_events(node_dir)
        assert len(expected) > 100
        wait_for(lambda: jsonl_lines(out) >= len(expected) or proc.poll() is not None, 120, "delivery")
        assert proc.poll() is None, err.read_text()[-3000:]
        assert stop_daemon(proc, timeout=60) == 0, err.read_text()[-3000:]
    finally:
        reap(proc)
        notify.close()
    assert read_jsonl(out) == expected, "every event once, in WAL order"
    seen = events(err)
    assert seen.count("waiting_for_node") == 1
    assert seen.index("waiting_for_node") < seen.index("daemon_started")
    assert any(m.startswith("READY=1") and "following" in m for m in notify.messages)


def test_sigterm_while_waiting_for_the_node_exits_0_promptly(tmp_path: Path) -> None:
    node_dir, err = tmp_path / "node", tmp_path / "daemon.err"
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(tmp_path / "out.jsonl"))
    notify = NotifySocket(tmp_path / "notify.sock")
    proc = start(config, err, notify)
    try:
        wait_for(lambda: "waiting_for_node" in events(err) or proc.poll() is not None, 60, "waiting_for_node")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, err.read_text()
        assert time.monotonic() - sent < 20, "a stop does not wait for the node"
    finally:
        reap(proc)
        notify.close()
    assert "Traceback" not in err.read_text()
    assert not node_dir.exists() and not (tmp_path / "out.jsonl").exists()


def test_a_waiting_daemon_serves_its_metrics_saying_so(tmp_path: Path) -> None:
    """While it waits for a node dir that does not exist, `cdcd run` answers on its metrics_address with
    cdcd_daemon_waiting_for_node 1 (and systemd's status says so); once the node appears the gauge is 0 and the
    same endpoint counts the delivered events."""
    node_dir, out, err = tmp_path / "node", tmp_path / "events.jsonl", tmp_path / "daemon.err"
    port = free_port()
    config = write_daemon_config(
        tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), metrics_address=f"127.0.0.1:{port}"
    )
    notify = NotifySocket(tmp_path / "notify.sock")
    proc = start(config, err, notify)

    def samples() -> dict[str, list[tuple[dict[str, str], float]]] | None:
        try:
            return scrape(port)
        except OSError:
            return None

    try:
        wait_for(lambda: samples() is not None or proc.poll() is not None, 60, "the metrics endpoint")
        assert proc.poll() is None, err.read_text()
        waiting = samples()
        assert waiting is not None and waiting["cdcd_daemon_waiting_for_node"] == [({}, 1.0)]
        assert "waiting_for_node" in events(err) and not node_dir.exists()
        assert f"STATUS=waiting for node dir {node_dir}" in notify.messages[0]

        make_node(node_dir, segments=2, tx_per_segment=20)
        expected = wal_events(node_dir)

        def counted() -> float:
            m = samples() or {}
            return sum(v for _, v in m.get("cdcd_daemon_events_total", []))

        wait_for(lambda: proc.poll() is not None or counted() >= len(expected), 120, "every event counted")
        assert proc.poll() is None, err.read_text()[-3000:]
        going = samples()
        assert going is not None and going["cdcd_daemon_waiting_for_node"] == [({}, 0.0)]
        assert stop_daemon(proc, timeout=60) == 0, err.read_text()[-3000:]
    finally:
        reap(proc)
        notify.close()
    assert read_jsonl(out) == expected, "every event once, in WAL order"


def test_a_daemon_started_while_its_node_opens_waits_for_its_answer(tmp_path: Path) -> None:
    """A node process holds its lock and has written its first segment but its control socket does not answer yet
    (failpoint ``node.open.locked``, paused): a `cdcd run` without state started then logs
    `waiting_for_node_socket` and waits for the node's answer, instead of sitting PASSIVE until the node's next
    start; once the node answers, every event it writes is delivered exactly, in WAL order."""
    node_dir, out, err = tmp_path / "node", tmp_path / "events.jsonl", tmp_path / "daemon.err"
    points = tmp_path / "failpoints"
    points.mkdir()
    marker = points / "node.open.locked"
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out))
    env = {**child_env(), "CDCD_FAILPOINTS": "node.open.locked=pause", "CDCD_FAILPOINTS_DIR": str(points)}
    code = "import tests.support.writer as t; t.writer_main()"
    args = [str(node_dir), "200", str(tmp_path / "writer.stop"), "0", str(tmp_path / "writer.done")]
    notify = NotifySocket(tmp_path / "notify.sock")
    writer = proc = None
    try:
        with (tmp_path / "writer.log").open("wb") as log:
            writer = subprocess.Popen([sys.executable, "-c", code, *args], stdout=log, stderr=log, env=env)
        wait_for(lambda: marker.exists() or writer.poll() is not None, 120, "the node paused before its socket")
        assert writer.poll() is None, (tmp_path / "writer.log").read_text()[-3000:]
        proc = start(config, err, notify)
        wait_for(
            lambda: bool({"waiting_for_node_socket", "daemon_started"} & set(events(err))) or proc.poll() is not None,
            60,
            "waiting_for_node_socket",
        )
        assert "waiting_for_node_socket" in events(err), err.read_text()[-3000:]
        assert proc.poll() is None, err.read_text()[-3000:]
        marker.unlink()  # the node goes on: socket up, 200 transactions, archived
        assert writer.wait(120) == 0, (tmp_path / "writer.log").read_text()[-3000:]
        expected = wal_events(node_dir)
        assert len(expected) > 1000
        wait_for(lambda: jsonl_lines(out) >= len(expected) or proc.poll() is not None, 120, "delivery")
        assert proc.poll() is None, err.read_text()[-3000:]
        assert stop_daemon(proc, timeout=60) == 0, err.read_text()[-3000:]
    finally:
        reap(writer)
        reap(proc)
        notify.close()
    assert read_jsonl(out) == expected, "every event once, in WAL order"
    seen = events(err)
    assert seen.count("waiting_for_node_socket") == 1 and "daemon_without_state_waits" not in seen
