"""Many caches into the lake: a batch over many cache partitions is written as one file per cache,
each with the Delta statistics of exactly its rows, its rows in WAL order."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cdcd.lake.landing.delta import ChangeTable
from cdcd.lake.landing.parquet_files import SMALL_FILE_ROWS, file_stats
from cdcd.lake.table import CHANGE_SCHEMA


def _changes(caches: list[str]) -> pa.Table:
    n = len(caches)
    cols = {
        "op": ["create"] * n,
        "key": [str(i) for i in range(n)],
        "value": ["{}"] * n,
        "partition": [i % 7 for i in range(n)],
        "primary": [True] * n,
        "version_order": [10 * n - i for i in range(n)],  # falling: min and max are not first and last
        "version_cluster_id": [1] * n,
        "node_order": [i % 3 for i in range(n)],
        "topology_version": [1] * n,
        "commit_ts": [1_700_000_000_000_000 + i for i in range(n)],
        "source_node": ["n"] * n,
        "wal_segment": [i // 100 for i in range(n)],
        "wal_offset": [i * 64 for i in range(n)],
        "wal_index": [0] * n,
        "expire_time_ms": [0] * n,
        "cache": caches,
        "source_generation": [0] * n,
    }
    return pa.table({f.name: pa.array(cols[f.name], f.type) for f in CHANGE_SCHEMA}, schema=CHANGE_SCHEMA)


def test_many_partitions_one_file_each_with_its_own_stats(tmp_path: Path) -> None:
    rng = random.Random(7)
    caches = [f"cache-{rng.randrange(300)}" for _ in range(3000)] + ["big"] * (SMALL_FILE_ROWS + 5)
    table = _changes(caches)
    changes = ChangeTable(tmp_path, False)
    changes.open()
    written = changes.write_arrow(table, max_rows_per_file=SMALL_FILE_ROWS)
    by_cache: dict[str, list[int]] = {}
    for add in written.adds:
        rows = pq.read_table(tmp_path / "changes" / add.path)
        assert json.loads(add.stats) == json.loads(file_stats(rows)), add.path
        cache = add.partition_values["cache"]
        assert cache is not None
        offsets = rows.column("wal_offset").to_pylist()
        assert offsets == sorted(offsets)  # WAL order inside each file
        by_cache.setdefault(cache, []).extend(offsets)
        assert add.path.endswith(".snappy.parquet" if rows.num_rows < SMALL_FILE_ROWS else ".zstd.parquet")
    expected: dict[str, list[int]] = {}
    for i, cache in enumerate(caches):
        expected.setdefault(cache, []).append(i * 64)
    assert {c: sorted(v) for c, v in by_cache.items()} == expected  # every row once, in its partition
    files = {cache: 0 for cache in expected}
    for add in written.adds:
        files[str(add.partition_values["cache"])] += 1
    assert files.pop("big") == 2 and set(files.values()) == {1}
