"""Upgrading from v0.1.0 (issue 44 section 3): v0.1.0's nodes and daemons, run from its own source
(``tests/support/releases.py``), write into a lake (the deltalake writer), a Kafka topic (a real broker) and a
replica (the replication consumer into a node of another cluster), one daemon per target (v0.1.0 has one consumer
per daemon, one daemon per node); they are stopped mid-stream, by SIGKILL or by SIGTERM, v0.1.0 compacts the lake once
(its compaction mark and ``_cuts`` without a format version), then the current code starts on the same directories
and configs and goes on writing. Every target must hold every WAL entry exactly once (the WAL, v0.1.0's segments and
the current code's, is the reference), ``cdcd lake verify`` and ``cdcd node diff`` pass, and every state and
metadata file v0.1.0 left unversioned is read and carries its format version afterwards.

Also here, next to the broker: a Kafka offset record of a newer format makes the Kafka daemon exit 10 with one line.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import lmdb
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from cdcd import formats
from cdcd.faults import ExitCode
from cdcd.kafka.offsets import partition_of, read_stored
from cdcd.lake.cuts import latest_cut
from cdcd.lake.maintenance.compact_mark import read_mark
from cdcd.lake.registry import read_registry
from tests.support.config import write_daemon_config
from tests.support.delta_lake import check_lake, lake_consumer
from tests.support.kafka import Broker, kafka_broker, positions_of, read_topic
from tests.support.procs import error_lines, run_daemon_until_exit, wait_for
from tests.support.releases import CURRENT, V0_1_0, Release, ReleaseDaemon, ReleaseNode, materialise
from tests.support.replication_rig import (
    Procs,
    committed,
    node_data,
    node_diff,
    origin,
    procs,
    split_entries,
    wait_caught_up,
)
from tests.support.wal import wal_events
from tests.support.writer import make_node

__all__ = ["kafka_broker", "procs"]  # fixtures, used by name

LOAD = {"rate": 800, "keyspace": 2000, "remove_pct": 20}
"""Each source node's built-in load: a few thousand entries per node in each phase."""


@pytest.fixture(scope="module")
def v0_1_0(tmp_path_factory: pytest.TempPathFactory) -> Release:
    return materialise(V0_1_0, tmp_path_factory.mktemp("v0.1.0"))


def lmdb_value(env_dir: Path, key: bytes, db: bytes | None = None) -> bytes | None:
    env = lmdb.open(str(env_dir), max_dbs=2, readonly=True, lock=False)
    try:
        handle = env.open_db(db, create=False) if db is not None else None
        with env.begin(db=handle) as txn:
            return txn.get(key)
    finally:
        env.close()


def kafka_exactly_once(broker: Broker, topic: str, node_dir: Path) -> int:
    """Every WAL entry of ``node_dir`` is in ``topic`` exactly once (read_committed); returns how many."""
    got = [pos for ps in positions_of(read_topic(broker.bootstrap, topic)).values() for pos in ps]
    expected = [tuple(e["pos"]) for e in wal_events(node_dir)]
    dupes = [p for p, n in Counter(got).items() if n > 1]
    assert not dupes, f"{len(dupes)} entries in Kafka more than once, e.g. {dupes[:5]}"
    missing = set(expected) - set(got)
    assert not missing, f"{len(missing)} WAL entries not in Kafka, e.g. {sorted(missing)[:5]}"
    assert set(got) == set(expected), "messages of no WAL entry"
    return len(got)


def v0_1_0_config(path: Path) -> Path:
    """The config as v0.1.0 reads it, used unchanged by the current code after the switch: without the keys
    0.2.0 added (the tests' ``max_files_per_partition = 0``; the current code then bounds files as it does by
    default)."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith(NEW_IN_0_2_0)]
    path.write_text("\n".join(lines) + "\n")
    return path


NEW_IN_0_2_0 = ("max_files_per_partition", "ready_within_s")


@pytest.mark.parametrize("stop", ["sigkill", pytest.param("sigterm", marks=pytest.mark.chaos)])
# make test: the SIGKILL at the switch (the harder case: torn WAL tails, uncommitted target writes of v0.1.0);
# make chaos: the same with a graceful stop.
def test_v0_1_0_to_current_loses_and_duplicates_nothing(
    tmp_path: Path, procs: Procs, kafka_broker: Broker, v0_1_0: Release, stop: str
) -> None:
    """v0.1.0 nodes and daemons into a lake, Kafka and a replica, stopped mid-stream (``stop``), then the current
    code on the same dirs and configs: every entry exactly once in each target, lake verify and node diff pass, and
    the states and metadata v0.1.0 wrote carry their format version."""
    lake = tmp_path / "lake"
    topic = f"upgrade-{stop}"
    replica = ReleaseNode(procs, tmp_path, "replica", 2)
    sources = {name: ReleaseNode(procs, tmp_path, name, 1, listen=False) for name in ("l", "k", "s")}
    configs = {
        "l": lake_consumer(lake),
        "k": {"kind": "kafka", "bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "topic_partitions": 4},
        "s": {"kind": "replication", "target": replica.target, "token_file": str(replica.token)},
    }
    daemons = {
        name: ReleaseDaemon(
            procs,
            tmp_path,
            f"{name}-daemon",
            v0_1_0_config(
                write_daemon_config(
                    tmp_path / f"{name}-daemon.toml", sources[name].dir, configs[name], batch_max_events=500
                )
            ),
        )
        for name in sources
    }
    everything: list[Any] = [replica, *sources.values(), *daemons.values()]

    # v0.1.0, stopped while every load still writes and every daemon has committed part of it.
    for thing in everything:
        thing.release = v0_1_0
    for seed, node in enumerate([replica, *sources.values()]):
        node.start(seconds=300, seed=seed, wait=False, **(LOAD if seed else {}))
    for node in [replica, *sources.values()]:
        node.wait_serving()
    for daemon in daemons.values():
        daemon.start()
    wait_for(
        lambda: all(d.check_running() or committed(sources[n]) is not None for n, d in daemons.items()),
        120,
        "every v0.1.0 daemon to commit",
        interval=0.2,
    )
    assert all(node.load_written() is None for node in sources.values()), "a load ended before the switch"
    for thing in [*daemons.values(), *sources.values(), replica]:
        if stop == "sigkill":
            thing.kill()
        else:
            thing.stop()
    if stop == "sigterm":
        # v0.1.0's compaction mark and cut (no format version), read by the current code's compaction below. Left
        # out of the SIGKILL case in make test (a Spark run of half a minute): tests/test_formats.py reads both
        # formats unversioned.
        res = v0_1_0.cdcd("lake", "compact", "--lake", str(lake), "--spark-master", "local[1]", timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        old_cut = latest_cut(lake)
        assert old_cut is not None
    state = sources["l"].dir / "cdcd-state"
    assert lmdb_value(state, b"format", b"state") is None, "v0.1.0 wrote no format version"
    assert "format" not in read_registry(lake)

    # The current code on the same dirs and configs, until every load is done and delivered.
    for thing in everything:
        thing.release = CURRENT
    for seed, node in enumerate([replica, *sources.values()], 10):
        node.start(seconds=2, seed=seed, wait=False, **(LOAD if seed > 10 else {}))
    for node in [replica, *sources.values()]:
        node.wait_serving()
    for daemon in daemons.values():
        daemon.start()
    wait_caught_up(*((sources[n], d) for n, d in daemons.items()), timeout=180)
    for thing in [*daemons.values(), *sources.values(), replica]:
        thing.stop()

    # The lake: every entry once, whole records per commit; compacted again, it equals the node.
    check_lake(lake, sources["l"].dir)
    res = CURRENT.cdcd("lake", "compact", "--lake", str(lake), "--spark-master", "local[1]", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    res = CURRENT.cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(sources["l"].dir))
    assert res.returncode == 0, res.stdout + res.stderr
    # Kafka: every entry once.
    assert kafka_exactly_once(kafka_broker, topic, sources["k"].dir) > 1000
    # The replica: equal to its source, every local entry of the source applied (the resolver drops a re-sent one).
    rc, diff = node_diff(sources["s"], replica)
    assert rc == 0, diff
    data = node_data(sources["s"])
    assert data and node_data(replica) == data
    s_local, s_repl = split_entries(sources["s"])
    r_local, r_repl = split_entries(replica)
    assert s_repl == [] and r_local == []
    assert {origin(e) for e in r_repl} == {e.version for e in s_local}

    # What v0.1.0 left unversioned now carries its version; its compaction mark and cut were read and moved on.
    for name, node in sources.items():
        assert lmdb_value(node.dir / "cdcd-state", b"format", b"state") == b"1", name
        assert lmdb_value(node.dir / "db" / "metastorage", b"format") == b"1", name
    assert read_registry(lake)["format"] == formats.LAKE_CACHES.current
    assert read_mark(lake).commits is not None
    cut = latest_cut(lake)
    assert cut is not None and (stop == "sigkill" or cut.changes_version > old_cut.changes_version)
    node_id = (sources["k"].dir / "node_id").read_text().strip()
    record = read_stored({"bootstrap.servers": kafka_broker.bootstrap}, "cdcd-offsets", 1, node_id, 60)
    assert record is not None and record.format == formats.KAFKA_OFFSETS.current


def test_newer_kafka_offset_record_is_refused(tmp_path: Path, kafka_broker: Broker) -> None:
    """The offsets topic's newest record of a node written by a newer cdcd: the Kafka daemon exits 10 with one line
    naming the topic, partition, offset and node, and sends nothing."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=2)
    node_id = (node_dir / "node_id").read_text().strip()
    offsets = "offsets-newer"
    consumer = {
        "kind": "kafka",
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic": "newer",
        "topic_partitions": 1,
        "offsets_topic": offsets,
    }
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer)
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    for future in admin.create_topics([NewTopic(offsets, 1, 1, config={"cleanup.policy": "compact"})]).values():
        future.result(30)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    errors: list[Any] = []
    value = json.dumps({"segment": 9, "offset": 40, "entry_index": 0, "node": node_id, "format": 2}).encode()
    producer.produce(
        offsets,
        key=node_id.encode(),
        value=value,
        partition=partition_of(node_id, 1),
        on_delivery=lambda e, _m: errors.append(e),
    )
    assert producer.flush(30) == 0 and errors == [None], errors
    err = tmp_path / "run.err"
    assert run_daemon_until_exit(config, err, timeout=60) == ExitCode.FORMAT_TOO_NEW, err.read_text()[-3000:]
    (line,) = error_lines(err)
    assert line.startswith(
        f"cdcd: error: offsets topic {offsets} partition 0 offset 0 (node {node_id}): Kafka offset record format "
        "version 2, newer than the version 1"
    ), line
    assert line.endswith(f"({formats.UPGRADE_HINT})"), line
    assert read_topic(kafka_broker.bootstrap, "newer") in ({}, {0: []})
