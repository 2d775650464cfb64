"""Typed rows for ``<lake>/tables/<cache>``: types inferred from the JSON text of keys and values.

Pure (no Spark, no I/O): ``convert`` takes one cache's winning changes (key and value as JSON text,
as the changes table holds them) and the table's current layout, and returns the typed Arrow rows
plus the layout after this batch (new columns, a key that had to become JSON text). The rules, as
docs/lake.md states them:

- types: bool, int64, float64, string, date, timestamp (UTC), arrays (``list``) and structs (a nested
  dict); a struct holds exactly the keys of its dict, so a nested dict with other keys than its column's
  does not fit. A top-level string in exactly the text a datetime has in the changes table
  (``2024-01-01T00:00:00.500000Z``: msgspec's, UTC, six fraction digits or none) is a timestamp, one
  in ``2024-01-01`` form a date (``temporal``).
- one lattice (``join``): int64 < float64; date < timestamp; at the top level of a value, two scalar
  types with no such join meet at string. A new column takes the join of its values' types; a column
  that meets a value of a type its own does not hold widens to the join (``Converted.widened``: the
  table is rewritten at that compaction); a declared column never widens. A value in a column takes the
  column's type: an int that a double holds exactly is that double, a scalar in a string column its
  JSON text, a date in a timestamp column its midnight (UTC).
- a value that fits no join (a dict where a scalar is, a list of mixed types, an int beyond int64 or
  one a double does not hold exactly, a nested dict whose keys would need a mapping, lists and dicts
  nested deeper than ``MAX_NESTING``) goes, as JSON, into ``_rescued`` (a JSON object of the fields that
  did not fit; for a value that is not a dict: the value's JSON text itself).
- an explicit null field is listed in ``_nulls`` (an absent field and a null one read back apart).
- field names Parquet refuses or holding a backtick or a control character, names of the reserved
  columns and names equal to another column's but for case get a column name by ``column_name``; the
  field's real name is in the column's comment (``cdcd/lake/typed/layout.py``).
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import msgspec
import pyarrow as pa

from cdcd.lake.table import ORDER_COLUMNS

KEY = "key"
VALUE = "value"
RESCUED = "_rescued"
NULLS = "_nulls"
OP = "_op"
"""In the MERGE source only (create/update/delete), never in the table."""

META_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("_commit_ts", pa.timestamp("us", tz="UTC"), "commit_ts"),
    ("_version", pa.int64(), "version_order"),
    ("_source_node", pa.string(), "source_node"),
    ("_expire_time_ms", pa.int64(), "expire_time_ms"),
    ("_wal_segment", pa.int64(), "wal_segment"),
    ("_wal_offset", pa.int64(), "wal_offset"),
    ("_wal_index", pa.int32(), "wal_index"),
    ("_topology_version", pa.int64(), "topology_version"),
    ("_node_order", pa.int32(), "node_order"),
)
"""(column, type, the changes-table column it copies)."""

ORDER = tuple({source: name for name, _, source in META_COLUMNS}[c] for c in ORDER_COLUMNS)
"""Which change of a key is newer: ``state``'s order (``table.ORDER_COLUMNS``), in the typed tables' names."""

BAD_CHARS = frozenset(" ,;{}()\n\t=`") | frozenset(map(chr, [*range(0x20), *range(0x7F, 0xA0)]))
"""Characters a column name never holds: those Parquet/Delta refuse without column mapping, the backtick
(delta-rs's MERGE names columns in backticks without escaping them) and every control character (C0, DEL,
C1; NUL among them, which Spark refuses): each is below U+00A0, so two hex digits escape it."""

MAX_NESTING = 16
"""Lists and structs nested in a typed column at most: a deeper value does not fit (it is rescued). Each
list level multiplies DuckDB's read time (below a second past this depth, minutes at 30), and a struct's
levels deepen the Delta schema JSON that delta-rs parses with a recursion limit."""

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_COLUMNS = 1000
"""Field columns per table at most; fields beyond go to ``_rescued`` (a value with unbounded keys, such as
a map keyed by id, must not grow a table without limit)."""

TIMESTAMP = pa.timestamp("us", tz="UTC")
DATE = pa.date32()

TYPE_NAMES: dict[str, pa.DataType] = {
    "bool": pa.bool_(),
    "int64": pa.int64(),
    "float64": pa.float64(),
    "string": pa.string(),
}
"""Scalar type names a declared schema may use (``[consumer.tables.X] columns``), besides ``json``."""


def base_columns(key_type: pa.DataType) -> list[pa.Field]:
    return [
        pa.field(KEY, key_type),
        *(pa.field(name, t) for name, t, _ in META_COLUMNS),
        pa.field(RESCUED, pa.string()),
        pa.field(NULLS, pa.list_(pa.string())),
    ]


@dataclass
class Layout:
    """A table's shape: key type, and per field its column (name and type)."""

    key_type: pa.DataType | None = None
    """None: no key seen yet."""
    key_json: bool = False
    """The key column holds JSON text (keys of more than one type, or not scalar)."""
    columns: dict[str, tuple[str, pa.DataType]] = field(default_factory=dict)
    """field name -> (column name, type); the non-dict value's field is ``VALUE`` with column ``value``."""
    json_fields: frozenset[str] = frozenset()
    """Declared ``json``: the field's JSON text in a string column, whatever its shape."""
    fixed: frozenset[str] = frozenset()
    """Declared fields: their column's type never widens."""

    def copy(self) -> Layout:
        return Layout(self.key_type, self.key_json, dict(self.columns), self.json_fields, self.fixed)

    def schema(self) -> pa.Schema:
        key_type = pa.string() if self.key_json or self.key_type is None else self.key_type
        return pa.schema(base_columns(key_type) + [pa.field(c, t) for c, t in self.columns.values()])


NON_DICT = "\x00value"
"""The layout's field name for values that are not dicts (no dict key can be this: a column ``value``)."""


def column_name(name: str, taken: Iterable[str]) -> str:
    """A column name Parquet and Delta accept without column mapping, unique ignoring case: the field's
    name when it is fine, else each refused character and ``$`` as ``$xx`` (hex); ``$`` in front of a
    name that is empty, starts with ``_`` or is ``key``/``value``; ``$2``, ``$3``… after one equal to
    another column's but for case. Reversible through the column's comment, which names the field."""
    out = "".join(f"${ord(c):02x}" if c in BAD_CHARS or c == "$" else c for c in name)
    if not out or out.startswith("_") or out.lower() in (KEY, VALUE):
        out = "$" + out
    lower = {t.lower() for t in taken}
    candidate, n = out, 1
    while candidate.lower() in lower:
        n += 1
        candidate = f"{out}${n}"
    return candidate


def plain_field(name: str) -> bool:
    return bool(name) and not (BAD_CHARS & set(name))


# --- types of values ---------------------------------------------------------------------------------
_SCALAR = {bool: pa.bool_(), float: pa.float64(), str: pa.string()}
_NULL = pa.null()


def type_of(v: object, room: int = MAX_NESTING) -> pa.DataType | None:
    """The Arrow type a JSON value fits, with ``null`` where nothing says (an empty list's items);
    None: no column type holds it (an int beyond int64, a dict with keys a struct cannot have, lists
    and dicts nested deeper than ``room``)."""
    t = type(v)
    scalar = _SCALAR.get(t)
    if scalar is not None:
        return scalar
    if t is int:
        return pa.int64() if INT64_MIN <= v <= INT64_MAX else None  # type: ignore[operator]
    if v is None:
        return _NULL
    if (t is list or t is dict) and room <= 0:
        return None
    if t is list:
        item: pa.DataType | None = _NULL
        for x in v:  # type: ignore[attr-defined]
            item = merge(item, type_of(x, room - 1))
            if item is None:
                return None
        return pa.list_(item)
    if t is dict:
        keys = list(v)  # type: ignore[call-overload]
        if not keys or not all(type(k) is str and plain_field(k) for k in keys):
            return None
        if len({k.lower() for k in keys}) != len(keys):
            return None
        fields = []
        for k in keys:
            ft = type_of(v[k], room - 1)  # type: ignore[index]
            if ft is None:
                return None
            fields.append(pa.field(k, ft))
        return pa.struct(fields)
    return None


_JOINS = {
    frozenset((pa.int64(), pa.float64())): pa.float64(),
    frozenset((DATE, TIMESTAMP)): TIMESTAMP,
}
"""The lattice's joins below string: int64 < float64, date < timestamp."""
_SCALARS = frozenset((pa.bool_(), pa.int64(), pa.float64(), pa.string(), DATE, TIMESTAMP))


def join(a: pa.DataType | None, b: pa.DataType | None) -> pa.DataType | None:
    """The type holding both at the top level of a value: ``merge``, or string for two scalars it does not
    join (bool and int, int and string, a date and a float…); None when none does."""
    m = merge(a, b)
    if m is None and a in _SCALARS and b in _SCALARS:
        return pa.string()
    return m


def merge(a: pa.DataType | None, b: pa.DataType | None) -> pa.DataType | None:
    """The type holding both anywhere in a value (``null`` gives way, int64 and float64 meet at float64,
    date and timestamp at timestamp, lists item by item, structs of the same keys field by field); None
    when none does."""
    if a is None or b is None:
        return None
    if a == b:
        return a
    if a == _NULL:
        return b
    if b == _NULL:
        return a
    joined = _JOINS.get(frozenset((a, b)))
    if joined is not None:
        return joined
    if pa.types.is_list(a) and pa.types.is_list(b):
        item = merge(a.value_type, b.value_type)
        return None if item is None else pa.list_(item)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        # Same keys in another order is the same dict: compare as sets, keep a's order.
        if sorted(f.name for f in a) != sorted(f.name for f in b):
            return None
        fields = []
        for f in a:
            t = merge(f.type, b.field(f.name).type)
            if t is None:
                return None
            fields.append(pa.field(f.name, t))
        return pa.struct(fields)
    return None


def concrete(t: pa.DataType) -> pa.DataType:
    """A column type from an inferred one: a ``null`` nobody settled (an empty list's items, a nested
    field only ever null) becomes string."""
    if t == _NULL:
        return pa.string()
    if pa.types.is_list(t):
        return pa.list_(concrete(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, concrete(f.type)) for f in t])
    return t


def fits(column: pa.DataType, t: pa.DataType | None) -> bool:
    """A value of type ``t`` goes into a ``column`` without widening it (see ``fits_value`` for ints in
    doubles)."""
    return t is not None and merge(column, t) == column


def fits_value(column: pa.DataType, v: object) -> bool:
    """``v`` (anywhere in a value) goes into ``column`` as it is: ``fits``, and every int under a float64
    is one a double holds exactly (``MAX_EXACT_INT``). The reference ``checker`` answers like."""
    return fits(column, type_of(v)) and _exact(column, v)


def _exact(t: pa.DataType, v: object) -> bool:
    if v is None:
        return True
    if t == pa.float64():
        return type(v) is not int or _exact_double(v)
    if pa.types.is_list(t):
        return all(_exact(t.value_type, x) for x in v)  # type: ignore[attr-defined]
    if pa.types.is_struct(t):
        return all(_exact(f.type, v[f.name]) for f in t)  # type: ignore[index]
    return True


MAX_EXACT_INT = 1 << 53
"""Ints a double column takes: up to 2^53 in magnitude, every one of which a double holds exactly (Arrow
refuses larger ones, even the few a double holds); a larger int stays exact in ``_rescued``."""


def _exact_double(v: int) -> bool:
    return -MAX_EXACT_INT <= v <= MAX_EXACT_INT


# --- dates and timestamps: strings in the text a datetime or a date has in the changes table -----------
_TIMESTAMP_TEXT = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{6})?Z")
_DATE_TEXT = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def temporal(s: str) -> pa.DataType | None:
    """TIMESTAMP for exactly the text msgspec writes for a datetime the node holds (a MessagePack timestamp:
    UTC, ``Z``, six fraction digits unless whole seconds), DATE for ``YYYY-MM-DD``; None for any other
    string (a naive datetime's text, another offset, other digits: each would not read back as it was)."""
    n = len(s)
    if n == 10 and _DATE_TEXT.fullmatch(s):
        try:
            dt.date.fromisoformat(s)
        except ValueError:
            return None
        return DATE
    if n in {20, 27} and _TIMESTAMP_TEXT.fullmatch(s) and not s.endswith(".000000Z"):
        try:
            dt.datetime.fromisoformat(s)
        except ValueError:
            return None
        return TIMESTAMP
    return None


def top_type(v: object) -> pa.DataType | None:
    """``type_of`` for a top-level field (or a non-dict value): strings may be dates and timestamps."""
    if type(v) is str:
        return temporal(v) or pa.string()
    return type_of(v)


def timestamp_text(x: dt.datetime) -> str:
    """A timestamp as the changes table's text of the datetime (a reader's naive datetime is UTC)."""
    if x.tzinfo is None:
        x = x.replace(tzinfo=dt.UTC)
    text: str = msgspec.json.encode(x.astimezone(dt.UTC)).decode()
    return text[1:-1]


def choose_type(values: list[object], *, top: bool = False) -> pa.DataType | None:
    """A new column's type: the most common type among the values, joined with the others it joins
    (an empty list gives way to a list of ints, ints to doubles; with ``top``, a top-level field: the
    lattice's ``join``, dates and timestamps among strings); None when no value has a type (all null)."""
    counts = Counter(t for t in map(top_type if top else type_of, values) if t is not None and t != _NULL)
    if not counts:
        return None
    return widen(None, counts, top=top)


def widen(column: pa.DataType | None, counts: Counter[pa.DataType], *, top: bool = True) -> pa.DataType | None:
    """``column`` (None: a new one) joined with the types of ``counts`` it joins, most common first."""
    chosen = column
    meet = join if top else merge
    for t, _ in counts.most_common():
        if chosen is None:
            chosen = t
            continue
        m = meet(chosen, t)
        if m is not None:
            chosen = m
    return None if chosen is None else concrete(chosen)


# --- keys --------------------------------------------------------------------------------------------
_KEY_TYPES = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}


def key_type(keys: list[object]) -> pa.DataType | None:
    """The one scalar type of all ``keys`` (None: more than one, or not scalar: JSON text). NaN and the
    infinities arrive as ``{"$float": ...}`` objects (cdcd/lake/landing/jsontext.py), so they are not scalar;
    -0.0 is not typed either: a DOUBLE column's equality makes it 0.0, and a MERGE would make the two
    keys one row."""
    kinds = {type(k) for k in keys}
    if len(kinds) != 1:
        return None
    t = _KEY_TYPES.get(next(iter(kinds)))
    if t == pa.int64() and not all(INT64_MIN <= k <= INT64_MAX for k in keys):  # type: ignore[operator]
        return None
    if t == pa.float64() and any(math.copysign(1.0, k) < 0 and k == 0 for k in keys):  # type: ignore[arg-type]
        return None
    return t


# --- one batch ----------------------------------------------------------------------------------------
@dataclass
class Converted:
    rows: pa.Table
    """Typed rows: ``OP`` then the layout's schema."""
    layout: Layout
    added: list[str]
    """Columns this batch added (in order)."""
    key_changed: bool
    """The key column had to become JSON text: the table is rewritten (its old keys as JSON)."""
    rescued: int
    """Fields (or non-dict values) that went to ``_rescued``."""
    widened: dict[str, tuple[pa.DataType, pa.DataType]] = field(default_factory=dict)
    """column -> (its type before, its type now): columns this batch widened (the table is rewritten)."""


def decode_all(texts: list[str | None]) -> list[object]:
    """JSON texts (None: a delete) decoded in one msgspec call."""
    body = ",".join("null" if t is None else t for t in texts)
    return msgspec.json.decode(f"[{body}]")  # type: ignore[no-any-return]


def convert(winners: pa.Table, layout: Layout) -> Converted:
    """``winners``: one cache's rows of the changes feed (``op``, ``key``, ``value`` JSON text and the
    metadata columns), one per key. ``layout``: the table's layout before (not changed)."""
    new = layout.copy()
    n = winners.num_rows
    keys = decode_all(winners.column("key").to_pylist())
    key_changed = False
    if not new.key_json:
        kt = key_type(keys)
        if kt is None or (new.key_type is not None and kt != new.key_type):
            key_changed = new.key_type is not None
            new.key_json = True
            new.key_type = pa.string()
        elif new.key_type is None:
            new.key_type = kt
    ops = winners.column("op").to_pylist()
    texts = winners.column("value").to_pylist()
    values = decode_all([None if op == "delete" else t for op, t in zip(ops, texts, strict=True)])
    live = [op != "delete" for op in ops]

    nulls: list[list[str] | None] = [None] * n
    rescued: list[dict[str, object] | None] = [None] * n
    whole: list[str | None] = [None] * n
    """A non-dict value that did not fit ``value``: its JSON text is the row's ``_rescued``."""
    empty: dict[str, object] = {}
    dicts: list[dict[str, object]] = []
    non_dict: list[object] = [None] * n
    for i, v in enumerate(values):
        if live[i] and type(v) is dict:
            dicts.append(v)
            continue
        dicts.append(empty)
        if live[i]:
            if v is None:
                whole[i] = "null"
            else:
                non_dict[i] = v
    names: set[str] = set().union(*dicts)
    for i, d in enumerate(dicts):
        if d and None in d.values():  # explicit nulls: rare, listed per row
            nulls[i] = [k for k, x in d.items() if x is None]
    misfits = 0
    if NON_DICT in names:  # a dict key that is the layout's name for non-dict values: never a column
        names.discard(NON_DICT)
        for i, d in enumerate(dicts):
            if NON_DICT in d:
                misfits += 1
                _rescue(rescued, whole, i, NON_DICT, d[NON_DICT], dict_field=True)

    added: list[str] = []
    widened: dict[str, tuple[pa.DataType, pa.DataType]] = {}
    columns: dict[str, pa.Array] = {}
    taken = [f.name for f in base_columns(pa.string())] + [c for c, _ in new.columns.values()]
    fields: list[tuple[str, list[object]]] = [(name, [d.get(name) for d in dicts]) for name in sorted(names)]
    if any(x is not None for x in non_dict):
        fields.append((NON_DICT, non_dict))
    for name, vals in fields:
        kinds = set(map(type, vals))
        kinds.discard(type(None))
        if not kinds:
            continue  # only nulls (listed in _nulls): no column for them, an existing one stays null
        existing = new.columns.get(name)
        if name in new.json_fields:
            texts_ = [None if x is None else msgspec.json.encode(x).decode() for x in vals]
            columns[existing[0]] = pa.array(texts_, pa.string())  # type: ignore[index]
            continue
        if existing is None and len(new.columns) < MAX_COLUMNS:
            t = _one_kind(kinds) or choose_type([x for x in vals if x is not None], top=True)
            if kinds == {str}:
                t = _strings_type(vals)
            if t is not None:
                col_name = VALUE if name == NON_DICT else column_name(name, taken)
                taken.append(col_name)
                new.columns[name] = existing = (col_name, t)
                added.append(col_name)
        if existing is None:
            for i, x in enumerate(vals):
                if x is not None:
                    misfits += 1
                    _rescue(rescued, whole, i, name, x)
            continue
        col_name, col_type = existing
        array = _fast_array(vals, kinds, col_type)
        if array is None:
            check = top_checker(col_type)
            bad = [i for i, x in enumerate(vals) if x is not None and not check(x)]
            if bad and name not in new.fixed:
                wider = widen(col_type, Counter(t for i in bad if (t := top_type(vals[i])) is not None))
                if wider is not None and wider != col_type:
                    widened[col_name] = (col_type, wider)
                    new.columns[name] = (col_name, wider)
                    col_type, check = wider, top_checker(wider)
                    bad = [i for i, x in enumerate(vals) if x is not None and not check(x)]
            kept = list(vals)
            for i in bad:
                kept[i] = None
                misfits += 1
                _rescue(rescued, whole, i, name, vals[i])
            array = top_array(kept, col_type)
        columns[col_name] = array

    rows = _rows(winners, keys, new, columns, _rescued_texts(nulls, rescued, whole))
    return Converted(rows, new, added, key_changed, misfits, widened)


def checker(t: pa.DataType) -> Callable[[object], bool]:
    """A test that a (non-null) value goes into type ``t`` without widening it, on Python types alone: the
    same answer as ``fits_value(t, v)``, without building Arrow types per value (the hot path)."""
    if t == pa.bool_():
        return lambda v: type(v) is bool
    if t == pa.int64():
        return lambda v: type(v) is int and INT64_MIN <= v <= INT64_MAX
    if t == pa.float64():
        return lambda v: type(v) is float or (type(v) is int and _exact_double(v))
    if t == pa.string():
        return lambda v: type(v) is str
    if pa.types.is_list(t):
        item = checker(t.value_type)
        return lambda v: type(v) is list and all(e is None or item(e) for e in v)
    if pa.types.is_struct(t):
        fields = {f.name: checker(f.type) for f in t}
        n = len(fields)

        def fits_struct(v: object) -> bool:
            if type(v) is not dict or len(v) != n:
                return False
            for k, x in v.items():
                check = fields.get(k)
                if check is None or (x is not None and not check(x)):
                    return False
            return True

        return fits_struct
    return lambda v: fits_value(t, v)


_SCALAR_KINDS = (str, bool, int, float)


def top_checker(t: pa.DataType) -> Callable[[object], bool]:
    """``checker`` for a top-level field's column: a string column takes any scalar (as its JSON text), a
    timestamp column the text of a timestamp or a date, a date column that of a date."""
    if t == pa.string():
        return lambda v: type(v) in _SCALAR_KINDS
    if t == TIMESTAMP:
        return lambda v: type(v) is str and temporal(v) is not None
    if t == DATE:
        return lambda v: type(v) is str and temporal(v) == DATE
    return checker(t)


def top_array(vals: list[object], t: pa.DataType) -> pa.Array:
    """A top-level column of type ``t`` from values ``top_checker(t)`` takes (or None)."""
    if t == pa.string():
        vals = [x if x is None or type(x) is str else msgspec.json.encode(x).decode() for x in vals]
    elif t == TIMESTAMP:
        return pa.array(vals, pa.string()).cast(pa.date32()).cast(TIMESTAMP) if _all_dates(vals) else _timestamps(vals)
    elif t == DATE:
        return pa.array(vals, pa.string()).cast(DATE)
    return pa.array(vals, t)


def _all_dates(vals: list[object]) -> bool:
    return all(x is None or len(x) == 10 for x in vals)  # type: ignore[arg-type]


def _timestamps(vals: list[object]) -> pa.Array:
    """Timestamp texts (and dates, as their midnight UTC) as a timestamp column."""
    texts = [x if x is None or len(x) != 10 else f"{x}T00:00:00Z" for x in vals]  # type: ignore[arg-type]
    return pa.array(texts, pa.string()).cast(TIMESTAMP)


def _strings_type(vals: list[object]) -> pa.DataType:
    """A new column of strings: TIMESTAMP when every one is a timestamp's or a date's text and one is a
    timestamp's, DATE when every one is a date's, else STRING."""
    kinds = {temporal(x) for x in vals if x is not None}  # type: ignore[arg-type]
    if None in kinds:
        return pa.string()
    return TIMESTAMP if TIMESTAMP in kinds else DATE


def _one_kind(kinds: set[type]) -> pa.DataType | None:
    """The column type of values all of one scalar Python type (None: any other mix)."""
    if len(kinds) != 1:
        return None
    kind = next(iter(kinds))
    return pa.int64() if kind is int else _SCALAR.get(kind)


def _fast_array(vals: list[object], kinds: set[type], t: pa.DataType) -> pa.Array | None:
    """``vals`` as an Arrow array in one pyarrow call when every non-null value is of the column's one
    scalar type (most fields of most batches); None: check value by value."""
    if _one_kind(kinds) != t:
        return None
    try:
        return pa.array(vals, t)
    except (OverflowError, pa.ArrowInvalid):  # an int beyond int64: value by value, it is rescued
        return None


def _rescue(
    rescued: list[dict[str, object] | None],
    whole: list[str | None],
    i: int,
    name: str,
    x: object,
    *,
    dict_field: bool = False,
) -> None:
    if name == NON_DICT and not dict_field:
        whole[i] = msgspec.json.encode(x).decode()
        return
    row = rescued[i]
    if row is None:
        rescued[i] = row = {}
    row[name] = x


def _rescued_texts(
    nulls: list[list[str] | None], rescued: list[dict[str, object] | None], whole: list[str | None]
) -> tuple[list[str | None], list[list[str] | None]]:
    texts = [
        w if w is not None else (None if r is None else msgspec.json.encode(r).decode())
        for w, r in zip(whole, rescued, strict=True)
    ]
    return texts, nulls


def _key_column(winners: pa.Table, keys: list[object], layout: Layout) -> pa.Array:
    if layout.key_json:
        return winners.column(KEY).combine_chunks().cast(pa.string())  # the lake's key text, as it is
    assert layout.key_type is not None
    return pa.array(keys, layout.key_type)


def _rows(
    winners: pa.Table,
    keys: list[object],
    layout: Layout,
    columns: Mapping[str, pa.Array],
    extra: tuple[list[str | None], list[list[str] | None]],
) -> pa.Table:
    n = winners.num_rows
    arrays: list[pa.Array] = [winners.column("op").combine_chunks(), _key_column(winners, keys, layout)]
    names = [OP, KEY]
    for name, t, source in META_COLUMNS:
        arrays.append(winners.column(source).cast(t).combine_chunks())
        names.append(name)
    rescued_text, nulls = extra
    arrays += [pa.array(rescued_text, pa.string()), pa.array(nulls, pa.list_(pa.string()))]
    names += [RESCUED, NULLS]
    for col_name, t in layout.columns.values():
        array = columns.get(col_name)
        arrays.append(pa.nulls(n, t) if array is None else array)
        names.append(col_name)
    return pa.Table.from_arrays(arrays, names=names)


def rebuild(row: Mapping[str, object], layout: Layout) -> object:
    """The value a typed row holds (its columns, ``_nulls`` and ``_rescued``): the inverse of ``convert`` up
    to the lattice (an int in a double column comes back a double, a scalar in a string column its text;
    dates and timestamps as the changes table's text of them), for checks and for readers that want the
    node's value back."""
    rescued_text = row.get(RESCUED)
    rescued = None if rescued_text is None else msgspec.json.decode(str(rescued_text))
    non_dict = layout.columns.get(NON_DICT)
    if non_dict is not None and row.get(non_dict[0]) is not None:
        return _value_back(row[non_dict[0]], non_dict[1])
    if rescued_text is not None and type(rescued) is not dict:
        return rescued
    out: dict[str, object] = {}
    for name, (col, t) in layout.columns.items():
        if name == NON_DICT:
            continue
        x = row.get(col)
        if x is not None:
            out[name] = msgspec.json.decode(str(x)) if name in layout.json_fields else _value_back(x, t)
    for name in row.get(NULLS) or []:  # type: ignore[attr-defined]
        out[name] = None
    if type(rescued) is dict:
        out.update(rescued)
    return out


def _value_back(x: object, t: pa.DataType) -> object:
    """A column's value (as a reader gives it) as the value's JSON form: dates and timestamps as text."""
    if t == TIMESTAMP and isinstance(x, dt.datetime):
        return timestamp_text(x)
    if t == DATE and isinstance(x, dt.date):
        return x.isoformat()
    return x
