"""Change files in the layout of the lake before Delta (``_cdcd_log`` plus Spark-style ``cache=<name>/``
directories), for the tests of ``cdcd lake migrate``: cdcd itself no longer writes it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Hive/Spark partition directory escaping (Spark's ExternalCatalogUtils.escapePathName).
_ESCAPED = {*range(0x20), 0x7F, *b"\"#%'*/:=?\\{[]^"}


def escape_partition(value: str) -> str:
    """A partition value as a directory name component, the way Spark writes it."""
    return "".join(f"%{ord(c):02X}" if ord(c) in _ESCAPED else c for c in value)


def write_partitioned(table: pa.Table, root: Path, partition_by: list[str], file_prefix: str) -> list[str]:
    """Write ``table`` under ``root`` as ``col=value/...`` directories, one file per group, the
    partition columns dropped from the files; returns the files' paths relative to ``root``."""
    # One integer per row naming its (cache, day, ...) group: groups are few, rows many.
    group = np.zeros(table.num_rows, np.int64)
    for c in partition_by:
        codes = table.column(c).combine_chunks().dictionary_encode()
        group = group * len(codes.dictionary) + codes.indices.to_numpy(zero_copy_only=False)
    data = table.drop_columns(partition_by)
    written = []
    for n, gid in enumerate(np.unique(group)):
        rows = np.flatnonzero(group == gid)
        part = data if len(rows) == table.num_rows else data.take(pa.array(rows))
        first = int(rows[0])
        rel = Path(*(f"{c}={escape_partition(str(table.column(c)[first].as_py()))}" for c in partition_by))
        rel = rel / f"{file_prefix}-{n:05d}.zstd.parquet"
        (root / rel.parent).mkdir(parents=True, exist_ok=True)
        pq.write_table(part, root / rel, compression="zstd", row_group_size=1 << 20)
        written.append(str(rel))
    return written
