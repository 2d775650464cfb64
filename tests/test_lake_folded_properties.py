"""The tables compaction folds into checkpoint every 10 commits (``FOLDED_PROPERTIES``), and a lake written before
that property gets it from its next compaction, a hand-set value kept (cdcd/lake/properties.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from deltalake import DeltaTable

from cdcd.lake.deltalog import last_checkpoint
from cdcd.lake.maintenance.compact import compact
from cdcd.lake.table import FOLDED_PROPERTIES, STATE
from cdcd.lake.typed.layout import list_tables
from tests.support.delta_tables import append_changes, change, expected_state, state_rows

INTERVAL = "delta.checkpointInterval"


def _tables(lake: Path) -> list[Path]:
    found = list_tables(lake)
    return [lake / STATE, *(Path(str(found[cache])) for cache in sorted(found))]


def _without(table: Path, key: str) -> None:
    """Make ``table`` as an older cdcd left it: one commit of a ``metaData`` action equal to the current one but
    for the property ``key`` (what ``ALTER TABLE ... UNSET TBLPROPERTIES`` commits)."""
    dt = DeltaTable(str(table))
    meta = dt.metadata()
    config = {k: v for k, v in meta.configuration.items() if k != key}
    action = {
        "metaData": {
            "id": meta.id,
            "name": meta.name,
            "description": meta.description,
            "format": {"provider": "parquet", "options": {}},
            "schemaString": dt.schema().to_json(),
            "partitionColumns": list(meta.partition_columns),
            "configuration": config,
            "createdTime": meta.created_time,
        }
    }
    info = {"commitInfo": {"timestamp": int(time.time() * 1000), "operation": "UNSET TBLPROPERTIES"}}
    path = table / "_delta_log" / f"{dt.version() + 1:020d}.json"
    path.write_text(json.dumps(info) + "\n" + json.dumps(action) + "\n")
    assert key not in DeltaTable(str(table)).metadata().configuration


def _fold(lake: Path, rows: list[dict[str, object]], n: int) -> None:
    new = [change(c, str(k % 3), json.dumps({"n": n, "k": k}), n * 10 + k) for k in range(6) for c in ("a", "b")]
    rows += new
    append_changes(lake, new)
    compact(None, lake)


def test_state_and_typed_tables_checkpoint_every_ten_commits(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    _fold(lake, rows, 0)
    tables = _tables(lake)
    assert len(tables) == 3
    for table in tables:
        assert DeltaTable(str(table)).metadata().configuration[INTERVAL] == FOLDED_PROPERTIES[INTERVAL]
        assert last_checkpoint(table) is None
    n = 1
    while DeltaTable(str(lake / STATE)).version() < 10:
        _fold(lake, rows, n)
        n += 1
    for table in tables:
        version = DeltaTable(str(table)).version()
        assert version >= 10
        found = last_checkpoint(table)
        assert found is not None, table
        # delta-rs checkpoints the commit that makes a multiple of 10 commits (versions 9, 19, ...).
        assert found[0] == version - (version + 1) % 10, (table, found, version)
    assert state_rows(lake) == expected_state(rows)  # type: ignore[arg-type]


def test_the_next_compaction_sets_the_interval_on_older_tables_and_keeps_a_hand_set_one(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    _fold(lake, rows, 0)
    state, a, b = _tables(lake)
    for table in (state, a, b):
        _without(table, INTERVAL)
    DeltaTable(str(b)).alter.set_table_properties({INTERVAL: "50"})  # set by hand
    before = {t: DeltaTable(str(t)).version() for t in (state, a, b)}
    compact(None, lake)  # nothing new: compaction changes nothing, properties included
    assert {t: DeltaTable(str(t)).version() for t in (state, a, b)} == before
    _fold(lake, rows, 1)
    assert DeltaTable(str(state)).metadata().configuration[INTERVAL] == "10"
    assert DeltaTable(str(a)).metadata().configuration[INTERVAL] == "10"
    assert DeltaTable(str(b)).metadata().configuration[INTERVAL] == "50"
    after = {t: DeltaTable(str(t)).version() for t in (state, a, b)}
    _fold(lake, rows, 2)  # set once: the next run's commits are its folds only
    for table in (state, a, b):
        ops = [h["operation"] for h in DeltaTable(str(table)).history() if h["version"] > after[table]]
        assert "SET TBLPROPERTIES" not in ops, (table, ops)
    assert state_rows(lake) == expected_state(rows)  # type: ignore[arg-type]
