"""Transient outages are ridden out (issue 29 item 3): the object store under the lake and the Kafka broker are
stopped while a node writes and `cdcd run` delivers: 15 s and two retry steps at least in `make test` (longer than
the Kafka request and transaction timeouts the test sets), 30 s in `make chaos`. The daemon never exits: it logs one
``consumer_retrying`` line per backoff step, counts ``cdcd_daemon_consumer_retries_total``, and once the server is
back every WAL entry is in the lake (or the topic) exactly once."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from cdcd.lake.storage import LakeLocation, StorageOptions
from cdcd.node.identity import read_node_id
from tests.support.cache_drop import write_scenario
from tests.support.chaos import scrape
from tests.support.kafka import Broker, kafka_broker, positions_of, read_topic
from tests.support.lake import caught_up, position, write_config
from tests.support.ports import free_port
from tests.support.procs import child_env, log_events, start_daemon, stop_daemon, wait_for
from tests.support.servers import MINIO_BIN, MINIO_PASSWORD, MINIO_USER, MinioServer
from tests.support.wal import wal_events
from tests.support.writer import start_writer, writer_count

__all__ = ["kafka_broker"]  # the fixture, used by name

OUTAGE_S = 30.0
"""The issue's outage length (`make chaos`)."""
OUTAGES_S = [15.0, pytest.param(OUTAGE_S, marks=pytest.mark.chaos)]
"""The suite's outage and the issue's: the same claim, the longer one in `make chaos`."""


@pytest.fixture
def minio(tmp_path: Path) -> Iterator[MinioServer]:
    if not MINIO_BIN.exists():
        pytest.fail(f"{MINIO_BIN} missing: run `make install` (scripts/ensure-minio.sh builds it)")
    server = MinioServer(tmp_path / "minio" / "data")
    server.start()
    server.create_bucket("lake")
    try:
        yield server
    finally:
        server.stop()


def ride_out(
    proc: Any, err: Path, metrics_port: int, stop: Callable[[], None], start: Callable[[], None], at_least_s: float
) -> tuple[float, int]:
    """Stop the server for at least ``at_least_s`` while the daemon runs, then start it again; the daemon must stay
    up and retry meanwhile. Returns (the outage's measured seconds, retry steps counted during it)."""
    stop()
    t0 = time.monotonic()

    def retried() -> int:
        return int(scrape(metrics_port)["cdcd_daemon_consumer_retries_total"][0][1])

    # The outage's length is the experiment, and at least two retry steps in it (a loaded machine may delay the
    # first failure past a short outage); the daemon is watched all along (it must never exit).
    wait_for(
        lambda: proc.poll() is not None or (time.monotonic() - t0 >= at_least_s and retried() >= 2),
        at_least_s + 120,
        "the outage",
    )
    assert proc.poll() is None, f"the daemon exited during the outage:\n{err.read_text()[-3000:]}"
    retries = retried()
    start()
    measured_s = time.monotonic() - t0
    assert proc.poll() is None, err.read_text()[-3000:]
    return measured_s, retries


def check_retry_lines(err: Path, retries: int) -> list[dict[str, Any]]:
    steps = [e for e in log_events(err) if e["event"] == "consumer_retrying"]
    assert retries >= 2 and len(steps) >= retries, (retries, len(steps))
    assert all(e["level"] == "warning" and e["retry_timeout_s"] == 300 for e in steps)
    assert all(0 < e["retry_in_s"] <= 5 and e["attempt"] >= 1 for e in steps)
    assert all("\n" not in e["error"] and "\x1b" not in e["error"] for e in steps)
    lines = err.read_text().splitlines()
    assert all(line.startswith("{") for line in lines), [x for x in lines if not x.startswith("{")][:5]
    return steps


@pytest.mark.parametrize("outage_s", OUTAGES_S)
def test_an_object_store_outage_is_ridden_out(tmp_path: Path, minio: MinioServer, outage_s: float) -> None:
    """MinIO stopped for 15 s (30 s in make chaos) under load while the JVM-free writer lands the lake on it: the
    daemon retries (never exits), then lands every WAL entry exactly once."""
    node_dir = tmp_path / "node"
    writer = start_writer(tmp_path, node_dir, count=0, pause_ms=60)
    wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 60, "the node's cdc dir")
    storage = {"endpoint": minio.endpoint, "path_style": True}
    lake = "s3://lake/outage"
    consumer = {"kind": "lake", "lake_path": lake, "writer": "deltalake", "storage": storage}
    port = free_port()
    config = write_config(
        tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=5000, metrics_address=f"127.0.0.1:{port}"
    )
    env = {**child_env(), "AWS_ACCESS_KEY_ID": MINIO_USER, "AWS_SECRET_ACCESS_KEY": MINIO_PASSWORD}
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=env)
    try:
        wait_for(lambda: proc.poll() is not None or position(config) is not None, 180, "a first landed batch")
        assert proc.poll() is None, err.read_text()[-3000:]
        measured_s, retries = ride_out(proc, err, port, minio.stop, minio.start, outage_s)
        (tmp_path / "writer.stop").touch()
        assert writer.wait(120) == 0
        until = caught_up(node_dir)
        wait_for(lambda: proc.poll() is not None or position(config) == until, 300, f"the daemon to land {until}", 0.25)
        assert proc.poll() is None, err.read_text()[-3000:]
        total_retries = int(scrape(port)["cdcd_daemon_consumer_retries_total"][0][1])
    finally:
        if writer.poll() is None:
            writer.kill()
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]
    steps = check_retry_lines(err, retries)
    assert any("lake s3://lake/outage" in e["error"] for e in steps), steps[0]

    loc = LakeLocation(lake, StorageOptions(**storage), env=env)
    dt = DeltaTable(loc.uri("changes"), storage_options=loc.delta_options)
    rows = dt.to_pyarrow_table(columns=["source_node", "wal_segment", "wal_offset", "wal_index", "op", "key"])
    node = str(read_node_id(node_dir))
    assert set(rows.column("source_node").to_pylist()) == {node}
    got = Counter(zip(*(rows.column(c).to_pylist() for c in ("wal_segment", "wal_offset", "wal_index", "op", "key"))))
    events = wal_events(node_dir)
    want = Counter((*e["pos"], e["op"], json.dumps(e["key"], separators=(",", ":"))) for e in events)
    assert max(got.values()) == 1, "an entry landed twice"
    assert set(got) == set(want), f"{len(set(want) - set(got))} missing, {len(set(got) - set(want))} unknown"
    print(
        f"\nstore outage {measured_s:.1f} s: {retries} retry steps during it ({total_retries} in all), "
        f"{len(events)} entries of {writer_count(tmp_path)} transactions landed once"
    )


@pytest.mark.parametrize("outage_s", OUTAGES_S)
def test_a_broker_outage_is_ridden_out(kafka_broker: Broker, tmp_path: Path, outage_s: float) -> None:
    """The Kafka broker stopped for 15 s (30 s in make chaos) under load: the daemon retries (never exits), then
    every WAL entry is in the topic exactly once (read_committed)."""
    node_dir = tmp_path / "node"
    topic = "outage"
    writer = start_writer(tmp_path, node_dir, count=0, pause_ms=60)
    wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 60, "the node's cdc dir")
    consumer = {
        "kind": "kafka",
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic": topic,
        "topic_partitions": 4,
        # a dead broker fails a transaction within seconds, so the outage is seen as retry steps
        "transaction_timeout_ms": 10_000,
        "request_timeout_ms": 5000,
    }
    port = free_port()
    config = write_config(
        tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=5000, metrics_address=f"127.0.0.1:{port}"
    )
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    try:
        wait_for(lambda: proc.poll() is not None or position(config) is not None, 120, "a first delivered batch")
        assert proc.poll() is None, err.read_text()[-3000:]
        measured_s, retries = ride_out(proc, err, port, kafka_broker.stop, kafka_broker.start, outage_s)
        (tmp_path / "writer.stop").touch()
        assert writer.wait(120) == 0
        until = caught_up(node_dir)
        wait_for(lambda: proc.poll() is not None or position(config) == until, 300, f"the daemon to send {until}", 0.25)
        assert proc.poll() is None, err.read_text()[-3000:]
        total_retries = int(scrape(port)["cdcd_daemon_consumer_retries_total"][0][1])
    finally:
        if writer.poll() is None:
            writer.kill()
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]
    steps = check_retry_lines(err, retries)
    assert any(f"Kafka at {kafka_broker.bootstrap}" in e["error"] for e in steps), steps[0]
    assert any(e["event"] == "librdkafka" for e in log_events(err)), "librdkafka's lines, as JSON events"

    events = wal_events(node_dir)
    got = [p for ps in positions_of(read_topic(kafka_broker.bootstrap, topic)).values() for p in ps]
    expected = [tuple(e["pos"]) for e in events]
    assert len(got) == len(set(got)), f"{len(got) - len(set(got))} duplicates"
    assert set(got) == set(expected), (
        f"{len(set(expected) - set(got))} missing, {len(set(got) - set(expected))} unknown"
    )
    print(f"\nbroker outage {measured_s:.1f} s: {retries} retry steps during it ({total_retries} in all), ", end="")
    print(f"{len(events)} entries sent once")


def test_an_object_store_outage_as_a_cache_first_shows_up_is_ridden_out(tmp_path: Path, minio: MinioServer) -> None:
    """MinIO stopped just as the daemon tells the lake sink of a new cache (a failpoint holds it at its first
    ``on_cache_change``, which writes ``_cdcd_caches.json`` to the store): the call is retried like a batch
    (consumer_retrying lines naming on_cache_change and the lake, the retries counter), the daemon never exits,
    and once the store is back the cache registry and every WAL entry are in the lake, each entry once."""
    node_dir = tmp_path / "node"
    write_scenario(node_dir)
    storage = {"endpoint": minio.endpoint, "path_style": True}
    lake = "s3://lake/caches"
    consumer = {"kind": "lake", "lake_path": lake, "writer": "deltalake", "storage": storage}
    port = free_port()
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, metrics_address=f"127.0.0.1:{port}")
    held = tmp_path / "failpoints"
    held.mkdir()
    env = {
        **child_env(),
        "AWS_ACCESS_KEY_ID": MINIO_USER,
        "AWS_SECRET_ACCESS_KEY": MINIO_PASSWORD,
        "CDCD_FAILPOINTS": "delivery.on_cache_change=pause",
        "CDCD_FAILPOINTS_DIR": str(held),
    }
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=env)
    try:
        point = held / "delivery.on_cache_change"
        wait_for(lambda: proc.poll() is not None or point.exists(), 120, "the first on_cache_change")
        assert proc.poll() is None, err.read_text()[-3000:]
        minio.stop()
        point.unlink()  # the call goes to the sink with the store away

        def retried() -> int:
            return sum(e["event"] == "consumer_retrying" for e in log_events(err))

        wait_for(lambda: proc.poll() is not None or retried() >= 3, 120, "3 retry steps of on_cache_change")
        assert proc.poll() is None, f"the daemon exited during the outage:\n{err.read_text()[-3000:]}"
        retries = int(scrape(port)["cdcd_daemon_consumer_retries_total"][0][1])
        minio.start()
        until = caught_up(node_dir)
        wait_for(lambda: proc.poll() is not None or position(config) == until, 180, f"the daemon to land {until}", 0.25)
        assert proc.poll() is None, err.read_text()[-3000:]
    finally:
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]
    steps = [e for e in log_events(err) if e["event"] == "consumer_retrying"]
    assert retries >= 3 and len(steps) >= retries, (retries, len(steps))
    assert {e["call"] for e in steps} == {"on_cache_change"}, steps
    assert all(f"lake {lake}" in e["error"] and "\n" not in e["error"] for e in steps), steps[0]

    loc = LakeLocation(lake, StorageOptions(**storage), env=env)
    registry = json.loads(minio.get_object("lake", "caches/_cdcd_caches.json"))
    assert registry.pop("format") == 1, registry  # the registry's format version (cdcd/formats.py)
    assert sorted({c["name"] for c in registry.values()}) == ["c", "o"], registry
    rows = DeltaTable(loc.uri("changes"), storage_options=loc.delta_options).to_pyarrow_table().to_pylist()
    landed = Counter((r["wal_segment"], r["wal_offset"], r["wal_index"]) for r in rows if r["op"] != "truncate")
    assert max(landed.values()) == 1, "an entry landed twice"
    assert set(landed) == {tuple(e["pos"]) for e in wal_events(node_dir)}


@pytest.mark.chaos  # tests/test_cache_call_retry.py retries a failing drop through a real `cdcd run` in
# seconds; the outage tests above ride out the same servers' outages
def test_a_broker_outage_during_a_cache_drop_is_ridden_out(kafka_broker: Broker, tmp_path: Path) -> None:
    """The broker stopped just as the daemon hands a cache drop to the Kafka sink (a failpoint holds it there):
    the drop's truncate is retried like a batch (consumer_retrying lines naming on_cache_drop, the retries
    counter), the daemon never exits, and once the broker is back each partition of the cache's topic holds
    every change of the cache once and one truncate ``t`` at the DESTROY record, between the changes before
    and after it."""
    node_dir = tmp_path / "node"
    drop = write_scenario(node_dir)
    consumer = {
        "kind": "kafka",
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic_prefix": "po",
        "topic_partitions": 2,
        "transaction_timeout_ms": 10_000,
        "request_timeout_ms": 5000,
    }
    port = free_port()
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, metrics_address=f"127.0.0.1:{port}")
    held = tmp_path / "failpoints"
    held.mkdir()
    env = {**child_env(), "CDCD_FAILPOINTS": "delivery.on_cache_drop=pause", "CDCD_FAILPOINTS_DIR": str(held)}
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=env)
    try:
        wait_for(lambda: proc.poll() is not None or (held / "delivery.on_cache_drop").exists(), 120, "the drop")
        assert proc.poll() is None, err.read_text()[-3000:]
        kafka_broker.stop()
        (held / "delivery.on_cache_drop").unlink()  # the drop goes to the sink with the broker away
        t0 = time.monotonic()

        def retried() -> int:
            return sum(e["event"] == "consumer_retrying" for e in log_events(err))

        wait_for(lambda: proc.poll() is not None or retried() >= 3, OUTAGE_S + 60, "3 retry steps of the drop")
        assert proc.poll() is None, f"the daemon exited during the outage:\n{err.read_text()[-3000:]}"
        retries = int(scrape(port)["cdcd_daemon_consumer_retries_total"][0][1])
        kafka_broker.start()
        outage_s = time.monotonic() - t0
        until = caught_up(node_dir)
        wait_for(lambda: proc.poll() is not None or position(config) == until, 180, f"the daemon to send {until}", 0.25)
        assert proc.poll() is None, err.read_text()[-3000:]
    finally:
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]
    steps = [e for e in log_events(err) if e["event"] == "consumer_retrying"]
    assert retries >= 3 and len(steps) >= retries, (retries, len(steps))
    assert {e["call"] for e in steps} == {"on_cache_drop"}, steps
    assert all(f"Kafka at {kafka_broker.bootstrap}" in e["error"] and "\n" not in e["error"] for e in steps), steps[0]

    expected = [tuple(e["pos"]) for e in wal_events(node_dir) if e["cache"] == "c"]
    parts = read_topic(kafka_broker.bootstrap, "po.c")
    assert sorted(parts) == [0, 1]
    for msgs in parts.values():
        values = [json.loads(m.value()) for m in msgs if m.value() is not None]
        here = [(v["source"]["segment"], v["source"]["offset"], v["source"]["entry_index"]) for v in values]
        ops = [v["op"] for v in values]
        assert ops.count("t") == 1, ops
        t = ops.index("t")
        assert here[t] == (drop.segment, drop.offset, 0)
        assert here[:t] == sorted(here[:t]) and here[t + 1 :] == sorted(here[t + 1 :])
        assert all(p < here[t] for p in here[:t]) and all(p > here[t] for p in here[t + 1 :])
    changes = sorted(p for msgs in parts.values() for v in msgs if v.value() is not None for p in [_source(v)])
    assert [p for p in changes if p[2] >= 0 and p != (drop.segment, drop.offset, 0)] == expected
    print(f"\nbroker outage during a drop {outage_s:.1f} s: {retries} retry steps of on_cache_drop, drop landed once")


def _source(msg: Any) -> tuple[int, int, int]:
    src = json.loads(msg.value())["source"]
    return (src["segment"], src["offset"], src["entry_index"])


@pytest.mark.chaos  # tests/test_cache_call_retry.py retries a failing drop through a real `cdcd run` in
# seconds; the outage tests above ride out the same servers' outages
def test_an_object_store_outage_during_a_lake_cache_drop_is_ridden_out(tmp_path: Path, minio: MinioServer) -> None:
    """MinIO stopped for 30 s just as the daemon hands a cache drop to the lake sink (a failpoint holds it there): the
    drop's landing is retried like a batch (consumer_retrying lines naming on_cache_drop and the lake, the
    retries counter), the daemon never exits, and once the store is back `changes` holds every WAL entry once
    and one truncate row of the cache, at the DESTROY record."""
    node_dir = tmp_path / "node"
    drop = write_scenario(node_dir)
    storage = {"endpoint": minio.endpoint, "path_style": True}
    lake = "s3://lake/drop"
    consumer = {"kind": "lake", "lake_path": lake, "writer": "deltalake", "storage": storage}
    port = free_port()
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, metrics_address=f"127.0.0.1:{port}")
    held = tmp_path / "failpoints"
    held.mkdir()
    env = {
        **child_env(),
        "AWS_ACCESS_KEY_ID": MINIO_USER,
        "AWS_SECRET_ACCESS_KEY": MINIO_PASSWORD,
        "CDCD_FAILPOINTS": "delivery.on_cache_drop=pause",
        "CDCD_FAILPOINTS_DIR": str(held),
    }
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=env)
    try:
        wait_for(lambda: proc.poll() is not None or (held / "delivery.on_cache_drop").exists(), 120, "the drop")
        assert proc.poll() is None, err.read_text()[-3000:]
        minio.stop()
        (held / "delivery.on_cache_drop").unlink()  # the drop goes to the sink with the store away
        t0 = time.monotonic()

        def retried() -> int:
            return sum(e["event"] == "consumer_retrying" for e in log_events(err))

        # The outage's length is the experiment (OUTAGE_S, and 3 retry steps at least); the daemon is watched
        # all along (it must never exit).
        wait_for(
            lambda: proc.poll() is not None or (retried() >= 3 and time.monotonic() - t0 >= OUTAGE_S),
            OUTAGE_S + 120,
            "a 30 s outage with 3 retry steps of the drop",
        )
        assert proc.poll() is None, f"the daemon exited during the outage:\n{err.read_text()[-3000:]}"
        retries = int(scrape(port)["cdcd_daemon_consumer_retries_total"][0][1])
        minio.start()
        outage_s = time.monotonic() - t0
        until = caught_up(node_dir)
        wait_for(lambda: proc.poll() is not None or position(config) == until, 180, f"the daemon to land {until}", 0.25)
        assert proc.poll() is None, err.read_text()[-3000:]
    finally:
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]
    steps = [e for e in log_events(err) if e["event"] == "consumer_retrying"]
    assert retries >= 3 and len(steps) >= retries, (retries, len(steps))
    assert {e["call"] for e in steps} == {"on_cache_drop"}, steps
    assert all(f"lake {lake}" in e["error"] and "\n" not in e["error"] for e in steps), steps[0]

    loc = LakeLocation(lake, StorageOptions(**storage), env=env)
    rows = DeltaTable(loc.uri("changes"), storage_options=loc.delta_options).to_pyarrow_table().to_pylist()
    truncates = [(r["cache"], r["wal_segment"], r["wal_offset"], r["wal_index"]) for r in rows if r["op"] == "truncate"]
    assert truncates == [("c", drop.segment, drop.offset, 0)], truncates
    landed = Counter((r["wal_segment"], r["wal_offset"], r["wal_index"]) for r in rows if r["op"] != "truncate")
    assert max(landed.values()) == 1, "an entry landed twice"
    assert set(landed) == {tuple(e["pos"]) for e in wal_events(node_dir)}
    print(f"\nstore outage during a lake drop {outage_s:.1f} s: {retries} retry steps of on_cache_drop, landed once")
