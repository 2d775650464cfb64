"""The Spark writer: Spark tasks build the batch's rows and write its Parquet files into the table.

The driver (the daemon) hands each part of a batch to a Spark task as the records themselves:
the ``RecordSlice``s packed (``arrow.pack``: MessagePack, the records as in the WAL) and
zstd-compressed, in a broadcast variable, with the cache names. ``ChangeTaskWriter``, running in
the task on an executor, builds the Arrow rows from them (``table_from_packed``: C code reads the
records into columns, keys and values as JSON text) and writes them as
Parquet files under ``<table>/<partition dirs>/`` with names unique per file (``part-<uuid>``, what
the JVM-free writer writes), fsynced on a local disk, and returns one row per file: its path, size,
partition values and statistics. The driver collects those rows as Delta ``AddAction``s, and
delta-rs commits them with the source's application transaction exactly as for any other batch
(cdcd/lake/landing/delta.py). So the daemon decodes the WAL and ships the records' bytes as it read them
(``RecordSlice.payload``: copied, not encoded again, where the reader kept them); the rest of the lake's
per-row work (columns, JSON text, Parquet) runs on the executors' cores, in parallel, one task per part.

Nothing is renamed or copied, so the same path serves a local lake and an object store (which has no
rename: a "move" is a copy of every byte), and no file goes through Hadoop's file systems. Files
that no commit names are orphans that ``vacuum`` removes (after the retention period), never rows
of the table: a task attempt that died (its executor or worker SIGKILLed) or lost to another
attempt, or a job that failed, leaves files only the driver could have named, and it named none of
them. The executors need this package installed in the Python ``spark.pyspark.python`` names (they
import this module to run the task), and reach an object store with the lake's storage settings,
which travel in the task (as Spark's own ``spark.hadoop.fs.s3a.*`` settings do).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pyarrow as pa
from deltalake.transaction import AddAction

from cdcd import failpoints
from cdcd.consumer import RecordSlice
from cdcd.lake.landing.arrow import pack, table_from_packed
from cdcd.lake.landing.delta import ChangeTable, WrittenFiles
from cdcd.lake.storage import LakeLocation

TASK_WRITTEN = "lake.spark_task.written"
"""Fail point (cdcd/failpoints.py) after a task wrote its files and before it returns them: the tests
pause the first task there (``spark.executorEnv.CDCD_FAILPOINTS``) and SIGKILL its Spark worker."""


class BatchInfo(msgspec.Struct, frozen=True):
    """What a task needs of the batch besides its records."""

    source_node: str
    generation: int
    cache_names: dict[int, str]


class ChangeTaskWriter:
    """The function each Spark task runs on its executor (pickled with the lake's location, the
    batch's source, generation and cache names, and the broadcast variables holding the parts):
    part ``i`` of the batch arrives as shipped records and leaves as Parquet files in the table."""

    def __init__(
        self,
        location: LakeLocation,
        partition_by_day: bool,
        batch: BatchInfo,
        parts: list[Any],
    ) -> None:
        self.location = location
        self.partition_by_day = partition_by_day
        self.batch = batch
        self.parts = parts

    def __call__(self, indexes: Iterator[int]) -> Iterator[tuple[str, int, str, int, str]]:
        table = ChangeTable(self.location.root(), self.partition_by_day)
        info = self.batch
        for i in indexes:
            packed = unship(self.parts[i].value)
            by_day = self.partition_by_day
            rows, _ = table_from_packed(packed, info.cache_names, info.source_node, by_day, info.generation)
            written = table.write_arrow(rows)
            failpoints.hit(TASK_WRITTEN)
            for a in written.adds:
                yield a.path, a.size, json.dumps(a.partition_values), a.modification_time, a.stats


_CODEC = pa.Codec("zstd", compression_level=1)


def ship(slices: list[RecordSlice]) -> bytes:
    """A part of a batch as a task receives it: its records packed (``arrow.pack``), zstd (the size first)."""
    raw = pack(slices)
    compressed: bytes = _CODEC.compress(raw, asbytes=True)
    return len(raw).to_bytes(8, "little") + compressed


def unship(data: bytes) -> bytes:
    """What ``ship`` packed."""
    size = int.from_bytes(data[:8], "little")
    raw: bytes = _CODEC.decompress(data[8:], decompressed_size=size, asbytes=True)
    return raw


def write_on_executors(
    spark: Any,
    table: ChangeTable,
    location: LakeLocation,
    parts: list[list[RecordSlice]],
    batch: BatchInfo,
) -> WrittenFiles:
    """The records of ``parts`` written by one Spark task each (one job) straight into ``table``; the
    files, not yet named by any commit.

    The parts travel in broadcast variables, one per task (no DataFrame: no type conversion through
    Spark's types, and no pandas, which PySpark's Arrow UDFs require). Broadcast rather than inside
    the tasks: Spark ships a broadcast in blocks, and in local mode the Python worker reads it from
    the file the driver wrote, where a task's own data is copied by the JVM."""
    parts = [p for p in parts if p]
    if not parts:
        return WrittenFiles(table.path, [])
    sc = spark.sparkContext
    shipped: list[Any] = []
    try:
        for part in parts:
            shipped.append(sc.broadcast(ship(part)))
        writer = ChangeTaskWriter(location, "day" in table.partition_by, batch, shipped)
        rows = sc.parallelize(range(len(shipped)), len(shipped)).mapPartitions(writer).collect()
    finally:
        for part in shipped:
            part.destroy()
    adds = [AddAction(path, size, json.loads(values), mtime, True, stats) for path, size, values, mtime, stats in rows]
    return WrittenFiles(table.path, adds)
