"""Node operations (issue 13): the runtime CDC switch, the roll on a clean close, and entry expiry (TTL).

Real nodes, real daemons (``sync_once``), ``cdcd node run`` subprocesses killed with SIGKILL and
``cdcd control`` against their control sockets.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cdcd.consumer import Consumer, EventBatch
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node import Node
from cdcd.wal import DataRecord, MissingSegment, WalReader
from cdcd.wal.segment import list_segments

CDCD = [sys.executable, "-m", "cdcd"]


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


class Collect(Consumer):
    """Every delivered event as (cache, op, key, value, expire_time_ms, position)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any, Any, int, tuple[int, int, int]]] = []

    def on_events(self, batch: EventBatch) -> bool:
        for e in batch:
            p = e.position
            self.events.append(
                (e.cache_name, e.op_name, e.key, e.value, e.expire_time_ms, (p.segment, p.offset, p.entry_index))
            )
        return True


def daemon_config(node_dir: Path) -> DaemonConfig:
    return DaemonConfig(node_dir=str(node_dir), metrics_address="", lock_timeout_ms=30_000)


def sync(node_dir: Path, consumer: Collect) -> int:
    with Daemon(daemon_config(node_dir), consumer, show_progress=False) as daemon:
        return daemon.sync_once()


def segs(d: Path) -> set[int]:
    return set(list_segments(d)[0])


def wal_entries(dirs: list[Path], active: int | None = None) -> list[tuple[str, Any, tuple[int, int, int]]]:
    """(op, key, position) of every DataEntry in ``dirs``, in WAL order."""
    out = []
    for ptr, rec in WalReader(dirs, active_segment=active):
        if type(rec) is DataRecord:
            for i, e in enumerate(rec.entries):
                out.append((e.op.name.lower(), e.decoded_key(), (ptr.segment, ptr.offset, i)))
    return out


# --- the runtime CDC switch ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, name: str) -> float:
    """One unlabelled sample of the node's Prometheus endpoint (0 if absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


class NodeProc:
    """``cdcd node run`` with a load generator, a metrics port, logs in a file."""

    def __init__(self, tmp: Path, node_dir: Path) -> None:
        self.node_dir = node_dir
        self.port = free_port()
        self.cfg = tmp / "node.toml"
        self.cfg.write_text(
            f'node_dir = "{node_dir}"\nwal_segment_size_bytes = 16384\nwal_force_archive_timeout_ms = 100\n'
            f'metrics_address = "127.0.0.1:{self.port}"\n'
        )
        self.log = tmp / "node.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*CDCD, "node", "run", "--config", str(self.cfg), "--load-rate", "1000", "--log-format", "json"],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        wait_for(lambda: (self.node_dir / "control.sock").exists() and self.metrics_up(), 60, "the node to open")

    def metrics_up(self) -> bool:
        try:
            scrape(self.port, "cdcd_node_cdc_disabled")
        except OSError:
            return False
        return True

    def control(self, *args: str) -> str:
        res = subprocess.run(
            [*CDCD, "control", "--node-dir", str(self.node_dir), *args], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        return res.stdout

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.control("status", "--json"))
        return out

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0, self.log.read_text()[-2000:]

    def events(self, name: str) -> list[dict[str, Any]]:
        lines = [json.loads(x) for x in self.log.read_text().splitlines() if x.startswith("{")]
        return [e for e in lines if e.get("event") == name]


def test_cdc_switch_off_survives_sigkill_and_the_daemon_reports_the_gap(tmp_path: Path) -> None:
    """`cdcd control cdc off` on a running node stops linking (counted, logged), stays off across a SIGKILL
    and reopen, `on` links again; the daemon stops at the first unlinked segment with `missing segment N`,
    and after relink-lost-segments delivers every entry of the WAL exactly once, in order."""
    node_dir = tmp_path / "n"
    archive, cdc = node_dir / "wal" / "archive", node_dir / "cdc"
    node = NodeProc(tmp_path, node_dir)
    node.start()
    try:
        assert node.status()["cdc"] == "on"
        wait_for(lambda: len(segs(cdc)) >= 2, 60, "linked segments")
        assert node.control("cdc", "off").startswith("cdc: off (from WAL position ")
        assert scrape(node.port, "cdcd_node_cdc_disabled") == 1
        off_from = max(segs(cdc)) + 1
        wait_for(lambda: len(segs(archive)) >= off_from + 3, 60, "segments archived while off")
        assert max(segs(cdc)) <= off_from
        skipped = scrape(node.port, "cdcd_node_cdc_links_skipped_total")
        assert skipped >= 2 and node.status()["cdc_links_skipped"] >= skipped  # the load goes on
        node.kill()

        node.start()  # the switch was persisted: still off after the crash
        assert node.status()["cdc"] == "off"
        assert scrape(node.port, "cdcd_node_cdc_disabled") == 1
        before = len(segs(archive))
        wait_for(lambda: len(segs(archive)) >= before + 2, 60, "segments archived after the restart")
        assert scrape(node.port, "cdcd_node_cdc_links_skipped_total") >= 2
        assert max(segs(cdc)) <= off_from
        assert node.control("cdc", "on").startswith("cdc: on")
        assert node.status()["cdc"] == "on" and scrape(node.port, "cdcd_node_cdc_disabled") == 0
        last_off = max(segs(archive))
        wait_for(lambda: max(segs(cdc)) > last_off + 1, 60, "links after cdc on")
    finally:
        node.stop()
    linked, archived = segs(cdc), segs(archive)
    gap = sorted(archived - linked)
    first_missing = gap[0]
    assert first_missing in (off_from - 1, off_from)  # the segment active at the switch, or the next one
    assert gap == list(range(first_missing, gap[-1] + 1)) and max(linked) > gap[-1]
    skipped_logs = node.events("cdc_link_skipped")
    assert sorted(e["segment"] for e in skipped_logs) == gap
    assert all(e["reason"] == "cdc_disabled" and e["level"] == "warning" for e in skipped_logs)
    assert [e["state"] for e in node.events("cdc_switched")] == ["off", "on"]

    consumer = Collect()
    with pytest.raises(MissingSegment, match=f"missing segment {first_missing}$"):
        sync(node_dir, consumer)
    all_entries = wal_entries([archive])
    before_gap = [x for x in all_entries if x[2][0] < first_missing]
    assert [(op, key, pos) for _c, op, key, _v, _x, pos in consumer.events] == before_gap

    res = subprocess.run(
        [*CDCD, "control", "relink-lost-segments", "--config", str(write_daemon_toml(tmp_path, node_dir)), "--yes"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and f"re-linked {len(gap)} segment(s)" in res.stdout, res.stderr
    sync(node_dir, consumer)
    assert [(op, key, pos) for _c, op, key, _v, _x, pos in consumer.events] == all_entries


def write_daemon_toml(tmp: Path, node_dir: Path) -> Path:
    path = tmp / "daemon.toml"
    path.write_text(f'node_dir = "{node_dir}"\nmetrics_address = ""\n')
    return path


def test_cdc_switch_refused_without_cdc_and_persisted_in_process(tmp_path: Path) -> None:
    """The switch is refused on a node configured without CDC; in-process it persists across a clean reopen."""
    with Node.open(tmp_path / "nocdc", cdc_enabled=False) as n, pytest.raises(ValueError, match="cdc_enabled = false"):
        n.set_cdc_links(False)
    with Node.open(tmp_path / "n", wal_force_archive_timeout_ms=0) as n:
        n.set_cdc_links(False)
        n.cache("a").put(1, 1)
        assert n.force_archive() == 0
        assert n.status()["cdc"] == "off"
    assert segs(tmp_path / "n" / "cdc") == set()
    with Node.open(tmp_path / "n", wal_force_archive_timeout_ms=0) as n:
        assert not n.cdc_links_on
        n.set_cdc_links(True)
    with Node.open(tmp_path / "n", wal_force_archive_timeout_ms=0) as n:
        assert n.cdc_links_on


# --- the roll on a clean close ---------------------------------------------------------------------
def test_clean_close_rolls_the_active_segment_so_the_daemon_sees_the_last_writes(tmp_path: Path) -> None:
    """After close() (no roll by size or time) the daemon delivers every write at once, and another
    open/close with no writes delivers nothing new."""
    node_dir = tmp_path / "n"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as n:
        c = n.cache("a")
        c.put_all({i: i * 10 for i in range(10)})
        c.remove(3)
    assert list_segments(node_dir / "wal")[0].keys() == {1}
    consumer = Collect()
    assert sync(node_dir, consumer) == 11
    assert [(op, key, value) for _c, op, key, value, _x, _p in consumer.events] == [
        *(("create", i, i * 10) for i in range(10)),
        ("delete", 3, None),
    ]
    with Node.open(node_dir, wal_force_archive_timeout_ms=0):
        pass
    assert sync(node_dir, consumer) == 0 and len(consumer.events) == 11


def test_clean_close_with_realtime_on_hands_the_daemon_the_final_position(tmp_path: Path) -> None:
    """With realtime on, close() drains, writes the final RealtimeCdcRecord and rolls it out: a PASSIVE
    daemon learns the node's last committed position right away and delivers nothing itself."""
    node_dir = tmp_path / "n"
    out = tmp_path / "node.jsonl"
    settings: dict[str, Any] = {
        "wal_force_archive_timeout_ms": 0,
        "realtime_cdc": True,
        "realtime_consumer": {"kind": "jsonl", "path": str(out)},
    }
    n = Node.open(node_dir, **settings)
    try:
        consumer = Collect()
        # The daemon passes the node's TryStart record (PASSIVE), so the node starts delivering.
        wait_for(lambda: sync(node_dir, consumer) >= 0 and n.realtime.mode.value == "on", 60, "realtime on")
        c = n.cache("a")
        for i in range(50):
            c.put(i, i)
    finally:
        n.close()
    final = n.realtime.position
    assert final is not None and len(out.read_text().splitlines()) == 50
    with Daemon(daemon_config(node_dir), consumer, show_progress=False) as daemon:
        assert daemon.sync_once() == 0
        assert daemon.state.mode.value == "PASSIVE" and daemon.state.position == final
    assert consumer.events == []
    assert segs(node_dir / "cdc") == {final.segment}  # the daemon deleted the links below it
