"""`cdcd kafka-to-node` against a real broker and a real target node process: node A's WAL goes to
Kafka through the sink, kafka-to-node applies the topic to node B through B's replication endpoint,
killed mid-stream (after an apply, before its offset commit) several times; B ends equal to A, the
replays are counted by B's resolver as duplicates, and a full replay under a new group changes
nothing B holds."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.kafka.sink import KafkaSink
from cdcd.node import Node
from cdcd.node.snapshot import NodeSnapshot
from tests.support.kafka import Broker, kafka_broker, read_topic
from tests.support.kafka_to_node import Applier, node_diff_rc
from tests.support.procs import child_env, wait_for
from tests.support.replication_rig import NodeProc, Procs, procs, split_entries
from tests.support.wal import wal_events
from tests.support.writer import make_node

__all__ = ["kafka_broker", "procs"]  # fixtures, used by name


def test_kafka_to_node_killed_mid_stream_then_full_replay(kafka_broker: Broker, tmp_path: Path, procs: Procs) -> None:
    rng = random.Random(20954)
    a_dir = tmp_path / "a"
    make_node(a_dir, 6, 40, cluster_id=1, partitions=64)
    topic = "k2n"
    sink = KafkaSink.from_options(
        {"bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "topic_partitions": 6}, "consumer"
    )
    with Daemon(DaemonConfig(node_dir=str(a_dir), metrics_address=""), sink) as daemon:
        while daemon.sync_once():
            pass
    total = len(wal_events(a_dir))
    in_topic = sum(1 for ms in read_topic(kafka_broker.bootstrap, topic).values() for m in ms if m.value() is not None)
    assert in_topic == total > 10_000

    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    common = {
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic": topic,
        "target": b.target,
        "token_file": str(b.token),
        "max_batch_events": 150,
        "retry_timeout_s": 60,
    }
    app = Applier(procs, tmp_path, "k2n", **common, group_id="g1")

    # killed after an apply and before its offset commit (the next run re-applies that batch), or
    # after reading a batch, before applying it (the next run must read it again)
    for k in range(4):
        before = b.processed()
        point = "kafka_to_node.applied" if k % 2 == 0 else "kafka_to_node.received"
        env = {**child_env(), "CDCD_FAILPOINTS": f"{point}@{rng.randint(3, 8)}"}
        proc = app.start("--threads", "2", "--partitions", "0-5", env=env)
        assert proc.wait(120) == -signal.SIGKILL, app.tail()
        assert b.processed() > before
    proc = app.start("--threads", "3")
    wait_for(lambda: node_diff_rc(a_dir, b) == 0 or proc.poll() is not None, 180, "B equal to A")
    assert proc.poll() is None, app.tail()
    wait_for(lambda: app.metric("cdcd_kafka_to_node_last_batch_timestamp_seconds") > 0, 30, "metrics")
    received = b.received()
    # replays were recognised: the re-applied versions are counted as duplicates, none rejected
    assert received["duplicate"] > 0 and received["rejected"] == 0 and received["local"] == 0
    assert app.metric("cdcd_kafka_to_node_events_received_total") > 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, app.tail()

    # every entry of A reached B (set of origin versions), and B holds what A holds
    b_local, b_repl_1 = split_entries(b)
    a_local, _ = split_entries_of(a_dir)
    assert b_local == []
    assert {e.version.other_cluster_version for e in b_repl_1} == {e.version for e in a_local}

    # a full replay (a new group: from the topic's start): a change B holds is ignored, an older
    # version of a key B holds newer is rejected; only keys A deleted see their put and delete
    # again (the resolver keeps no tombstones); B ends as it was
    replay = Applier(procs, tmp_path, "replay", **common, group_id="g2")
    dup_before = b.received()["duplicate"]
    proc = replay.start("--threads", "2")
    wait_for(lambda: replay_done(replay, total) or proc.poll() is not None, 180, "the replay to read the whole topic")
    assert proc.poll() is None, replay.tail()
    try:
        wait_for(lambda: replay_applied(replay) == total, 60, "every replayed change decided")
    except AssertionError:
        names = ["received", "applied", "ignored", "rejected"]
        got = {n: replay.metric(f"cdcd_kafka_to_node_events_{n}_total") for n in names}
        raise AssertionError(f"{got} total {total} b {b.received()}") from None
    ignored = replay.metric("cdcd_kafka_to_node_events_ignored_total")
    assert ignored > total // 2
    assert b.received()["duplicate"] - dup_before == ignored
    assert replay.metric("cdcd_kafka_to_node_events_received_total") == total + n_deletes(a_dir)  # + tombstones
    # every message read is accounted for once: decided by the target, or skipped (the tombstones); the replication
    # sender's figures this process exports say the same
    assert replay.metric("cdcd_kafka_to_node_skipped_messages_total") == n_deletes(a_dir)
    assert replay.metric("cdcd_replication_sent_events_total") == replay_applied(replay) == total
    assert replay.metric("cdcd_replication_last_batch_timestamp_seconds") > 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, replay.tail()
    _, b_repl_2 = split_entries(b)
    new = b_repl_2[len(b_repl_1) :]
    deleted_on_a = {(e.cache_id, bytes(e.key)) for e in a_local if e.op == 2}
    assert all((e.cache_id, bytes(e.key)) in deleted_on_a for e in new) or not new
    assert node_diff_rc(a_dir, b) == 0
    b.stop()
    assert node_raw(a_dir) == node_raw(b.dir)


def replay_done(app: Applier, total: int) -> bool:
    try:
        return app.metric("cdcd_kafka_to_node_events_received_total") >= total
    except OSError:
        return False


def replay_applied(app: Applier) -> float:
    """Changes the target decided on: applied, ignored (had it) or rejected (holds a newer version)."""
    return sum(app.metric(f"cdcd_kafka_to_node_events_{n}_total") for n in ("applied", "ignored", "rejected"))


def n_deletes(a_dir: Path) -> int:
    return sum(1 for e in wal_events(a_dir) if e["op"] == "delete")


class _Dir:
    def __init__(self, d: Path) -> None:
        self.dir = d


def split_entries_of(d: Path) -> Any:
    return split_entries(_Dir(d))  # type: ignore[arg-type]


def node_raw(d: Path) -> dict[str, dict[bytes, bytes]]:
    """A stopped node's caches, key and value bytes as stored."""
    with NodeSnapshot(d) as snap:
        return {c: {bytes(k): bytes(v) for k, v in snap.raw_items(c)} for c in snap.caches()}


def test_kafka_to_node_reads_per_cache_topics(kafka_broker: Broker, tmp_path: Path, procs: Procs) -> None:
    """``topic_prefix``: kafka-to-node reads every ``<prefix>.*`` topic (the transaction topic's
    records carry no change and are skipped), and picks up the topic of a cache created while it
    runs; B ends equal to A."""
    a_dir = tmp_path / "a"
    make_node(a_dir, 3, 40, cluster_id=1, partitions=16)
    options = {
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic_prefix": "pk",
        "topic_partitions": 3,
        "transaction_metadata": True,
    }

    def deliver() -> None:
        sink = KafkaSink.from_options(options, "consumer")
        with Daemon(DaemonConfig(node_dir=str(a_dir), metrics_address=""), sink) as daemon:
            while daemon.sync_once():
                pass

    deliver()
    # A dead-letter topic beside the cache topics: set aside for an operator, never read (as with ``topic``).
    dlq = "pk.zz.dlq"
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    admin.create_topics([NewTopic(dlq, 1, 1)])[dlq].result(60)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    producer.produce(dlq, key=b"k", value=b"set aside")
    assert producer.flush(60) == 0
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    app = Applier(
        procs,
        tmp_path,
        "k2n-prefix",
        bootstrap_servers=kafka_broker.bootstrap,
        topic_prefix="pk",
        target=b.target,
        token_file=str(b.token),
        group_id="gp",
    )
    proc = app.start("--threads", "2")
    wait_for(lambda: node_diff_rc(a_dir, b) == 0 or proc.poll() is not None, 180, "B equal to A")
    assert proc.poll() is None, app.tail()
    skipped_before = app.metric("cdcd_kafka_to_node_skipped_messages_total")
    assert skipped_before > 0  # BEGIN/END records and tombstones
    reading = [json.loads(line) for line in app.tail_all().splitlines() if '"kafka_to_node_reading"' in line]
    read = {tp.rpartition(":")[0] for event in reading for tp in event["offsets"]}
    assert read and not any(topic.endswith(".dlq") for topic in read), read

    with Node.open(a_dir, wal_force_archive_timeout_ms=0) as node:  # a new cache: a new topic
        node.cache("late comer").put_all({k: {"n": k} for k in range(50)})
        node.force_archive()
    deliver()
    wait_for(lambda: node_diff_rc(a_dir, b) == 0 or proc.poll() is not None, 180, "B equal to A with the new cache")
    assert proc.poll() is None, app.tail()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, app.tail()
    b.stop()
    assert node_raw(a_dir) == node_raw(b.dir)


def test_a_stop_held_by_an_apply_ends_at_the_stop_timeout_then_the_next_start_converges(
    kafka_broker: Broker, tmp_path: Path, procs: Procs
) -> None:
    """SIGTERM while a thread is held after an apply, before its offset commit (fail point
    ``kafka_to_node.applied=pause``): the process leaves at ``--stop-timeout`` with one line and 128 + SIGTERM
    instead of waiting for the thread; the next start re-applies the batch in hand and B ends equal to A."""
    a_dir = tmp_path / "a"
    make_node(a_dir, 2, 30, cluster_id=1, partitions=8)
    topic = "k2n-stop"
    sink = KafkaSink.from_options({"bootstrap_servers": kafka_broker.bootstrap, "topic": topic}, "consumer")
    with Daemon(DaemonConfig(node_dir=str(a_dir), metrics_address=""), sink) as daemon:
        while daemon.sync_once():
            pass
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    app = Applier(
        procs,
        tmp_path,
        "k2n-stop",
        bootstrap_servers=kafka_broker.bootstrap,
        topic=topic,
        target=b.target,
        token_file=str(b.token),
        group_id="gs",
        max_batch_events=100,
    )
    env = {**child_env(), "CDCD_FAILPOINTS": "kafka_to_node.applied=pause", "CDCD_FAILPOINTS_DIR": str(tmp_path)}
    proc = app.start("--stop-timeout", "1", env=env)
    wait_for(lambda: (tmp_path / "kafka_to_node.applied").exists() or proc.poll() is not None, 120, "a held apply")
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(60)  # the pause alone would hold it for ten minutes
    assert rc == 128 + signal.SIGTERM, app.tail()
    errors = [line for line in app.tail_all().splitlines() if line.startswith("cdcd: error:")]
    assert errors == [
        f"cdcd: error: kafka-to-node of {app.config} did not stop within 1 s of SIGTERM: left without closing "
        "(the next start re-applies at most the batches in hand)"
    ], app.tail()
    (tmp_path / "kafka_to_node.applied").unlink()
    proc = app.start()
    wait_for(lambda: node_diff_rc(a_dir, b) == 0 or proc.poll() is not None, 180, "B equal to A")
    assert proc.poll() is None, app.tail()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, app.tail()
    b.stop()
    assert node_raw(a_dir) == node_raw(b.dir)
