"""The change data feed compaction reads (cdcd/lake/maintenance/feed.py): for every range of versions, exactly the
rows the range's commits added, also where the writer's small-file rewrites (``dataChange = false``) or a delta-rs
OPTIMIZE replaced those files with fewer, larger ones, which it then reads instead, and where a rewrite took files
from before the range, whose inputs it must then read as they are."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from cdcd.lake.maintenance.feed import FEED_COLUMNS, _feed_files, read_feed
from cdcd.lake.table import CHANGES
from cdcd.node import Node
from tests.support.delta_lake import land_each_record, wal_batch
from tests.support.writer import WRITER_NODE_SETTINGS

HOSTILE = ("x" * 255, "é" * 200, "a%2Fb c", "plain")


def _node(node_dir: Path, transactions: int) -> None:
    with Node.open(node_dir, **{**WRITER_NODE_SETTINGS, "wal_force_archive_timeout_ms": 0}) as node:
        for n in range(transactions):
            with node.transaction() as tx:
                for i, cache in enumerate(HOSTILE[: 1 + n % len(HOSTILE)]):
                    tx.put(cache, n % 40, {"n": n, "cache": i})
        node.force_archive()


def _land(tmp_path: Path, *, max_files: int, transactions: int = 90) -> Path:
    """One commit per WAL record, with the writer's rewrites bounding each partition to ``max_files``."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    _node(node_dir, transactions)
    land_each_record(lake, wal_batch(node_dir), max_files=max_files)
    return lake / CHANGES


def _added_rows(changes: Path, start: int, end: int) -> Counter[tuple[object, ...]]:
    """The reference: every file a data-changing commit in ``start..end`` added, read as the log names it."""
    rows: Counter[tuple[object, ...]] = Counter()
    for version in range(start, end + 1):
        for line in (changes / "_delta_log" / f"{version:020d}.json").read_text().splitlines():
            add = json.loads(line).get("add")
            if add is None or not add["dataChange"]:
                continue
            data = pq.read_table(changes / unquote(add["path"]))
            cache = add["partitionValues"]["cache"]
            for row in data.select(["op", "key", "wal_segment", "wal_offset", "wal_index"]).to_pylist():
                rows[(cache, *row.values())] += 1
    return rows


def _feed_rows(feed: pa.Table) -> Counter[tuple[object, ...]]:
    cols = ["cache", "op", "key", "wal_segment", "wal_offset", "wal_index"]
    return Counter(tuple(r.values()) for r in feed.select(cols).to_pylist())


def _rewrite_versions(changes: Path, latest: int) -> list[int]:
    out = []
    for version in range(latest + 1):
        text = (changes / "_delta_log" / f"{version:020d}.json").read_text()
        if any(json.loads(line).get("remove") for line in text.splitlines()):
            out.append(version)
    return out


def test_every_range_reads_exactly_the_rows_its_commits_added_from_fewer_files(tmp_path: Path) -> None:
    """90 transactions, a commit per WAL record, into four partitions (names no file system takes as they are),
    the writer rewriting them at a bound of 6: every range of versions (150 of them at random) yields exactly
    the rows its data-changing commits added, each once; the whole range reads a fraction of the files the
    commits added (the rewrites' outputs), and ranges starting after a rewrite that took earlier files read
    that rewrite's inputs."""
    changes = _land(tmp_path, max_files=6)
    latest = DeltaTable(str(changes)).version()
    rewrites = _rewrite_versions(changes, latest)
    assert len(rewrites) >= 20, rewrites
    assert set(read_feed(changes, 0, latest).column_names) >= set(FEED_COLUMNS)
    ranges = [(a, b) for a in range(latest + 1) for b in range(a, latest + 1)]
    random.Random(43).shuffle(ranges)
    for start, end in [(0, latest), (1, latest), *ranges[:150]]:
        want = _added_rows(changes, start, end)
        got = _feed_rows(read_feed(changes, start, end))
        assert got == want, (start, end, sum(got.values()), sum(want.values()))
    added = sum(1 for v in range(latest + 1) for _ in _adds(changes, v, data_change=True))
    read = len(_feed_files(changes, 0, latest))
    assert read <= added // 4, (read, added)


def _adds(changes: Path, version: int, *, data_change: bool) -> list[dict[str, object]]:
    lines = (changes / "_delta_log" / f"{version:020d}.json").read_text().splitlines()
    return [a["add"] for a in map(json.loads, lines) if "add" in a and a["add"]["dataChange"] is data_change]


def test_a_delta_rs_optimize_in_the_range_is_read_instead_of_its_inputs(tmp_path: Path) -> None:
    """A delta-rs OPTIMIZE (another tool's rearranging commit: its own file names, one per partition) after 30
    commits with the writer's rewrites off: the range across it reads the OPTIMIZE's files, the same rows; a
    range starting after its first input reads the inputs as they are."""
    changes = _land(tmp_path, max_files=0, transactions=30)
    before = DeltaTable(str(changes)).version()
    dt = DeltaTable(str(changes))
    dt.optimize.compact(partition_filters=[("cache", "=", "plain")])
    latest = DeltaTable(str(changes)).version()
    assert latest == before + 1 and _adds(changes, latest, data_change=False)
    for start, end in [(0, latest), (1, latest), (5, latest), (0, before)]:
        assert _feed_rows(read_feed(changes, start, end)) == _added_rows(changes, start, end), (start, end)
    whole = {str(f) for f, _ in _feed_files(changes, 0, latest)}
    optimized = {str(changes / unquote(str(a["path"]))) for a in _adds(changes, latest, data_change=False)}
    assert optimized <= whole
    assert not optimized & {str(f) for f, _ in _feed_files(changes, 5, latest)}
