"""The Spark writer: Spark tasks write the batch's Parquet files straight into the table.

The driver (the daemon) builds each part of a batch as Arrow columns with the entries' keys and
values still MessagePack (``build_table(json_text=False)``) and hands it to a Spark task as Arrow
IPC. ``ChangeTaskWriter``, running in the task on an executor, turns keys and values into the lake's
JSON text (the one per-row cost no vector kernel takes: it runs on the executors' cores, not the
daemon's) and writes the rows as Parquet files under ``<table>/<partition dirs>/`` with names unique
per file (``part-<uuid>``, what the JVM-free writer writes), fsynced on a local disk, and returns one
row per file: its path, size, partition values and statistics. The driver collects those rows as
Delta ``AddAction``s, and delta-rs commits them with the source's application transaction exactly as
for any other batch (cdcd/lake/delta.py).

Nothing is renamed or copied, so the same path serves a local lake and an object store (which has no
rename: a "move" is a copy of every byte), and no file goes through Hadoop's local file system
(which forks ``chmod`` for every file it creates when Hadoop's native library is absent, as in
pyspark's wheels: seconds per thousand partitions). Files that no commit names are orphans that
``vacuum`` removes (after the retention period), never rows of the table: a task attempt that died
(its executor or worker SIGKILLed) or lost to another attempt, or a job that failed, leaves files
only the driver could have named, and it named none of them. The executors need this package
installed in the Python ``spark.pyspark.python`` names (they import this module to run the task),
and reach an object store with the lake's storage settings, which travel in the task (as Spark's own
``spark.hadoop.fs.s3a.*`` settings do).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake.transaction import AddAction

from cdcd.lake.arrow import with_json_text
from cdcd.lake.delta import ChangeTable, WrittenFiles
from cdcd.lake.storage import LakeLocation

PAUSE_POINT = "lake.spark_task.written"
PAUSE_DIR_ENV = "CDCD_TEST_PAUSE_DIR"
"""Tests only: with ``$CDCD_TEST_PAUSE_DIR`` set in the executors' environment, the first task (of
all executors, once: a file ``<dir>/lake.spark_task.written`` created exclusively holds its pid) stops
after writing its files and before returning them, until it is killed: the test SIGKILLs the Spark
worker running it mid-write."""


def _pause_once() -> None:
    where = os.environ.get(PAUSE_DIR_ENV)
    if not where:
        return
    try:
        fd = os.open(Path(where) / PAUSE_POINT, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.5)


class ChangeTaskWriter:
    """The function each Spark task runs on its executor (pickled with the lake's location and the
    broadcast variables holding the parts): part ``i`` of the batch arrives as Arrow IPC bytes (keys
    and values MessagePack or JSON text) and leaves as Parquet files in the table."""

    def __init__(
        self, location: LakeLocation, partition_by_day: bool, max_rows_per_file: int, parts: list[Any]
    ) -> None:
        self.location = location
        self.partition_by_day = partition_by_day
        self.max_rows_per_file = max_rows_per_file
        self.parts = parts

    def __call__(self, indexes: Iterator[int]) -> Iterator[tuple[str, int, str, int, str]]:
        table = ChangeTable(self.location.root(), self.partition_by_day)
        for i in indexes:
            rows = with_json_text(pa.ipc.open_stream(self.parts[i].value).read_all())
            written = table.write_arrow(rows, self.max_rows_per_file)
            _pause_once()
            for a in written.adds:
                yield a.path, a.size, json.dumps(a.partition_values), a.modification_time, a.stats


_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")
"""Compressed, a part is a fraction of the bytes for the JVM and the network to carry, for a few
milliseconds of (multi-threaded) zstd on the driver."""


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    # One chunk per column: keys and values are slices of one shared buffer, which the IPC writer
    # copies far more slowly than a contiguous column.
    with pa.ipc.new_stream(sink, table.schema, options=_IPC_OPTIONS) as out:
        out.write_table(table.combine_chunks())
    return bytes(sink.getvalue())


def write_on_executors(
    spark: Any, table: ChangeTable, location: LakeLocation, data: pa.Table, *, tasks: int, max_rows_per_file: int
) -> WrittenFiles:
    """``data`` (rows of the change schema, keys and values MessagePack or JSON text) written by
    ``tasks`` Spark tasks straight into ``table``; the files, not yet named by any commit.

    The parts travel as Arrow IPC in broadcast variables, one per task (no DataFrame: no type
    conversion through Spark's types, and no pandas, which PySpark's Arrow UDFs require). Broadcast
    rather than inside the tasks: Spark ships a broadcast in blocks, and in local mode the Python
    worker reads it from the file the driver wrote, where a task's own data is copied by the JVM."""
    if data.num_rows == 0:
        return WrittenFiles(table.path, [])
    n = max(1, min(tasks, data.num_rows))
    step = -(-data.num_rows // n)
    sc = spark.sparkContext
    parts = [sc.broadcast(_ipc(data.slice(i, step))) for i in range(0, data.num_rows, step)]
    try:
        writer = ChangeTaskWriter(location, "day" in table.partition_by, max_rows_per_file, parts)
        rows = sc.parallelize(range(len(parts)), len(parts)).mapPartitions(writer).collect()
    finally:
        for part in parts:
            part.destroy()
    adds = [AddAction(path, size, json.loads(values), mtime, True, stats) for path, size, values, mtime, stats in rows]
    return WrittenFiles(table.path, adds)
