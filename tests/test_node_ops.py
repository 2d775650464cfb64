"""Node operations (issue 13): the runtime CDC switch, the roll on a clean close, and entry expiry (TTL).

Real nodes, real daemons (``sync_once``), ``cdcd node run`` subprocesses killed with SIGKILL and
``cdcd control`` against their control sockets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cdcd.consumer import Consumer, EventBatch
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node import Node
from cdcd.node.snapshot import NodeSnapshot
from cdcd.wal import DataRecord, MissingSegment, WalReader
from cdcd.wal.segment import list_segments
from tests.support.ports import free_port
from tests.support.procs import wait_for

CDCD = [sys.executable, "-m", "cdcd"]
ROOT = Path(__file__).resolve().parent.parent
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
"""Children import the same ``cdcd`` as the tests."""


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
        assert any(line.split()[:3] == ["cdc", "links", "off"] for line in node.control("status").splitlines())
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


# --- TTL -------------------------------------------------------------------------------------------
def now_ms() -> int:
    return time.time_ns() // 1_000_000


def metric(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name) or 0.0


MANUAL = {"checkpoint_interval_ms": 3_600_000, "ttl_expire_interval_ms": 3_600_000, "wal_force_archive_timeout_ms": 0}
"""No background checkpoint or expiry: the test calls ``checkpoint()`` and ``expire_entries()`` itself."""


def test_ttl_get_hides_expired_entries_and_expiry_writes_one_delete_each(tmp_path: Path) -> None:
    """Entries expire by their own ttl_ms or the cache's default; get/len/items/contains hide them at once;
    a remove of an expired key writes nothing and a put creates it anew; the expirer writes exactly one DELETE
    per expired key carrying its expire time, which the daemon delivers after the PUT with that expire time."""
    node_dir = tmp_path / "n"
    expired_before = metric("cdcd_node_ttl_expired_total")
    with Node.open(node_dir, **MANUAL) as node:
        s = node.cache("s", ttl_ms=300)
        assert s.info.config.ttl_ms == 300
        t0 = now_ms()
        s.put_all({i: i for i in range(20)})  # the cache's default
        s.put(100, "never", ttl_ms=0)
        s.put(101, "long", ttl_ms=600_000)
        s.put(5, "renewed", ttl_ms=600_000)  # a later put sets the expiry anew
        s.put(6, "again")  # default again: a new expire time
        assert s.remove(7)  # a user remove: a DELETE without expire time
        with node.transaction() as tx:
            tx.put("s", 200, "tx", ttl_ms=250)
            tx.put("plain", 1, 1)
        t1 = now_ms()
        assert s.get(101) == "long" and s.get(100) == "never" and s.get(5) == "renewed"
        short = {*range(20), 200} - {5, 7}
        latest_short = t1 + 300
        wait_for(lambda: now_ms() > latest_short, 30, "the short TTLs to pass")
        # Nothing was deleted yet (no checkpoint, no expirer round): reads hide the entries by themselves.
        assert all(s.get(k) is None and k not in s for k in short)
        assert dict(s.items()) == {5: "renewed", 100: "never", 101: "long"} and len(s) == 3
        assert node.cache("plain").get(1) == 1
        assert not s.remove(3)  # expired: nothing to remove, nothing written
        s.put(8, "back", ttl_ms=0)  # expired: this put creates the key anew
        assert s.get(8) == "back"
        assert node.expire_entries() == 0  # all still in the dirty map: they reach the index at a checkpoint
        node.checkpoint()
        assert node.expire_entries() == len(short) - 1  # all but 8
        assert node.expire_entries() == 0  # their DELETEs are pending: not again
        node.checkpoint()
        assert node.expire_entries() == 0
        assert node._store.expiry_rows() == 2  # 5 and 101: rows of deleted or re-put entries are gone
        assert metric("cdcd_node_ttl_expired_total") - expired_before == len(short) - 1
        s.put(300, "brief", ttl_ms=1)  # expired at close, not yet deleted: hidden all the same
        wait_for(lambda: now_ms() > t1 + 1 and s.get(300) is None, 30, "a 1 ms TTL to pass")
        live = sorted(node.raw_items("s"))
    with NodeSnapshot(node_dir) as snap:  # what `node diff` and `lake verify` read of a stopped node
        assert sorted(snap.raw_items("s")) == live and len(live) == 4
    consumer = Collect()
    sync(node_dir, consumer)
    by_key: dict[Any, list[tuple[str, Any, int]]] = {}
    for cache, op, key, value, expire, _pos in consumer.events:
        if cache == "s":
            by_key.setdefault(key, []).append((op, value, expire))
    assert set(by_key) == {*range(20), 100, 101, 200, 300}
    assert [x[0] for x in by_key.pop(300)] == ["create"]  # its DELETE comes after the next open
    for k, events in by_key.items():
        puts = [x for x in events if x[0] != "delete"]
        deletes = [x for x in events if x[0] == "delete"]
        if k in (100, 101, 5):
            assert deletes == []
        elif k == 7:
            assert deletes == [("delete", None, 0)] and events[-1] == deletes[0]
        elif k == 8:
            assert events == [("create", 8, puts[0][2]), ("create", "back", 0)]
        else:
            assert deletes == [("delete", None, puts[-1][2])] and events[-1] == deletes[0], (k, events)
        ttl = {100: 0, 101: 600_000, 200: 250}.get(k, 300)
        first_expire = puts[0][2]
        assert (first_expire == 0) if ttl == 0 else (t0 + ttl <= first_expire <= t1 + ttl), (k, events)
    assert by_key[5][-1][2] >= t0 + 600_000 and by_key[6][-2][2] >= by_key[6][0][2]


def test_ttl_background_expiry_and_sigkill_recovery_keep_one_delete_per_key(tmp_path: Path) -> None:
    """A node SIGKILLed after writing (not yet checkpointing) expiry DELETEs, and with other TTL entries still
    live, reopens consistently: the background expirer deletes the rest, no key gets a second DELETE."""
    node_dir = tmp_path / "n"
    child = tmp_path / "child.py"
    child.write_text(
        f"""
import sys, time
from cdcd.node import Node
from cdcd.node.snapshot import NodeSnapshot
node = Node.open({str(node_dir)!r}, **{MANUAL!r})
c = node.cache("c")
c.put_all({{i: i for i in range(50)}}, ttl_ms=200)
c.put_all({{i: i for i in range(50, 100)}}, ttl_ms=1500)
c.put_all({{i: i for i in range(100, 120)}})
node.checkpoint()
expired = 0
while expired < 50:  # the 200 ms ones (and the others too on a very slow machine)
    expired += node.expire_entries()
    time.sleep(0.02)
node.flush()
print("ready", flush=True)
time.sleep(600)
"""
    )
    proc = subprocess.Popen(
        [sys.executable, str(child)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=CHILD_ENV
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # structlog's default configuration logs to stdout too
            if line.strip() == "ready":
                break
        else:
            raise AssertionError(f"child exited with {proc.wait()} before expiring")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    expired_before = metric("cdcd_node_ttl_expired_total")
    with Node.open(node_dir, ttl_expire_interval_ms=20, checkpoint_interval_ms=50) as node:
        c = node.cache("c")
        assert all(c.get(i) is None for i in range(50))
        assert [c.get(i) for i in range(100, 120)] == list(range(100, 120))
        wait_for(lambda: all(c.get(i) is None for i in range(50, 100)), 60, "the 1.5 s TTLs to pass")
        wait_for(lambda: metric("cdcd_node_ttl_expired_total") - expired_before >= 50, 60, "background expiry")
        wait_for(lambda: node._store.expiry_rows() == 0, 60, "a checkpoint after the expiry")
        assert metric("cdcd_node_ttl_expired_total") - expired_before == 50
        assert len(c) == 20
    consumer = Collect()
    sync(node_dir, consumer)
    puts = {k: x for _c, op, k, _v, x, _p in consumer.events if op != "delete"}
    deletes = [(k, x) for _c, op, k, _v, x, _p in consumer.events if op == "delete"]
    assert sorted(deletes) == sorted((k, puts[k]) for k in range(100))
    assert all(puts[k] > 0 for k in range(100)) and all(puts[k] == 0 for k in range(100, 120))


def cache_entries(node: Node, cache: str) -> list[Any]:
    """Every DataEntry of ``cache`` in a (closed or force-archived) node's archive, in WAL order."""
    cache_id = node.cache(cache).cache_id
    reader = WalReader([Path(node.config.node_dir) / "wal" / "archive"])
    return [e for _p, r in reader if type(r) is DataRecord for e in r.entries if e.cache_id == cache_id]


def test_ttl_reaches_the_replica_which_expires_it_without_sending_it_back(tmp_path: Path) -> None:
    """Replication carries expire_time_ms: the replica holds the origin's expire times, hides and deletes the
    entries itself (DELETEs that keep the origin version, so nothing goes back), and the origin's own expiry
    DELETEs then change nothing there."""
    from cdcd.sinks import load_consumer
    from cdcd.sinks.replication import ReplicationConsumer

    tok = tmp_path / "token"
    tok.write_text("s3cret-token-for-tests\n")
    tok.chmod(0o600)
    listen = {"replication_listen": "127.0.0.1:0", "replication_token_file": str(tok)}
    a = Node.open(tmp_path / "a", cluster_id=1, **MANUAL, **listen)
    b = Node.open(
        tmp_path / "b", cluster_id=2, ttl_expire_interval_ms=20, checkpoint_interval_ms=50,
        wal_force_archive_timeout_ms=0, **listen,
    )  # fmt: skip

    def replicate(src: Node, dst: Node) -> ReplicationConsumer:
        assert dst.replication is not None
        consumer = load_consumer(
            {"kind": "replication", "target": f"127.0.0.1:{dst.replication.port}", "token_file": str(tok)}
        ).consumer
        with Daemon(daemon_config(Path(src.config.node_dir)), consumer, show_progress=False) as daemon:
            daemon.sync_once()
        assert isinstance(consumer, ReplicationConsumer)
        return consumer

    try:
        c = a.cache("c", ttl_ms=300)
        c.put_all({i: i for i in range(10)})
        c.put("keep", 1, ttl_ms=0)
        c.put("long", 2, ttl_ms=600_000)
        a.force_archive()
        sent = replicate(a, b)
        assert sent.applied == 12
        a_expire = {e.decoded_key(): e.expire_time_ms for e in cache_entries(a, "c")}
        bc = b.cache("c")
        wait_for(lambda: all(bc.get(i) is None for i in range(10)), 30, "the replica to hide the expired entries")
        assert (bc.get("keep"), bc.get("long")) == (1, 2)
        wait_for(lambda: b._store.expiry_rows() == 1, 60, "the replica's expirer and a checkpoint")
        b.force_archive()
        b_entries = cache_entries(b, "c")
        puts = {e.decoded_key(): e.expire_time_ms for e in b_entries if e.op.name != "DELETE"}
        assert puts == a_expire and a_expire["long"] > 0 and a_expire["keep"] == 0
        deletes = [e for e in b_entries if e.op.name == "DELETE"]
        assert sorted((e.decoded_key(), e.expire_time_ms) for e in deletes) == [(i, a_expire[i]) for i in range(10)]
        assert all(e.version.other_cluster_version is not None for e in deletes)
        assert replicate(b, a).sent == 0  # neither the replicated puts nor the replica's expiry go back

        # The origin's own expiry reaches the replica, which has nothing left to delete.
        a.checkpoint()
        assert a.expire_entries() == 10
        a.force_archive()
        replicate(a, b)
        b.force_archive()
        assert len([e for e in cache_entries(b, "c") if e.op.name == "DELETE"]) == 10
        assert dict(bc.items()) == dict(c.items()) == {"keep": 1, "long": 2}
    finally:
        a.close()
        b.close()


def test_ttl_out_of_range_is_refused_naming_the_cache(tmp_path: Path) -> None:
    """A negative or absurd TTL, and a peer's expire time outside 0..2^63-1, are refused before anything is
    written (an expire time that cannot be indexed would fail the next checkpoint)."""
    import msgspec

    from cdcd.replication.applier import apply_replicated
    from cdcd.replication.protocol import Apply, ReplEntry
    from cdcd.replication.resolver import ConflictResolver
    from cdcd.replication.server import RequestRefused
    from cdcd.wal.records import CacheVersion, Op

    with Node.open(tmp_path / "n", **MANUAL) as node:
        with pytest.raises(ValueError, match="cache 'bad': ttl_ms must be 0"):
            node.cache("bad", ttl_ms=-5)
        c = node.cache("c")
        for ttl in (-1, 10**15):
            with pytest.raises(ValueError, match=f"cache 'c': ttl_ms must be 0 .* got {ttl}"):
                c.put(1, 1, ttl_ms=ttl)
            with pytest.raises(ValueError, match="ttl_ms must be"):
                c.put_all({2: 2}, ttl_ms=ttl)
        key, value = msgspec.Raw(msgspec.msgpack.encode(1)), msgspec.Raw(msgspec.msgpack.encode("v"))
        for expire in (-1, 2**63):
            bad = Apply(1, "c", [ReplEntry(Op.UPDATE, key, value, CacheVersion(1, 1, 2, 1), expire)])
            with pytest.raises(RequestRefused, match=f"cache 'c' entry 0: expire_time_ms {expire} out of range"):
                apply_replicated(node, bad, ConflictResolver(1))
        assert len(c) == 0 and node.caches() == ["c"]
        node.checkpoint()  # still fine


def test_ttl_destroyed_cache_leaves_no_expiry_behind(tmp_path: Path) -> None:
    """Destroying a cache purges its expiry index rows (others stay): a recreated cache of that name gets no
    DELETE for the old entries."""
    with Node.open(tmp_path / "n", **MANUAL) as node:
        node.cache("gone").put_all({i: i for i in range(30)}, ttl_ms=1)
        node.cache("kept").put_all({i: i for i in range(5)}, ttl_ms=600_000)
        node.checkpoint()
        assert node._store.expiry_rows() == 35
        assert node.destroy_cache("gone")
        assert node._store.expiry_rows() == 5
        again = node.cache("gone")
        again.put("new", 1)
        assert node.expire_entries() == 0 and again.get("new") == 1 and len(node.cache("kept")) == 5
