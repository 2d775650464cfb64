"""The daemon end to end: a node process writes, a ``cdcd run`` process follows it into a JSON-lines file.

The writer commits deterministic transactions (``tx_writes``) over three caches, so the test knows
what was written; the WAL itself (read with ``WalReader`` over archive + work dir) is the reference
the daemon's output is compared with, entry by entry and position by position.

The helpers (writer, configs, WAL reference, process handling) are in ``tests/support/``.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from cdcd.daemon.config import DaemonConfig, load_daemon_config
from cdcd.daemon.daemon import Daemon
from cdcd.node import Node
from cdcd.sinks.jsonl import JsonlConsumer
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import (
    catch_up_and_stop,
    cdcd,
    child_env,
    log_events,
    polled_position,
    start_daemon,
    state_position,
    stop_daemon,
    wait_for,
)
from tests.support.wal import archived_segments, cdc_links, read_jsonl, wal_events
from tests.support.writer import CACHES, expected_final_state, make_node, start_writer, writer_count


# --- tests -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_daemon_process_follows_writing_node_exactly(tmp_path: Path) -> None:
    """A `cdcd run` process following a node that writes 200k+ entries over hundreds of segments delivers exactly the
    WAL's data entries in WAL order, deletes every consumed link, leaves the archive alone and stops with exit 0 on
    SIGTERM."""
    node_dir = tmp_path / "node"
    out = tmp_path / "events.jsonl"
    n_tx = 4200  # ~50 entries each, removes of absent keys write nothing: > 200k entries
    writer = start_writer(tmp_path, node_dir, count=n_tx, pause_ms=2)
    wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 30, "the node's cdc dir")
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), batch_max_events=5000)
    daemon = start_daemon(config, tmp_path / "daemon.err")
    try:
        assert writer.wait(120) == 0, (tmp_path / "writer.log").read_text()[-3000:]
        while_writing = polled_position(config)
        assert writer_count(tmp_path) == n_tx
        archive = archived_segments(node_dir)
        last = max(archive)
        assert last > 100, f"expected many small segments, got {last + 1}"
        assert sorted(archive) == list(range(last + 1)), "archive_max_bytes=0 keeps every segment"
        # Delivered while writing: the daemon was already following before the writer finished.
        assert daemon.poll() is None, (tmp_path / "daemon.err").read_text()[-3000:]
        assert isinstance(while_writing, tuple) and while_writing[0] > 0, "the daemon followed the node live"
        wait_for(lambda: polled_position(config) == (last + 1, 0, 0), 60, f"the daemon to commit {last + 1}:0#0")
    finally:
        rc = stop_daemon(daemon)
    assert rc == 0, (tmp_path / "daemon.err").read_text()[-3000:]

    expected = wal_events(node_dir)
    assert len(expected) >= 200_000
    assert wal_events(node_dir, upto=last + 1) == expected, "every data entry is in an archived segment"
    got = read_jsonl(out)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"line {i + 1}: {g} != {e}"
    # Consumed links are gone; the archive still holds every segment, no longer linked.
    assert cdc_links(node_dir) == {}
    archive = archived_segments(node_dir)
    assert sorted(archive) == list(range(last + 1))
    assert all(p.stat().st_nlink == 1 for p in archive.values())
    # The content is exactly what the writer wrote: replaying the file gives the writer's final state.
    replayed: dict[str, dict[str, Any]] = {c: {} for c in CACHES}
    for ev in got:
        k = json.dumps(ev["key"])
        if ev["op"] == "delete":
            replayed[ev["cache"]].pop(k, None)
        else:
            replayed[ev["cache"]][k] = ev["value"]
    assert replayed == expected_final_state(n_tx)
    events = [e["event"] for e in log_events(tmp_path / "daemon.err")]
    assert "daemon_state_from_node" in events and events[-1] == "daemon_stopped"  # a fresh state asks the node


JSONL_FIELDS = ["cache", "op", "key", "value", "partition", "primary", "version", "commit_ts_ns", "pos"]
VERSION_FIELDS = ["order", "node_order", "cluster_id", "topology_version"]


def test_sync_once_jsonl_format_and_resume(tmp_path: Path) -> None:
    """Daemon.sync_once() writes one JSON object per entry with exactly the fields, order and encodings documented in
    cdcd/sinks/jsonl.py, and a restarted daemon resumes after the last committed entry without re-delivering."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    settings = {"wal_segment_size_bytes": 64 * 1024, "wal_force_archive_timeout_ms": 0, "partitions": 64}
    t0 = time.time_ns()
    with Node.open(node_dir, **settings, cluster_id=3, node_order=7, topology_version=9) as node:
        orders = node.cache("orders")
        node.cache("tags", partitions=8)
        orders.put(1, {"total": 9.5, "items": ["a", "b"]})
        orders.put(1, {"total": 10})
        orders.put_all({2: "two", 3: b"\x00\xff"})
        with node.transaction() as tx:
            tx.remove("orders", 2)
            tx.put("tags", ("k", 1), {5: "int-keyed map", "nested": {7: None}})
        orders.remove(99)  # absent: writes nothing
        node.force_archive()
    t1 = time.time_ns()
    config = DaemonConfig(node_dir=str(node_dir), metrics_address="")
    with Daemon(config, JsonlConsumer(out)) as daemon:
        assert daemon.sync_once() == 6
        assert daemon.state.mode.value == "ACTIVE"
    lines = out.read_bytes().splitlines()
    assert len(lines) == 6
    objs = [json.loads(line) for line in lines]
    for o in objs:
        assert list(o) == JSONL_FIELDS
        assert list(o["version"]) == VERSION_FIELDS
        assert o["primary"] is True
        assert t0 <= o["commit_ts_ns"] <= t1
        assert len(o["pos"]) == 3 and all(isinstance(p, int) for p in o["pos"])
    assert [(o["cache"], o["op"], o["key"], o["value"]) for o in objs] == [
        ("orders", "create", 1, {"total": 9.5, "items": ["a", "b"]}),
        ("orders", "update", 1, {"total": 10}),
        ("orders", "create", 2, "two"),
        ("orders", "create", 3, "AP8="),  # bytes: base64
        ("orders", "delete", 2, None),
        ("tags", "create", ["k", 1], {"5": "int-keyed map", "nested": {"7": None}}),  # non-str map keys: JSON text
    ]
    assert [o["version"]["order"] for o in objs] == [1, 2, 3, 4, 5, 6]
    assert all(
        o["version"] | {"order": 0} == {"order": 0, "node_order": 7, "cluster_id": 3, "topology_version": 9}
        for o in objs
    )
    key_bytes = [msgspec.msgpack.Encoder(order="deterministic").encode(k) for k in (1, 1, 2, 3, 2)]
    assert [o["partition"] for o in objs[:5]] == [zlib.crc32(k) % 64 for k in key_bytes]
    assert 0 <= objs[5]["partition"] < 8
    # Positions are the WAL's: (segment, offset of the record, index of the entry inside it).
    assert [o["pos"] for o in objs] == [e["pos"] for e in wal_events(node_dir)]
    assert objs[2]["pos"][:2] == objs[3]["pos"][:2] and [objs[2]["pos"][2], objs[3]["pos"][2]] == [0, 1]
    assert objs[4]["pos"][:2] == objs[5]["pos"][:2]
    # Nothing new: nothing delivered. New writes: only they are delivered, also after a restart.
    with Node.open(node_dir, **settings) as node:
        node.cache("orders").put(4, "four")
        node.force_archive()
    with Daemon(config, JsonlConsumer(out)) as daemon:
        assert daemon.sync_once() == 1
        assert daemon.sync_once() == 0
    with Daemon(config, JsonlConsumer(out)) as daemon:
        assert daemon.sync_once() == 0
        pos = daemon.state.position
    got = read_jsonl(out)
    assert got == [json.loads(msgspec.json.encode(e)) for e in wal_events(node_dir)]  # bytes: base64
    assert got[-1]["key"] == 4 and got[-1]["op"] == "create"
    assert pos is not None and (pos.segment, pos.offset, pos.entry_index) == (
        max(archived_segments(node_dir)) + 1,
        0,
        0,
    )
    assert cdc_links(node_dir) == {}


def test_env_overrides_config(tmp_path: Path) -> None:
    """CDCD_* variables override top-level keys and, with a double underscore, keys of the [consumer] table; bad values
    name the key."""
    from cdcd.config import ConfigError

    path = write_daemon_config(tmp_path / "c.toml", tmp_path / "node", jsonl_consumer(tmp_path / "a.jsonl"))
    base = load_daemon_config(path, environ={})
    defaults = DaemonConfig(node_dir="x")
    assert base.batch_max_events == defaults.batch_max_events != 5
    assert base.consumer == {"kind": "jsonl", "path": str(tmp_path / "a.jsonl")}
    cfg = load_daemon_config(
        path,
        environ={
            "CDCD_BATCH_MAX_EVENTS": "5",
            "CDCD_CONSUMER__PATH": "/tmp/other.jsonl",
            "CDCD_CONSUMER__FSYNC": "false",
            "CDCD_LOG_FORMAT": "console",
            "CDCD_CONFIG": "/ignored.toml",
            "CDCD_SPARK_JARS_DIR": "/opt/jars",
            "PATH_UNRELATED": "x",
        },
    )
    assert cfg.batch_max_events == 5
    assert cfg.log_format == "console"
    assert cfg.consumer == {"kind": "jsonl", "path": "/tmp/other.jsonl", "fsync": False}
    assert cfg.check_interval_ms == base.check_interval_ms
    # An override replaces the file's value of that key only; the process environment is not read.
    assert load_daemon_config(path, environ={"CDCD_CONSUMER__KIND": "null"}).consumer["path"] == str(
        tmp_path / "a.jsonl"
    )
    with pytest.raises(ConfigError, match=r"key 'check_interval_ms': out of range: 1"):
        load_daemon_config(path, environ={"CDCD_CHECK_INTERVAL_MS": "1"})
    with pytest.raises(ConfigError, match=r"key 'batch_max_bytes': Expected `int`, got `str`"):
        load_daemon_config(path, environ={"CDCD_BATCH_MAX_BYTES": "lots"})
    # And a `cdcd run` process takes them from its environment.
    env = child_env()
    env["CDCD_CHECK_INTERVAL_MS"] = "3"
    res = cdcd("run", "--config", str(path), env=env)
    assert res.returncode == 2
    assert res.stderr.strip() == f"cdcd: error: {path}: key 'check_interval_ms': out of range: 3"


def test_sigterm_mid_backlog_commits_exactly_what_was_written(tmp_path: Path) -> None:
    """SIGTERM while the daemon works through a backlog ends its in-flight batch, commits exactly up to the last line
    written and exits 0; the restarted daemon goes on without a single duplicate."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    make_node(node_dir, segments=60, tx_per_segment=20)
    expected = wal_events(node_dir)
    positions = [tuple(e["pos"]) for e in expected]
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), batch_max_events=20)
    err = tmp_path / "run1.err"
    proc = start_daemon(config, err)
    try:
        wait_for(lambda: (out.exists() and out.stat().st_size > 100_000) or proc.poll() is not None, 30, "output")
    finally:
        rc = stop_daemon(proc)
    assert rc == 0, err.read_text()[-3000:]
    got = read_jsonl(out)
    assert 0 < len(got) < len(expected), "stopped in the middle of the backlog"
    assert got == expected[: len(got)]
    position = state_position(config)
    assert position is not None
    assert sum(1 for p in positions if p < position) == len(got), f"committed {position}, wrote {len(got)} entries"
    first_link = min(cdc_links(node_dir))
    assert first_link == position[0], "links below the committed segment are deleted, none at or after it"

    catch_up_and_stop(config, tmp_path / "run2.err", (max(archived_segments(node_dir)) + 1, 0, 0))
    assert read_jsonl(out) == expected
    assert cdc_links(node_dir) == {}
