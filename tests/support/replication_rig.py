"""The replication rig: node and daemon processes with replication endpoints and tokens, and the
checks comparing two nodes (moved from test_replication.py so other tests can use it)."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cdcd.control import request
from cdcd.node.snapshot import NodeSnapshot
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheVersion, DataEntry, DataRecord
from cdcd.wal.segment import HEADER_SIZE
from tests.support.config import write_daemon_config
from tests.support.ports import free_port
from tests.support.procs import CDCD, cdcd, child_env, reap, start_daemon, wait_for
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
            reap(proc)


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.cleanup()


def _tail(path: Path, n: int = 16000) -> str:  # room for the threads' stacks of a close that hung
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
            reap(self.proc)
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
            reap(self.proc)
        assert rc == 0, f"daemon {self.name} exited {rc}:\n{_tail(self.err)}"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP, returning once the process is stopped: the signal is only queued when ``kill`` returns, and a
        daemon still running for a moment could commit after the caller read its position."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")

        def stopped() -> bool:
            # Every thread's state, the field after the parenthesised command name: "T", stopped by a signal.
            try:
                states = [(t / "stat").read_text().rpartition(")")[2].split()[0] for t in tasks.iterdir()]
            except FileNotFoundError:  # a thread ended between the listing and the read: look again
                return False
            return all(state == "T" for state in states)

        wait_for(stopped, 30, "every thread of the daemon to stop")

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
