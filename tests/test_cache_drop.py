"""A cache dropped and created again on the node travels to every target (issue 28, item 4).

One scenario on a real node, delivered by a real ``cdcd run``: cache ``c`` gets five keys (one updated, one
removed), is destroyed, is created again with three keys (one of them an old key), while cache ``o`` goes on
beside it. Each target is checked entry by entry against the WAL:

- the lake: ``changes`` holds every WAL entry once and one ``truncate`` row at the DESTROY record, also when
  the daemon is SIGKILLed just before and just after landing it; compaction leaves in ``state`` and in
  ``tables/c`` exactly the re-created rows (also when an earlier compaction had folded the old ones), and
  ``lake verify`` agrees with the node;
- Kafka: the topic holds every change and exactly one ``op = "t"`` between the last old and the first new
  change of ``c``; ``kafka-to-node`` empties ``c`` on it;
- replication: the replica drops ``c`` and takes the new rows (``node diff`` says same), and an entry written
  before the drop that arrives late is rejected.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from cdcd.lake.reading.verify import verify
from cdcd.lake.table import CHANGE_SCHEMA
from cdcd.node import Node
from cdcd.replication.client import ReplicationClient
from cdcd.replication.protocol import ReplEntry
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheOp, CacheRecord, DataRecord
from tests.support.cache_drop import NEW, NODE, OLD, OTHER, write_scenario
from tests.support.delta_lake import lake_consumer
from tests.support.kafka import Broker, kafka_broker, read_topic
from tests.support.lake import caught_up, position, run_to_end, write_config
from tests.support.procs import CDCD, cdcd, child_env, reap, start_daemon, wait_for
from tests.support.replication_rig import DaemonProc, NodeProc, Procs, node_data, node_diff, procs
from tests.support.wal import wal_events, wal_records

__all__ = ["kafka_broker", "procs"]  # fixtures, used by name


def node_items(node_dir: Path, cache: str) -> dict[Any, Any]:
    with Node.open(node_dir, **NODE) as node:
        info = node.cache_info(cache)
        return {} if info is None else dict(node.cache(cache).items())


# --- the lake ----------------------------------------------------------------------------------------------
DROP_KILL_PLUGIN = '''
"""The real LakeConsumer, SIGKILLing its process before or after it lands a drop (once: a marker file)."""
import os
import signal
from pathlib import Path

from cdcd.lake.sink import LakeConsumer, LakeOptions


class KillAtDrop(LakeConsumer):
    def __init__(self, kill_at, marker, **options):
        super().__init__(LakeOptions(**{"compact_interval_s": 0.0, "optimize_interval_s": 0.0, **options}))
        self.kill_at = kill_at
        self.marker = Path(marker)

    def on_cache_drop(self, drops):
        if self.kill_at == "before":
            self.marker.write_text("before")
            os.kill(os.getpid(), signal.SIGKILL)
        super().on_cache_drop(drops)
        self.marker.write_text("after")
        os.kill(os.getpid(), signal.SIGKILL)
'''


def changes_rows(lake: Path) -> list[dict[str, Any]]:
    return DeltaTable(str(lake / "changes")).to_pyarrow_table().to_pylist()


def check_changes(lake: Path, node_dir: Path, drop: WalPointer, *, complete: bool) -> None:
    """Every WAL entry at most once (all of them when ``complete``), and one truncate row, at ``drop``,
    once the lake got past it."""
    rows = changes_rows(lake)
    truncates = [r for r in rows if r["op"] == "truncate"]
    data = [r for r in rows if r["op"] != "truncate"]
    landed = [(r["wal_segment"], r["wal_offset"], r["wal_index"]) for r in data]
    assert len(landed) == len(set(landed)), "an entry landed twice"
    expected = {tuple(e["pos"]): e for e in wal_events(node_dir)}
    assert set(landed) <= set(expected)
    for r in data:
        e = expected[(r["wal_segment"], r["wal_offset"], r["wal_index"])]
        assert (r["cache"], r["op"], json.loads(r["key"])) == (e["cache"], e["op"], e["key"])
    if complete:
        assert set(landed) == set(expected)
    past_drop = any((s, o) > (drop.segment, drop.offset) for s, o, _ in landed)
    if complete or past_drop:
        assert len(truncates) == 1, truncates
    assert len(truncates) <= 1, truncates
    for t in truncates:
        assert (t["cache"], t["wal_segment"], t["wal_offset"], t["wal_index"]) == ("c", drop.segment, drop.offset, 0)
        assert t["key"] is None and t["value"] is None and t["source_node"]


def state_rows(lake: Path, cache: str) -> dict[Any, Any]:
    table = DeltaTable(str(lake / "state")).to_pyarrow_table()
    table = table.filter(pc.equal(table.column("cache"), cache))
    keys, values = table["key"].to_pylist(), table["value"].to_pylist()
    return {json.loads(k): json.loads(v) for k, v in zip(keys, values, strict=True)}


def typed_rows(lake: Path, cache: str) -> dict[Any, Any]:
    """``tables/<cache>`` of ``c``: an int key column and the value's field ``v``."""
    return {r["key"]: {"v": r["v"]} for r in DeltaTable(str(lake / "tables" / cache)).to_pyarrow_table().to_pylist()}


@pytest.mark.timeout(300)
def test_lake_drop_truncates_exactly_once_and_compaction_keeps_only_the_new_rows(tmp_path: Path, spark: Any) -> None:
    from cdcd.lake.maintenance.compact import compact

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    drop = write_scenario(node_dir)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "drop_kill.py").write_text(DROP_KILL_PLUGIN)
    env = child_env(plugins)
    plain = lake_consumer(lake)
    marker = tmp_path / "killed"
    for kill_at in ("before", "after"):
        options = {"kind": "python", "class": "drop_kill:KillAtDrop", "options": {**plain, "kill_at": kill_at}}
        options["options"]["marker"] = str(marker)
        del options["options"]["kind"]
        config = write_config(tmp_path / f"{kill_at}.toml", node_dir, options)
        err = tmp_path / f"{kill_at}.err"
        proc = start_daemon(config, err, env)
        try:
            assert proc.wait(120) == -signal.SIGKILL, err.read_text()[-3000:]
        finally:
            reap(proc)
        assert marker.read_text() == kill_at
        check_changes(lake, node_dir, drop, complete=False)
        truncates = [r for r in changes_rows(lake) if r["op"] == "truncate"]
        assert len(truncates) == (kill_at == "after")
        if kill_at == "before":
            # state folds the old rows of c: the drop's compaction must remove them from there
            compact(spark, lake)
            assert state_rows(lake, "c") == OLD
            assert typed_rows(lake, "c") == OLD

    # The rest by the Spark writer: its batch after the truncate row the deltalake writer's sink landed.
    config = write_config(tmp_path / "plain.toml", node_dir, lake_consumer(lake, "spark"))
    run_to_end(config, node_dir, tmp_path / "plain.err")
    check_changes(lake, node_dir, drop, complete=True)

    result = compact(spark, lake)
    assert result.did_work
    assert state_rows(lake, "c") == NEW
    assert state_rows(lake, "o") == OTHER
    assert typed_rows(lake, "c") == NEW
    with Node.open(node_dir, **NODE) as node:
        checks = verify(lake, [node])
    assert {c.cache: (c.ok, c.lake_rows) for c in checks} == {"c": (True, 3), "o": (True, 2)}
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    res = cdcd("lake", "show", "--lake", str(lake))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    # Compacting again changes nothing (the drop is folded once).
    assert not compact(spark, lake).did_work
    assert state_rows(lake, "c") == NEW


def test_wal_keeps_the_drop_version_and_old_segments_decode(tmp_path: Path) -> None:
    """The DESTROY record carries the version the node's next write gets; a record without it (an
    older segment) decodes with none."""
    node_dir = tmp_path / "node"
    drop = write_scenario(node_dir)
    records = dict(wal_records(node_dir))
    rec = records[drop]
    assert isinstance(rec, CacheRecord) and rec.version is not None
    events = wal_events(node_dir)
    before = [e for e in events if tuple(e["pos"][:2]) < (drop.segment, drop.offset)]
    after = [e for e in events if tuple(e["pos"][:2]) > (drop.segment, drop.offset)]
    key = lambda v: (v["topology_version"], v["order"], v["node_order"])  # noqa: E731
    drop_key = (rec.version.topology_version, rec.version.order, rec.version.node_order)
    assert all(key(e["version"]) < drop_key for e in before)
    assert all(key(e["version"]) >= drop_key for e in after)
    legacy = msgspec.msgpack.encode([2, 1, "c", 1, [1024, True, 0], 5])
    assert msgspec.msgpack.decode(legacy, type=CacheRecord).version is None


# --- replication -------------------------------------------------------------------------------------------
def test_replica_drops_the_cache_and_rejects_a_late_entry_from_before_the_drop(tmp_path: Path, procs: Procs) -> None:
    """A `cdcd run` replicating A to node process B: B destroys ``c`` where A did and takes A's new rows
    (``node diff`` same); A's entries of ``c`` from before the drop sent again are all rejected and the
    drop sent again destroys nothing."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    drop = write_scenario(a.dir)
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    daemon = DaemonProc(procs, tmp_path, a, b)
    daemon.start()
    until = caught_up(a.dir)
    wait_for(
        lambda: daemon.proc is None or daemon.proc.poll() is not None or position(daemon.config) == until, 120, "B"
    )
    daemon.check_running()
    rc, diff = node_diff(a, b)
    assert rc == 0 and diff["c"]["same"] and diff["o"]["same"], diff

    # Late entries of A written before the drop (a reordered batch, a resend): rejected, B keeps NEW.
    records = dict(wal_records(a.dir))
    destroy = records[drop]
    assert isinstance(destroy, CacheRecord)
    old = [
        e
        for p, r in records.items()
        if type(r) is DataRecord and p < drop
        for e in r.entries
        if e.cache_id == destroy.cache_id
    ]
    assert len(old) == 7  # five puts, an update, a remove
    late = [ReplEntry(e.op, e.key, e.value, e.version, e.expire_time_ms) for e in old]
    with ReplicationClient(("127.0.0.1", b.repl_port), b.token.read_bytes().strip(), sender_cluster_id=1) as client:
        client.connect()
        reply = client.apply_all([("c", late)])
        assert (reply.applied, reply.rejected, reply.duplicates) == (0, 7, 0)
        again = client.drop("c", destroy.version)  # the same drop once more: nothing destroyed
        assert (again.applied, again.duplicates) == (0, 1)
    rc, diff = node_diff(a, b)
    assert rc == 0, diff
    daemon.stop()
    b.stop()
    assert node_data(b)["c"] == NEW and node_data(b)["o"] == OTHER
    # B's WAL: c created by the first replicated change, destroyed once, created again.
    b_caches = [(r.name, r.op) for _p, r in wal_records(b.dir) if type(r) is CacheRecord and r.name == "c"]
    assert b_caches == [("c", CacheOp.CREATE), ("c", CacheOp.DESTROY), ("c", CacheOp.CREATE)]


# --- Kafka ---------------------------------------------------------------------------------------------------
def test_kafka_gets_one_truncate_per_partition_at_the_drop_and_kafka_to_node_drops_the_cache(
    kafka_broker: Broker, tmp_path: Path, procs: Procs
) -> None:
    """`cdcd run` into per-cache topics of two partitions, SIGKILLed right after the truncate's Kafka
    transaction committed, then run again: each partition of ``pk.c`` holds every change of ``c`` once, in
    WAL order, and one ``op = "t"`` between the last change before the drop and the first after it (Debezium's
    truncate: null key, null before/after, source at the DESTROY record); the metadata topic says destroy.
    ``cdcd kafka-to-node`` applying the topics to node B leaves B equal to A (``node diff`` same)."""
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    drop = write_scenario(a.dir)
    options = {
        "kind": "kafka",
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic_prefix": "pk",
        "topic_partitions": 2,
    }
    config = write_config(tmp_path / "kafka.toml", a.dir, options)
    err = tmp_path / "killed.err"
    proc = start_daemon(config, err, {**child_env(), "CDCD_FAILPOINTS": "kafka.truncate_committed"})
    try:
        assert proc.wait(120) == -signal.SIGKILL, err.read_text()[-3000:]
    finally:
        reap(proc)
    run_to_end(config, a.dir, tmp_path / "plain.err")

    expected = [e for e in wal_events(a.dir) if e["cache"] == "c"]
    parts = read_topic(kafka_broker.bootstrap, "pk.c")
    assert sorted(parts) == [0, 1]
    seen = []
    for msgs in parts.values():
        values = [json.loads(m.value()) for m in msgs if m.value() is not None]
        ops = [v["op"] for v in values]
        assert ops.count("t") == 1, ops
        t = ops.index("t")
        truncate = values[t]
        assert truncate["before"] is None and truncate["after"] is None
        assert [m for m in msgs if m.value() is not None][t].key() is None
        src = truncate["source"]
        assert (src["cache"], src["segment"], src["offset"], src["entry_index"]) == ("c", drop.segment, drop.offset, 0)
        here = [(v["source"]["segment"], v["source"]["offset"], v["source"]["entry_index"]) for v in values]
        assert all(p < here[t] for p in here[:t]) and all(p > here[t] for p in here[t + 1 :])
        assert here[:t] == sorted(here[:t]) and here[t + 1 :] == sorted(here[t + 1 :])
        seen += here[:t] + here[t + 1 :]
    assert sorted(seen) == [tuple(e["pos"]) for e in expected]
    meta_parts = read_topic(kafka_broker.bootstrap, "pk")  # the metadata topic of topic_prefix "pk"
    meta = [json.loads(m.value()) for msgs in meta_parts.values() for m in msgs]
    assert [(m["op"], m.get("name")) for m in meta if m.get("name") == "c"][-2:] == [("destroy", "c"), ("create", "c")]

    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    k2n = tmp_path / "k2n.toml"
    k2n.write_text(
        f'bootstrap_servers = "{kafka_broker.bootstrap}"\ntopic_prefix = "pk"\ntarget = "{b.target}"\n'
        f'token_file = "{b.token}"\ngroup_id = "drop"\nmetrics_address = ""\n'
    )
    with (tmp_path / "k2n.err").open("wb") as f:
        app = procs.track(
            subprocess.Popen(
                [*CDCD, "kafka-to-node", "--config", str(k2n), "--log-format", "json"],
                stdout=subprocess.DEVNULL,
                stderr=f,
                env=child_env(),
            )
        )
    wait_for(lambda: app.poll() is not None or node_diff(a, b)[0] == 0, 120, "B equal to A")
    assert app.poll() is None, (tmp_path / "k2n.err").read_text()[-3000:]
    app.send_signal(signal.SIGTERM)
    assert app.wait(60) == 0
    b.stop()
    assert node_data(b)["c"] == NEW and node_data(b)["o"] == OTHER


# --- compaction's reading of truncate rows ---------------------------------------------------------------
def _feed_row(op: str, cache: str, source: str, pos: tuple[int, int, int, int], key: str | None) -> dict[str, Any]:
    gen, seg, off, idx = pos
    row = dict.fromkeys(CHANGE_SCHEMA.names)
    row.update(op=op, cache=cache, source_node=source, key=key, version_order=1, version_cluster_id=1, node_order=1)
    row.update(topology_version=1, source_generation=gen, wal_segment=seg, wal_offset=off, wal_index=idx)
    return row


def test_split_truncates_drops_only_the_same_sources_older_rows_of_the_cache() -> None:
    """A truncate of ``c`` by source A at (gen 1, 5:100) removes A's rows of ``c`` before it (an earlier
    generation at a higher position included) and keeps A's rows after it, B's rows of ``c`` and A's rows of
    other caches; the truncate rows themselves never reach the winners."""
    from cdcd.lake.maintenance.compact import FEED_COLUMNS, split_truncates

    rows = [
        _feed_row("create", "c", "A", (0, 9, 0, 0), '"gen0-later-pos"'),
        _feed_row("create", "c", "A", (1, 5, 50, 3), '"before"'),
        _feed_row("update", "c", "A", (1, 5, 99, 0), '"previous-record"'),
        _feed_row("truncate", "c", "A", (1, 5, 100, 0), None),
        _feed_row("create", "c", "A", (1, 5, 120, 0), '"after"'),
        _feed_row("create", "c", "B", (0, 1, 0, 0), '"other-source"'),
        _feed_row("create", "d", "A", (1, 5, 50, 0), '"other-cache"'),
    ]
    rows[2]["op"] = "create"
    rows[2]["key"] = '"same-record-before"'
    rows[2]["wal_offset"] = 99
    feed = pa.Table.from_pylist(
        rows, schema=pa.schema([CHANGE_SCHEMA.field(n) for n in (*FEED_COLUMNS, "source_generation")])
    )
    kept, truncated = split_truncates(feed)
    assert truncated == frozenset({"c"})
    assert kept.column_names == list(FEED_COLUMNS)
    assert sorted(kept.column("key").to_pylist()) == ['"after"', '"other-cache"', '"other-source"']
    plain, none = split_truncates(feed.filter(pc.not_equal(feed.column("op"), "truncate")))
    assert none == frozenset() and plain.num_rows == 6
