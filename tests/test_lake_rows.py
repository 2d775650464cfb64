"""The lake's C module (cdcd/lake/_rows.c) against its definition: the JSON text of any key or value
is byte for byte what ``jsontext.to_json_bytes`` writes, the common values never take the Python
fallback, records decode to the right columns whatever extra fields a later schema appends, and a
malformed input raises ValueError naming the byte offset (never a crash, never rows made up)."""

from __future__ import annotations

import random
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.consumer import RecordSlice
from cdcd.lake import _rows
from cdcd.lake.arrow import pack, table_from_packed
from cdcd.lake.jsontext import to_json_bytes
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheVersion, DataEntry, DataRecord, Op

_enc = msgspec.msgpack.Encoder()


class Calls:
    """A fallback that records what it was handed."""

    def __init__(self) -> None:
        self.raws: list[bytes] = []

    def __call__(self, raw: bytes) -> bytes:
        self.raws.append(raw)
        return to_json_bytes(raw)


def refuse(raw: bytes) -> bytes:
    raise AssertionError(f"the fallback was called for {raw!r}")


def native(raw: bytes, fallback: Any = to_json_bytes) -> bytes:
    return _rows.to_json(raw, fallback)


# --- values the C code writes itself -----------------------------------------------------------------
common_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**40), 2**40).map(lambda i: i / 4),
    st.integers(-(2**53), 2**53).map(lambda i: i / 1024),
    st.text(),
    st.binary(),
)
common_values = st.recursive(
    common_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=20)),
    max_leaves=30,
)


@given(common_values)
@settings(max_examples=3000, suppress_health_check=[HealthCheck.too_slow])
def test_common_values_are_written_in_c_exactly_as_msgspec_writes_them(value: Any) -> None:
    """None, bools, any int, any double (NaN and infinities as null), UTF-8 text with every escape, bytes as
    base64, lists, maps with distinct string keys (more than 16 too): the very bytes of the Python path,
    with the fallback never called."""
    raw = _enc.encode(value)
    assert native(raw, refuse) == to_json_bytes(raw)


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=3000)
def test_float32_values_match(bits: int) -> None:
    raw = b"\xca" + struct.pack(">I", bits)
    assert native(raw, refuse) == to_json_bytes(raw)


def test_doubles_near_the_notation_switches_match() -> None:
    """msgspec's own notation rules (decimal from 1e-5 up to 1e16, '1e16' / '1e-7' exponents) and the
    dtoa-free shortcut for m * 2^-n, on a million doubles around their edges."""
    rng = random.Random(1)
    values = [0.0, -0.0, 5e-324, 2.0**53, 2.0**53 - 1, 2.0**53 + 2, 1e15 + 0.25, 1e16, 1e-5, 1e-6, 0.1, 0.5]
    for _ in range(200_000):
        values.append(rng.randint(-(2**53), 2**53) / 2 ** rng.randint(0, 14))
        values.append(rng.random() * 10 ** rng.randint(-9, 22))
        values.append(struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0])
        values.append(float(rng.randint(-(10**17), 10**17)) / 10 ** rng.randint(0, 20))
        values.append(rng.randint(1, 2**20) * 2.0 ** rng.randint(-60, 60))
    for v in values:
        raw = _enc.encode(v)
        assert native(raw, refuse) == to_json_bytes(raw), repr(v)


# --- values handed to the fallback ------------------------------------------------------------------
def _map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(k + v for k, v in pairs)


FALLBACK_CASES = {
    "int keys": _enc.encode({1: "a", 2: "b"}),
    "tuple and bool keys": _enc.encode({(1, "a"): 1, True: None}),
    "bytes keys": _enc.encode({b"ab": 1}),
    "a repeated key": _map([(b"\xa1a", b"\x01"), (b"\xa1b", b"\x02"), (b"\xa1a", b"\x03")]),
    "a key repeated in another encoding": _map([(b"\xa1a", b"\x01"), (b"\xd9\x01a", b"\x02")]),
    "a repeated key in a big map": _enc.encode({f"k{i}": i for i in range(40)})[:-5] + b"\xa2k0\x07",
    "a timestamp": b"\xd6\xff\x00\x00\x00\x01",
    "nesting deeper than 64": b"\x91" * 100 + b"\x01",
}


@pytest.mark.parametrize("name", sorted(FALLBACK_CASES))
def test_values_the_c_code_does_not_write_go_through_the_fallback_once(name: str) -> None:
    raw = FALLBACK_CASES[name]
    calls = Calls()
    assert native(raw, calls) == to_json_bytes(raw)
    assert calls.raws == [raw]


def test_a_repeated_key_keeps_python_semantics() -> None:
    """msgspec keeps the last value of a repeated key at the first one's place; a plain transcoder would not."""
    raw = _map([(b"\xa1a", b"\x01"), (b"\xa1b", b"\x02"), (b"\xa1a", b"\x03")])
    assert native(raw) == b'{"a":3,"b":2}'


@pytest.mark.parametrize(
    "bad",
    [b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80", b"a\xe2\x82", b"\xf0\x9f\x98"],
    ids=["start byte", "surrogate", "overlong", "past U+10FFFF", "cut 3-byte", "cut 4-byte"],
)
def test_invalid_utf8_raises_what_the_python_path_raises(bad: bytes) -> None:
    raw = bytes([0xA0 | len(bad)]) + bad
    with pytest.raises(UnicodeDecodeError):
        to_json_bytes(raw)
    with pytest.raises(UnicodeDecodeError):
        native(raw)
    assert native(_enc.encode("é\u2028\U0001f600"), refuse) == to_json_bytes(_enc.encode("é\u2028\U0001f600"))


def test_an_extension_value_fails_as_on_the_python_path() -> None:
    raw = _enc.encode({"a": msgspec.msgpack.Ext(5, b"abc")})
    with pytest.raises(TypeError, match="Ext is unsupported"):
        native(raw)


# --- records to columns -----------------------------------------------------------------------------
def _entry(i: int, **kw: Any) -> DataEntry:
    return DataEntry(
        i % 3,
        Op(i % 3),
        msgspec.Raw(_enc.encode(f"k{i}")),
        msgspec.Raw(_enc.encode({"v": i, "f": i / 8})),
        i % 1024,
        CacheVersion(1000 + i, 2, 3, 4),
        **kw,
    )


def test_columns_hold_each_field_of_each_entry_in_the_slice() -> None:
    rec = DataRecord(
        tuple(_entry(i, primary=bool(i % 2), expire_time_ms=i * 7) for i in range(6)), 1_700_000_000 * 10**9
    )
    slices = [RecordSlice(WalPointer(3, 64), rec, 1, 5), RecordSlice(WalPointer(4, 128), rec, 4)]
    n, buffers = _rows.columns(pack(slices), refuse)
    assert n == 6
    cols = [np.frombuffer(b, t).tolist() for b, t in zip(buffers, (np.int8, np.int32, np.bool_), strict=False)]
    assert cols[0] == [1, 2, 0, 1, 1, 2]  # op
    assert cols[1] == [1, 2, 3, 4, 4, 5]  # partition
    assert cols[2] == [True, False, True, False, False, True]  # primary
    assert np.frombuffer(buffers[11], np.int32).tolist() == [1, 2, 3, 4, 4, 5]  # index in the record
    assert np.frombuffer(buffers[9], np.int64).tolist() == [3] * 4 + [4] * 2  # segment
    table, _ = table_from_packed(pack(slices), {0: "zero"}, "src", False)
    v1, v3, v4 = '{"v":1,"f":0.125}', '{"v":3,"f":0.375}', '{"v":4,"f":0.5}'
    assert table.column("value").to_pylist() == [v1, None, v3, v4, v4, None]  # deletes: null
    assert table.column("cache").to_pylist() == ["cache-1", "cache-2", "zero", "cache-1", "cache-1", "cache-2"]


def test_fields_a_later_schema_appends_are_skipped() -> None:
    """Records only ever gain fields at the end (DESIGN's schema rule): a slice, record, entry and version with
    extra trailing fields give the same rows."""
    entry = [7, 1, b"\xa1k", b"\x81\xa1v\x01", 9, [5, 1, 2, 3, None, "new", [1, 2]], True, 0, {"later": 1}]
    record = [1, [entry, entry], 1_700_000_000 * 10**9, False, "added", 42]
    plain_entry = [*entry[:5], entry[5][:5], *entry[6:8]]
    plain = _enc.encode([[0, 8, 0, None, [1, [plain_entry, plain_entry], record[2], False]]])
    extended = _enc.encode([[0, 8, 0, None, record, "slice extra"]])
    assert _rows.columns(extended, refuse) == _rows.columns(plain, refuse)


def _valid_pack() -> bytes:
    rec = DataRecord(tuple(_entry(i) for i in range(4)), 1_700_000_000 * 10**9)
    return pack([RecordSlice(WalPointer(0, 64), rec), RecordSlice(WalPointer(0, 200), rec, 2)])


def test_every_truncation_raises_value_error_naming_the_offset() -> None:
    data = _valid_pack()
    for cut in range(len(data)):
        with pytest.raises(ValueError, match=r"^packed lake rows at byte \d+: "):
            _rows.columns(data[:cut], to_json_bytes)


@pytest.mark.parametrize(
    ("packed", "what"),
    [
        (_enc.encode([[0, 8, 3, None, [1, [], 0]]]), "slice start/stop outside the record"),
        (_enc.encode([[0, 8, 0, None, [2, [], 0]]]), "record is not a DataRecord"),
        (_enc.encode([[0, 8, 0, None, [1, [[1, 5, b"\xc0", b"\xc0", 0, [1, 1, 1, 1], True, 0]], 0]]]), "op is not"),
        (_enc.encode([[0, 8, 0, None, [1, [[1, 0, b"\xc0", b"\xc0", 2**31, [1, 1, 1, 1], True, 0]], 0]]]), "int32"),
        (_enc.encode([[0, 8, 0, None, [1, [[1, 0, b"\xc0"]], 0]]]), "entry has fewer than 8 fields"),
        (_enc.encode([[0, 8, 0, None, [1, [], 0]]]) + b"\x00", "trailing bytes"),
        (_enc.encode({"not": "a list"}), "not an array of record slices"),
    ],
    ids=["start past end", "not a data record", "bad op", "partition range", "short entry", "trailing", "no list"],
)
def test_malformed_inputs_say_what_and_where(packed: bytes, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        _rows.columns(packed, to_json_bytes)


def test_random_corruption_never_crashes() -> None:
    """Bytes flipped anywhere in a packed input: rows or a ValueError (UnicodeDecodeError, msgspec's
    DecodeError), a TypeError from the fallback for an extension value, nothing else (a crash kills the test
    process)."""
    data = bytearray(_valid_pack())
    rng = random.Random(7)
    outcomes = {"rows": 0, "error": 0}
    for _ in range(20_000):
        d = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            d[rng.randrange(len(d))] = rng.randrange(256)
        try:
            _rows.columns(bytes(d), to_json_bytes)
            outcomes["rows"] += 1
        except (ValueError, TypeError):
            outcomes["error"] += 1
    assert outcomes["rows"] and outcomes["error"], outcomes
