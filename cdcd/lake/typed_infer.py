"""Typed rows for ``<lake>/tables/<cache>``: types inferred from the JSON text of keys and values.

Pure (no Spark, no I/O): ``convert`` takes one cache's winning changes (key and value as JSON text,
as the changes table holds them) and the table's current layout, and returns the typed Arrow rows
plus the layout after this batch (new columns, a key that had to become JSON text). The rules, as
docs/lake.md states them:

- types: bool, int64, float64, string, arrays (``list``) and structs (a nested dict); a struct holds
  exactly the keys of its dict, so a nested dict with other keys than its column's does not fit.
- a column's type is fixed when it is added: the most common type of the field in that batch;
  a value that does not fit its column (another type, an int beyond int64, a nested dict whose keys
  would need a mapping, lists and dicts nested deeper than ``MAX_NESTING``) goes, as JSON, into
  ``_rescued`` (a JSON object of the fields that did not fit; for a value that is not a dict: the
  value's JSON text itself). Nothing widens.
- an explicit null field is listed in ``_nulls`` (an absent field and a null one read back apart).
- field names Parquet refuses or holding a backtick or a control character, names of the reserved
  columns and names equal to another column's but for case get a column name by ``column_name``; the
  field's real name is in the column's comment (``cdcd/lake/typed_layout.py``).
"""

from __future__ import annotations

import math
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

    def copy(self) -> Layout:
        return Layout(self.key_type, self.key_json, dict(self.columns), self.json_fields)

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


def merge(a: pa.DataType | None, b: pa.DataType | None) -> pa.DataType | None:
    """The type holding both (``null`` gives way); None when none does."""
    if a is None or b is None:
        return None
    if a == b:
        return a
    if a == _NULL:
        return b
    if b == _NULL:
        return a
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
    return t is not None and merge(column, t) == column


def choose_type(values: list[object]) -> pa.DataType | None:
    """A new column's type: the most common type among the values, merged with the others it holds
    (an empty list gives way to a list of ints); None when no value has a type (all null)."""
    counts = Counter(t for t in map(type_of, values) if t is not None and t != _NULL)
    if not counts:
        return None
    chosen: pa.DataType | None = None
    for t, _ in counts.most_common():
        if chosen is None:
            chosen = t
            continue
        m = merge(chosen, t)
        if m is not None:
            chosen = m
    return None if chosen is None else concrete(chosen)


# --- keys --------------------------------------------------------------------------------------------
_KEY_TYPES = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}


def key_type(keys: list[object]) -> pa.DataType | None:
    """The one scalar type of all ``keys`` (None: more than one, or not scalar: JSON text). NaN and the
    infinities arrive as ``{"$float": ...}`` objects (cdcd/lake/jsontext.py), so they are not scalar;
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
            dicts.append(v)  # type: ignore[arg-type]
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
            t = _one_kind(kinds) or choose_type([x for x in vals if x is not None])
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
            check = checker(col_type)
            kept = list(vals)
            for i, x in enumerate(vals):
                if x is not None and not check(x):
                    kept[i] = None
                    misfits += 1
                    _rescue(rescued, whole, i, name, x)
            array = pa.array(kept, col_type)
        columns[col_name] = array

    rows = _rows(winners, keys, new, columns, _rescued_texts(nulls, rescued, whole))
    return Converted(rows, new, added, key_changed, misfits)


def checker(t: pa.DataType) -> Callable[[object], bool]:
    """A test that a (non-null) value fits column type ``t`` exactly, on Python types alone: the same
    answer as ``fits(t, type_of(v))``, without building Arrow types per value (the hot path)."""
    if t == pa.bool_():
        return lambda v: type(v) is bool
    if t == pa.int64():
        return lambda v: type(v) is int and INT64_MIN <= v <= INT64_MAX  # type: ignore[operator]
    if t == pa.float64():
        return lambda v: type(v) is float
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
    return lambda v: fits(t, type_of(v))


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
    """The value a typed row holds (its columns, ``_nulls`` and ``_rescued``): the inverse of ``convert``,
    for checks and for readers that want the node's value back."""
    rescued_text = row.get(RESCUED)
    rescued = None if rescued_text is None else msgspec.json.decode(str(rescued_text))
    non_dict = layout.columns.get(NON_DICT)
    if non_dict is not None and row.get(non_dict[0]) is not None:
        return row[non_dict[0]]
    if rescued_text is not None and type(rescued) is not dict:
        return rescued
    out: dict[str, object] = {}
    for name, (col, _) in layout.columns.items():
        if name == NON_DICT:
            continue
        x = row.get(col)
        if x is not None:
            out[name] = msgspec.json.decode(str(x)) if name in layout.json_fields else x
    for name in row.get(NULLS) or []:  # type: ignore[attr-defined]
        out[name] = None
    if type(rescued) is dict:
        out.update(rescued)
    return out
