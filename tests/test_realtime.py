"""Realtime CDC and the hand-over protocol (IEP-104, DESIGN §5), end to end with real processes.

A node process (``node_main`` below: ``Node.from_config_file`` on a TOML whose
``[realtime_consumer]`` table is a JSON-lines sink, writing the deterministic transactions of
``tests.support.writer.tx_writes``) and a ``cdcd run`` daemon process (a JSON-lines sink of its
own) share the delivery; ``cdcd control`` switches between them.

The reference is the WAL. From its marker records the protocol says exactly who delivers which
entry: the daemon delivers from a ``StopRealtimeCdcRecord(last)`` (read while PASSIVE) up to the
next ``TryStartRealtimeCdcRecord`` (read while ACTIVE), the node everything else. So each side's
file must hold exactly its share, in WAL order: no entry lost, none delivered by both sides.
Where a process is SIGKILLed, that side's file splits into runs; a run restarted after a kill
must begin exactly at the position that side had committed (duplicates only after the last
commit), and de-duplicated the file must still be exactly its share.

The fault-injection cases live in ``test_realtime_faults.py``; the helpers here are shared.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.node import Node
from cdcd.realtime import RealtimeMode
from cdcd.wal.records import (
    RealtimeCdcRecord,
    StopRealtimeCdcRecord,
)
from tests.support import rt_lag_consumer
from tests.support.procs import (
    cdcd,
    wait_for,
)
from tests.support.realtime import Rig, as_pos, check_delivery, entries_in, markers, node_realtime_state, rig_maker
from tests.support.wal import wal_events
from tests.support.writer import expected_final_state


@pytest.fixture
def rig_factory(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    yield from rig_maker(tmp_path)


# --- tests -----------------------------------------------------------------------------------------
def test_switches_under_load_split_the_wal_exactly(rig_factory: Any) -> None:
    """Switching realtime off, on, off, on via `cdcd control` while the node writes hands delivery back and forth with
    no entry lost and none delivered twice: each side's file is exactly the share the WAL's markers give it."""
    rig: Rig = rig_factory(realtime_cdc=True)
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    st = rig.wait_mode("on", "PASSIVE")
    assert (st["cdc_mode"], st["delivering"]) == ("NODE_ACTIVE", "node")
    for state in ("off", "on", "off", "on"):
        # Each side delivers a stretch under load before the next switch (the share checks below need it).
        rig.wait_delivered("node" if state == "off" else "daemon", 1100)
        st = rig.switch_off() if state == "off" else rig.switch_on()
        assert st["cdc_mode"] == ("DAEMON_ACTIVE" if state == "off" else "NODE_ACTIVE")
        assert st["delivering"] == ("daemon" if state == "off" else "node")
    rig.wait_delivered("node", 1100)
    rig.stop_node()
    final = rig.final_status()
    assert final["realtime"]["mode"] == "on"
    assert final["realtime"]["stops"] == {"command": 2}
    rig.stop_daemon()

    node_exp, daemon_exp, intervals = check_delivery(rig)
    stops = [rec for _, rec in markers(rig.node_dir) if isinstance(rec, StopRealtimeCdcRecord)]
    assert [s.reason for s in stops] == ["node_start_realtime_off", "command", "command"]
    # The daemon delivered the start-up segment, then one stretch per `off`, each under load.
    assert len(intervals) == 3
    assert all(b is not None for _, b in intervals)
    assert [entries_in(daemon_exp, a, b) > 1000 for a, b in intervals[1:]] == [True, True]
    assert len(node_exp) > 3 * 1000


def test_overflow_under_load_hands_over_to_the_daemon(rig_factory: Any) -> None:
    """A tiny cdc_buffer_bytes overflows under load: the node stops realtime (reason overflow, in status and in the
    Stop record) and the daemon delivers from the Stop record's position; nothing is lost or delivered twice."""
    rig: Rig = rig_factory(realtime_cdc=True, cdc_buffer_bytes=8192)
    rig.start_node(pause_ms=20, every=1, go=False)
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")  # nothing written yet: the try-start buffers (almost) nothing
    rig.go()  # ~2.5 KiB per transaction, one per 20 ms: fits
    rig.wait_delivered("node", 50)
    rig.burst()  # full speed: a few transactions per flush are more than 8 KiB
    st = rig.wait_mode("off", "ACTIVE", stops={"overflow": 1})
    assert st["realtime"]["buffer_used_bytes"] == 0
    rig.wait_delivered("daemon", 1100)
    rig.stop_node()
    rig.wait_daemon_caught_up()
    rig.stop_daemon()

    node_exp, daemon_exp, intervals = check_delivery(rig)
    stops = [(p, rec) for p, rec in markers(rig.node_dir) if isinstance(rec, StopRealtimeCdcRecord)]
    assert [s.reason for _, s in stops] == ["node_start_realtime_off", "overflow"]
    last = stops[1][1].last
    assert last is not None and intervals[-1] == (as_pos(last), None)
    assert len(node_exp) > 0, "the node delivered before it overflowed"
    assert len(daemon_exp) > 1000, "the daemon took over under load"
    events = rig.node_log_events()
    assert any(e["event"] == "realtime_switch" and e.get("reason") == "overflow" for e in events)


def test_off_during_a_long_batch_answers_stopping_then_hands_over(rig_factory: Any, tmp_path: Path) -> None:
    """`realtime off` while the realtime consumer holds a batch answers "stopping" (not "on"); the node turns off
    when the batch is done, without starting another, and the daemon takes over, nothing lost or delivered twice."""
    gate = tmp_path / "gate"
    consumer = {
        "kind": "python",
        "class": "rt_plugins:Gated",
        "options": {"path": str(tmp_path / "node.jsonl"), "gate": str(gate)},
    }
    rig: Rig = rig_factory(realtime_cdc=True, consumer=consumer, cdc_buffer_bytes=8 << 20)  # no overflow meanwhile
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")
    rig.wait_batch_started(0)  # the worker is inside a batch now, held until the gate opens
    assert rig.control("realtime", "off").strip() == "realtime: stopping"
    assert rig.status()["realtime"]["mode"] == "on", "the batch in flight ends first"
    gate.touch()
    st = rig.wait_mode("off", "ACTIVE", timeout=30, stops={"command": 1})
    assert (st["cdc_mode"], st["delivering"]) == ("DAEMON_ACTIVE", "daemon")
    assert rig.batches_started() == 1, "no batch started after the stop request"
    rig.wait_delivered("daemon", 100)
    rig.stop_node()
    rig.wait_daemon_caught_up()
    rig.stop_daemon()
    node_exp, daemon_exp, _ = check_delivery(rig)
    assert node_exp and len(daemon_exp) > 0


def test_failing_realtime_consumer_hands_over_to_the_daemon(rig_factory: Any, tmp_path: Path) -> None:
    """A realtime consumer that raises stops realtime (reason consumer_error) and the daemon delivers from the Stop
    record's position; once the consumer is healthy, `realtime on` hands delivery back; nothing lost, nothing twice."""
    trigger = tmp_path / "fail.trigger"
    consumer = {
        "kind": "python",
        "class": "rt_plugins:FailOnTrigger",
        "options": {"path": str(tmp_path / "node.jsonl"), "trigger": str(trigger)},
    }
    rig: Rig = rig_factory(realtime_cdc=True, consumer=consumer)
    rig.start_node(pause_ms=30)
    rig.start_daemon()
    rig.wait_mode("on", "PASSIVE")
    rig.wait_delivered("node", 100)
    trigger.touch()
    rig.wait_mode("off", "ACTIVE", stops={"consumer_error": 1})
    rig.wait_delivered("daemon", 1100)
    trigger.unlink()
    rig.switch_on()
    rig.wait_delivered("node", 1100)
    rig.stop_node()
    rig.stop_daemon()

    node_exp, daemon_exp, intervals = check_delivery(rig)
    stops = [rec for _, rec in markers(rig.node_dir) if isinstance(rec, StopRealtimeCdcRecord)]
    assert [s.reason for s in stops] == ["node_start_realtime_off", "consumer_error"]
    assert len(intervals) == 2 and entries_in(daemon_exp, *intervals[1]) > 1000
    assert entries_in(node_exp, intervals[1][1], None) > 1000, "the node delivered again after `on`"
    events = rig.node_log_events()
    failed = [e for e in events if e["event"] == "realtime_consumer_failed"]
    assert len(failed) == 1 and "injected realtime consumer failure" in failed[0]["error"]


def _connect_as(uid: int, path: Path) -> dict[str, Any]:
    """In a forked child running as ``uid``: connect to ``path`` and ask for the status."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        result: dict[str, Any]
        try:
            os.close(rfd)
            os.setgid(uid)
            os.setuid(uid)
            import socket

            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(str(path))
                try:
                    sock.sendall(b'{"cmd": "status"}\n')
                except BrokenPipeError:
                    pass  # refused: the node may have answered and closed before the request went out
                data = b""
                while not data.endswith(b"\n"):
                    part = sock.recv(65536)
                    if not part:
                        break
                    data += part
            result = {"reply": json.loads(data) if data else None}
        except OSError as exc:
            result = {"oserror": type(exc).__name__, "errno": exc.errno}
        except BaseException as exc:
            result = {"other": repr(exc)}
        os.write(wfd, json.dumps(result).encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        out = r.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    reply: dict[str, Any] = json.loads(out)
    return reply


def test_control_socket(rig_factory: Any, tmp_path: Path) -> None:
    """The control socket is 0600 and owner-only (another uid is refused), answers bad requests with an error line and
    keeps serving, reports status through the CLI, and `resend --cache` writes every current entry as a CREATE."""
    sock_dir = Path(tempfile.mkdtemp(prefix="cdcd-ctl-", dir="/tmp"))  # short, and reachable by another uid
    try:
        os.chmod(sock_dir, 0o711)
        rig: Rig = rig_factory(control_socket=str(sock_dir / "control.sock"))
        n_tx = 40
        rig.start_node(count=n_tx, pause_ms=0)
        wait_for(lambda: (rig.ctl / "written").exists(), 30, "the node's writes")
        st = os.stat(rig.socket)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()

        # Bad requests on one connection: one error line each, and the connection keeps serving.
        requests = [
            (b"not json\n", "bad request: not JSON"),
            (b"[1, 2]\n", 'bad request: expected {"cmd": ...}'),
            (b'{"state": "on"}\n', 'bad request: expected {"cmd": ...}'),
            (b'{"cmd": "explode"}\n', "unknown command 'explode' (one of: realtime, cdc, status, resend, digest)"),
            (b'{"cmd": "realtime", "state": "maybe"}\n', "realtime: state must be 'on' or 'off'"),
            (b'{"cmd": "realtime"}\n', "realtime: state must be 'on' or 'off'"),
            (b'{"cmd": "cdc", "state": "of"}\n', "cdc: state must be 'on' or 'off'"),
            (b'{"cmd": "resend"}\n', 'resend: expected {"cache": NAME}'),
            (b'{"cmd": "resend", "cache": "nope"}\n', "no cache 'nope' (caches: events, orders, users)"),
        ]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(rig.socket))
            f = s.makefile("rb")
            for line, error in requests:
                s.sendall(line)
                reply = json.loads(f.readline())
                assert reply["ok"] is False, (line, reply)
                assert reply["error"].startswith(error), (line, reply)
            s.sendall(b'{"cmd": "status"}\n')
            reply = json.loads(f.readline())
            assert reply["ok"] is True and reply["realtime"]["mode"] == "off"
            f.close()
        # A later connection is served too; so is the CLI.
        assert rig.status()["node_id"] == reply["node_id"]
        status = json.loads(rig.control("status", "--json"))
        assert status["realtime"]["mode"] == "off" and status["delivering"] == "daemon"
        assert status["cdc_mode"] == "DAEMON_ACTIVE"
        assert status["node_dir"] == str(rig.node_dir)
        text = rig.control("status")
        assert "realtime          off" in text and "delivering        daemon" in text
        res = cdcd("control", "--socket", str(rig.socket), "resend", "--cache", "nope")
        assert res.returncode == 1 and "no cache 'nope'" in res.stderr
        res = cdcd("control", "--socket", str(rig.socket), "realtime", "maybe")
        assert res.returncode == 2
        assert rig.control("realtime", "off").strip() == "realtime: off", "off when off: nothing to do"

        # Another uid: the 0600 socket keeps it out; with the mode opened up, the node itself refuses it.
        if os.geteuid() == 0:
            nobody = 65534
            got = _connect_as(nobody, rig.socket)
            assert got == {"oserror": "PermissionError", "errno": errno.EACCES}, got
            os.chmod(rig.socket, 0o666)
            got = _connect_as(nobody, rig.socket)
            assert got == {"reply": {"ok": False, "error": f"uid {nobody} is not the node's owner"}}, got
            assert rig.status()["ok"], "the node still serves its owner"

        # resend: every current entry of the cache, as CREATE events with their versions, after all writes.
        t0 = time.time_ns()  # every write was committed before this
        assert rig.control("resend", "--cache", "users").strip() == (
            f"resent {len(expected_final_state(n_tx)['users'])} entries of cache users"
        )
        assert rig.stop_node() == n_tx
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    stops = [rec.reason for _, rec in markers(rig.node_dir) if isinstance(rec, StopRealtimeCdcRecord)]
    assert stops == ["node_start_realtime_off"], "`off` while off writes no Stop record"
    events = wal_events(rig.node_dir)
    written = [e for e in events if e["commit_ts_ns"] < t0]
    resent = events[len(written) :]
    assert all(e["commit_ts_ns"] >= t0 for e in resent)
    users = expected_final_state(n_tx)["users"]
    assert len(resent) == len(users) > 0
    latest = {}
    for e in written:
        if e["cache"] == "users":
            latest[json.dumps(e["key"])] = e
    for e in resent:
        key = json.dumps(e["key"])
        assert (e["cache"], e["op"]) == ("users", "create")
        assert e["value"] == users[key]
        assert e["version"] == latest[key]["version"], "the resent entry keeps the version of its last write"
        assert e["partition"] == latest[key]["partition"]
    assert {json.dumps(e["key"]) for e in resent} == set(users)


class _StalledMetastorage:
    """The node's real metastorage whose synced write of an *enabled* state blocks until released:
    a disk that takes its time over one fsync."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.stalled = threading.Event()

    def put(self, state: Any) -> None:
        if state.enabled and not self.release.is_set():
            self.stalled.set()
            self.release.wait(60)
        self.inner.put(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_slow_position_write_does_not_hold_up_delivery(tmp_path: Path) -> None:
    """The realtime worker persists its position (a synced LMDB write) on the marker cadence; while
    that write is stuck, records flushed meanwhile are still delivered, and once it completes the
    marker follows it: persisted state first, then the RealtimeCdcRecord, never ahead of each other."""
    channel = f"stall-{os.getpid()}"
    rec = rt_lag_consumer.recorder(channel, fresh=True)
    consumer = {"kind": "python", "class": "tests.support.rt_lag_consumer:LagConsumer", "options": {"channel": channel}}
    node = Node.open(
        tmp_path / "node",
        wal_mode="fsync",
        realtime_cdc=True,
        realtime_consumer=consumer,
        cdc_enabled=False,
        realtime_commit_record_interval_ms=0,
    )
    try:
        wait_for(lambda: node.realtime.mode is RealtimeMode.ON, 30, "realtime on")
        meta = _StalledMetastorage(node.realtime.markers.meta)
        node.realtime.markers.meta = meta
        cache = node.cache("c")
        cache.put(1, "a")
        wait_for(meta.stalled.is_set, 30, "the position write to start")
        for key in range(2, 12):
            cache.put(key, "b")
        wait_for(lambda: rec.delivered() >= 11, 30, "delivery while the position write is stuck")
        assert not meta.release.is_set()
        meta.release.set()
        wait_for(lambda: meta.inner.get().enabled, 30, "the position write to finish")
    finally:
        meta_release = getattr(node.realtime.markers.meta, "release", None)
        if meta_release is not None:
            meta_release.set()
        node.close()
        rt_lag_consumer.drop(channel)
    state = node_realtime_state(tmp_path / "node")
    marks = [m for _, m in markers(tmp_path / "node") if isinstance(m, RealtimeCdcRecord)]
    assert state.enabled and marks
    assert as_pos(marks[-1].last) <= as_pos(state.position)
    assert sorted(k for _, _, keys in rec.snapshot() for k in keys) == list(range(1, 12))
