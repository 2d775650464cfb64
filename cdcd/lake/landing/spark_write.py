"""The Spark writer: Spark tasks build the batch's rows and write its Parquet files into the table.

The driver (the daemon) hands each part of a batch to a Spark task as the records themselves:
the ``RecordSlice``s packed (``arrow.pack``: MessagePack, the records as in the WAL) and
zstd-compressed, with the cache names: in a broadcast variable, or on a local master in a file of the
driver's own private directory (``PartFiles``), which the task reads where the driver wrote it.
``ChangeTaskWriter``, running in the task on an executor, builds the Arrow rows from them
(``table_from_packed``: C code reads the records into columns, keys and values as JSON text) and writes
them as Parquet files under ``<table>/<partition dirs>/`` with names unique per file (``part-<uuid>``, what
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
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
from deltalake.transaction import AddAction

from cdcd import failpoints
from cdcd.consumer import RecordSlice
from cdcd.lake.landing.arrow import pack, table_from_packed
from cdcd.lake.landing.delta import ChangeTable, WrittenFiles
from cdcd.lake.storage import LakeLocation
from cdcd.lock import pid_alive

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
            part = self.parts[i]
            packed = unship(part.read() if isinstance(part, LocalPart) else part.value)
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


class LocalPart:
    """A part shipped as a file (``PartFiles``): what a task on the driver's machine reads."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()


class PartFiles:
    """A local master's parts as files in a directory of this process's own (mode 0700, removed at ``close``):
    a broadcast would be read into the JVM's heap, copied into its block store in 4 MiB blocks and written to a
    file for the Python worker all the same; a file the task reads leaves the JVM out of the data's way. A
    process SIGKILLed leaves its directory behind: the next one removes those of processes that are gone."""

    PREFIX = "cdcd-lake-parts-"

    def __init__(self) -> None:
        _remove_stale(Path(tempfile.gettempdir()), self.PREFIX)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.PREFIX}{os.getpid()}-"))

    def write(self, data: bytes) -> LocalPart:
        path = self.dir / uuid.uuid4().hex
        with open(path, "wb") as f:
            f.write(data)
        return LocalPart(str(path))

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _remove_stale(root: Path, prefix: str) -> None:
    """Directories ``<prefix><pid>-*`` of this user under ``root`` whose process is gone (never a link)."""
    for entry in os.scandir(root):
        pid = entry.name.removeprefix(prefix).partition("-")[0]
        if entry.name == pid or not pid.isdigit() or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_uid != os.getuid() or pid_alive(int(pid)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)


def write_on_executors(
    spark: Any,
    table: ChangeTable,
    location: LakeLocation,
    parts: list[list[RecordSlice]],
    batch: BatchInfo,
    *,
    files: PartFiles | None = None,
) -> WrittenFiles:
    """The records of ``parts`` written by one Spark task each (one job) straight into ``table``; the
    files, not yet named by any commit.

    The parts travel in broadcast variables, one per task (no DataFrame: no type conversion through
    Spark's types, and no pandas, which PySpark's Arrow UDFs require), or as ``files`` on a local
    master. Broadcast rather than inside the tasks: Spark ships a broadcast in blocks, where a task's
    own data is copied by the JVM."""
    parts = [p for p in parts if p]
    if not parts:
        return WrittenFiles(table.path, [])
    sc = spark.sparkContext
    shipped: list[Any] = []
    try:
        for part in parts:
            shipped.append(sc.broadcast(ship(part)) if files is None else files.write(ship(part)))
        writer = ChangeTaskWriter(location, "day" in table.partition_by, batch, shipped)
        rows = sc.parallelize(range(len(shipped)), len(shipped)).mapPartitions(writer).collect()
    finally:
        for part in shipped:
            if isinstance(part, LocalPart):
                Path(part.path).unlink()
            else:
                part.destroy()
    adds = [AddAction(path, size, json.loads(values), mtime, True, stats) for path, size, values, mtime, stats in rows]
    return WrittenFiles(table.path, adds)
