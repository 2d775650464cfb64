"""Declared column types for the typed tables: ``[consumer.tables.<cache>] columns = { qty = "int64" }``
in the lake sink's config, or the same ``[tables.<cache>]`` tables in a file for ``cdcd lake compact``.

A declared field's column exists from the table's creation with that type, whatever the values hold, and
never widens: a value takes the column's type where the lattice puts it there (an int in ``float64``, a
scalar in ``string`` as its text), anything else goes to ``_rescued`` (counted). ``json`` keeps the
field's JSON text in a string column, whatever its shape (a semi-structured field).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from cdcd.lake.typed.infer import TYPE_NAMES, Layout, base_columns, column_name

JSON_TYPE = "json"


@dataclass(frozen=True)
class DeclaredTable:
    """``[consumer.tables.<cache>]``: columns whose type is declared, not inferred."""

    columns: Mapping[str, str]
    """field name -> ``bool`` | ``int64`` | ``float64`` | ``string`` | ``json``."""


class DeclaredSchemaError(ValueError):
    """A declared schema names an unknown type (the message names the config key)."""


class TableOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[consumer.tables.<cache>]``."""

    columns: dict[str, str] = msgspec.field(default_factory=dict)
    """field name -> type: ``bool``, ``int64``, ``float64``, ``string`` or ``json``."""


def check_declared(tables: Mapping[str, TableOptions], prefix: str) -> dict[str, DeclaredTable]:
    """``DeclaredSchemaError`` naming ``<prefix>.<cache>.columns.<field>`` for an unknown type."""
    out: dict[str, DeclaredTable] = {}
    for cache, options in tables.items():
        for field, type_name in options.columns.items():
            if type_name not in TYPE_NAMES and type_name != JSON_TYPE:
                known = ", ".join([*TYPE_NAMES, JSON_TYPE])
                raise DeclaredSchemaError(
                    f"{prefix}.{cache}.columns.{field} = {type_name!r}: unknown type (one of {known})"
                )
        out[cache] = DeclaredTable(dict(options.columns))
    return out


def load_declared(path: Path) -> dict[str, DeclaredTable]:
    """The declared schemas in a TOML file: a daemon config's ``[consumer.tables.*]`` or a file of
    ``[tables.*]`` tables (``cdcd lake compact --tables-config FILE``). Errors name the file and key."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise DeclaredSchemaError(f"{path}: {exc}") from None
    consumer = doc.get("consumer")
    if isinstance(consumer, dict) and "tables" in consumer:
        raw, prefix = consumer["tables"], "consumer.tables"
    else:
        raw, prefix = doc.get("tables", {}), "tables"
    try:
        tables = msgspec.convert(raw, dict[str, TableOptions])
    except msgspec.ValidationError as exc:
        raise DeclaredSchemaError(f"{path}: {prefix}: {exc}") from None
    try:
        return check_declared(tables, prefix)
    except DeclaredSchemaError as exc:
        raise DeclaredSchemaError(f"{path}: {exc}") from None


def apply_declared(layout: Layout, declared: DeclaredTable) -> Layout:
    """``layout`` with the declared fields it lacks added as columns of their declared type."""
    new = layout.copy()
    taken = [f.name for f in base_columns(new.schema().field("key").type)] + [c for c, _ in new.columns.values()]
    json_fields = set(new.json_fields)
    for field, type_name in declared.columns.items():
        if field in new.columns:
            continue
        col = column_name(field, taken)
        taken.append(col)
        if type_name == JSON_TYPE:
            json_fields.add(field)
            new.columns[field] = (col, TYPE_NAMES["string"])
        else:
            new.columns[field] = (col, TYPE_NAMES[type_name])
    new.json_fields = frozenset(json_fields)
    new.fixed = new.fixed | frozenset(declared.columns)
    return new


def with_declared(layout: Layout, declared: DeclaredTable | None) -> Layout:
    return layout if declared is None else apply_declared(layout, declared)
