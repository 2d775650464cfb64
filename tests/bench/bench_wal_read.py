"""WAL read + decode throughput: ``WalReader`` over a whole log, counting entries.

Setup (untimed) writes the log straight through ``WalWriter`` + ``SegmentFiles`` (no fsync), with
DataRecords shaped like the node's (fresh int keys, 100-byte values, CREATE, a CacheVersion per
entry) into 64 MiB segments; rolled segments move to an archive dir, the last one stays active.
The timed part iterates ``WalReader([archive_dir, wal_dir], active_segment=...)`` over every record
and sums ``len(record.entries)`` -- keys and values stay ``msgspec.Raw``, as a CDC consumer that
filters before decoding would see them. The files were just written, so they are in the page
cache: this measures CPU (framing, CRC, msgpack decode), single-threaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
import zlib
from pathlib import Path

import msgspec

from cdcd.wal import DataRecord, WalReader
from cdcd.wal.frame import encode_frame
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheVersion, DataEntry, Op
from cdcd.wal.writer import SegmentFiles, WalWriter
from tests.support.bench import VALUE_100B, Bench, Measurement

SEGMENT_BYTES = 64 << 20
CACHE_ID = zlib.crc32(b"bench") & 0x7FFFFFFF
PARTITIONS = 1024


class WalLogFixture:
    """A log of ``entries`` entries in transactions of ``tx_size``, written once in setup."""

    def __init__(self, entries: int, tx_size: int) -> None:
        self.entries = entries
        self.tx_size = tx_size
        self.root: Path | None = None
        self.wal_dir = Path()
        self.archive_dir = Path()
        self.active_segment = 0
        self.bytes = 0
        self.segments = 0

    def setup(self) -> None:
        base = os.environ.get("CDCD_BENCH_DIR") or None
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-wal-", dir=base))
        self.wal_dir = self.root / "wal"
        self.archive_dir = self.root / "archive"
        self.wal_dir.mkdir()
        self.archive_dir.mkdir()

        def archive(segment: int, path: Path) -> None:
            os.replace(path, self.archive_dir / path.name)

        writer = WalWriter(uuid.uuid4(), SEGMENT_BYTES, 4 << 20, WalPointer(0, 0))
        files = SegmentFiles(self.wal_dir, archive, fsync=False)
        # WalWriter.append_record(record) where it exists, else the older append(encode_frame(record)).
        append = getattr(writer, "append_record", None) or (lambda record: writer.append(encode_frame(record)))
        enc = msgspec.msgpack.Encoder()
        value = msgspec.Raw(enc.encode(VALUE_100B))
        raw = msgspec.Raw
        order = 0
        for start in range(0, self.entries, self.tx_size):
            entries = []
            for key in range(start, min(start + self.tx_size, self.entries)):
                order += 1
                key_raw = enc.encode(key)
                entries.append(
                    DataEntry(
                        CACHE_ID,
                        Op.CREATE,
                        raw(key_raw),
                        value,
                        zlib.crc32(key_raw) % PARTITIONS,
                        CacheVersion(order, 1, 1, 1),
                    )
                )
            append(DataRecord(tuple(entries), time.time_ns()))
            if writer.buffered_bytes >= writer.buffer_bytes:
                files.write(writer.take())
        files.write(writer.take())
        files.close()
        self.active_segment = writer.segment
        self.bytes = files.bytes_written
        self.segments = writer.segment + 1

    def teardown(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def read_all(self) -> Measurement:
        n = 0
        records = 0
        data_record = DataRecord
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        for _ptr, record in WalReader([self.archive_dir, self.wal_dir], active_segment=self.active_segment):
            if type(record) is data_record:
                n += len(record.entries)
                records += 1
        seconds = time.perf_counter() - t0
        cpu = time.thread_time() - cpu0
        if n != self.entries:
            raise AssertionError(f"read {n} entries, wrote {self.entries}")
        mib = self.bytes / (1 << 20)
        # entries per CPU-second of this thread: what the rate would be on an idle core.
        return Measurement(
            n,
            seconds,
            {
                "records": records,
                "mib": round(mib, 1),
                "mib_per_s": round(mib / seconds, 1),
                "cpu_s": round(cpu, 3),
                "entries_per_cpu_s": round(n / cpu) if cpu > 0 else None,
            },
        )


def benchmarks(quick: bool) -> list[Bench]:
    entries = 100_000 if quick else 1_000_000
    out = []
    for name, tx_size, goal in (("wal_read.tx10", 10, 1_000_000.0), ("wal_read.tx1", 1, 400_000.0)):
        fx = WalLogFixture(entries, tx_size)
        out.append(
            Bench(
                name=name,
                description=f"WalReader over {entries:,} entries in {tx_size}-entry DataRecords (no key/value decode)",
                run_once=fx.read_all,
                goal=goal,
                setup=fx.setup,
                teardown=fx.teardown,
                params={
                    "entries": entries,
                    "tx_size": tx_size,
                    "value_bytes": len(VALUE_100B) + 2,
                    "wal_segment_size_bytes": SEGMENT_BYTES,
                },
            )
        )
    return out
