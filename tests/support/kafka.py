"""A real Apache Kafka broker (KRaft, scripts/kafka.sh) for the Kafka tests, and a reader.

``kafka_broker`` starts one broker per test module on free ports and stops it after; tests may
stop, SIGKILL and restart it (same data dir). ``read_topic`` reads a topic the way any consumer
with ``isolation.level = read_committed`` would.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from tests.support.ports import free_port, free_ports
from tests.support.procs import child_env, reap

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kafka.sh"
LIBS = ROOT / "var" / "kafka" / "libs"


class Broker:
    def __init__(self, directory: Path, node_id: int = 1, profile: str = "test") -> None:
        """``profile``: kafka.sh's ``--profile`` (``test``: quick to start; ``standard``: the Kafka distribution's
        own JVM and thread settings, for benchmarks)."""
        self.dir = directory
        self.port = free_ports(2)  # the broker's listener and the controller's
        self.node_id = node_id
        self.profile = profile
        self.cluster: list[str] = []
        """kafka.sh start arguments of a cluster member (--voters, --cluster-id, --replication)."""

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start_args(self) -> list[str]:
        return [
            "bash", str(SCRIPT), "start", "--dir", str(self.dir), "--port", str(self.port),
            "--node-id", str(self.node_id), "--profile", self.profile, *self.cluster,
        ]  # fmt: skip

    def start(self) -> None:
        res = subprocess.run(self._start_args(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"kafka.sh start failed: {res.stderr[-3000:]}"

    def start_async(self) -> subprocess.Popen[str]:
        """Start without waiting (cluster members wait for each other's quorum)."""
        return subprocess.Popen(self._start_args(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self, *, kill: bool = False) -> None:
        args = ["bash", str(SCRIPT), "stop", "--dir", str(self.dir)] + (["--kill"] if kill else [])
        res = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr

    def restart(self, *, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()


@pytest.fixture(scope="module")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    if not LIBS.is_dir():
        pytest.fail(f"{LIBS} missing: run `make install` (scripts/ensure-kafka.sh) first")
    broker = Broker(tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


class Cluster:
    """``size`` brokers (each also a controller voter), internal topics replicated ``size`` times."""

    def __init__(self, directory: Path, size: int) -> None:
        self.brokers = [Broker(directory / f"b{i}", node_id=i) for i in range(1, size + 1)]
        voters = ",".join(f"{b.node_id}@127.0.0.1:{b.port + 1}" for b in self.brokers)
        cluster_id = "cdcdTestKafkaClusterAA"  # any 22-character base64 id; the same for every member
        for b in self.brokers:
            b.cluster = ["--voters", voters, "--cluster-id", cluster_id, "--replication", str(size)]

    @property
    def bootstrap(self) -> str:
        return ",".join(b.bootstrap for b in self.brokers)

    def start(self) -> None:
        procs = [b.start_async() for b in self.brokers]
        for p in procs:
            _out, err = p.communicate(timeout=300)
            assert p.returncode == 0, f"kafka.sh start failed: {err[-3000:]}"

    def stop(self) -> None:
        for b in self.brokers:
            b.stop()

    def broker(self, node_id: int) -> Broker:
        return next(b for b in self.brokers if b.node_id == node_id)


@pytest.fixture(scope="module")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not LIBS.is_dir():
        pytest.fail(f"{LIBS} missing: run `make install` (scripts/ensure-kafka.sh) first")
    cluster = Cluster(tmp_path_factory.mktemp("kafka-cluster"), 3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def read_topic(bootstrap: str, topic: str, *, timeout_s: float = 120) -> dict[int, list[Any]]:
    """Every committed message of ``topic`` per partition, in offset order (read_committed, up to
    the high watermark as it was when called). A missing topic reads as no partitions."""
    base = {"bootstrap.servers": bootstrap, "group.id": "test-reader", "enable.auto.commit": False}
    probe = Consumer({**base, "isolation.level": "read_uncommitted"})
    try:
        meta = probe.list_topics(topic, timeout=30)
        t = meta.topics.get(topic)
        if t is None or t.error is not None:
            return {}
        highs = {p: probe.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in t.partitions}
    finally:
        probe.close()
    out: dict[int, list[Any]] = {p: [] for p in highs}
    pending = {p for p, h in highs.items() if h > 0}
    if not pending:
        return out
    reader = Consumer({**base, "isolation.level": "read_committed", "enable.partition.eof": True})
    try:
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in pending])
        deadline = time.monotonic() + timeout_s
        while pending:
            assert time.monotonic() < deadline, f"{topic}: partitions {sorted(pending)} not read to their end"
            msg = reader.poll(1.0)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    if msg.offset() >= highs[msg.partition()]:
                        pending.discard(msg.partition())
                    continue
                raise KafkaException(err)
            out[msg.partition()].append(msg)
            if msg.offset() + 1 >= highs[msg.partition()]:
                pending.discard(msg.partition())
    finally:
        reader.close()
    return out


def positions_of(parts: dict[int, list[Any]]) -> dict[int, list[tuple[int, int, int]]]:
    """The WAL positions of the data messages, per Kafka partition in offset order."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for p, msgs in parts.items():
        out[p] = []
        for m in msgs:
            if m.value() is None:
                continue
            s = json.loads(m.value())["source"]
            out[p].append((s["segment"], s["offset"], s["entry_index"]))
    return out


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return (value >> 1) ^ -(value & 1), i
        shift += 7


def log_batches(partition_dir: Path) -> list[dict[str, Any]]:
    """The record batch headers of a partition's log segments as the broker wrote them: offsets,
    producer id and epoch, transactional/control flags and, for a control batch, COMMIT or ABORT
    (the ground truth a read_committed reader's filtering can be checked against)."""
    out: list[dict[str, Any]] = []
    for seg in sorted(partition_dir.glob("*.log")):
        data = seg.read_bytes()
        i = 0
        while i + 61 <= len(data):
            base, length = struct.unpack_from(">qi", data, i)
            if length <= 0:
                break
            attrs, last_delta = struct.unpack_from(">hi", data, i + 21)
            pid, epoch = struct.unpack_from(">qh", data, i + 43)
            control = bool(attrs & 0x20)
            marker = None
            if control:  # one record, key = (version int16, type int16)
                j = _varint(data, i + 61)[1] + 1  # length, attributes
                j = _varint(data, _varint(data, _varint(data, j)[1])[1])[1]  # timestamp, offset deltas, key length
                marker = {0: "ABORT", 1: "COMMIT"}.get(struct.unpack_from(">hh", data, j)[1], "?")
            out.append(
                {"base": base, "last": base + last_delta, "pid": pid, "epoch": epoch,
                 "transactional": bool(attrs & 0x10), "marker": marker}
            )  # fmt: skip
            i += 12 + length
    return out


def locate_missing(
    broker: Broker, topic: str, missing: set[tuple[int, int, int]]
) -> dict[tuple[int, int, int], list[str]]:
    """Where WAL entries missing from a read_committed read are in the broker's log: for each, the
    copies found (read_uncommitted), each with the fate of its batch, the next marker of its producer
    on that partition: "COMMIT" (a reader lost committed data), "ABORT" or "open"; no copy: never
    written."""
    base = {"bootstrap.servers": broker.bootstrap, "group.id": "test-explainer", "enable.auto.commit": False}
    probe = Consumer({**base, "isolation.level": "read_uncommitted", "enable.partition.eof": True})
    found: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    try:
        meta = probe.list_topics(topic, timeout=30).topics[topic]
        probe.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in meta.partitions])
        pending = set(meta.partitions)
        while pending:
            msg = probe.poll(5.0)
            if msg is None:
                break
            if msg.error() is not None:
                pending.discard(msg.partition())
                continue
            value, part, off = msg.value(), msg.partition(), msg.offset()
            if value is not None and part is not None and off is not None:
                s = json.loads(value)["source"]
                pos = (s["segment"], s["offset"], s["entry_index"])
                if pos in missing:
                    found.setdefault(pos, []).append((part, off))
    finally:
        probe.close()
    batches = {p: log_batches(broker.dir / "data" / f"{topic}-{p}") for p in meta.partitions}
    out: dict[tuple[int, int, int], list[str]] = {}
    for pos in missing:
        out[pos] = []
        for p, off in found.get(pos, []):
            bs = batches[p]
            k = next(k for k, b in enumerate(bs) if b["base"] <= off <= b["last"])
            b = bs[k]
            end = next((c for c in bs[k + 1 :] if c["marker"] and c["pid"] == b["pid"]), None)
            fate = end["marker"] if end else "open"
            out[pos].append(f"{fate}: p{p}@{off} in batch {b['base']}-{b['last']} of producer {b['pid']}.{b['epoch']}")
    return out


def explain_missing(located: dict[tuple[int, int, int], list[str]], *, limit: int = 20) -> str:
    lines = [f"{len(located)} WAL entries missing from the read_committed read; in the broker's log:"]
    for pos in sorted(located)[:limit]:
        lines.append(f"  {pos}: {'; '.join(located[pos]) or 'not in the log'}")
    return "\n".join(lines)


SKIPPED_MARKERS = "Couldn't find leader endpoint for partitions"
"""Kafka's transaction coordinator, sending the markers of a transaction it loaded in PREPARE_COMMIT,
skips every partition whose leader its metadata cache does not know yet ("likely deleted already")
and completes the commit anyway. Right after an unclean restart of the only broker the data
partitions have no leader yet, so the commit the producer was told succeeded is never written: its
data (and the position stored with it) is later aborted by the producer's next epoch."""


def skipped_markers(broker: Broker) -> list[str]:
    """The broker's log lines (since its last start) where it dropped transaction markers."""
    log = broker.dir / "server.log"
    if not log.exists():
        return []
    return [line for line in log.read_text(errors="replace").splitlines() if SKIPPED_MARKERS in line]


# --- kafka-to-node for the benchmarks -----------------------------------------------------------------
_DECIDED = (
    "cdcd_kafka_to_node_events_applied_total",
    "cdcd_kafka_to_node_events_ignored_total",
    "cdcd_kafka_to_node_events_rejected_total",
)


def _metric_sum(port: int, names: tuple[str, ...]) -> float:
    """The sum of ``names`` on ``127.0.0.1:port/metrics``; -1 while nothing answers there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name in names)


def apply_topic_to_node(work: Path, bootstrap: str, topic: str, group_id: str, rows: int) -> float:
    """``cdcd kafka-to-node`` (2 threads) applies ``topic`` to a fresh ``cdcd node run`` process in
    ``work``; returns the seconds from starting it until all ``rows`` were decided (process start
    included). Raises unless exactly ``rows`` were applied; both processes are stopped."""
    work.mkdir()
    token = work / "token"
    token.write_text("bench-token-0123456789abcdef0123\n")
    token.chmod(0o600)
    repl_port, node_metrics, app_metrics = free_port(), free_port(), free_port()
    node_cfg = work / "node.toml"
    node_cfg.write_text(
        f'node_dir = {json.dumps(str(work / "node"))}\ncluster_id = 2\nwal_mode = "background"\n'
        f'metrics_address = "127.0.0.1:{node_metrics}"\n'
        f'replication_listen = "127.0.0.1:{repl_port}"\nreplication_token_file = {json.dumps(str(token))}\n'
    )
    app_cfg = work / "k2n.toml"
    app_cfg.write_text(
        f"bootstrap_servers = {json.dumps(bootstrap)}\ntopic = {json.dumps(topic)}\n"
        f'target = "127.0.0.1:{repl_port}"\ntoken_file = {json.dumps(str(token))}\nthreads = 2\n'
        f'group_id = {json.dumps(group_id)}\nmetrics_address = "127.0.0.1:{app_metrics}"\n'
    )
    cdcd = [sys.executable, "-m", "cdcd"]
    node_log, app_log = work / "node.log", work / "k2n.log"

    def tail(path: Path) -> str:
        return "\n".join(path.read_text(errors="replace").splitlines()[-15:])

    def stop(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            finally:
                reap(proc)

    with node_log.open("wb") as err:
        node = subprocess.Popen([*cdcd, "node", "run", "--config", str(node_cfg)], stderr=err, env=child_env())
    app: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 60
        while _metric_sum(node_metrics, ()) < 0:
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"target node did not start:\n{tail(node_log)}")
            time.sleep(0.05)
        t0 = time.perf_counter()
        with app_log.open("wb") as err:
            app = subprocess.Popen([*cdcd, "kafka-to-node", "--config", str(app_cfg)], stderr=err, env=child_env())
        deadline = time.monotonic() + 600
        while _metric_sum(app_metrics, _DECIDED) < rows:
            if app.poll() is not None:
                raise RuntimeError(f"kafka-to-node exited {app.returncode}:\n{tail(app_log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kafka-to-node: {rows:,} rows not decided after 600 s:\n{tail(app_log)}")
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        applied = _metric_sum(app_metrics, ("cdcd_kafka_to_node_events_applied_total",))
    finally:
        stop(app)
        stop(node)
    if applied != rows:
        raise AssertionError(f"{applied:,.0f} applied of {rows:,}")
    return seconds
