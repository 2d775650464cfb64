"""The lake's row builders against their definition: the C module (cdcd/lake/landing/_rows.c) writes the JSON
text of any key or value byte for byte as ``jsontext.to_json_bytes`` does and never takes the Python
fallback for the common values; the C module and the Python path (cdcd/lake/landing/rows_py.py) give the same
buffers for any records, fixed-width columns hold each entry's fields, extra fields a later schema
appends are skipped, and a malformed input raises ValueError naming the place (never a crash, never
rows made up). Which builder a process uses, and what it says when the C module is missing."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.consumer import RecordSlice
from cdcd.lake.landing import _rows, arrow, rows_py
from cdcd.lake.landing.arrow import pack, table_from_packed
from cdcd.lake.landing.jsontext import InvalidValue, key_json_bytes, to_json_bytes
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheVersion, DataEntry, DataRecord, Op
from tests.support.wal_fuzz import COLUMN_WIDTHS, compare_row_builders

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
    """The C module's own JSON text (its fallback only where it says so)."""
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
    with pytest.raises(InvalidValue, match=r"^invalid UTF-8 in a string value"):
        to_json_bytes(raw)
    with pytest.raises(InvalidValue, match=r"^invalid UTF-8 in a string value"):
        native(raw)
    assert native(_enc.encode("é\u2028\U0001f600"), refuse) == to_json_bytes(_enc.encode("é\u2028\U0001f600"))


def test_an_extension_value_fails_as_on_the_python_path() -> None:
    raw = _enc.encode({"a": msgspec.msgpack.Ext(5, b"abc")})
    with pytest.raises(TypeError, match="Ext is unsupported"):
        native(raw)


# --- records to columns, on both paths (the row_builder fixture) ------------------------------------------
def build(packed: bytes, fallback: Any = to_json_bytes) -> tuple[int, tuple[bytes, ...]]:
    return arrow.build_columns(packed, fallback, key_json_bytes)


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


@pytest.mark.usefixtures("row_builder")
def test_columns_hold_each_field_of_each_entry_in_the_slice() -> None:
    rec = DataRecord(
        tuple(_entry(i, primary=bool(i % 2), expire_time_ms=i * 7) for i in range(6)), 1_700_000_000 * 10**9
    )
    slices = [RecordSlice(WalPointer(3, 64), rec, 1, 5), RecordSlice(WalPointer(4, 128), rec, 4)]
    n, buffers = build(pack(slices))
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


# Any key or value, as MessagePack: the common ones (smaller than above: here they fill records) and the ones
# C hands to the fallback.
any_values = st.one_of(
    st.recursive(
        common_scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
        max_leaves=6,
    ).map(_enc.encode),
    st.sampled_from(sorted(FALLBACK_CASES.values())),
    st.dictionaries(st.integers(-5, 5) | st.booleans(), common_scalars, max_size=3).map(_enc.encode),
)
i64 = st.integers(-(2**63), 2**63 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
entries = st.builds(
    lambda cache_id, op, key, value, partition, version, primary, expire: DataEntry(
        cache_id,
        op,
        msgspec.Raw(key),
        msgspec.Raw(b"\xc0" if op == Op.DELETE else value),
        partition,
        version,
        primary=primary,
        expire_time_ms=expire,
    ),
    i64,
    st.sampled_from(Op),
    any_values,
    any_values,
    i32,
    st.builds(CacheVersion, i64, i32, i32, i64, st.none() | st.builds(CacheVersion, i64, i32, i32, i64)),
    st.booleans(),
    i64,
)


@st.composite
def record_slices(draw: st.DrawFn) -> list[RecordSlice]:
    out = []
    for _ in range(draw(st.integers(0, 5))):
        record = DataRecord(tuple(draw(st.lists(entries, min_size=1, max_size=6))), draw(i64), draw(st.booleans()))
        start = draw(st.integers(0, len(record.entries)))
        stop = draw(st.none() | st.integers(start, len(record.entries)))
        out.append(RecordSlice(WalPointer(draw(i64), draw(i64)), record, start, stop))
    return out


def definition(slices: list[RecordSlice]) -> list[list[int]]:
    """The fixed-width columns as ``_rows.columns`` documents them, one list per column, from the entries."""
    cols: list[list[int]] = [[] for _ in COLUMN_WIDTHS]
    for s in slices:
        for i in range(s.start, len(s.record.entries) if s.stop is None else s.stop):
            e = s.record.entries[i]
            v = e.version
            row = [e.op, e.partition, e.primary, v.order, v.node_order, v.cluster_id, v.topology_version]
            row += [e.expire_time_ms, e.cache_id, s.pointer.segment, s.pointer.offset, i, s.record.commit_ts_ns]
            for col, value in zip(cols, row, strict=True):
                col.append(int(value))
    return cols


@pytest.mark.usefixtures("row_builder")
@given(record_slices())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fixed_width_columns_hold_what_the_definition_says(slices: list[RecordSlice]) -> None:
    """Every fixed-width column, on any field values (the int64 and int32 extremes too), any slice bounds: the
    entry's own field, in the builder's dtype, for each entry in the slice and no other; key and value text is
    the definitions' (``key_json_bytes``, ``to_json_bytes``), a DELETE's value empty."""
    n, buffers = build(pack(slices))
    want = definition(slices)
    assert n == len(want[0])
    for i, (dtype, column) in enumerate(zip(rows_py.FIXED_DTYPES, want, strict=True)):
        assert np.frombuffer(buffers[i], dtype).tolist() == [dtype(x).item() for x in column], f"column {i}"
    rows = [(s, i) for s in slices for i in range(s.start, len(s.record.entries) if s.stop is None else s.stop)]
    keys = [key_json_bytes(bytes(s.record.entries[i].key)) for s, i in rows]
    values = [
        b"" if s.record.entries[i].op == Op.DELETE else to_json_bytes(bytes(s.record.entries[i].value)) for s, i in rows
    ]
    for (offsets_at, text_at), pieces in (((13, 14), keys), ((15, 16), values)):
        offsets = np.frombuffer(buffers[offsets_at], np.int32).tolist()
        assert offsets == [sum(len(p) for p in pieces[:k]) for k in range(n + 1)]
        assert buffers[text_at] == b"".join(pieces)


@given(record_slices())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_c_module_and_the_python_path_give_the_same_buffers(slices: list[RecordSlice]) -> None:
    n, _buffers = compare_row_builders(pack(slices))
    assert n == sum((len(s.record.entries) if s.stop is None else s.stop) - s.start for s in slices)


@pytest.mark.usefixtures("row_builder")
def test_fields_a_later_schema_appends_are_skipped() -> None:
    """Records only ever gain fields at the end (DESIGN's schema rule): a slice, record, entry and version with
    extra trailing fields give the same rows."""
    entry = [7, 1, b"\xa1k", b"\x81\xa1v\x01", 9, [5, 1, 2, 3, None, "new", [1, 2]], True, 0, {"later": 1}]
    record = [1, [entry, entry], 1_700_000_000 * 10**9, False, "added", 42]
    plain_entry = [*entry[:5], entry[5][:5], *entry[6:8]]
    plain = _enc.encode([[0, 8, 0, None, [1, [plain_entry, plain_entry], record[2], False]]])
    extended = _enc.encode([[0, 8, 0, None, record, "slice extra"]])
    assert build(extended)[0] == 2
    assert build(extended) == build(plain)


def _valid_pack() -> bytes:
    rec = DataRecord(tuple(_entry(i) for i in range(4)), 1_700_000_000 * 10**9)
    return pack([RecordSlice(WalPointer(0, 64), rec), RecordSlice(WalPointer(0, 200), rec, 2)])


WHERE = {"c": r"byte \d+", "python": r"\$[\[\]\d]*"}
"""How each builder names the place: C the byte offset, Python msgspec's path into the slices."""


def test_every_truncation_raises_value_error_naming_the_place(row_builder: str) -> None:
    data = _valid_pack()
    for cut in range(len(data)):
        with pytest.raises(ValueError, match=rf"^packed lake rows at {WHERE[row_builder]}: "):
            build(data[:cut])


@pytest.mark.parametrize(
    ("packed", "what"),
    [
        (_enc.encode([[0, 8, 3, None, [1, [], 0]]]), "slice start/stop outside the record"),
        (_enc.encode([[0, 8, 0, None, [2, [], 0]]]), "record is not a DataRecord"),
        (
            _enc.encode([[0, 8, 0, None, [1, [[1, 5, b"\xc0", b"\xc0", 0, [1, 1, 1, 1], True, 0]], 0]]]),
            "op is not|<= 2",
        ),
        (
            _enc.encode([[0, 8, 0, None, [1, [[1, 0, b"\xc0", b"\xc0", 2**31, [1, 1, 1, 1], True, 0]], 0]]]),
            "int32|<= 2147483647",
        ),
        (_enc.encode([[0, 8, 0, None, [1, [[1, 0, b"\xc0"]], 0]]]), "fewer than 8 fields|at least length 8"),
        (_enc.encode([[0, 8, 0, None, [1, [], 0]]]) + b"\x00", "trailing"),
        (_enc.encode({"not": "a list"}), "not an array of record slices|Expected `array`, got `object`"),
    ],
    ids=["start past end", "not a data record", "bad op", "partition range", "short entry", "trailing", "no list"],
)
def test_malformed_inputs_say_what_and_where(row_builder: str, packed: bytes, what: str) -> None:
    with pytest.raises(ValueError, match=rf"^packed lake rows at {WHERE[row_builder]}: .*({what})"):
        build(packed)


def test_random_corruption_gives_the_same_outcome_on_both_paths() -> None:
    """Bytes flipped anywhere in a packed input: the same rows from both builders, or an error from both
    (ValueError, UnicodeDecodeError, msgspec's DecodeError, a TypeError from the fallback for an extension
    value), nothing else (a crash kills the test process)."""
    data = bytearray(_valid_pack())
    rng = random.Random(7)
    outcomes = {"rows": 0, "error": 0}
    for _ in range(10_000):
        d = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            d[rng.randrange(len(d))] = rng.randrange(256)
        try:
            compare_row_builders(bytes(d))
            outcomes["rows"] += 1
        except (ValueError, TypeError):
            outcomes["error"] += 1
    assert outcomes["rows"] and outcomes["error"], outcomes


# --- which builder a process uses --------------------------------------------------------------------------
BLOCK_C_MODULE = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "cdcd.lake.landing._rows":
            raise ImportError("blocked: as if never built")
sys.meta_path.insert(0, Block())
"""

USE_ROWS = """
import msgspec
from cdcd.lake.landing import arrow, rows_py
from cdcd.lake.landing.jsontext import key_json_bytes, to_json_bytes
entry = [7, 1, b"\\xa1k", b"\\x81\\xa1v\\x01", 9, [5, 1, 2, 3], True, 0]
data = msgspec.msgpack.encode([[0, 8, 0, None, [1, [entry, entry], 10**18]]])
first = arrow.build_columns(data, to_json_bytes, key_json_bytes)
second = arrow.build_columns(data, to_json_bytes, key_json_bytes)
assert first == second == rows_py.columns(data, to_json_bytes, key_json_bytes)
print(arrow.build_columns is rows_py.columns, file=sys.stderr)
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_without_the_c_module_rows_come_from_python_with_one_warning_naming_the_build() -> None:
    res = _python("import sys\n" + BLOCK_C_MODULE + USE_ROWS, CDCD_LAKE_ROWS="")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "", "a library prints nothing on stdout"
    warnings = [line for line in res.stderr.splitlines() if "lake_rows_without_c_module" in line]
    assert len(warnings) == 1, res.stderr
    assert "make install" in warnings[0] and "python setup.py build_ext --inplace" in warnings[0]
    assert res.stderr.splitlines()[-1] == "True"


def test_the_environment_chooses_the_python_path_without_a_warning() -> None:
    res = _python("import sys\n" + USE_ROWS, CDCD_LAKE_ROWS="python")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == ["True"]


@pytest.mark.parametrize(
    ("value", "blocked", "error"),
    [("fast", False, "CDCD_LAKE_ROWS='fast' is not 'c' or 'python'"), ("c", True, "CDCD_LAKE_ROWS=c but")],
)
def test_a_bad_choice_fails_at_import_naming_the_variable(value: str, blocked: bool, error: str) -> None:
    res = _python((BLOCK_C_MODULE if blocked else "") + "import cdcd.lake.landing.arrow", CDCD_LAKE_ROWS=value)
    assert res.returncode == 1
    assert error in res.stderr


AT_IMPORT = arrow.build_columns
"""This process's builder before the row_builder fixture changes it for some tests."""


def test_this_process_uses_the_builder_the_environment_names() -> None:
    """``make test`` runs lake test files again with CDCD_LAKE_ROWS=python: this says that run really is on
    the Python path (and the ordinary run on C)."""
    assert AT_IMPORT is (rows_py.columns if os.environ.get("CDCD_LAKE_ROWS") == "python" else _rows.columns)
