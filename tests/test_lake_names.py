"""Any cache name compacts (docs/lake.md, Layout): a NUL, 255 characters, 200 x "é", "/", "..", names that
differ only by case. A `cdcd run` process lands them, `cdcd lake compact` (first append, then MERGE) and
OPTIMIZE write them with real Spark + Delta, `cdcd lake verify` passes and every key is in `state` exactly once
under its real name; no directory any writer made is Spark's rendering of a name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdcd.lake.maintenance.compact import compact
from cdcd.lake.maintenance.ops import optimize
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.node import Node
from tests.support.config import NO_MAINTENANCE
from tests.support.delta_lake import lake_consumer, wal_batch
from tests.support.delta_tables import append_changes, change, expected_state, state_rows
from tests.support.lake import run_to_end, write_config
from tests.support.procs import cdcd

NODE_NAMES = ["\0", "nul\0mid", "x" * 255, "é" * 200, "..", "..x", "Orders", "orders", "ORDERS", "plain"]
"""Every hostile name the node accepts (it refuses "/" and "="; those are below, landed by delta-rs)."""
SLASH_NAMES = ["a/b", "A/b", "/", "../..", "/..", "\0/x"]


def write_round(node_dir: Path, round_: int) -> None:
    """Per cache: keys 0..5 written again (a new value each round), key ``round_`` removed in rounds >= 1."""
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        for name in NODE_NAMES:
            cache = node.cache(name)
            cache.put_all({k: {"cache": name, "k": k, "round": round_} for k in range(6)})
            if round_:
                cache.remove(round_)
        node.force_archive()


def node_state(node_dir: Path) -> dict[tuple[str, Any], Any]:
    """(cache, key) -> value of every live entry on the node."""
    with Node.open(node_dir) as node:
        return {(name, k): v for name in NODE_NAMES for k, v in node.cache(name).items()}


def lake_state(lake: Path) -> dict[tuple[str, Any], Any]:
    """``state`` decoded (``state_rows`` asserts one row per (cache, key))."""
    return {(cache, json.loads(k)): json.loads(v) for (cache, k), v in state_rows(lake).items()}


def dir_names(root: Path) -> set[str]:
    return {p.name for p in root.rglob("*") if p.is_dir()}


@pytest.mark.timeout(1500)  # three daemon runs and two compaction JVMs, on a machine shared with other work
def test_the_daemon_lands_any_cache_name_and_compact_and_verify_succeed(tmp_path: Path, spark: Any) -> None:
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake))

    def compact_and_verify() -> None:
        # The worker's session, not `cdcd lake compact`: the command is the same function plus a JVM start
        # (tests/test_lake.py runs the command end to end).
        compact(spark, lake)
        res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir), timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr[-3000:]
        assert res.stdout.splitlines()[-1].endswith("keys, OK"), res.stdout
        assert lake_state(lake) == node_state(node_dir), "every key once, under its real cache name"

    write_round(node_dir, 0)
    run_to_end(config, node_dir, tmp_path / "daemon0.err")
    compact_and_verify()  # the first compaction: a plain append into state
    for round_ in (1, 2):
        write_round(node_dir, round_)
        run_to_end(config, node_dir, tmp_path / f"daemon{round_}.err")
    compact_and_verify()  # a MERGE naming every cache

    state = pa.table(DeltaTable(str(lake / "state")).get_add_actions(flatten=True)).to_pylist()
    assert {a["partition.cache"] for a in state} == set(NODE_NAMES), "state's partition values are the real names"
    dirs = dir_names(lake)
    assert all("\0" not in d and len(d.encode()) <= 255 for d in dirs)
    assert not any(d.startswith("cache=") and "%" in d for d in dirs), "no directory in Spark's escaping"

    # lake sql: every cache table is a view, a name with a NUL escaped (docs/lake.md, view names).
    live = node_state(node_dir)
    for name, view in (("\0", '"#{0}"'), ("nul\0mid", '"nul#{0}mid"'), ("é" * 200, "é" * 200)):
        res = cdcd("lake", "sql", "--lake", str(lake), "--format", "json", f"SELECT count(*) AS n FROM {view}")
        assert res.returncode == 0, res.stderr[-2000:]
        assert json.loads(res.stdout) == [{"n": sum(1 for c, _ in live if c == name)}]

    res = cdcd("lake", "show", "--lake", str(lake), "--json")
    assert res.returncode == 0, res.stderr
    shown = {t["name"]: t for t in json.loads(res.stdout)["tables"]}
    per_cache: dict[str, int] = {}
    for name, _ in node_state(node_dir):
        per_cache[name] = per_cache.get(name, 0) + 1
    assert shown["state"]["rows_per_cache"] == dict(sorted(per_cache.items()))


@pytest.mark.timeout(1500)  # two compactions and two OPTIMIZEs in one local Spark, on a shared machine
def test_compaction_and_optimize_take_any_name_slashes_and_dots_too(spark: Any, tmp_path: Path) -> None:
    """The node's hostile names (landed by the sink in two commits: two files per partition to bin-pack) and names
    only another writer could land ("/" and friends, by delta-rs): compaction (append, then MERGE) and OPTIMIZE of
    both tables keep every one apart, "Orders" and "orders" too, each key once under its real name."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    for round_ in range(2):
        write_round(node_dir, round_)
        sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
        sink.start()
        try:
            assert sink.on_events(wal_batch(node_dir)) is True  # the earlier round's records: replays, dropped
        finally:
            sink.stop()
    rows = [
        change(n, json.dumps(k), json.dumps([n, k, 1]), 10 + 10 * i + k)
        for i, n in enumerate(SLASH_NAMES)
        for k in range(3)
    ]
    append_changes(lake, rows)
    # state and OPTIMIZE are Spark's writes under test here; typed tables with these names: the daemon test above.
    compact(spark, lake, typed_tables=False)
    later = [
        change(n, json.dumps(k), json.dumps([n, k, 2]), 500 + 10 * i + k)
        for i, n in enumerate(SLASH_NAMES)
        for k in range(1, 4)
    ]
    later += [change(n, json.dumps(0), None, 900 + i) for i, n in enumerate(SLASH_NAMES[:3])]
    append_changes(lake, later)
    compact(spark, lake, typed_tables=False)

    def expected() -> dict[tuple[str, Any], Any]:
        slash = {(c, json.loads(k)): json.loads(v) for (c, k), v in expected_state(rows + later).items()}
        return {**node_state(node_dir), **slash}

    assert lake_state(lake) == expected()
    optimized = optimize(spark, lake)
    assert optimized["changes"]["numFilesAdded"] > 0, "two files per node cache partition bin-packed"
    assert lake_state(lake) == expected()
    names = set(NODE_NAMES) | set(SLASH_NAMES)
    for table in ("changes", "state"):
        adds = pa.table(DeltaTable(str(lake / table)).get_add_actions(flatten=True)).to_pylist()
        assert {a["partition.cache"] for a in adds} == names
    assert all("\0" not in d and len(d.encode()) <= 255 for d in dir_names(lake))
