"""The lake's Arrow side without Spark: JSON text of keys and values, the columnar table builder
(on the C module and on the Python path: the ``row_builder`` fixture) against a row-by-row reference,
batch splitting, partition directory names and the pyarrow writer."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cdcd.consumer import OP_NAMES, EventBatch, RecordSlice
from cdcd.lake.landing.arrow import SCHEMA, build_table, pack, split_slices, table_from_packed, to_json
from cdcd.lake.landing.spark_write import ship, unship
from cdcd.wal.dump import json_key, jsonable
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheVersion, DataEntry, DataRecord, Op

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()
_json = msgspec.json.Encoder()

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
)
hashable = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
    st.tuples(st.integers(-5, 5), st.text(max_size=3)),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
        st.dictionaries(hashable, inner, max_size=4),
    ),
    max_leaves=12,
)


def reference_json(raw: bytes) -> str:
    """The definition: decode, make every map key a string (``jsonable``), encode."""
    value = _dec.decode(raw)
    if isinstance(value, dict | list):
        value = jsonable(value)
    return _json.encode(value).decode()


@given(values)
@settings(max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
def test_json_text_matches_the_reference_for_any_value(value: Any) -> None:
    """The fast path (msgspec straight from the decoded value) writes the same text as the key-stringifying reference
    (maps whose keys collide as text, like '' and b'', excepted: JSON has no way to keep both apart)."""
    raw = _enc.encode(value)
    assume(not has_colliding_keys(_dec.decode(raw)))
    assert to_json(raw) == reference_json(raw)
    msgspec.json.decode(to_json(raw))  # and it is valid JSON


def has_colliding_keys(value: Any) -> bool:
    if isinstance(value, dict):
        texts = [json_key(k) for k in value]
        return len(set(texts)) < len(texts) or any(has_colliding_keys(v) for v in value.values())
    if isinstance(value, list):
        return any(has_colliding_keys(v) for v in value)
    return False


def make_slices(spec: list[tuple[int, list[tuple[int, int]]]], base_ts_ns: int) -> list[RecordSlice]:
    """One record per ``(start, [(cache_id, op), ...])``; keys and values derived from a running counter."""
    out = []
    k = 0
    for r, (start, entries) in enumerate(spec):
        data = []
        for cache_id, op in entries:
            value: Any = {"k": k, "tags": [k % 3], 7: "int key"}
            if k % 7 == 3:
                value = {(1, "a"): k, True: None}  # JSON cannot hold these keys: the fallback path
            if op == Op.DELETE:
                value = None
            data.append(
                DataEntry(
                    cache_id,
                    Op(op),
                    msgspec.Raw(_enc.encode(k if k % 2 else f"key-{k}")),
                    msgspec.Raw(_enc.encode(value)),
                    k % 16,
                    CacheVersion(k, 1, k % 3, 2),
                    primary=bool(k % 5),
                    expire_time_ms=(1_800_000_000_000 + k) if k % 4 == 1 else 0,
                )
            )
            k += 1
        ts = base_ts_ns + r * 7_200 * 10**9  # two hours apart: batches span days
        out.append(
            RecordSlice(WalPointer(r // 3, 40 + 100 * r), DataRecord(tuple(data), ts), min(start, len(data) - 1))
        )
    return out


def reference_rows(slices: list[RecordSlice], names: EventBatch, source: str) -> list[dict[str, Any]]:
    rows = []
    for s in slices:
        for i in range(s.start, len(s.record.entries)):
            e = s.record.entries[i]
            ts = datetime.fromtimestamp(s.record.commit_ts_ns // 1000 / 1e6, UTC)
            rows.append(
                {
                    "op": OP_NAMES[e.op],
                    "key": reference_json(bytes(e.key)),
                    "value": None if e.op == Op.DELETE else reference_json(bytes(e.value)),
                    "partition": e.partition,
                    "primary": e.primary,
                    "version_order": e.version.order,
                    "version_cluster_id": e.version.cluster_id,
                    "node_order": e.version.node_order,
                    "topology_version": e.version.topology_version,
                    "commit_ts": ts,
                    "source_node": source,
                    "wal_segment": s.pointer.segment,
                    "wal_offset": s.pointer.offset,
                    "wal_index": i,
                    "expire_time_ms": e.expire_time_ms,
                    "cache": names.cache_name(e.cache_id),
                    "source_generation": 0,
                    "day": ts.strftime("%Y-%m-%d"),
                }
            )
    return rows


records = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.lists(st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([0, 1, 2])), min_size=1, max_size=6),
    ),
    min_size=1,
    max_size=30,
)


@pytest.mark.usefixtures("row_builder")
@given(records, st.integers(1_600_000_000, 1_900_000_000))
@settings(max_examples=200, deadline=None)
def test_columnar_table_equals_a_row_by_row_build(spec: list[Any], base_s: int) -> None:
    """build_table gives, row for row, what a plain per-entry loop gives, and the right per-cache rows and max times."""
    slices = make_slices(spec, base_s * 10**9)
    names = EventBatch("node-a", slices, {1: "orders", 2: "a/b:c"})
    table, stats = build_table(slices, names, "node-a", partition_by_day=True)
    expected = reference_rows(slices, names, "node-a")
    assert table.schema == SCHEMA.append(pa.field("day", pa.string()))
    assert table.to_pylist() == expected
    want: dict[str, tuple[int, int]] = {}
    for s in slices:
        for e in s.record.entries[s.start :]:
            rows, ts = want.get(names.cache_name(e.cache_id), (0, 0))
            want[names.cache_name(e.cache_id)] = (rows + 1, max(ts, s.record.commit_ts_ns))
    assert stats == want
    plain, _ = build_table(slices, names, "node-a", partition_by_day=False)
    assert plain.schema == SCHEMA
    assert plain.to_pylist() == [{k: v for k, v in row.items() if k != "day"} for row in expected]


@pytest.mark.usefixtures("row_builder")
@given(records, st.booleans())
@settings(max_examples=100, deadline=None)
def test_records_shipped_to_a_spark_task_build_the_same_rows(spec: list[Any], by_day: bool) -> None:
    """What a Spark writer task receives (the slices, MessagePack + zstd) decodes to the very slices,
    and the rows the task builds from them equal the ones built from the originals."""
    slices = make_slices(spec, 1_700_000_000 * 10**9)
    names = EventBatch("node-a", slices, {1: "orders", 2: "a/b:c"})
    received = unship(ship(slices))
    assert received == pack(slices)
    direct, _ = build_table(slices, names, "node-a", by_day)
    there, _ = table_from_packed(received, names.cache_names, "node-a", by_day)
    assert there.equals(direct)


@given(records, st.integers(1, 6), st.integers(1, 40))
def test_split_keeps_every_entry_in_order_within_the_bounds(spec: list[Any], parts: int, min_rows: int) -> None:
    """split_slices cuts only between records, keeps their order and never makes more or smaller parts than asked."""
    slices = make_slices(spec, 0)
    total = sum(len(s.record.entries) - s.start for s in slices)
    out = split_slices(slices, parts, min_rows)
    assert [s for part in out for s in part] == slices
    assert all(out)
    assert len(out) <= max(1, min(parts, total // min_rows))


@given(st.lists(st.text(min_size=1, max_size=255), min_size=1, max_size=20, unique=True))
def test_delta_partition_directories_are_safe_short_and_distinct(names: list[str]) -> None:
    """Any cache name (any characters, up to 255 of them, 4 bytes each) gets a partition directory value that is a
    plain name of at most 64 ASCII bytes ('cache=' plus it fits any file system), the same every time, and one per
    name; Delta keeps the real name in the log."""
    from cdcd.lake.landing.delta import partition_dir_value

    dirs = [partition_dir_value(n) for n in names]
    for d in dirs:
        assert d.isascii() and len(d) <= 64 and d[0] not in "._-" and all(c.isalnum() or c in "._-" for c in d)
    assert dirs == [partition_dir_value(n) for n in names]
    assert len(set(dirs)) == len(dirs)
