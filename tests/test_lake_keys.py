"""Distinct node keys stay distinct in the lake (issue 28, item 5; docs/lake.md, "Keys").

The key text (``jsontext.key_json_bytes``) has a left inverse, so no two MessagePack keys share a text: on
generated keys (NaN of any bits, the infinities, -0.0, nil, binary next to its base64 text, ints, floats and
bools that print alike, maps with non-string, repeated and ``$`` keys, timestamps, extension values). The C
module writes the same bytes, the two row builders the same buffers. End to end: a node holding every pair
that used to collide, landed by ``cdcd run``, compacted by Spark into ``state`` and the typed tables, is one
row per node key with its value, and ``cdcd lake verify`` agrees; then again after updates and deletes of
those keys (compaction's MERGE, and a typed table's key turning into JSON text)."""

from __future__ import annotations

import base64
import json
import struct
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.consumer import RecordSlice
from cdcd.lake.landing import _rows
from cdcd.lake.landing.arrow import key_to_json, pack, to_json
from cdcd.lake.landing.jsontext import KEY_MAX_NESTING, key_json_bytes, to_json_bytes
from cdcd.lake.typed.infer import decode_all, key_type
from cdcd.node.writes import MAX_NESTING, key_encoder
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheVersion, DataEntry, DataRecord, Op
from tests.support.wal_fuzz import compare_row_builders

_enc = msgspec.msgpack.Encoder()
_json_dec = msgspec.json.Decoder()


def _bits(hex_bits: str) -> float:
    return float(struct.unpack(">d", bytes.fromhex(hex_bits))[0])


NEG_NAN = _bits("fff8000000000000")
"""The NaN x86 arithmetic makes (inf - inf): sign bit set, a key of its own on the node."""

DOCUMENTED: list[tuple[str, Any, str]] = [
    ("nil", None, "null"),
    ("NaN", float("nan"), '{"$float":"NaN"}'),
    ("a NaN with the sign bit", NEG_NAN, '{"$float":"NaN:fff8000000000000"}'),
    ("+inf", float("inf"), '{"$float":"Infinity"}'),
    ("-inf", float("-inf"), '{"$float":"-Infinity"}'),
    ("-0.0", -0.0, "-0.0"),
    ("0.0", 0.0, "0.0"),
    ("1", 1, "1"),
    ("1.0", 1.0, "1.0"),
    ("True", True, "true"),
    ("'5'", "5", '"5"'),
    ("5", 5, "5"),
    ("'null'", "null", '"null"'),
    ("b'abc'", b"abc", '{"$binary":"YWJj"}'),
    ("'YWJj'", "YWJj", '"YWJj"'),
    ("[1, 2]", [1, 2], "[1,2]"),
    ("'[1,2]'", "[1,2]", '"[1,2]"'),
    ("{'1': 'x'}", {"1": "x"}, '{"1":"x"}'),
    ("{'$float': 'NaN'}", {"$float": "NaN"}, '{"$map":[["$float","NaN"]]}'),
    ("{'$binary': 'YWJj'}", {"$binary": "YWJj"}, '{"$map":[["$binary","YWJj"]]}'),
    ("a datetime", datetime(2024, 1, 1, tzinfo=UTC), '{"$date":"2024-01-01T00:00:00Z"}'),
    ("'2024-01-01T00:00:00Z'", "2024-01-01T00:00:00Z", '"2024-01-01T00:00:00Z"'),
    ("an extension value", msgspec.msgpack.Ext(5, b"ab"), '{"$ext":[5,"YWI="]}'),
]
"""(what, node key, lake key text): the table in docs/lake.md, pairs that used to collide side by side."""

INT_KEYED = b"\x81\x01\xa1x"
"""{1: "x"}: a map with an int key, which the node's key encoder refuses but a WAL can hold."""
INT_KEYED_TEXT = '{"$map":[[1,"x"]]}'


def test_the_documented_keys_have_the_documented_texts_all_distinct() -> None:
    texts = [key_to_json(key_encoder.encode(key)) for _, key, _ in DOCUMENTED]
    assert texts == [text for _, _, text in DOCUMENTED]
    assert key_to_json(INT_KEYED) == INT_KEYED_TEXT and to_json(INT_KEYED) == '{"1":"x"}'
    assert len({*texts, INT_KEYED_TEXT}) == len(DOCUMENTED) + 1
    docs = (Path(__file__).parent.parent / "docs" / "lake.md").read_text()
    for _, _, text in DOCUMENTED:
        assert f"`{text}`" in docs, f"docs/lake.md does not show the key text {text}"
    assert f"`{INT_KEYED_TEXT}`" in docs


def test_values_keep_their_plain_json_text() -> None:
    """Only keys are tagged: a value NaN is still null, bytes base64 text (docs/lake.md says so)."""
    assert to_json(_enc.encode([float("nan"), b"abc", {"$x": 1}])) == '[null,"YWJj",{"$x":1}]'


# --- the inverse: key text -> the very MessagePack bytes ---------------------------------------------------
def _header(n: int, fix: int, short: int) -> bytes:
    if n < 16:
        return bytes([fix | n])
    return bytes([short]) + n.to_bytes(2, "big") if n < 1 << 16 else bytes([short + 1]) + n.to_bytes(4, "big")


def array_of(items: list[bytes]) -> bytes:
    return _header(len(items), 0x90, 0xDC) + b"".join(items)


def map_of(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return _header(len(pairs), 0x80, 0xDE) + b"".join(k + v for k, v in pairs)


_FLOATS = {"NaN": "7ff8000000000000", "Infinity": "7ff0000000000000", "-Infinity": "fff0000000000000"}


def from_key_text(obj: Any) -> bytes:
    """The MessagePack (canonical: smallest headers, float64) of a decoded key text, by the documented
    rules alone: that it exists and gives back every key's bytes is what makes the mapping injective."""
    if isinstance(obj, dict):
        names = list(obj)
        if any(n.startswith("$") for n in names):
            assert len(names) == 1, f"a tag object has one member: {obj}"
            tag, arg = names[0], obj[names[0]]
            if tag == "$float":
                bits = _FLOATS.get(arg) or arg.removeprefix("NaN:")
                return b"\xcb" + bytes.fromhex(bits)
            if tag == "$binary":
                return _enc.encode(base64.b64decode(arg, validate=True))
            if tag == "$map":
                return map_of([(from_key_text(k), from_key_text(v)) for k, v in arg])
            if tag == "$date":
                return _enc.encode(datetime.fromisoformat(arg))
            assert tag == "$ext", tag
            return _enc.encode(msgspec.msgpack.Ext(arg[0], base64.b64decode(arg[1], validate=True)))
        return map_of([(_enc.encode(k), from_key_text(v)) for k, v in obj.items()])
    if isinstance(obj, list):
        return array_of([from_key_text(x) for x in obj])
    return _enc.encode(obj)


def float_bits(bits: int) -> bytes:
    return b"\xcb" + bits.to_bytes(8, "big")


TAG_NAMES = st.sampled_from(["$float", "$binary", "$map", "$date", "$ext", "$", "$$float", "1"])
raw_scalars = st.one_of(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=6),
        st.binary(max_size=6),
        TAG_NAMES,
        st.sampled_from(["NaN", "Infinity", "YWJj", "null", "1", "1.0", "true"]),
        st.datetimes(timezones=st.just(UTC)),
        st.builds(msgspec.msgpack.Ext, st.integers(-128, 127).filter(lambda c: c != -1), st.binary(max_size=17)),
    ).map(_enc.encode),
    st.integers(0, 2**64 - 1).map(float_bits),  # every double, NaN payloads included
    st.sampled_from([float_bits(0x7FF8000000000000), float_bits(0xFFF8000000000000), float_bits(1 << 63)]),
)
raw_keys = st.recursive(
    raw_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(array_of),
        # any keys, repeated ones too (a map JSON cannot hold as an object)
        st.lists(st.tuples(inner, inner), max_size=4).map(map_of),
        st.lists(st.tuples(st.one_of(TAG_NAMES, st.text(max_size=2)).map(_enc.encode), inner), max_size=4).map(map_of),
    ),
    max_leaves=10,
)
"""MessagePack keys as bytes, in canonical form (what an encoder writes, not every byte string that decodes)."""

node_objects = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=6),
        st.binary(max_size=6),
        TAG_NAMES,
        st.datetimes(timezones=st.just(UTC)),
    ),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3) | TAG_NAMES, inner, max_size=3)
    ),
    max_leaves=8,
)
"""Python keys as a node takes them (``Cache.put``), encoded by the node's own key encoder."""


@given(raw_keys)
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_key_text_gives_back_the_key_bytes_so_distinct_keys_have_distinct_texts(raw: bytes) -> None:
    text = key_json_bytes(raw)
    assert from_key_text(_json_dec.decode(text)) == raw
    assert _rows.key_json(raw, key_json_bytes) == text


@given(node_objects)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_key_a_node_takes_comes_back_from_its_text(key: Any) -> None:
    raw = key_encoder.encode(key)
    text = key_json_bytes(raw)
    assert from_key_text(_json_dec.decode(text)) == raw
    assert _rows.key_json(raw, key_json_bytes) == text


@given(st.lists(raw_keys, min_size=2, max_size=6, unique=True))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_distinct_keys_never_share_a_text(raws: list[bytes]) -> None:
    assert len({key_json_bytes(r) for r in raws}) == len(raws)


plain_keys = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(),
    ),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6).filter(lambda k: not k.startswith("$")), inner, max_size=20)
    ),
    max_leaves=20,
)


@given(plain_keys)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_plain_keys_are_written_as_values_are_and_in_c_alone(key: Any) -> None:
    """Ordinary keys read as ordinary JSON: the very text of the value path, without the Python fallback."""
    raw = _enc.encode(key)

    def refuse(raw: bytes) -> bytes:
        raise AssertionError(f"the key fallback was called for {raw!r}")

    assert _rows.key_json(raw, refuse) == to_json_bytes(raw) == key_json_bytes(raw)


@pytest.mark.parametrize(
    "raw",
    [
        float_bits(0x7FF8000000000000),
        float_bits(0xFFF8000000000001),
        float_bits(0x7FF0000000000000),
        _enc.encode(b"\x00\xff"),
        _enc.encode({"a": [b"x", float("-inf")]}),
    ],
    ids=["NaN", "NaN payload", "inf", "binary", "nested"],
)
def test_c_writes_the_common_tags_itself(raw: bytes) -> None:
    def refuse(raw: bytes) -> bytes:
        raise AssertionError(f"the key fallback was called for {raw!r}")

    assert _rows.key_json(raw, refuse) == key_json_bytes(raw)


@pytest.mark.parametrize(
    "raw",
    [
        _enc.encode({"$a": 1}),
        INT_KEYED,
        map_of([(b"\xa1a", b"\x01"), (b"\xd9\x01a", b"\x02")]),
        b"\xca\x7f\xc0\x00\x00",
        b"\xca\xff\x80\x00\x01",
        _enc.encode(datetime(1, 1, 1, tzinfo=UTC)),
        b"\xd6\xff\x00\x00\x00\x01",
        b"\xd7\xff" + ((999_999_999 << 34) | 1).to_bytes(8, "big"),
        b"\xd7\xff" + ((10**9 << 34) | 1).to_bytes(8, "big"),
        b"\xc7\x0c\xff" + (5).to_bytes(4, "big") + (2**40).to_bytes(8, "big"),
        b"\x91" * 100 + b"\x01",
    ],
    ids=[
        "$ key",
        "int key",
        "repeated key",
        "float32 NaN",
        "float32 NaN payload",
        "year 1",
        "ts32",
        "ts64 nanos",
        "ts64 bad nanos",
        "ts96 beyond year 9999",
        "deep",
    ],
)
def test_keys_handed_to_the_fallback_get_its_text_once(raw: bytes) -> None:
    calls: list[bytes] = []

    def fallback(raw: bytes) -> bytes:
        calls.append(raw)
        return key_json_bytes(raw)

    text = _rows.key_json(raw, fallback)
    assert calls == [raw] and text == key_json_bytes(raw)
    msgspec.json.decode(text)


def test_timestamps_read_exactly() -> None:
    ts64 = b"\xd7\xff" + ((999_999_999 << 34) | 1).to_bytes(8, "big")
    assert key_json_bytes(ts64) == b'{"$date":"1970-01-01T00:00:01.999999999Z"}'
    bad = b"\xd7\xff" + ((10**9 << 34) | 1).to_bytes(8, "big")
    assert key_json_bytes(bad) == b'{"$ext":[-1,"7msoAAAAAAE="]}'
    assert key_json_bytes(_enc.encode(datetime(1, 1, 1, tzinfo=UTC))) == b'{"$date":"0001-01-01T00:00:00Z"}'


def test_nesting_is_bounded_as_on_the_node() -> None:
    assert KEY_MAX_NESTING == MAX_NESTING
    assert key_json_bytes(b"\x91" * MAX_NESTING + b"\x01") == b"[" * MAX_NESTING + b"1" + b"]" * MAX_NESTING
    with pytest.raises(ValueError, match=f"key nested deeper than {MAX_NESTING} levels"):
        key_json_bytes(b"\x91" * (MAX_NESTING + 1) + b"\x01")
    with pytest.raises(ValueError, match="nested deeper"):
        _rows.key_json(b"\x91" * (MAX_NESTING + 1) + b"\x01", key_json_bytes)


@pytest.mark.parametrize(
    ("raw", "what"),
    [(b"\x92\x01", "truncated"), (b"\xc1", "0xc1"), (b"\x01\x02", "trailing"), (b"\xa3ab", "truncated")],
)
def test_malformed_keys_raise_value_error_naming_the_byte(raw: bytes, what: str) -> None:
    with pytest.raises(ValueError, match=rf"^MessagePack key at byte \d+: .*{what}"):
        key_json_bytes(raw)


def _record(keys: list[bytes]) -> DataRecord:
    entries = tuple(
        DataEntry(
            1,
            Op(1 + i % 2),
            msgspec.Raw(k),
            msgspec.Raw(b"\xc0" if i % 2 else _enc.encode(i)),
            0,
            CacheVersion(i, 1, 1, 1),
        )
        for i, k in enumerate(keys)
    )
    return DataRecord(entries, 1_700_000_000 * 10**9)


@given(st.lists(raw_keys, min_size=1, max_size=8))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_both_row_builders_write_the_same_key_column(keys: list[bytes]) -> None:
    n, buffers = compare_row_builders(pack([RecordSlice(WalPointer(0, 64), _record(keys))]))
    offsets = struct.unpack(f"<{n + 1}i", buffers[13])
    texts = [buffers[14][offsets[i] : offsets[i + 1]] for i in range(n)]
    assert texts == [key_json_bytes(k) for k in keys]


# --- typed tables: which keys a key column may type ---------------------------------------------------------
@pytest.mark.parametrize(
    ("keys", "typed"),
    [
        ([1, 2, 3], pa.int64()),
        ([0.0, 1.5], pa.float64()),
        ([0.0, -0.0], None),
        ([-0.0], None),
        ([1.5, float("nan")], None),
        ([float("inf")], None),
        (["a", "YWJj"], pa.string()),
        (["YWJj", b"abc"], None),
        ([1, 1.0], None),
        ([1, True], None),
        (["5", 5], None),
    ],
)
def test_a_key_column_is_typed_only_for_keys_of_one_plain_scalar_type(keys: list[Any], typed: Any) -> None:
    texts = [key_to_json(key_encoder.encode(k)) for k in keys]
    assert key_type(decode_all(texts)) == typed  # type: ignore[arg-type]


# --- end to end: node -> cdcd run -> changes -> Spark compaction -> state, typed tables; verify ---------------
def _node_keys() -> dict[str, list[tuple[Any, str]]]:
    """Per cache, (key, value) as the test puts them: the value names the key."""
    mixed = [(key, what) for what, key, _ in DOCUMENTED]
    return {
        "mixed": mixed,
        "floats": [(0.0, "zero"), (1.5, "one and a half"), (2.5, "two and a half")],
        "ints": [(i, f"int {i}") for i in range(1, 6)],
        "nan": [(float("nan"), "NaN"), (1.5, "one and a half")],
    }


def _state(lake: Path) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for row in DeltaTable(str(lake / "state")).to_pyarrow_table(columns=["cache", "key", "value"]).to_pylist():
        out.setdefault(row["cache"], []).append((row["key"], row["value"]))
    return {cache: sorted(rows) for cache, rows in out.items()}


def _node_state(node_dir: Path) -> dict[str, list[tuple[str, str]]]:
    from cdcd.node import Node

    with Node.open(node_dir) as node:
        return {c: sorted((key_to_json(k), to_json(v)) for k, v in node.raw_items(c)) for c in node.caches()}


def _typed_keys(lake: Path, cache: str) -> tuple[pa.DataType, list[Any]]:
    table = DeltaTable(str(lake / "tables" / cache)).to_pyarrow_table(columns=["key"])
    return table.schema.field("key").type, sorted(table.column("key").to_pylist())


def _land_compact_verify(tmp_path: Path, node_dir: Path, lake: Path, run: str, spark: Any) -> str:
    from cdcd.lake.maintenance.compact import compact
    from tests.support.delta_lake import lake_consumer
    from tests.support.lake import wait_caught_up, wait_started, write_config
    from tests.support.procs import cdcd, start_daemon, stop_daemon

    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake))
    err = tmp_path / f"daemon-{run}.err"
    proc = start_daemon(config, err)
    try:
        wait_started(proc, err)
        wait_caught_up(proc, config, node_dir, err, 300)
    finally:
        assert stop_daemon(proc, timeout=60) == 0, err.read_text()[-3000:]
    # The worker's session, not `cdcd lake compact`: the same function without a JVM start per run
    # (tests/test_lake.py runs the command end to end).
    compact(spark, lake)
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.splitlines()[-1]


@pytest.mark.timeout(1800)  # two daemon runs and two Spark compactions on a loaded 2-core machine
def test_colliding_keys_land_compact_and_verify_as_one_row_each(tmp_path: Path, spark: Any) -> None:
    from cdcd.node import Node
    from tests.support.delta_lake import wal_batch

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    keys = _node_keys()
    with Node.open(node_dir) as node:
        for cache, items in keys.items():
            c = node.cache(cache)
            for key, value in items:
                c.put(key, value)
        # A map with an int key: the node's key encoder refuses it, a WAL can hold it (written raw).
        info = node.cache("mixed").info
        node.writes.write([(info, INT_KEYED, msgspec.Raw(_enc.encode("{1: 'x'}")), 0, None)], now=1)
    # The real WAL through both row builders: the same buffers.
    compare_row_builders(pack(wal_batch(node_dir).peek_slices()))

    last = _land_compact_verify(tmp_path, node_dir, lake, "first", spark)
    n_keys = sum(len(items) for items in keys.values()) + 1
    assert last == f"verified: {n_keys:,} keys, OK"
    state = _state(lake)
    assert state == _node_state(node_dir)
    mixed = dict(state["mixed"])
    assert len(mixed) == len(keys["mixed"]) + 1, "one state row per node key"
    for what, _, text in DOCUMENTED:
        assert mixed[text] == json.dumps(what), what
    assert mixed[INT_KEYED_TEXT] == "\"{1: 'x'}\""
    assert _typed_keys(lake, "ints") == (pa.int64(), [1, 2, 3, 4, 5])
    assert _typed_keys(lake, "floats") == (pa.float64(), [0.0, 1.5, 2.5])
    assert _typed_keys(lake, "nan") == (pa.string(), sorted(['{"$float":"NaN"}', "1.5"]))
    assert _typed_keys(lake, "mixed") == (pa.string(), sorted(mixed))

    # Updates and deletes of keys that used to collide, and -0.0 next to 0.0 in a typed DOUBLE key.
    with Node.open(node_dir) as node:
        c = node.cache("mixed")
        for key in (None, float("nan"), -0.0, True, "YWJj", datetime(2024, 1, 1, tzinfo=UTC)):
            c.put(key, "updated")
        for key in (b"abc", float("inf"), {"$float": "NaN"}, 1.0):
            assert c.remove(key)
        node.cache("floats").put(-0.0, "minus zero")
    last = _land_compact_verify(tmp_path, node_dir, lake, "second", spark)
    assert last == f"verified: {n_keys - 4 + 1:,} keys, OK"
    state = _state(lake)
    assert state == _node_state(node_dir)
    mixed = dict(state["mixed"])
    assert len(mixed) == len(keys["mixed"]) + 1 - 4
    for text in ("null", '{"$float":"NaN"}', "-0.0", "true", '"YWJj"', '{"$date":"2024-01-01T00:00:00Z"}'):
        assert mixed[text] == '"updated"', text
    for text in ('{"$binary":"YWJj"}', '{"$float":"Infinity"}', '{"$map":[["$float","NaN"]]}', "1.0"):
        assert text not in mixed, text
    assert mixed['{"$float":"NaN:fff8000000000000"}'] == json.dumps("a NaN with the sign bit")
    assert (
        mixed["0.0"] == '"0.0"'
        and mixed["1"] == '"1"'
        and mixed['"2024-01-01T00:00:00Z"'] == json.dumps("'2024-01-01T00:00:00Z'")
    )
    assert dict(state["floats"]) == {"0.0": '"zero"', "-0.0": '"minus zero"', "1.5": '"one and a half"'} | {
        "2.5": '"two and a half"'
    }
    # The floats table's key became JSON text (rebuilt from state), one row per key.
    assert _typed_keys(lake, "floats") == (pa.string(), sorted(["0.0", "-0.0", "1.5", "2.5"]))
    assert _typed_keys(lake, "mixed") == (pa.string(), sorted(mixed))
