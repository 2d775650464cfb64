"""Table properties a table created by an older cdcd lacks, set once by the writer that next opens it.

A property that cdcd's tables are created with (cdcd/lake/table.py, cdcd/lake/typed/layout.py) and that a lake
written before it does not carry is added by one metadata commit (``ALTER TABLE ... SET TBLPROPERTIES``), which
changes no data; a value set by hand, whatever it is, is kept. Two writers setting the same properties at the
same moment: one commit wins, the other finds them set.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from cdcd.lake.storage import LakeDir
from cdcd.lake.table import FOLDED_PROPERTIES
from cdcd.logging import describe

log = structlog.get_logger("cdcd.lake")


def absent_properties(dt: DeltaTable, wanted: Mapping[str, str]) -> dict[str, str]:
    """The ``wanted`` properties ``dt``'s snapshot does not set (whatever value it sets counts as set)."""
    have = dt.metadata().configuration
    return {k: v for k, v in wanted.items() if k not in have}


def set_absent_properties(dt: DeltaTable, wanted: Mapping[str, str]) -> dict[str, str]:
    """Set the ``wanted`` properties ``dt`` lacks in one commit, ``dt`` brought up to date after it; returns
    what was set (empty: all were set already, or a neighbour set them first). Raises the commit's error when
    they are still absent after it."""
    absent = absent_properties(dt, wanted)
    if not absent:
        return {}
    try:
        dt.alter.set_table_properties(absent, raise_if_not_exists=False)
    except (DeltaError, OSError):
        dt.update_incremental()
        if absent_properties(dt, absent):
            raise
        return {}
    dt.update_incremental()
    return absent


def fold_properties(dt: DeltaTable, path: LakeDir) -> None:
    """``FOLDED_PROPERTIES`` on ``dt`` (the table at ``path`` compaction is about to fold into, as it opened it)
    when it was created without them. A failure is logged and changes nothing else: the table is read and
    written as before (only its log replays longer), and the next compaction tries again."""
    try:
        added = set_absent_properties(dt, FOLDED_PROPERTIES)
    except (DeltaError, OSError) as exc:
        log.warning("lake_table_properties_not_set", table=str(path), error=describe(exc))
        return
    if added:
        log.info("lake_table_properties_set", table=str(path), properties=added)
