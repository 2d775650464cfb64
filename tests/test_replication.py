"""Node-to-node replication with real processes: `cdcd node run` nodes of two clusters, `cdcd run` daemons with the
replication consumer between them (one-way, active-active with and without a conflict field, faults).

A node process runs the built-in load (``--load-*``) or serves data written into it before it started. After the
nodes stop, their WALs are the reference: a local entry has no ``other_cluster_version``, a replicated one carries
its origin's version there. A node is *caught up* when it holds nothing unarchived (its active segment is empty) and
its daemon has committed the start of that active segment: everything it wrote went through its daemon.
"""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cdcd.control import request
from cdcd.node.node import Node
from cdcd.node.snapshot import NodeSnapshot
from cdcd.replication.protocol import Error, Hello, Welcome, encode_frame
from cdcd.wal.pointer import WalPointer
from cdcd.wal.reader import WalReader
from cdcd.wal.records import CacheVersion, DataEntry, DataRecord, Op
from cdcd.wal.segment import HEADER_SIZE
from tests.support.config import write_daemon_config
from tests.support.procs import CDCD, cdcd, child_env, error_lines, start_daemon, wait_for
from tests.support.replication import exchange
from tests.support.wal import wal_records

TOKEN = "replication-token-0123456789abcdef"
NODE_SETTINGS: dict[str, Any] = {
    "wal_mode": "background",  # replicated entries are made durable before the reply whatever the mode
    "wal_segment_size_bytes": 256 * 1024,
    "wal_force_archive_timeout_ms": 200,  # the node archives on its own: the daemon sees every write soon
    "archive_max_bytes": 0,  # keep every segment: the WAL is the reference
    "checkpoint_interval_ms": 500,
    "partitions": 64,
}
DAEMON_SETTINGS: dict[str, Any] = {"batch_max_events": 2000}
RULES = ("local", "new", "version", "field", "unresolved", "duplicate")
_decode = msgspec.msgpack.Decoder().decode


# --- processes ---------------------------------------------------------------------------------------
_ports_given: set[int] = set()


def free_port() -> int:
    """A free TCP port below the ephemeral range, so no outgoing connection takes it while its node is down."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        port = rng.randrange(10_000, max(10_001, low))
        if port in _ports_given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port


def write_token(path: Path, text: str = TOKEN) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


class Procs:
    """Every process a test started; whatever still runs at the end is killed (by its own pid)."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def track(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.started.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.cleanup()


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text()[-n:] if path.exists() else f"({path} missing)"


def events(path: Path, name: str) -> list[dict[str, Any]]:
    """The JSON log lines called ``name`` of a process's stderr; a line still being written is left for later."""
    lines = path.read_bytes().split(b"\n")[:-1] if path.exists() else []
    return [e for line in lines if line.startswith(b"{") and (e := json.loads(line)).get("event") == name]


class NodeProc:
    """A `cdcd node run` process of one cluster: its config, replication endpoint, metrics port and runs."""

    def __init__(self, procs: Procs, tmp: Path, name: str, cluster_id: int, *, listen: bool = True, **settings: Any):
        self.procs = procs
        self.tmp = tmp
        self.name = name
        self.cluster_id = cluster_id
        self.dir = tmp / name
        self.token = write_token(tmp / f"{name}.token")
        self.repl_port = free_port() if listen else 0
        self.metrics_port = free_port()
        values: dict[str, Any] = {
            "node_dir": str(self.dir),
            "cluster_id": cluster_id,
            "metrics_address": f"127.0.0.1:{self.metrics_port}",
            **NODE_SETTINGS,
            **settings,
        }
        if listen:
            values["replication_listen"] = self.target
            values["replication_token_file"] = str(self.token)
        self.config = tmp / f"{name}.toml"
        self.config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
        self.runs: list[Path] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.load = False

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.repl_port}"

    @property
    def err(self) -> Path:
        return self.runs[-1]

    def start(self, *, rate: int = 0, seconds: float = 0, keyspace: int = 1000, remove_pct: int = 0, seed: int = 1):
        """Start the node (with the built-in load when ``rate``) and wait until it serves metrics."""
        args = [*CDCD, "node", "run", "--config", str(self.config), "--log-format", "json"]
        if rate:
            args += ["--load-rate", str(rate), "--load-seconds", str(seconds), "--load-keyspace", str(keyspace)]
            args += ["--load-remove-pct", str(remove_pct), "--load-seed", str(seed)]
        self.load = bool(rate)
        self.runs.append(self.tmp / f"{self.name}-{len(self.runs) + 1}.err")
        with self.err.open("wb") as err:
            self.proc = self.procs.track(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, env=child_env()))
        wait_for(lambda: self.exited() or self.serving(), 60, f"node {self.name} to serve")
        self.check_running()

    def exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def check_running(self) -> None:
        assert not self.exited(), f"node {self.name} exited:\n{_tail(self.err)}"

    def serving(self) -> bool:
        try:
            self.samples()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """SIGTERM; the node must close cleanly (exit 0)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        assert rc == 0, f"node {self.name} exited {rc}:\n{_tail(self.err)}"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def events(self, name: str) -> list[dict[str, Any]]:
        """Log lines called ``name`` of the current run."""
        return events(self.err, name)

    def load_written(self) -> int | None:
        """Entries the load wrote (its ``load_finished`` line), None while it still runs."""
        done = self.events("load_finished")
        return int(done[0]["written"]) if done else None

    def load_done(self) -> bool:
        return not self.load or self.load_written() is not None

    def status(self) -> dict[str, Any] | None:
        try:
            reply = request(self.dir / "control.sock", {"cmd": "status"}, timeout_s=10)
        except OSError:
            return None
        return reply if reply.get("ok") else None

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]

    def metric(self, name: str, samples: list[tuple[str, dict[str, str], float]] | None = None, **labels: str):
        """The sum of the samples called ``name`` carrying ``labels`` (0 when there is none)."""
        got = samples if samples is not None else self.samples()
        return sum(v for n, lab, v in got if n == name and all(lab.get(k) == x for k, x in labels.items()))

    def received(self) -> dict[str, float]:
        """cdcd_replication_received_entries_total by rule, and the rejected count under "rejected"."""
        samples = self.samples()
        out = {r: self.metric("cdcd_replication_received_entries_total", samples, rule=r) for r in RULES}
        out["rejected"] = self.metric("cdcd_replication_rejected_entries_total", samples)
        return out

    def processed(self) -> float:
        """Replicated entries this node process has taken a decision on (every rule, duplicates included)."""
        samples = self.samples()
        return sum(self.metric("cdcd_replication_received_entries_total", samples, rule=r) for r in RULES)

    def connections(self) -> float:
        return self.metric("cdcd_replication_connections")

    def entries_written(self) -> float:
        return self.metric("cdcd_node_entries_total")


class DaemonProc:
    """A `cdcd run` process on ``source`` whose replication consumer sends to ``target``; one stderr file per run."""

    def __init__(
        self,
        procs: Procs,
        tmp: Path,
        source: NodeProc,
        target: NodeProc,
        *,
        token_file: Path | None = None,
        name: str = "",
        **options: Any,
    ) -> None:
        self.procs = procs
        self.tmp = tmp
        self.name = name or f"{source.name}-to-{target.name}"
        token = token_file or target.token
        consumer = {"kind": "replication", "target": target.target, "token_file": str(token), **options}
        self.config = write_daemon_config(tmp / f"{self.name}.toml", source.dir, consumer, **DAEMON_SETTINGS)
        self.runs: list[Path] = []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def err(self) -> Path:
        return self.runs[-1]

    def start(self) -> None:
        self.runs.append(self.tmp / f"{self.name}-{len(self.runs) + 1}.err")
        self.proc = self.procs.track(start_daemon(self.config, self.err))

    def check_running(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, f"daemon {self.name} exited:\n{_tail(self.err)}"

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """SIGTERM; the daemon must stop cleanly (exit 0)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        assert rc == 0, f"daemon {self.name} exited {rc}:\n{_tail(self.err)}"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def events(self, name: str) -> list[dict[str, Any]]:
        return events(self.err, name)


def committed(node: NodeProc) -> tuple[int, int, int] | None:
    """The position the node's daemon committed, as the node's status reads it."""
    st = node.status()
    assert st is not None, f"node {node.name} does not answer on its control socket"
    pos = (st["daemon"] or {}).get("position_parts")
    return (pos[0], pos[1], pos[2]) if pos else None


def caught_up(node: NodeProc) -> bool:
    st = node.status()
    if st is None:
        return False
    pos = WalPointer.parse(st["wal_position"])
    daemon = st["daemon"] or {}
    return (
        pos.offset == HEADER_SIZE
        and st["last_archived_segment"] == pos.segment - 1
        and daemon.get("position_parts") == [pos.segment, 0, 0]
    )


def wait_caught_up(*pairs: tuple[NodeProc, DaemonProc], timeout: float = 120) -> None:
    """Until every node's load is done and every node is caught up by its daemon, all in one look."""

    def check() -> bool:
        for node, daemon in pairs:
            node.check_running()
            daemon.check_running()
        return all(node.load_done() and caught_up(node) for node, _daemon in pairs)

    wait_for(check, timeout, "the loads to finish and the daemons to catch up", interval=0.2)


def node_diff(a: NodeProc, b: NodeProc) -> tuple[int, dict[str, dict[str, Any]]]:
    """`cdcd node diff A B --json`: (exit code, per-cache result)."""
    res = cdcd("node", "diff", str(a.dir), str(b.dir), "--json", timeout=120)
    assert res.returncode in (0, 1), res.stdout + res.stderr
    return res.returncode, {d["cache"]: d for d in json.loads(res.stdout)}


# --- the reference: a stopped node's data and WAL ------------------------------------------------------------
def node_data(node: NodeProc) -> dict[str, dict[Any, Any]]:
    with NodeSnapshot(node.dir) as snap:
        return {c: {_decode(k): _decode(v) for k, v in snap.raw_items(c)} for c in snap.caches()}


def data_entries(node: NodeProc) -> list[DataEntry]:
    return [e for _p, rec in wal_records(node.dir) if type(rec) is DataRecord for e in rec.entries]


def split_entries(node: NodeProc) -> tuple[list[DataEntry], list[DataEntry]]:
    """(local, replicated) data entries of the node's WAL, in WAL order."""
    entries = data_entries(node)
    return (
        [e for e in entries if e.version.other_cluster_version is None],
        [e for e in entries if e.version.other_cluster_version is not None],
    )


def origin(e: DataEntry) -> CacheVersion:
    v = e.version.other_cluster_version
    assert v is not None
    return v


def version_text(v: CacheVersion) -> str:
    """How the resolver's log line shows a version."""
    return f"cluster {v.cluster_id} node {v.node_order} order {v.order} topology {v.topology_version}"


def stop_all(*things: NodeProc | DaemonProc) -> None:
    for thing in things:
        thing.stop()


# --- tests -----------------------------------------------------------------------------------------------
def test_one_way_replication_under_load(tmp_path: Path, procs: Procs) -> None:
    """A node under load (puts, updates, removes) replicated by a daemon process makes the other cluster's node equal to
    it (node diff exit 0 live and key by key), its WAL an entry-for-entry mirror of A's with A's versions as origins."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=2000, seconds=4, keyspace=4000, remove_pct=20, seed=11)
    daemon = DaemonProc(procs, tmp_path, a, b)
    daemon.start()
    wait_caught_up((a, daemon))
    rc, live = node_diff(a, b)
    assert rc == 0, live
    assert live["load"]["same"] and live["load"]["rows_a"] > 1000
    received = b.received()
    stop_all(daemon, a, b)

    rc, diff = node_diff(a, b)
    assert rc == 0, diff
    assert (diff["load"]["only_a"], diff["load"]["only_b"], diff["load"]["different"]) == (0, 0, 0)
    data_a = node_data(a)
    assert list(data_a) == ["load"] and len(data_a["load"]) == live["load"]["rows_a"]
    assert node_data(b) == data_a

    a_local, a_repl = split_entries(a)
    b_local, b_repl = split_entries(b)
    assert a_repl == [] and b_local == []
    assert len(a_local) > 5000 and {e.version.cluster_id for e in a_local} == {1}
    ops = {op: sum(1 for e in a_local if e.op is op) for op in Op}
    assert ops[Op.DELETE] > 0 and ops[Op.UPDATE] > 0
    mirror = [(e.op, bytes(e.key), bytes(e.value), origin(e)) for e in b_repl]
    assert mirror == [(e.op, bytes(e.key), bytes(e.value), e.version) for e in a_local]
    assert {e.version.cluster_id for e in b_repl} == {2}
    # Every entry was new (rule 2) or a newer version of A's (rule 3); none rejected, none applied twice.
    assert received == {
        "local": 0,
        "new": ops[Op.CREATE],
        "version": ops[Op.UPDATE] + ops[Op.DELETE],
        "field": 0,
        "unresolved": 0,
        "duplicate": 0,
        "rejected": 0,
    }


def test_active_active_with_conflict_field(tmp_path: Path, procs: Procs) -> None:
    """Two clusters writing the same keys at once, each replicated to the other, end identical with the higher
    updated_at winning every key on both sides, and nothing bounces: each WAL holds its load's entries plus at most
    one replicated entry per entry of the other side, and stays still once both are quiet."""
    a = NodeProc(procs, tmp_path, "a", 1, conflict_resolve_field="updated_at")
    b = NodeProc(procs, tmp_path, "b", 2, conflict_resolve_field="updated_at")
    load = {"rate": 1500, "seconds": 4, "keyspace": 1500, "remove_pct": 0}
    a.start(**load, seed=21)
    b.start(**load, seed=22)
    a_to_b, b_to_a = DaemonProc(procs, tmp_path, a, b), DaemonProc(procs, tmp_path, b, a)
    a_to_b.start()
    b_to_a.start()
    wait_caught_up((a, a_to_b), (b, b_to_a))
    rc, live = node_diff(a, b)
    assert rc == 0, live
    received = {"a": a.received(), "b": b.received()}
    written = {"a": a.entries_written(), "b": b.entries_written()}
    time.sleep(3)  # a quiet period: a bouncing entry would be written again and again
    assert {"a": a.entries_written(), "b": b.entries_written()} == written, "a WAL grew after quiescence"
    assert caught_up(a) and caught_up(b)
    assert {"a": a.received(), "b": b.received()} == received
    stop_all(a_to_b, b_to_a, a, b)

    rc, diff = node_diff(a, b)
    assert rc == 0, diff
    data_a, data_b = node_data(a), node_data(b)
    assert data_a == data_b

    local = {"a": split_entries(a)[0], "b": split_entries(b)[0]}
    repl = {"a": split_entries(a)[1], "b": split_entries(b)[1]}
    assert len(local["a"]) == a.load_written() and len(local["b"]) == b.load_written()
    # Every key's winner: the write with the highest updated_at among both sides' local writes (tie: higher cluster).
    best: dict[Any, tuple[int, int, Any]] = {}
    for e in local["a"] + local["b"]:
        value = e.decoded_value()
        cand = (value["updated_at"], e.version.cluster_id, value)
        key = e.decoded_key()
        if key not in best or cand[:2] > best[key][:2]:
            best[key] = cand
    assert data_a["load"] == {k: c[2] for k, c in best.items()}
    keys_a = {e.decoded_key() for e in local["a"]}
    keys_b = {e.decoded_key() for e in local["b"]}
    assert len(keys_a & keys_b) > 500, "the loads must overlap for the test to mean anything"
    won_by_b = sum(1 for c in best.values() if c[1] == 2)
    assert 0 < won_by_b < len(best), "each side won some keys"

    for me, other in (("a", "b"), ("b", "a")):
        got, theirs = received[me], local[other]
        their_versions = {e.version for e in theirs}
        origins = [origin(e) for e in repl[me]]
        assert all(v.cluster_id == (2 if me == "a" else 1) for v in origins), f"an entry bounced back to {me}"
        assert len(set(origins)) == len(origins) and set(origins) <= their_versions
        # Each entry of the other side arrived exactly once (no retries here) and was applied or rejected by a rule.
        assert sum(got[r] for r in RULES) == len(theirs)
        assert (got["local"], got["unresolved"], got["duplicate"]) == (0, 0, 0)
        assert got["field"] > 0
        assert len(repl[me]) == len(theirs) - got["rejected"], f"{me}: one replicated WAL entry per applied entry"
        assert written[me] == len(local[me]) + len(repl[me])


def _write_before_start(node: NodeProc, values: dict[int, Any]) -> None:
    """Write ``values`` into cache ``c`` of the (not yet running) node, in records of 50, all archived."""
    with Node.open(node.dir, cluster_id=node.cluster_id, **NODE_SETTINGS) as n:
        cache = n.cache("c")
        keys = sorted(values)
        for i in range(0, len(keys), 50):
            cache.put_all({k: values[k] for k in keys[i : i + 50]})
        n.force_archive()


def test_active_active_without_conflict_field_rejects_exactly_the_overlap(tmp_path: Path, procs: Procs) -> None:
    """Without a conflict field, two clusters that wrote overlapping keys each reject exactly the overlapping keys by
    rule 5 (metrics and one log line per key with both versions) and take every other key of the other side."""
    n = 200
    a = NodeProc(procs, tmp_path, "a", 1)
    b = NodeProc(procs, tmp_path, "b", 2)
    a_vals = {k: {"from": "a", "k": k} for k in range(n)}
    b_vals = {k: {"from": "b", "k": k} for k in range(n // 2, 3 * n // 2)}
    overlap = set(a_vals) & set(b_vals)
    assert len(overlap) == n // 2
    _write_before_start(a, a_vals)
    _write_before_start(b, b_vals)
    a.start()
    b.start()
    a_to_b, b_to_a = DaemonProc(procs, tmp_path, a, b), DaemonProc(procs, tmp_path, b, a)
    a_to_b.start()
    b_to_a.start()
    wait_caught_up((a, a_to_b), (b, b_to_a))
    received = {"a": a.received(), "b": b.received()}
    rc, live = node_diff(a, b)
    assert rc == 1 and not live["c"]["same"]
    conflicts = {"a": a.events("replication_conflict_unresolved"), "b": b.events("replication_conflict_unresolved")}
    stop_all(a_to_b, b_to_a, a, b)

    expected = {
        "local": 0,
        "new": n // 2,
        "version": 0,
        "field": 0,
        "unresolved": n // 2,
        "duplicate": 0,
        "rejected": n // 2,
    }
    assert received == {"a": expected, "b": expected}
    versions = {
        "a": {e.decoded_key(): e.version for e in split_entries(a)[0]},
        "b": {e.decoded_key(): e.version for e in split_entries(b)[0]},
    }
    assert set(versions["a"]) == set(a_vals) and set(versions["b"]) == set(b_vals)
    for me, other in (("a", "b"), ("b", "a")):
        lines = conflicts[me]
        assert sorted(int(e["key"]) for e in lines) == sorted(overlap), f"{me}: one line per overlapping key"
        for e in lines:
            k = int(e["key"])
            assert (e["level"], e["cache"], e["conflict_resolve_field"]) == ("warning", "c", None)
            assert e["held_version"] == version_text(versions[me][k])
            assert e["new_version"] == version_text(versions[other][k])

    rc, diff = node_diff(a, b)
    assert rc == 1
    assert (diff["c"]["only_a"], diff["c"]["only_b"], diff["c"]["different"]) == (0, 0, n // 2)
    assert node_data(a)["c"] == {**b_vals, **a_vals}, "a keeps its overlapping keys and takes b's others"
    assert node_data(b)["c"] == {**a_vals, **b_vals}, "b keeps its overlapping keys and takes a's others"


def entries_before(node: NodeProc, pos: tuple[int, int, int] | None) -> int:
    """Data entries of the node's WAL before the daemon position ``pos`` (None: none), counted in its archive: the
    daemon reads archived segments only, so everything before its position is there."""
    if pos is None:
        return 0
    n = 0
    for ptr, rec in WalReader([node.dir / "wal" / "archive"]):
        if (ptr.segment, ptr.offset) >= pos[:2]:
            if (ptr.segment, ptr.offset) == pos[:2] and type(rec) is DataRecord:
                n += pos[2]
            break
        if type(rec) is DataRecord:
            n += len(rec.entries)
    return n


def assert_converged(a: NodeProc, b: NodeProc) -> None:
    """Both stopped: equal key by key, and every entry of A (and nothing else) was applied on B."""
    rc, diff = node_diff(a, b)
    assert rc == 0, diff
    assert (diff["load"]["only_a"], diff["load"]["only_b"], diff["load"]["different"]) == (0, 0, 0)
    data = node_data(a)
    assert len(data["load"]) > 1000 and node_data(b) == data
    a_local, a_repl = split_entries(a)
    b_local, b_repl = split_entries(b)
    assert a_repl == [] and b_local == []
    # Re-sent batches may replay a put and its remove (no tombstones), so B may hold an entry more than once.
    assert {origin(e) for e in b_repl} == {e.version for e in a_local}


def test_daemon_sigkilled_mid_stream_loses_nothing(tmp_path: Path, procs: Procs) -> None:
    """The replicating daemon SIGKILLed three times while the target was applying entries the daemon had not committed,
    and restarted each time, leaves the target equal to the source, every re-sent entry counted exactly once more."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=1000, seconds=20, keyspace=3000, remove_pct=20, seed=31)
    # Small requests, one at a time: the backlog a restarted daemon finds takes it a while to send.
    daemon = DaemonProc(procs, tmp_path, a, b, max_batch_size=16, max_in_flight=1)
    pos: tuple[int, int, int] | None = None
    processed = 0.0
    resent = mid_stream = attempts = 0
    while mid_stream < 3:
        attempts += 1
        assert a.load_written() is None, f"the load ended after {attempts - 1} kills, {mid_stream} mid-stream"
        daemon.start()
        before = processed
        wait_for(lambda: daemon.check_running() or b.processed() > before, 60, "b to apply entries", interval=0.02)
        # Freeze the daemon, then kill it only if b has applied entries beyond its committed position: a stopped
        # daemon cannot commit, so the kill lands mid-stream by construction, however loaded the machine is.
        deadline = time.monotonic() + 120
        while True:
            daemon.pause()
            if int(b.processed() - processed) > entries_before(a, committed(a)) - entries_before(a, pos):
                break
            assert time.monotonic() < deadline, "b never applied entries the daemon had not committed"
            daemon.resume()
            seen = b.processed()
            wait_for(lambda: daemon.check_running() or b.processed() > seen, 60, "b to apply more", interval=0.01)
        daemon.kill()
        wait_for(lambda: b.connections() == 0, 30, "b to finish the killed daemon's last request")
        new_pos, now = committed(a), b.processed()
        # Entries b took a decision on in this run beyond those up to the committed position: sent again next run.
        excess = int(now - processed) - (entries_before(a, new_pos) - entries_before(a, pos))
        assert excess > 0
        mid_stream += 1
        resent += excess
        pos, processed = new_pos, now
    assert mid_stream == 3, f"{mid_stream} of {attempts} kills came while b applied uncommitted entries"
    daemon.start()
    wait_caught_up((a, daemon))
    rc, live = node_diff(a, b)
    assert rc == 0, live
    received = b.received()
    stop_all(daemon, a, b)

    assert_converged(a, b)
    a_local = split_entries(a)[0]
    assert sum(received[r] for r in RULES) == len(a_local) + resent
    assert (received["local"], received["field"], received["unresolved"]) == (0, 0, 0)


def test_target_killed_daemon_gives_up_after_max_retry_then_recovers(tmp_path: Path, procs: Procs) -> None:
    """With the target node SIGKILLed mid-stream, the daemon logs replication_retry warnings and exits 4 within
    max_retry_s plus a margin with one error line naming the target; both restarted, the target converges."""
    max_retry_s = 5.0
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=1000, seconds=8, keyspace=3000, remove_pct=20, seed=41)
    daemon = DaemonProc(
        procs, tmp_path, a, b, max_retry_s=max_retry_s, retry_backoff_max_ms=500, connect_timeout_ms=1000
    )
    daemon.start()
    wait_for(lambda: daemon.check_running() or b.processed() > 0, 60, "entries to reach b", interval=0.05)
    b.kill()
    killed_at = time.monotonic()
    rc = daemon.wait(max_retry_s + 30)
    took = time.monotonic() - killed_at
    assert rc == 4, _tail(daemon.err)
    assert took <= max_retry_s + 10, f"exited {took:.1f} s after the target died"
    retries = daemon.events("replication_retry")
    assert len(retries) >= 3, _tail(daemon.err)
    assert all(e["level"] == "warning" and e["target"] == b.target for e in retries)
    failing = [e["failing_for_s"] for e in retries]
    assert failing == sorted(failing) and failing[-1] <= max_retry_s
    errors = error_lines(daemon.err)
    assert len(errors) == 1 and daemon.err.read_text().splitlines()[-1] == errors[0]
    assert b.target in errors[0] and f"max_retry_s = {max_retry_s:g}" in errors[0], errors[0]
    match = re.search(r"failing for ([0-9.]+) s", errors[0])
    assert match and float(match.group(1)) >= max_retry_s, errors[0]

    b.start()  # same config, same port
    daemon.start()  # as systemd restarts a failed unit
    wait_caught_up((a, daemon))
    rc, live = node_diff(a, b)
    assert rc == 0, live
    stop_all(daemon, a, b)
    assert_converged(a, b)


def test_bad_peers_are_refused_and_a_restarted_target_is_rejoined(tmp_path: Path, procs: Procs) -> None:
    """A node process refuses a daemon with a wrong token (exit 4 at once, no retries) and garbage frames, counting
    each refusal, keeps serving a good daemon, and once SIGTERMed and restarted mid-stream is rejoined by that daemon
    (retrying, not exiting) until it equals the source."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=800, seconds=8, keyspace=2000, remove_pct=20, seed=51)
    wrong = write_token(tmp_path / "wrong.token", "wrong-" + TOKEN)
    bad = DaemonProc(procs, tmp_path, a, b, token_file=wrong, name="a-to-b-wrong-token")
    bad.start()
    assert bad.wait(60) == 4, _tail(bad.err)
    errors = error_lines(bad.err)
    assert len(errors) == 1 and "token refused" in errors[0] and b.target in errors[0], _tail(bad.err)
    assert bad.events("replication_retry") == []

    http = exchange(b.repl_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # read as a frame of ~1.2 GB
    assert [type(f) for f in http] == [Error] and http[0].fatal and "over the limit" in http[0].message
    junk = exchange(b.repl_port, encode_frame(Hello(TOKEN)) + struct.pack(">I", 3) + b"\xc1\xc1\xc1")
    assert [type(f) for f in junk] == [Welcome, Error] and "undecodable" in junk[1].message
    samples = b.samples()
    refused = {r: b.metric("cdcd_replication_refused_total", samples, reason=r) for r in ("token", "frame", "tls")}
    assert refused == {"token": 1, "frame": 2, "tls": 0}
    assert b.processed() == 0

    daemon = DaemonProc(procs, tmp_path, a, b, retry_backoff_max_ms=500)
    daemon.start()
    wait_for(lambda: daemon.check_running() or b.processed() > 0, 60, "entries to reach b", interval=0.05)
    b.stop()  # SIGTERM while the daemon sends: a clean close
    wait_for(lambda: daemon.check_running() or daemon.events("replication_retry"), 60, "the daemon to retry")
    b.start()
    wait_caught_up((a, daemon))
    assert len(daemon.events("replication_connected")) == 2, "connected, then reconnected once b was back"
    rc, live = node_diff(a, b)
    assert rc == 0, live
    stop_all(daemon, a, b)
    assert_converged(a, b)


def test_sigterm_while_the_target_is_down_stops_at_once(tmp_path: Path, procs: Procs) -> None:
    """SIGTERM while the daemon retries a dead target stops it within seconds with exit 0; the unconfirmed batch is
    sent by the next run."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    a.start(rate=500, seconds=6, keyspace=2000, remove_pct=20, seed=61)
    daemon = DaemonProc(procs, tmp_path, a, b, max_retry_s=30, retry_backoff_max_ms=500)
    daemon.start()
    wait_for(lambda: daemon.check_running() or b.processed() > 0, 60, "entries to reach b", interval=0.05)
    b.kill()
    wait_for(lambda: daemon.check_running() or daemon.events("replication_retry"), 30, "the daemon to retry")
    t0 = time.monotonic()
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)
    rc = daemon.proc.wait(60)
    took = time.monotonic() - t0
    assert (rc, error_lines(daemon.err)) == (0, []), f"exit {rc} after {took:.1f} s"
    assert took < 10, f"took {took:.1f} s"
    b.start()
    daemon.start()
    wait_caught_up((a, daemon))
    for p in (daemon, a, b):
        p.stop()
    assert_converged(a, b)
