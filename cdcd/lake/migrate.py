"""``cdcd lake migrate``: a lake in the pre-Delta format (``_cdcd_log`` + Parquet) converted once.

Steps, each safe to repeat after a crash: (1) finish the old log's own publishing; (2) move the old
``changes/`` (and ``state/``) aside to ``_pre_delta_changes/`` (``_pre_delta_state/``); (3) copy every
committed batch's rows into the new Delta table ``changes/`` (missing columns null, generation 0);
(4) one commit naming all the files and seeding each source's application transaction from the old
log's high-water mark, so the daemon goes on exactly where the old lake ended; (5) rename
``_cdcd_log`` to ``_pre_delta_cdcd_log``. A crash before (4) leaves no table: a rerun starts
(3) again on an empty ``changes/``; a crash after it only repeats (5). The old files are kept
(``_pre_delta_*``) for the operator to delete; ``lake compact`` rebuilds ``state``.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction

from cdcd.lake.delta import OLD_LOG_DIR, ChangeTable, LakeWriteError, app_id, encode_version
from cdcd.lake.log import LakeLog
from cdcd.lake.table import CHANGES, STATE
from cdcd.wal.pointer import WalPointer

OLD_CHANGES = "_pre_delta_changes"
OLD_STATE = "_pre_delta_state"
OLD_LOG_DONE = "_pre_delta_cdcd_log"
_ROWS_PER_WRITE = 1_000_000


class MigrateError(RuntimeError):
    """Nothing to migrate, or the lake is not in a state migrate can take (one line)."""


@dataclass(frozen=True)
class Migrated:
    rows: int
    batches: int
    sources: dict[str, WalPointer]
    files: int


def _partition_values(rel: str) -> dict[str, str]:
    out = {}
    for part in Path(rel).parts[:-1]:
        col, _, value = part.partition("=")
        out[col] = urllib.parse.unquote(value)  # the old layout escaped values the way Spark does (%XX)
    return out


def migrate(lake: Path) -> Migrated:
    log_dir = lake / OLD_LOG_DIR
    if not log_dir.is_dir():
        if (lake / CHANGES / "_delta_log").is_dir():
            raise MigrateError(f"{lake} is already a Delta lake: nothing to migrate")
        raise MigrateError(f"{lake} is not a cdcd lake (no {OLD_LOG_DIR}/ in it)")
    old_log = LakeLog(lake, create=False, keep_entries=True)
    table_dir = lake / CHANGES
    if not (lake / OLD_CHANGES).exists():
        old_log.recover()  # (1) finish publishing committed batches, drop dead staging
    else:
        old_log.refresh()
    entries = old_log.entries
    marks = {source: hw.pointer for source, hw in old_log.high_water.items()}
    if (table_dir / "_delta_log").is_dir():
        dt = DeltaTable(str(table_dir))
        if all(dt.transaction_version(app_id(s, 0)) == encode_version(p) for s, p in marks.items()):
            log_dir.rename(lake / OLD_LOG_DONE)  # (5) after a crash right before it
            return Migrated(dt.count(), len(entries), marks, 0)
        raise MigrateError(f"{table_dir} is a Delta table that does not match {log_dir}: move one of them away")
    # (2) the old layout aside, once.
    if not (lake / OLD_CHANGES).exists():
        if table_dir.exists():
            table_dir.rename(lake / OLD_CHANGES)
        else:
            (lake / OLD_CHANGES).mkdir()
        if (lake / STATE).exists():
            (lake / STATE).rename(lake / OLD_STATE)
    elif table_dir.exists():
        shutil.rmtree(table_dir)  # a crashed earlier run's uncommitted copy
    old_changes = lake / OLD_CHANGES
    by_day = any("day" in _partition_values(rel) for e in entries for rel in e.files)
    table = ChangeTable(lake, by_day)
    table.open(allow_old_log=True)
    schema = table.schema
    # (3) copy the rows, in WAL order per source, a million at a time.
    adds = []
    pending: list[pa.Table] = []
    rows = 0

    def flush() -> None:
        if pending:
            adds.extend(table.write_arrow(pa.concat_tables(pending)).adds)
            pending.clear()

    buffered = 0
    for entry in entries:
        for rel in entry.files:
            path = old_changes / rel
            t = pq.read_table(path)
            n = t.num_rows
            columns = []
            for field in schema:
                values = _partition_values(rel)
                if field.name in values:
                    columns.append(pa.array([values[field.name]] * n, field.type))
                elif field.name == "source_generation":
                    columns.append(pa.array([0] * n, field.type))
                elif field.name in t.column_names:
                    columns.append(t.column(field.name).cast(field.type))
                else:
                    columns.append(pa.nulls(n, field.type))
            pending.append(pa.Table.from_arrays(columns, schema=schema))
            rows += n
            buffered += n
            if buffered >= _ROWS_PER_WRITE:
                flush()
                buffered = 0
    flush()
    # (4) one commit: every file and every source's mark.
    txns = [Transaction(app_id(s, 0), encode_version(p), int(time.time() * 1000)) for s, p in sorted(marks.items())]
    info = {"migrated_from": OLD_LOG_DIR, "batches": len(entries), "rows": rows}
    props = CommitProperties(app_transactions=txns, custom_metadata={"cdcd": json.dumps(info)})
    try:
        table.table.create_write_transaction(
            list(adds), "append", schema, partition_by=table.partition_by, commit_properties=props
        )
    except Exception as exc:
        raise LakeWriteError(f"lake {table_dir}: migration commit failed: {exc}") from None
    log_dir.rename(lake / OLD_LOG_DONE)  # (5)
    return Migrated(rows, len(entries), marks, len(adds))
