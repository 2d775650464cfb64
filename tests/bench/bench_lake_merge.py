"""Compaction of the Delta lake: ``cdcd.lake.maintenance.compact.compact`` (MERGE of the change data feed into state).

- ``lake.merge``: 100k changes (60k updates, 30k new keys, 10k deletes over 10 caches) MERGEd into a
  state of 1M keys, on ``local[2]``. Goal: <= 15 s (issue 15).
- ``lake.compact_caches``: 10,000 caches x 2 entries compacted in one job (first compaction, then an
  update of every key). Goal: < 60 s (issue 19.7).

Both build their tables with delta-rs in setup (untimed), as the writers lay them out, and check the
state's row count after every timed compaction.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from tests.support.bench import Bench, Measurement, Metric

MASTER = "local[2]"
STATE_KEYS = 1_000_000
MERGE_CHANGES = (60_000, 30_000, 10_000)
"""updates, creates, deletes"""
CACHES = 10
MANY_CACHES = 10_000
MERGE_GOAL_S = 15.0
MANY_CACHES_GOAL_S = 60.0


def _bench_dir() -> str | None:
    var = Path(__file__).resolve().parents[2] / "var"
    var.mkdir(exist_ok=True)
    return str(var)


def _item(k: int, order: int) -> str:
    return f'{{"id":{k},"name":"item-{k}","qty":{k % 100},"v":{order}}}'


def change_table(
    caches: list[str],
    keys: list[int],
    ops: list[str],
    first_order: int,
    value_of: Callable[[int, int], str] = _item,
) -> pa.Table:
    """Change rows in the table contract's schema; version order (and WAL offset) increase by row;
    ``value_of(key, order)`` is each live row's value (JSON text)."""
    from cdcd.lake.table import CHANGE_SCHEMA

    n = len(keys)
    orders = list(range(first_order, first_order + n))
    values = [None if op == "delete" else value_of(k, o) for k, op, o in zip(keys, ops, orders, strict=True)]
    cols: dict[str, Any] = {
        "op": ops,
        "key": [str(k) for k in keys],
        "value": values,
        "partition": [k % 1024 for k in keys],
        "primary": [True] * n,
        "version_order": orders,
        "version_cluster_id": [1] * n,
        "node_order": [1] * n,
        "topology_version": [1] * n,
        "commit_ts": [1_700_000_000_000_000 + o for o in orders],
        "source_node": ["bench-node"] * n,
        "wal_segment": [o // 100_000 for o in orders],
        "wal_offset": [(o % 100_000) * 64 for o in orders],
        "wal_index": [0] * n,
        "expire_time_ms": [0] * n,
        "cache": caches,
        "source_generation": [0] * n,
    }
    return pa.table({f.name: pa.array(cols[f.name], f.type) for f in CHANGE_SCHEMA}, schema=CHANGE_SCHEMA)


def append(lake: Path, table: pa.Table) -> int:
    from deltalake import DeltaTable, write_deltalake

    from cdcd.lake.table import CHANGES, CHANGES_PROPERTIES, PARTITION_BY

    write_deltalake(
        str(lake / CHANGES), table, mode="append", partition_by=list(PARTITION_BY), configuration=CHANGES_PROPERTIES
    )
    return DeltaTable(str(lake / CHANGES)).version()


def state_count(lake: Path) -> int:
    from deltalake import DeltaTable

    adds = pa.table(DeltaTable(str(lake / "state")).get_add_actions(flatten=True))
    return int(sum(adds.column("num_records").to_pylist()))


class Session:
    def __init__(self) -> None:
        self.spark: Any = None

    def ensure(self) -> Any:
        if self.spark is None:
            from cdcd.lake import spark as spark_session

            self.spark = spark_session.acquire(MASTER, "cdcd-bench-lake-merge", {})
            atexit.register(self.close)
        return self.spark

    def close(self) -> None:
        if self.spark is not None:
            from cdcd.lake import spark as spark_session

            spark_session.release()
            self.spark = None


SESSION = Session()


class MergeLake:
    """A 1M-key state compacted in setup (``base``); every repetition merges 100k changes into a copy."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.initial_s = 0.0
        self.next_order = 0

    def ensure(self) -> None:
        from cdcd.lake.maintenance.compact import compact

        spark = SESSION.ensure()
        if self.root is not None:
            return
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-lake-merge-", dir=_bench_dir()))
        atexit.register(self.cleanup)
        base = self.root / "base"
        step = 250_000
        for start in range(0, STATE_KEYS, step):
            keys = list(range(start, start + step))
            append(base, change_table([f"cache-{k % CACHES}" for k in keys], keys, ["create"] * step, start))
        self.next_order = STATE_KEYS
        t0 = time.perf_counter()
        compact(spark, base)
        self.initial_s = time.perf_counter() - t0
        if state_count(base) != STATE_KEYS:
            raise AssertionError(f"initial state: {state_count(base):,} rows, expected {STATE_KEYS:,}")

    def increment(self, lake: Path) -> int:
        updates, creates, deletes = MERGE_CHANGES
        upd = list(range(1, STATE_KEYS, STATE_KEYS // updates))[:updates]
        dels = list(range(3, STATE_KEYS, STATE_KEYS // deletes))[:deletes]
        new = list(range(STATE_KEYS, STATE_KEYS + creates))
        keys = upd + new + dels
        ops = ["update"] * len(upd) + ["create"] * len(new) + ["delete"] * len(dels)
        append(lake, change_table([f"cache-{k % CACHES}" for k in keys], keys, ops, self.next_order))
        return STATE_KEYS + len(new) - len(dels)

    def cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


MERGE = MergeLake()


def run_merge() -> Measurement:
    from cdcd.lake.maintenance.compact import compact

    spark = SESSION.ensure()
    assert MERGE.root is not None
    lake = MERGE.root / "work"
    shutil.rmtree(lake, ignore_errors=True)
    shutil.copytree(MERGE.root / "base", lake)
    expected = MERGE.increment(lake)
    t0 = time.perf_counter()
    result = compact(spark, lake)
    seconds = time.perf_counter() - t0
    if state_count(lake) != expected:
        raise AssertionError(f"after the MERGE: {state_count(lake):,} state rows, expected {expected:,}")
    n = sum(MERGE_CHANGES)
    return Measurement(n, seconds, {"keys": result.keys, "initial_1m_s": round(MERGE.initial_s, 2)}, value=seconds)


def run_many_caches() -> Measurement:
    from cdcd.lake.maintenance.compact import compact

    spark = SESSION.ensure()
    root = Path(tempfile.mkdtemp(prefix="cdcd-bench-lake-caches-", dir=_bench_dir()))
    try:
        lake = root / "lake"
        caches = [f"cache-{i}" for i in range(MANY_CACHES) for _ in range(2)]
        keys = [j for _ in range(MANY_CACHES) for j in range(2)]
        append(lake, change_table(caches, keys, ["create"] * len(keys), 0))
        # state only: 10,000 typed tables would be 10,000 Delta tables (docs/lake.md, typed_tables).
        t0 = time.perf_counter()
        compact(spark, lake, typed_tables=False)
        first_s = time.perf_counter() - t0
        if state_count(lake) != len(keys):
            raise AssertionError(f"first compaction: {state_count(lake):,} rows, expected {len(keys):,}")
        append(lake, change_table(caches, keys, ["update"] * len(keys), len(keys)))
        t0 = time.perf_counter()
        compact(spark, lake, typed_tables=False)
        again_s = time.perf_counter() - t0
        if state_count(lake) != len(keys):
            raise AssertionError(f"second compaction: {state_count(lake):,} rows, expected {len(keys):,}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return Measurement(len(keys), first_s, {"update_all_s": round(again_s, 2)}, value=first_s)


def benchmarks(quick: bool) -> list[Bench]:
    return [
        Bench(
            name="lake.merge",
            description="compact(): MERGE of 100k changes into a 1M-key state",
            run_once=run_merge,
            metric="merge",
            unit="s",
            goal=MERGE_GOAL_S,
            lower_is_better=True,
            setup=MERGE.ensure,
            teardown=MERGE.cleanup,
            max_repeats=1 if quick else 3,
            more=(Metric("initial_1m", "initial_1m_s", "s", lower_is_better=True),),
            params={
                "state_keys": STATE_KEYS,
                "caches": CACHES,
                "changes": dict(zip(("updates", "creates", "deletes"), MERGE_CHANGES, strict=True)),
                "spark_master": MASTER,
            },
        ),
        Bench(
            name="lake.compact_caches",
            description=f"compact() of {MANY_CACHES:,} caches x 2 entries in one job",
            run_once=run_many_caches,
            metric="first",
            unit="s",
            goal=MANY_CACHES_GOAL_S,
            lower_is_better=True,
            setup=SESSION.ensure,
            max_repeats=1 if quick else 2,
            more=(Metric("update_all", "update_all_s", "s", MANY_CACHES_GOAL_S, lower_is_better=True),),
            params={"caches": MANY_CACHES, "entries_per_cache": 2, "spark_master": MASTER},
        ),
    ]
