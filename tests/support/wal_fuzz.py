"""Fuzz targets for the WAL reader (``SegmentReader``, ``WalReader``) and the inputs that drive them.

A target is a plain function taking bytes and raising ``FuzzFailure`` when the reader breaks its
contract, so the same targets run under our own random loop, hypothesis and atheris:

- ``check_segment``: the bytes are a segment file. Read archived and active, with the default and a
  tiny read buffer, from the start and from a record boundary, with and without skipped types: the
  reader yields a contiguous chain of CRC-checked frames or raises one of its typed errors
  (``BadSegmentHeader``, ``CorruptRecord``, ``TruncatedSegment``) naming the file and the offset of
  the first frame it did not yield; only the active segment may end early (short, zero-filled or
  torn tail); the buffer size changes nothing.
  DataRecords read with their entries left undecoded (``lazy_entries``: the C check of cdcd/wal/_entries.c)
  are the same records, or the same error at the same offset.
- ``check_memory``: the bytes are a segment file read under tracemalloc: the peak stays under a fixed
  bound whatever the length fields claim.
- ``check_wal_dir``: the bytes are a program that builds two WAL dirs from valid segments (gaps,
  mutated or misnamed segments, foreign names, symlinks, a start pointer, an active segment);
  ``WalReader`` must agree with a model built from ``SegmentReader`` and a strict directory scan.
- ``check_name``: the bytes are a file name: it is a segment iff it is exactly 16 ASCII digits and
  ``.wal``; anything else is ``BadSegmentName`` or refused by the listing.
- ``check_lake_rows``: the bytes are record slices packed for the lake's C module
  (``cdcd.lake.landing._rows.columns``): column buffers of exactly one value per row, offsets that cut the
  text, valid JSON in every key and value, or a ValueError; never a crash; the same buffers from the
  Python path (``rows_py``). Its seed holds keys of every kind the key text tags (NaN, binary, maps
  with ``$``, int or repeated keys, timestamps, extensions).

Generators (``gen_segment``, ``gen_name``, ``gen_program``) turn a ``Chooser`` into a target's input:
a seeded ``random.Random`` for the fast loop, or a fuzzer's bytes (``ByteChooser``) for hypothesis and
atheris. Segments are mutated from seeds written by the real ``WalWriter`` (``seeds()``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import random
import re
import shutil
import signal
import struct
import tempfile
import threading
import traceback
import tracemalloc
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np

from cdcd.consumer import RecordSlice
from cdcd.lake.landing import _rows, rows_py
from cdcd.lake.landing.arrow import pack
from cdcd.lake.landing.jsontext import key_json_bytes, to_json_bytes
from cdcd.wal.errors import (
    BadSegmentHeader,
    BadSegmentName,
    CorruptRecord,
    MissingSegment,
    TruncatedSegment,
    WalError,
)
from cdcd.wal.frame import FRAME_HEADER, FRAME_HEADER_SIZE, SEGMENT_END_FRAME
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.reader import DEFAULT_READ_BUFFER_BYTES, SegmentReader, WalReader
from cdcd.wal.records import (
    NIL,
    RECORD_TYPES,
    CacheConfig,
    CacheOp,
    CacheRecord,
    CacheVersion,
    Checkpoint,
    DataEntry,
    DataRecord,
    Op,
    RealtimeCdcRecord,
    Record,
    SegmentEnd,
    StopRealtimeCdcRecord,
    TryStartRealtimeCdcRecord,
)
from cdcd.wal.segment import (
    HEADER_SIZE,
    encode_header,
    is_segment_name,
    list_segments,
    parse_segment_name,
    segment_name,
)
from cdcd.wal.writer import WalWriter

T = TypeVar("T")

SEGMENT_ERRORS = (BadSegmentHeader, CorruptRecord, TruncatedSegment)
"""What ``SegmentReader`` may raise while iterating (its name is checked in the constructor)."""
DIR_ERRORS = (*SEGMENT_ERRORS, MissingSegment)
"""What ``WalReader`` may raise while iterating."""

CASE_CPU_SECONDS = 5.0
"""CPU budget of one case: a small segment reads in well under a millisecond, so this is a hang."""
MEMORY_READ_BUFFER = 64 << 10
"""Read buffer configured for the memory target."""
MEMORY_MAX_INPUT = 64 << 10
"""The memory target reads small segments: longer inputs are cut to this."""
MEMORY_BOUND = MEMORY_READ_BUFFER + (2 << 20)
"""Peak traced allocation allowed while reading a small segment: the buffer plus 2 MiB for the refill
copies and one decoded record. A length field is a u32, so one that were honoured would need up to 4 GiB."""

NODE_ID = uuid.UUID("6f1c0a4e-2b7d-4c59-9e83-5a0d1f2e3b4c")
FIRST_SEGMENT = 5
CHAIN = (5, 6, 7, 8)
"""Consecutive seed segments: 5, 6 and 7 archived, 8 active (the dir target's WAL)."""
ACTIVE_SEGMENT = 8
CACHE_ID = 0x2A1B3C4D
_SEGMENT_FALLBACK = 7
_STRICT_NAME = re.compile(rb"[0-9]{16}\.wal")
_msgpack = msgspec.msgpack.Encoder(order="deterministic")


class FuzzFailure(Exception):
    """A broken contract: ``kind`` is the short signature failures are grouped and minimised by."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class FuzzHang(BaseException):
    """Raised by the CPU timer; a BaseException so that no ``except Exception`` in the code under test eats it."""


# --- choices ---------------------------------------------------------------------------------------
class Chooser(Protocol):
    def below(self, n: int) -> int:
        """An integer in ``[0, n)`` (0 when ``n <= 1``)."""

    def take(self, n: int) -> bytes:
        """``n`` bytes."""


class RandomChooser:
    """Choices from a seeded ``random.Random`` (the fast loop)."""

    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd

    def below(self, n: int) -> int:
        return self.rnd.randrange(n) if n > 1 else 0

    def take(self, n: int) -> bytes:
        return self.rnd.randbytes(n)


class ByteChooser:
    """Choices read from a fuzzer's bytes, all zeros once they run out, so a shorter input is a simpler case
    (which is what hypothesis' shrinker and libFuzzer's length growth both work with)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def below(self, n: int) -> int:
        if n <= 1:
            return 0
        width = 1 if n <= 1 << 8 else 2 if n <= 1 << 16 else 4 if n <= 1 << 32 else 8
        return int.from_bytes(self.take(width), "little") % n

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        return chunk + bytes(n - len(chunk))


def pick(ch: Chooser, items: Sequence[T]) -> T:
    return items[ch.below(len(items))]


def chance(ch: Chooser, one_in: int) -> bool:
    """True one time in ``one_in``; never for an exhausted ``ByteChooser``, whose zeros mean "the usual"."""
    return ch.below(one_in) == one_in - 1


# --- seeds: valid segments written by the real writer ----------------------------------------------
@dataclass(frozen=True)
class Seed:
    segment: int
    data: bytes
    records: tuple[Record, ...]
    archived: bool


def _raw(obj: Any) -> msgspec.Raw:
    return msgspec.Raw(_msgpack.encode(obj))


def _entry(i: int, op: Op, key: Any, value: Any, **kw: Any) -> DataEntry:
    other = kw.pop("other", None)
    return DataEntry(
        cache_id=CACHE_ID,
        op=op,
        key=_raw(key),
        value=NIL if value is None else _raw(value),
        partition=zlib.crc32(_msgpack.encode(key)) % 1024,
        version=CacheVersion(i, 1, 1, 3, other),
        **kw,
    )


def _all_types_records() -> list[Record]:
    """Every record type but SegmentEnd (the roll writes it), with every DataEntry field exercised."""
    entries = [
        _entry(1, Op.CREATE, 17, {"qty": 3, "sku": "A-7"}),
        _entry(2, Op.UPDATE, "user-9", {"name": "Zoë", "tags": ["a", "b"], "score": 1.5}),
        _entry(3, Op.DELETE, [4, 2], None),
        _entry(4, Op.CREATE, b"\x00\xffkey", [1, None, True], other=CacheVersion(9, 2, 7, 1), primary=False),
        _entry(5, Op.UPDATE, -(2**40), {"nested": {"deep": [1, 2, {"x": b"y"}]}}, expire_time_ms=1_700_000_000_000),
    ]
    return [
        CacheRecord(CACHE_ID, "orders", CacheOp.CREATE, CacheConfig(partitions=1024, cdc_enabled=True), ts_ns=11),
        DataRecord(tuple(entries), commit_ts_ns=1_795_321_598_142_668_452),
        TryStartRealtimeCdcRecord(ts_ns=12),
        RealtimeCdcRecord(last=WalPosition(4, 40, 2)),
        StopRealtimeCdcRecord(last=WalPosition(5, 40, 1), reason="realtime_cdc_disabled"),
        StopRealtimeCdcRecord(),
        Checkpoint(ts_ns=13, next_order=6),
        CacheRecord(CACHE_ID + 1, "gone", CacheOp.DESTROY, CacheConfig(partitions=8, cdc_enabled=False), ts_ns=14),
        DataRecord((_entry(6, Op.CREATE, "k", "v"),), commit_ts_ns=15),
    ]


def _big_records() -> list[Record]:
    """A record larger than the tiny read buffers the checks use, so refills split it."""
    entries = [
        _entry(100 + i, Op(i % 3), f"key-{i}", None if i % 3 == 2 else {"v": "x" * 40, "i": i}) for i in range(60)
    ]
    return [DataRecord(tuple(entries), commit_ts_ns=16), DataRecord((_entry(200, Op.CREATE, 0, 0),), commit_ts_ns=17)]


def _active_records() -> list[Record]:
    entries = [_entry(300, Op.CREATE, "a", 1), _entry(301, Op.DELETE, "b", None)]
    return [DataRecord(tuple(entries), commit_ts_ns=18), Checkpoint(19, 302)]


@functools.cache
def seeds() -> tuple[Seed, ...]:
    """Segments 5 (every record type), 6 (a big record), 7 (empty), all archived; 8 active; 9 header only."""
    writer = WalWriter(NODE_ID, segment_size_bytes=1 << 20, buffer_bytes=1 << 16, position=WalPointer(FIRST_SEGMENT, 0))
    plan = [(_all_types_records(), True), (_big_records(), True), ([], True), (_active_records(), False)]
    written: dict[int, tuple[Record, ...]] = {}
    for records, archived in plan:
        segment = writer.segment
        for record in records:
            writer.append_record(record)
        written[segment] = (*records, SegmentEnd()) if archived else tuple(records)
        if archived:
            writer.roll()
    data: dict[int, bytearray] = {}
    for chunk in writer.take():
        buf = data.setdefault(chunk.segment, bytearray())
        if chunk.offset != len(buf):
            raise RuntimeError(f"writer chunks of segment {chunk.segment} are not contiguous: {chunk}")
        buf += chunk.data
    out = [Seed(s, bytes(data[s]), written[s], s != ACTIVE_SEGMENT) for s in CHAIN]
    out.append(Seed(9, encode_header(9, NODE_ID), (), False))
    return tuple(out)


def seed(segment: int) -> Seed:
    return next(s for s in seeds() if s.segment == segment)


# --- frames ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    offset: int
    length: int
    rtype: int
    crc: int

    @property
    def start(self) -> int:
        """Offset of the payload."""
        return self.offset + FRAME_HEADER_SIZE

    @property
    def end(self) -> int:
        return self.start + self.length


def frames(data: bytes | bytearray) -> list[Frame]:
    """The frames after the header that lie wholly inside ``data`` (all of them for a valid segment)."""
    out = []
    off = HEADER_SIZE
    while off + FRAME_HEADER_SIZE <= len(data):
        length, rtype, crc = FRAME_HEADER.unpack_from(data, off)
        frame = Frame(off, length, rtype, crc)
        if frame.end > len(data):
            break
        out.append(frame)
        off = frame.end
    return out


def frame_bytes(payload: bytes, rtype: int) -> bytes:
    return FRAME_HEADER.pack(len(payload), rtype, zlib.crc32(payload)) + payload


def boundaries(data: bytes | bytearray) -> list[int]:
    """Offsets where a frame could be inserted: after the header and after every frame."""
    return [HEADER_SIZE, *(f.end for f in frames(data))] if len(data) >= HEADER_SIZE else [len(data)]


# --- MessagePack snippets that lie or nest -----------------------------------------------------------
_DEPTHS = (2, 64, 500, 900, 1000, 1500, 3000, 20000)
"""Nesting depths around the interpreter's recursion limit (1000), which msgspec's decoder counts against."""


def msgpack_snippet(ch: Chooser) -> bytes:
    """A MessagePack value built to hurt a decoder: deep nesting, lying lengths, odd extensions."""
    depth = pick(ch, _DEPTHS)
    builders: list[Callable[[], bytes]] = [
        lambda: b"\x91" * depth + b"\xc0",  # arrays of one element
        lambda: b"\x81\xc0" * depth + b"\xc0",  # maps {nil: ...}
        lambda: b"\x95\x01\x01\x01\x01" * depth + b"\xc0",  # CacheVersion.other_cluster_version chains
        lambda: b"\xdd\xff\xff\xff\xff",  # array32 of 4G elements
        lambda: b"\xdc\xff\xff" + b"\xc0" * ch.below(8),  # array16 of 65535
        lambda: b"\xdf\xff\xff\xff\xff",  # map32 of 4G pairs
        lambda: b"\xdb\xff\xff\xff\xff" + ch.take(ch.below(8)),  # str32 of 4 GiB
        lambda: b"\xc6\x7f\xff\xff\xff",  # bin32 of 2 GiB
        lambda: b"\xc9\xff\xff\xff\xff\x01",  # ext32 of 4 GiB
        lambda: b"\xd7\xff" + ch.take(8),  # timestamp64
        lambda: b"\xc7\x0c\xff" + ch.take(12),  # timestamp96
        lambda: b"\xcf" + ch.take(8),  # uint64
        lambda: b"\xd3" + ch.take(8),  # int64
        lambda: b"\xcb" + ch.take(8),  # float64 (NaN, inf)
        lambda: b"\xc1",  # never used
        lambda: b"\xa5ab\xff\xfe\x80",  # invalid UTF-8 in a str
        lambda: ch.take(ch.below(24)),
    ]
    return pick(ch, builders)()


_ODD_VALUES: tuple[Any, ...] = (
    None,
    True,
    -1,
    0,
    255,
    2**31,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 40,
    b"",
    b"\x00" * 9,
    [],
    [0],
    {},
    {"k": 1},
)


# --- mutations of valid segments ---------------------------------------------------------------------
Mutator = Callable[[bytearray, Chooser], bytearray]
_INTERESTING_BYTES = (0x00, 0x01, 0x06, 0x07, 0x08, 0x7F, 0x80, 0x90, 0xC0, 0xC1, 0xDD, 0xFF)


def flip_bits(d: bytearray, ch: Chooser) -> bytearray:
    if d:
        for _ in range(1 + ch.below(4)):
            bit = ch.below(len(d) * 8)
            d[bit // 8] ^= 1 << (bit % 8)
    return d


def overwrite_bytes(d: bytearray, ch: Chooser) -> bytearray:
    if d:
        for _ in range(1 + ch.below(4)):
            d[ch.below(len(d))] = pick(ch, _INTERESTING_BYTES) if chance(ch, 2) else ch.below(256)
    return d


def truncate(d: bytearray, ch: Chooser) -> bytearray:
    """Cut anywhere, or within a few bytes of a frame boundary (where readers make off-by-one mistakes)."""
    cut = ch.below(len(d) + 1) if chance(ch, 2) else pick(ch, boundaries(d)) + ch.below(11) - 5
    del d[max(0, cut) :]
    return d


def append_tail(d: bytearray, ch: Chooser) -> bytearray:
    """Bytes after the last frame: zeros (a pre-extended file), garbage, a whole frame, a second SegmentEnd."""
    fs = frames(d)
    tails: list[Callable[[], bytes]] = [
        lambda: bytes(1 + ch.below(64)),
        lambda: ch.take(1 + ch.below(32)),
        lambda: SEGMENT_END_FRAME,
        lambda: _copy_frame(d, pick(ch, fs)) if fs else b"\x00",
        lambda: FRAME_HEADER.pack(ch.below(1 << 32), ch.below(256), ch.below(1 << 32)),
    ]
    d += pick(ch, tails)()
    return d


def _copy_frame(d: bytearray, f: Frame) -> bytes:
    return bytes(d[f.offset : f.end])


def zero_range(d: bytearray, ch: Chooser) -> bytearray:
    """A torn page: a range of zeros in the middle or at the end."""
    if d:
        start = ch.below(len(d))
        n = 1 + ch.below(min(4096, len(d) - start))
        d[start : start + n] = bytes(n)
    return d


def _with_frames(d: bytearray, ch: Chooser, op: Callable[[bytearray, list[Frame]], bytearray]) -> bytearray:
    fs = frames(d)
    return op(d, fs) if fs else flip_bits(d, ch)


def duplicate_frame(d: bytearray, ch: Chooser) -> bytearray:
    def op(d: bytearray, fs: list[Frame]) -> bytearray:
        f = pick(ch, fs)
        at = pick(ch, boundaries(d))
        d[at:at] = d[f.offset : f.end]
        return d

    return _with_frames(d, ch, op)


def swap_frames(d: bytearray, ch: Chooser) -> bytearray:
    def op(d: bytearray, fs: list[Frame]) -> bytearray:
        i, j = sorted((ch.below(len(fs)), ch.below(len(fs))))
        a, b = fs[i], fs[j]
        if i != j:
            d[a.offset : b.end] = d[b.offset : b.end] + d[a.end : b.offset] + d[a.offset : a.end]
        return d

    return _with_frames(d, ch, op)


def drop_frame(d: bytearray, ch: Chooser) -> bytearray:
    def op(d: bytearray, fs: list[Frame]) -> bytearray:
        f = fs[-1] if chance(ch, 3) else pick(ch, fs)  # often the SegmentEnd
        del d[f.offset : f.end]
        return d

    return _with_frames(d, ch, op)


def set_length(d: bytearray, ch: Chooser) -> bytearray:
    """A length field that lies: huge, zero, one off, exactly to EOF, past EOF."""

    def op(d: bytearray, fs: list[Frame]) -> bytearray:
        f = pick(ch, fs)
        choices = (
            0,
            1,
            max(0, f.length - 1),
            f.length + 1,
            len(d) - f.start,
            len(d) - f.start + 1,
            len(d),
            0x7FFFFFFF,
            0x80000000,
            0xFFFFFFF7,
            0xFFFFFFFF,
            ch.below(1 << 32),
        )
        struct.pack_into("<I", d, f.offset, pick(ch, choices) & 0xFFFFFFFF)
        return d

    return _with_frames(d, ch, op)


def set_crc(d: bytearray, ch: Chooser) -> bytearray:
    def op(d: bytearray, fs: list[Frame]) -> bytearray:
        f = pick(ch, fs)
        crc = f.crc ^ (1 << ch.below(32)) if chance(ch, 2) else ch.below(1 << 32)
        struct.pack_into("<I", d, f.offset + 5, crc)
        return d

    return _with_frames(d, ch, op)


def set_type(d: bytearray, ch: Chooser) -> bytearray:
    """The type byte is outside the CRC: another known type, 0, one past the last, anything."""

    def op(d: bytearray, fs: list[Frame]) -> bytearray:
        f = pick(ch, fs)
        d[f.offset + 4] = pick(ch, (*RECORD_TYPES, 0, max(RECORD_TYPES) + 1, 0xFF, ch.below(256), f.rtype ^ 1))
        return d

    return _with_frames(d, ch, op)


def _replace_payload(d: bytearray, f: Frame, payload: bytes) -> bytearray:
    d[f.offset : f.end] = frame_bytes(payload, f.rtype)
    return d


def mutate_payload(d: bytearray, ch: Chooser) -> bytearray:
    """Bytes of one payload changed and the frame's length and CRC fixed, so the decoder sees them."""

    def op(d: bytearray, fs: list[Frame]) -> bytearray:
        f = pick(ch, fs)
        p = bytearray(d[f.start : f.end])
        at = ch.below(len(p) + 1)
        edit = ch.below(5)
        if edit == 0:
            p = flip_bits(p, ch)
        elif edit == 1:
            p = overwrite_bytes(p, ch)
        elif edit == 2:
            p[at:at] = msgpack_snippet(ch)
        elif edit == 3:
            del p[at : at + 1 + ch.below(16)]
        else:
            p[at : at + 1 + ch.below(16)] = msgpack_snippet(ch)
        return _replace_payload(d, f, bytes(p))

    return _with_frames(d, ch, op)


def _tree_slots(tree: Any) -> list[tuple[list[Any] | dict[Any, Any], Any]]:
    """Every (container, index or key) of a decoded MessagePack tree."""
    out: list[tuple[list[Any] | dict[Any, Any], Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            out += [(node, i) for i in range(len(node))]
            stack += node
        elif isinstance(node, dict):
            out += [(node, k) for k in node]
            stack += node.values()
    return out


def mutate_tree(d: bytearray, ch: Chooser) -> bytearray:
    """One field anywhere in a payload (tag, enum, version, key, value, ...) replaced, dropped or extended
    with a well-formed payload around it, so the mutation reaches the typed decoding of that field."""

    def op(d: bytearray, fs: list[Frame]) -> bytearray:
        f = pick(ch, fs)
        try:
            tree = msgspec.msgpack.decode(bytes(d[f.start : f.end]))
        except Exception:  # already damaged by an earlier round (msgspec raises several kinds)
            return mutate_payload(d, ch)
        slots = _tree_slots(tree)
        if not slots or chance(ch, 16):
            tree = msgspec.Raw(msgpack_snippet(ch))  # the whole payload
        else:
            container, key = pick(ch, slots)
            edit = ch.below(4)
            if edit == 0 and isinstance(container, list):
                del container[key]
            elif edit == 1 and isinstance(container, list):
                container.append(pick(ch, _ODD_VALUES))  # a newer writer's extra field
            elif edit == 2:
                container[key] = pick(ch, _ODD_VALUES)
            else:
                container[key] = msgspec.Raw(msgpack_snippet(ch))
        try:
            payload = msgspec.msgpack.encode(tree)
        except (TypeError, ValueError, OverflowError):
            return mutate_payload(d, ch)
        return _replace_payload(d, f, payload)

    return _with_frames(d, ch, op)


def mutate_header(d: bytearray, ch: Chooser) -> bytearray:
    """One header field changed (magic, version, flags, index, node id, CRC), often with the CRC fixed so the
    later checks (version, index) are reached."""
    if len(d) < HEADER_SIZE:
        return flip_bits(d, ch)
    field = ch.below(6)
    if field == 0:
        d[ch.below(8)] = ch.below(256)
    elif field == 1:
        struct.pack_into("<H", d, 8, pick(ch, (0, 2, 0xFFFF, ch.below(1 << 16))))
    elif field == 2:
        struct.pack_into("<H", d, 10, ch.below(1 << 16))
    elif field == 3:
        struct.pack_into("<Q", d, 12, pick(ch, (0, 10**16 - 1, 10**16, 2**64 - 1, ch.below(1 << 64))))
    elif field == 4:
        d[20:36] = ch.take(16)
    else:
        struct.pack_into("<I", d, 36, ch.below(1 << 32))
    if field != 5 and chance(ch, 2):
        struct.pack_into("<I", d, 36, zlib.crc32(d[:36]))
    return d


def torn_tail(d: bytearray, ch: Chooser) -> bytearray:
    """What a crash leaves: the last frame cut short, or whole but with bytes that never reached the disk."""

    def op(d: bytearray, fs: list[Frame]) -> bytearray:
        f = fs[-1]
        if chance(ch, 2):
            del d[f.offset + 1 + ch.below(f.end - f.offset - 1) :]
        else:
            del d[f.end :]
            at = f.start + ch.below(max(1, f.length))
            if at < len(d):
                d[at] ^= 1 + ch.below(255)
        return d

    return _with_frames(d, ch, op)


def splice_seed(d: bytearray, ch: Chooser) -> bytearray:
    """Frames of another segment inserted at a boundary (valid frames in the wrong place)."""
    other = pick(ch, seeds()).data
    fs = frames(other)
    if not fs:
        return d
    a, b = sorted((pick(ch, fs), pick(ch, fs)), key=lambda f: f.offset)
    at = pick(ch, boundaries(d))
    d[at:at] = other[a.offset : b.end]
    return d


MUTATORS: tuple[Mutator, ...] = (
    flip_bits,
    overwrite_bytes,
    truncate,
    append_tail,
    zero_range,
    duplicate_frame,
    swap_frames,
    drop_frame,
    set_length,
    set_crc,
    set_type,
    mutate_payload,
    mutate_tree,
    mutate_tree,  # twice: it is the one that reaches the decoder
    mutate_header,
    torn_tail,
    splice_seed,
)


def mutate(data: bytes, ch: Chooser, rounds: int = 0) -> bytes:
    """``data`` after 1-3 (or ``rounds``) random mutations."""
    d = bytearray(data)
    for _ in range(rounds or 1 + ch.below(3)):
        d = pick(ch, MUTATORS)(d, ch)
    return bytes(d)


# --- generators: a chooser becomes a target's input ----------------------------------------------------
def gen_segment(ch: Chooser) -> bytes:
    """Mostly mutated seeds; sometimes arbitrary bytes, or a valid header followed by arbitrary bytes."""
    kind = ch.below(20)
    if kind == 18:
        return ch.take(ch.below(300))
    if kind == 19:
        header = encode_header(pick(ch, CHAIN), NODE_ID)
        return header + ch.take(ch.below(200))
    return mutate(pick(ch, seeds()).data, ch)


_NAME_SUFFIXES = ("\n", "\r\n", " ", "\t", ".", "~", ".tmp", ".bak", "\x00", "/", ".wal", "\u200b")
_NAME_PREFIXES = (" ", ".", "\n", "x", "./", "dir/", "-", "0")
# Arabic-Indic, fullwidth, mathematical bold, NKo and Malayalam fours are Unicode digits (``\d`` in a str
# regex, and ``int()`` reads them); superscript two is a digit to ``str.isdigit`` but not to ``int()``.
_DIGIT_LOOKALIKES = ("\u0664", "\uff14", "\U0001d7d2", "\u07c4", "\u0d6a", "\u00b2", "a", " ", "-", "+", "_", "\n")
_BAD_SUFFIXES = (".WAL", ".wa", ".wall", "wal", ".wal.wal", "", ".wal.tmp", ".log")


def gen_name(ch: Chooser) -> bytes:
    """A file name near ``%016d.wal``: padded, with look-alike digits, another length or suffix; or random."""
    if chance(ch, 8):
        return ch.take(1 + ch.below(40))
    index = ch.below(10**16) if chance(ch, 2) else ch.below(100)
    name = segment_name(index)
    for _ in range(ch.below(4)):
        edit = ch.below(7)
        at = ch.below(len(name) + 1)
        if edit == 0:
            name += pick(ch, _NAME_SUFFIXES)
        elif edit == 1:
            name = pick(ch, _NAME_PREFIXES) + name
        elif edit == 2:
            name = name[:at] + pick(ch, _DIGIT_LOOKALIKES) + name[at + 1 :]
        elif edit == 3:
            name = name.removesuffix(".wal") + pick(ch, _BAD_SUFFIXES)
        elif edit == 4:
            name = name[:at] + name[at + 1 :]
        elif edit == 5:
            name = name[:at] + name[at : at + 1] * 2 + name[at + 1 :]
        else:
            name = name[:at] + chr(1 + ch.below(0x3000)) + name[at:]
    return os.fsencode(name)


def gen_program(ch: Chooser) -> bytes:
    """Choices for the dir target."""
    return ch.take(16 + ch.below(112))


# --- the scratch dir and the CPU guard -------------------------------------------------------------
SCRATCH_ENV = "CDCD_FUZZ_SCRATCH"
"""Parent dir for scratch dirs: the runner sets it and removes it, since pool workers and libFuzzer children
exit without running atexit hooks."""
_workdirs: dict[int, Path] = {}


def _remove_if_owner(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # a forked child inherits the hook but not the dir
        shutil.rmtree(path, ignore_errors=True)


def workdir() -> Path:
    """This process's scratch dir (per pid: forked workers must not share files), on tmpfs when there is one."""
    pid = os.getpid()
    if pid not in _workdirs:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        path = Path(tempfile.mkdtemp(prefix=f"cdcd-fuzz-{pid}-", dir=os.environ.get(SCRATCH_ENV) or shm))
        atexit.register(_remove_if_owner, path, pid)
        _workdirs[pid] = path
    return _workdirs[pid]


def fresh_dir(name: str) -> Path:
    path = workdir() / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    return path


def _on_cpu_timer(signum: int, frame: FrameType | None) -> None:
    raise FuzzHang(f"case used more than {CASE_CPU_SECONDS} s of CPU")


@contextlib.contextmanager
def hang_guard(seconds: float = CASE_CPU_SECONDS) -> Iterator[None]:
    """Turns a case that spins into ``FuzzFailure("hang")``. SIGPROF counts CPU time, so it neither fires
    while the machine is busy with other work nor clashes with pytest-timeout's SIGALRM."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    if signal.getsignal(signal.SIGPROF) is not _on_cpu_timer:
        signal.signal(signal.SIGPROF, _on_cpu_timer)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    except FuzzHang as exc:
        raise FuzzFailure("hang", f"{exc}\n{traceback.format_exc(limit=-8)}") from None
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)


def _untyped(what: str, exc: BaseException) -> FuzzFailure:
    tb = "".join(traceback.format_exception(exc, limit=-6))
    return FuzzFailure(f"untyped:{type(exc).__name__}", f"{what} raised {exc!r}\n{tb}")


# --- reading one segment -----------------------------------------------------------------------------
@dataclass
class Outcome:
    """Everything observable about one read of a segment."""

    records: list[tuple[WalPointer, Record]]
    error: WalError | None
    end_offset: int
    ended: bool
    torn_tail: bool

    def error_key(self) -> tuple[str, int | None, str] | None:
        e = self.error
        return None if e is None else (type(e).__name__, e.offset, str(e))

    def key(self) -> tuple[Any, ...]:
        return (self.records, self.error_key(), self.end_offset, self.ended, self.torn_tail)

    def describe(self) -> str:
        """``TruncatedSegment@40``, or ``ended:8`` / ``open:3`` / ``torn:3`` (records read)."""
        if self.error is not None:
            return f"{type(self.error).__name__}@{self.error.offset}"
        state = "ended" if self.ended else "torn" if self.torn_tail else "open"
        return f"{state}:{len(self.records)}"


def read_segment(
    path: Path,
    *,
    archived: bool,
    read_buffer_bytes: int = DEFAULT_READ_BUFFER_BYTES,
    start_offset: int = 0,
    skip_types: frozenset[int] = frozenset(),
    lazy_entries: bool = False,
) -> Outcome:
    """Read a whole segment, keeping a typed error as part of the outcome; anything else is a failure."""
    reader = SegmentReader(
        path,
        archived=archived,
        read_buffer_bytes=read_buffer_bytes,
        start_offset=start_offset,
        skip_types=skip_types,
        lazy_entries=lazy_entries,
    )
    records: list[tuple[WalPointer, Record]] = []
    error: WalError | None = None
    try:
        for ptr, record in reader:
            records.append((ptr, record))
    except SEGMENT_ERRORS as exc:
        error = exc
    except (FuzzHang, KeyboardInterrupt):
        raise
    except BaseException as exc:
        what = f"SegmentReader(archived={archived}, read_buffer_bytes={read_buffer_bytes}, start_offset={start_offset})"
        raise _untyped(what, exc) from None
    return Outcome(records, error, reader.end_offset, reader.ended, reader.torn_tail)


def segment_index_of(data: bytes) -> int:
    """The index the header claims, so mutations get past the name check; 7 when there is none to take."""
    if len(data) >= 20:
        (index,) = struct.unpack_from("<Q", data, 12)
        if index < 10**16:
            return int(index)
    return _SEGMENT_FALLBACK


def write_segment(data: bytes, subdir: str = "segment") -> Path:
    directory = workdir() / subdir
    directory.mkdir(exist_ok=True)
    path = directory / segment_name(segment_index_of(data))
    path.write_bytes(data)
    return path


# --- the segment contract -----------------------------------------------------------------------------
def _fail(kind: str, mode: str, detail: str) -> FuzzFailure:
    return FuzzFailure(kind, f"{mode}: {detail}")


def check_chain(o: Outcome, data: bytes, path: Path, *, archived: bool, start: int = 0) -> int:
    """The records are consecutive CRC-checked frames from the start; returns where the chain ends."""
    mode = "archived" if archived else "active"
    segment = int(path.name[:16])
    off = max(start, HEADER_SIZE)
    for i, (ptr, record) in enumerate(o.records):
        if ptr != WalPointer(segment, off) or off + FRAME_HEADER_SIZE > len(data):
            raise _fail("chain", mode, f"record {i} at {ptr}, expected {segment}:{off} (file of {len(data)} bytes)")
        length, rtype, crc = FRAME_HEADER.unpack_from(data, off)
        payload = data[off + FRAME_HEADER_SIZE : off + FRAME_HEADER_SIZE + length]
        if len(payload) != length or zlib.crc32(payload) != crc or rtype != record.TYPE:
            raise _fail("chain", mode, f"record {i} at offset {off} is not the frame there (type {rtype})")
        if type(record) is SegmentEnd and i != len(o.records) - 1:
            raise _fail("chain", mode, f"records after the SegmentEnd at offset {off}")
        off += FRAME_HEADER_SIZE + length
    return off


def check_error(o: Outcome, data: bytes, path: Path, chain_end: int, *, archived: bool) -> None:
    """A typed error names this file and the offset of the first frame not yielded."""
    e = o.error
    mode = "archived" if archived else "active"
    if e is None:
        return
    where = 0 if isinstance(e, BadSegmentHeader) else chain_end
    if e.message.endswith("bytes after SegmentEnd") and not (o.records and type(o.records[-1][1]) is SegmentEnd):
        # Raised before yielding the SegmentEnd frame at chain_end: it names where the extra bytes start.
        where += FRAME_HEADER_SIZE + FRAME_HEADER.unpack_from(data, chain_end)[0]
    if e.path != str(path) or e.offset != where:
        named = f"{type(e).__name__} names {e.path} at {e.offset}"
        raise _fail("error-location", mode, f"{named}, expected {path} at {where}")
    if not str(e).startswith(f"{path} at offset {where}: "):
        raise _fail("error-message", mode, f"message does not start with the file and offset: {e}")
    if isinstance(e, BadSegmentHeader) and o.records:
        raise _fail("error-location", mode, "records before a bad header")
    if isinstance(e, TruncatedSegment) and not archived:
        raise _fail("active-truncated", mode, f"the active segment raised {e}")


def check_clean_end(o: Outcome, data: bytes, chain_end: int, *, archived: bool) -> None:
    """Without an error: an archived segment ended with SegmentEnd at EOF; an active one stopped only at a tail
    that is short, zero-filled, runs past EOF, or is a torn last frame."""
    size = len(data)
    if o.error is not None:
        return
    mode = "archived" if archived else "active"
    if o.end_offset != max(chain_end, HEADER_SIZE) and size >= HEADER_SIZE:
        raise _fail("end-offset", mode, f"end_offset {o.end_offset}, the last record ends at {chain_end}")
    if o.ended:
        if not o.records or type(o.records[-1][1]) is not SegmentEnd or chain_end != size:
            raise _fail("ended", mode, f"ended without a SegmentEnd at EOF ({chain_end} of {size})")
        return
    if archived:
        raise _fail("archived-open-end", mode, f"an archived segment ended at {chain_end} of {size} without SegmentEnd")
    if size < HEADER_SIZE:
        return
    rest = size - chain_end
    if rest < FRAME_HEADER_SIZE:
        tail = "short"
    else:
        length, rtype, crc = FRAME_HEADER.unpack_from(data, chain_end)
        end = chain_end + FRAME_HEADER_SIZE + length
        if length == 0 and rtype == 0:
            tail = "zero"
        elif end > size:
            tail = "past-eof"
        elif end == size and zlib.crc32(data[chain_end + FRAME_HEADER_SIZE :]) != crc:
            tail = "torn"
        else:
            raise _fail("active-stopped-early", mode, f"stopped at {chain_end} before a whole frame (type {rtype})")
    if o.torn_tail != (tail == "torn"):
        raise _fail("torn-flag", mode, f"torn_tail={o.torn_tail} for a {tail} tail at {chain_end}")


def check_modes_agree(arch: Outcome, act: Outcome, size: int) -> None:
    """Archived and active differ only at the tail: the same records, the same errors, and where the active
    segment stops quietly the archived one raises at that very offset."""
    if size < HEADER_SIZE:
        if act.records or act.error is not None or not isinstance(arch.error, BadSegmentHeader):
            raise _fail("modes", "both", f"a {size}-byte file: active {act.describe()}, archived {arch.describe()}")
        return
    if arch.records != act.records:
        raise _fail("modes", "both", f"archived read {len(arch.records)} records, active {len(act.records)}")
    if act.error is not None or act.ended:
        if arch.key()[1:] != act.key()[1:]:
            raise _fail("modes", "both", f"active {act.describe()}, archived {arch.describe()}")
        return
    e = arch.error
    if not isinstance(e, (CorruptRecord, TruncatedSegment)) or e.offset != act.end_offset:
        raise _fail("torn-tail-archived", "both", f"active stops at {act.end_offset}, archived {arch.describe()}")
    if act.torn_tail and not isinstance(e, CorruptRecord):
        raise _fail("torn-tail-archived", "both", f"a torn last frame in an archived segment gave {arch.describe()}")


def check_one_mode(data: bytes, path: Path, *, archived: bool) -> Outcome:
    o = read_segment(path, archived=archived)
    chain_end = check_chain(o, data, path, archived=archived) if len(data) >= HEADER_SIZE else HEADER_SIZE
    check_error(o, data, path, chain_end, archived=archived)
    check_clean_end(o, data, chain_end, archived=archived)
    return o


def check_buffer_independent(data: bytes, path: Path, reference: Outcome, *, archived: bool) -> None:
    """A tiny read buffer (refills inside every frame) gives exactly the default buffer's outcome."""
    size = FRAME_HEADER_SIZE + zlib.crc32(data) % 57 + (0 if archived else 7)
    small = read_segment(path, archived=archived, read_buffer_bytes=size)
    if small.key() != reference.key():
        mode = "archived" if archived else "active"
        got = f"read_buffer_bytes={size}: {small.describe()}"
        raise _fail("buffer-size", mode, f"{got}, default buffer: {reference.describe()}")


def check_resume(data: bytes, path: Path, reference: Outcome) -> None:
    """Reading from a record's offset (how the daemon resumes) yields the rest of the same read."""
    if not reference.records:
        return
    i = len(reference.records) // 2
    start = reference.records[i][0].offset
    o = read_segment(path, archived=True, start_offset=start, read_buffer_bytes=FRAME_HEADER_SIZE + len(data) % 31)
    expected = Outcome(reference.records[i:], reference.error, reference.end_offset, reference.ended, False)
    if o.key() != expected.key():
        raise _fail("resume", "archived", f"from offset {start}: {o.describe()}, expected {expected.describe()}")


def check_skip(path: Path, reference: Outcome) -> None:
    """Skipping DataRecords (a PASSIVE daemon) yields the other records of the same read. Skipped frames are not
    decoded, so an undecodable DataRecord is the one thing skipping may read past."""
    o = read_segment(path, archived=True, skip_types=frozenset({DataRecord.TYPE}))
    expected = [(p, r) for p, r in reference.records if type(r) is not DataRecord]
    e = reference.error
    decode_error = isinstance(e, CorruptRecord) and "undecodable record of type 1" in e.message
    if decode_error:
        assert e is not None and e.offset is not None
        got = [(p, r) for p, r in o.records if p.offset < e.offset]
        if got != expected:
            raise _fail("skip", "archived", f"before the undecodable DataRecord at {e.offset}: {len(got)} records")
        return
    if o.records != expected or o.error_key() != reference.error_key() or o.ended != reference.ended:
        raise _fail("skip", "archived", f"skipping DataRecords: {o.describe()}, reading all: {reference.describe()}")


def check_lazy(path: Path, reference: Outcome) -> None:
    """Entries left undecoded (``lazy_entries``, checked by cdcd/wal/_entries.c) read as the decoded ones: the
    same records, which decode without an error when compared, and the same error at the same offset (its
    words may differ: the C check and msgspec name a bad field each in their own terms)."""
    try:
        o = read_segment(path, archived=True, lazy_entries=True)
        same = o.records == reference.records
    except (FuzzFailure, FuzzHang, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise _untyped("records read with lazy_entries, compared", exc) from None
    e, r = o.error, reference.error
    errors = (type(e).__name__, e.offset if e else None) == (type(r).__name__, r.offset if r else None)
    if not same or not errors or o.ended != reference.ended or o.end_offset != reference.end_offset:
        raise _fail("lazy", "archived", f"entries undecoded: {o.describe()}, decoded: {reference.describe()}")


def check_segment(data: bytes) -> None:
    """Target: ``data`` as a segment file (see the module docstring)."""
    with hang_guard():
        path = write_segment(data)
        try:
            arch = check_one_mode(data, path, archived=True)
            act = check_one_mode(data, path, archived=False)
            check_modes_agree(arch, act, len(data))
            check_buffer_independent(data, path, arch, archived=True)
            check_buffer_independent(data, path, act, archived=False)
            check_resume(data, path, arch)
            check_skip(path, arch)
            check_lazy(path, arch)
        finally:
            path.unlink()


# --- memory -------------------------------------------------------------------------------------------
def _traced_peak(path: Path, *, archived: bool) -> int:
    """Peak traced allocation above the starting point while reading ``path`` (records are dropped as read)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        reader = SegmentReader(path, archived=archived, read_buffer_bytes=MEMORY_READ_BUFFER)
        with contextlib.suppress(*SEGMENT_ERRORS):
            for _ in reader:
                pass
        return tracemalloc.get_traced_memory()[1] - base
    except (FuzzHang, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise _untyped(f"SegmentReader(archived={archived}) under tracemalloc", exc) from None
    finally:
        if started:
            tracemalloc.stop()


def check_memory(data: bytes) -> None:
    """Target: reading ``data`` (cut to 64 KiB) as a segment never allocates more than ``MEMORY_BOUND``."""
    data = data[:MEMORY_MAX_INPUT]
    with hang_guard():
        path = write_segment(data, "memory")
        try:
            for archived in (True, False):
                peak = _traced_peak(path, archived=archived)
                if peak > MEMORY_BOUND:
                    mode = "archived" if archived else "active"
                    raise _fail("memory", mode, f"peak {peak} bytes > bound {MEMORY_BOUND} for a {len(data)}-byte file")
        finally:
            path.unlink()


# --- a directory of segments ----------------------------------------------------------------------------
def strict_scan(dirs: Sequence[Path]) -> dict[int, Path]:
    """The segments a WAL dir holds, by the letter of the format: regular files (not symlinks) named exactly
    16 ASCII digits + ``.wal``; the first dir wins (this is the model ``WalReader`` is compared with)."""
    found: dict[int, Path] = {}
    for d in dirs:
        for name in sorted(os.listdir(d)):
            p = d / name
            if _STRICT_NAME.fullmatch(os.fsencode(name)) and not p.is_symlink() and p.is_file():
                found.setdefault(int(name[:16]), p)
    return found


DirOutcome = tuple[list[tuple[WalPointer, Record]], tuple[str, int | None, str] | None]


def model_wal(dirs: Sequence[Path], start: WalPointer | None, active: int | None) -> DirOutcome:
    """What ``WalReader`` documents: segments in index order from ``start``, a gap is ``MissingSegment``,
    every segment but the active one read as archived."""
    present = strict_scan(dirs)
    records: list[tuple[WalPointer, Record]] = []
    if not present:
        return records, None
    first = min(present) if start is None else start.segment
    for seg in range(first, max(first, max(present)) + 1):
        if seg not in present:
            e = MissingSegment(dirs[0], seg)
            return records, (type(e).__name__, e.offset, str(e))
        offset = start.offset if start is not None and seg == start.segment else 0
        o = read_segment(present[seg], archived=seg != active, start_offset=offset)
        records += o.records
        if o.error is not None:
            return records, o.error_key()
    return records, None


def read_wal(dirs: Sequence[Path], start: WalPointer | None, active: int | None) -> DirOutcome:
    records: list[tuple[WalPointer, Record]] = []
    try:
        for item in WalReader(dirs, start, active_segment=active):
            records.append(item)
    except DIR_ERRORS as exc:
        return records, (type(exc).__name__, exc.offset, str(exc))
    except (FuzzHang, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise _untyped(f"WalReader(start={start}, active_segment={active})", exc) from None
    return records, None


def _place(dirs: Sequence[Path], name: str, data: bytes, ch: Chooser) -> None:
    """Write a segment into the work dir, the archive, or both (then the archive copy differs)."""
    where = ch.below(3)
    if where == 2:
        (dirs[0] / name).write_bytes(data)
        (dirs[1] / name).write_bytes(mutate(data, ch, rounds=1))
    else:
        (dirs[where] / name).write_bytes(data)


def _add_foreign(root: Path, dirs: Sequence[Path], ch: Chooser) -> None:
    """Things a WAL dir may hold that are not segments: odd names, symlinks and dirs named like segments,
    temp files."""
    d = pick(ch, dirs)
    kind = ch.below(4)
    if kind == 0:
        name = gen_name(ch)
        if _creatable(name) and not (d / os.fsdecode(name)).exists():
            (d / os.fsdecode(name)).write_bytes(pick(ch, seeds()).data)
    elif kind == 1:
        target = root / f"target-{ch.below(1 << 30)}"
        target.write_bytes(seed(pick(ch, CHAIN)).data)
        link = d / segment_name(pick(ch, (*CHAIN, 4, 9)))
        if not link.exists() and not link.is_symlink():
            link.symlink_to(target)
    elif kind == 2:
        sub = d / segment_name(pick(ch, (4, 9, 10)))
        if not sub.exists() and not sub.is_symlink():
            sub.mkdir()
    else:
        (d / (segment_name(pick(ch, (4, 9))) + ".tmp")).write_bytes(b"partial")


def _choose_start(ch: Chooser, dirs: Sequence[Path]) -> WalPointer | None:
    kind = ch.below(5)
    if kind == 0:
        return None
    present = strict_scan(dirs)
    segment = pick(ch, sorted(present)) if present and kind < 4 else pick(ch, (*CHAIN, 4, 9))
    if kind == 2 and segment in present:
        offsets = [HEADER_SIZE, *(f.offset for f in frames(present[segment].read_bytes()))]
        return WalPointer(segment, pick(ch, offsets))
    if kind == 3:
        return WalPointer(segment, ch.below(4096))
    return WalPointer(segment, 0)


def check_wal_dir(program: bytes) -> None:
    """Target: ``program`` builds a two-dir WAL (see ``_build_wal``); ``WalReader`` must agree with the model."""
    with hang_guard():
        root = fresh_dir("wal")
        dirs = [root / "wal", root / "archive"]
        for d in dirs:
            d.mkdir()
        ch = ByteChooser(program)
        _build_wal(root, dirs, ch)
        active = pick(ch, (None, ACTIVE_SEGMENT, ACTIVE_SEGMENT, 7, 5, ch.below(12)))
        start = _choose_start(ch, dirs)
        got = read_wal(dirs, start, active)
        expected = model_wal(dirs, start, active)
        if got != expected:
            raise FuzzFailure(
                "wal-dir",
                f"start={start} active={active} files={_listing(dirs)}: WalReader read {len(got[0])} records, "
                f"error {got[1]}; expected {len(expected[0])} records, error {expected[1]}",
            )


def _build_wal(root: Path, dirs: Sequence[Path], ch: Chooser) -> None:
    """The chain of seed segments, each kept, dropped (a gap), mutated or misnamed, plus foreign files."""
    for s in seeds()[: len(CHAIN)]:
        op = ch.below(12)  # 0-7 as written, 8-9 mutated, 10 misnamed, 11 missing
        if op == 11:
            continue
        data = mutate(s.data, ch) if op in (8, 9) else s.data
        index = s.segment + 1 + ch.below(3) if op == 10 else s.segment
        _place(dirs, segment_name(index), data, ch)
    for _ in range(ch.below(4)):
        _add_foreign(root, dirs, ch)


def _listing(dirs: Sequence[Path]) -> list[str]:
    return [f"{d.name}/{name}" for d in dirs for name in sorted(os.listdir(d))]


# --- names --------------------------------------------------------------------------------------------
def _creatable(name: bytes) -> bool:
    return bool(name) and b"/" not in name and b"\x00" not in name and name not in (b".", b"..") and len(name) <= 255


def check_name(data: bytes) -> None:
    """Target: ``data`` as a file name. It names a segment iff it is exactly 16 ASCII digits + ``.wal``:
    ``parse_segment_name``, ``is_segment_name``, ``SegmentReader`` and the directory listing all agree."""
    with hang_guard():
        name = os.fsdecode(data)
        base = os.path.basename(name)
        expected = int(base[:16]) if _STRICT_NAME.fullmatch(os.fsencode(base)) else None
        try:
            got: int | None = parse_segment_name(name)
        except BadSegmentName as exc:
            got = None
            if exc.path != name:
                raise FuzzFailure("name", f"BadSegmentName for {name!r} names {exc.path!r}") from None
        except (FuzzHang, KeyboardInterrupt):
            raise
        except BaseException as exc:
            raise _untyped(f"parse_segment_name({name!r})", exc) from None
        if got != expected:
            raise FuzzFailure("name", f"parse_segment_name({name!r}) = {got}, expected {expected}")
        if is_segment_name(name) != bool(_STRICT_NAME.fullmatch(data)):
            raise FuzzFailure("name", f"is_segment_name({name!r}) = {is_segment_name(name)}")
        if _creatable(data):
            _check_listing(name, expected)


def _check_listing(name: str, expected: int | None) -> None:
    """A file of that name in a dir: listed as its segment, skipped silently (``.tmp``) or refused; and a reader
    refuses it by name, before opening it."""
    d = fresh_dir("names")
    path = d / name
    path.write_bytes(b"")
    found, refused = list_segments(d)
    if expected is not None:
        want: tuple[dict[int, Path], list[Path]] = ({expected: path}, [])
    elif name.endswith(".tmp"):
        want = ({}, [])
    else:
        want = ({}, [path])
    if (found, refused) != want:
        raise FuzzFailure("name-listing", f"list_segments with {name!r}: found {found}, refused {refused}")
    if expected is None:
        try:
            SegmentReader(path)
        except BadSegmentName:
            return
        raise FuzzFailure("name", f"SegmentReader accepted the name {name!r}")


# --- registry -----------------------------------------------------------------------------------------
# --- the lake's row builders ------------------------------------------------------------------------------
COLUMN_WIDTHS = tuple(np.dtype(t).itemsize for t in rows_py.FIXED_DTYPES)
"""Bytes per row of the row builders' fixed-width buffers, in their order."""


def _key_records() -> list[DataRecord]:
    """Keys whose lake text is a tag (docs/lake.md, "Keys"), next to the plain keys they used to share a text
    with: NaN (two bit patterns), the infinities, binary and its base64, maps with '$', int and repeated keys,
    a float32 NaN, timestamps, an extension value, nested tags."""
    nan_bits = b"\xcb\xff\xf8\x00\x00\x00\x00\x00\x00"
    keys: list[Any] = [float("nan"), msgspec.Raw(nan_bits), float("inf"), float("-inf"), None, "null", -0.0, 0.0]
    keys += [1, 1.0, True, "5", 5, b"abc", "YWJj", {"$float": "NaN"}, {"1": "x"}, msgspec.msgpack.Ext(5, b"ab")]
    keys += [[b"x", {"$a": float("nan")}], msgspec.Raw(b"\x81\x01\xa1x"), msgspec.Raw(b"\x82\xa1a\x01\xa1a\x02")]
    keys += [msgspec.Raw(b"\xca\x7f\xc0\x00\x01"), msgspec.Raw(b"\xd6\xff\x65\x92\x00\x80"), "2024-01-01T00:00:00Z"]
    keys += [msgspec.Raw(b"\xd7\xff" + ((1 << 34) | 1).to_bytes(8, "big")), msgspec.Raw(b"\xc7\x0c\xff" + bytes(12))]
    entries = [_entry(400 + i, Op(i % 3), key, None if i % 3 == 2 else {"i": i}) for i, key in enumerate(keys)]
    return [DataRecord(tuple(entries), commit_ts_ns=20)]


@functools.cache
def _rows_seed() -> bytes:
    """Every seed DataRecord packed as the lake packs slices (some starting mid-record, one ending early)."""
    records = [r for r in (*_all_types_records(), *_big_records(), *_key_records()) if isinstance(r, DataRecord)]
    slices = [
        RecordSlice(WalPointer(i, 40 + 8 * i), r, i % len(r.entries), len(r.entries) if i % 2 else None)
        for i, r in enumerate(records)
    ]
    return pack(slices)


def gen_lake_rows(ch: Chooser) -> bytes:
    """Packed slices of the seed records, bytes flipped, overwritten, cut, spliced with MessagePack or appended."""
    d = bytearray(_rows_seed())
    for _ in range(1 + ch.below(3)):
        if chance(ch, 4):
            at = ch.below(len(d) + 1)
            d[at : at + ch.below(4)] = msgpack_snippet(ch)
        else:
            d = pick(ch, (flip_bits, overwrite_bytes, truncate, append_tail))(d, ch)
    return bytes(d)


ROW_ERRORS = (ValueError, TypeError, RecursionError)
"""What a row builder may raise: its own ValueError, the fallback's InvalidValue (a ValueError); the fallback's
TypeError for an extension value or RecursionError for a value nested past msgspec's limit."""


def compare_row_builders(data: bytes) -> tuple[int, tuple[bytes, ...]]:
    """``data`` through the C module and through the Python path (cdcd/lake/landing/rows_py.py): their rows when every
    buffer of both is the same; the C module's error when both fail (each stops at the first fault it meets, so
    the two errors may differ). One failure but not the other, or any buffer that differs, is a FuzzFailure.
    The one difference rows_py documents is let through: C skips a value nested past the recursion limit where
    it only skips, the Python path raises RecursionError (the C rows are returned)."""
    c_rows: tuple[int, tuple[bytes, ...]] | None = None
    try:
        c_rows = _rows.columns(data, to_json_bytes, key_json_bytes)
    except ROW_ERRORS as exc:
        c_error: BaseException = exc
    try:
        py_rows = rows_py.columns(data, to_json_bytes, key_json_bytes)
    except ROW_ERRORS as exc:
        if c_rows is None:
            raise c_error from None
        if isinstance(exc, RecursionError):
            return c_rows
        raise _fail("lake_rows", "python", f"{exc!r} where the C module gave {c_rows[0]} rows") from None
    if c_rows is None:
        raise _fail("lake_rows", "python", f"{py_rows[0]} rows where the C module raised {c_error!r}")
    if c_rows[0] != py_rows[0]:
        raise _fail("lake_rows", "python", f"{py_rows[0]} rows where the C module gave {c_rows[0]}")
    for i, (c_buf, py_buf) in enumerate(zip(c_rows[1], py_rows[1], strict=True)):
        if c_buf != py_buf:
            raise _fail("lake_rows", f"buffer {i}", f"C {c_buf[:40]!r}... Python {py_buf[:40]!r}...")
    return c_rows


def check_lake_rows(data: bytes) -> None:
    """Target: ``data`` as packed record slices for the row builders, the C module (cdcd/lake/landing/_rows.c) and the
    Python path (cdcd/lake/landing/rows_py.py): the same rows from both, buffer for buffer, or an error from both
    (``ROW_ERRORS``); rows come as buffers of exactly ``rows`` values each, and every key and value text is
    valid JSON."""
    with hang_guard():
        try:
            n, buffers = compare_row_builders(data)
        except ROW_ERRORS:
            return
        except (FuzzHang, FuzzFailure, KeyboardInterrupt):
            raise
        except BaseException as exc:
            raise _untyped("row builders", exc) from None
    for i, width in enumerate(COLUMN_WIDTHS):
        if len(buffers[i]) != n * width:
            raise _fail("lake_rows", "columns", f"buffer {i} holds {len(buffers[i])} bytes for {n} rows")
    ops = buffers[0]
    for name, offsets_at, texts_at in (("keys", 13, 14), ("values", 15, 16)):
        offsets = struct.unpack(f"<{n + 1}i", buffers[offsets_at])
        text = buffers[texts_at]
        if offsets[0] != 0 or offsets[-1] != len(text) or any(b < a for a, b in itertools.pairwise(offsets)):
            raise _fail("lake_rows", name, f"offsets {offsets[:8]}... do not cut {len(text)} bytes of text")
        for row in range(n):
            piece = text[offsets[row] : offsets[row + 1]]
            if name == "values" and ops[row] == Op.DELETE:
                if piece:
                    raise _fail("lake_rows", name, f"row {row} is a delete with value text {piece!r}")
                continue
            try:
                msgspec.json.decode(piece)
            except msgspec.DecodeError:
                raise _fail("lake_rows", name, f"row {row}: {piece[:80]!r} is not JSON") from None


@dataclass(frozen=True)
class Target:
    name: str
    check: Callable[[bytes], None]
    generate: Callable[[Chooser], bytes]
    weight: int
    """Share of a run's cases."""


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("segment", check_segment, gen_segment, 70),
        Target("memory", check_memory, gen_segment, 8),
        Target("wal_dir", check_wal_dir, gen_program, 7),
        Target("name", check_name, gen_name, 15),
        Target("lake_rows", check_lake_rows, gen_lake_rows, 10),
    )
}


def run_program(target: Target, program: bytes) -> bytes:
    """How hypothesis and atheris drive a target: their bytes are choices for the generator."""
    data = target.generate(ByteChooser(program))
    target.check(data)
    return data
