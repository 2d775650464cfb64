"""What ``state`` says it reflects of ``changes``: the compaction mark, and whether its versions still
name the commits that were compacted.

The mark is ``state``'s application transaction ``(app id, changes version compacted up to)``. A
version number alone can be reused: the newest ``changes`` commit deleted (or the lake restored from
a backup) and the number taken by a different commit when the sink lands again. So each compaction
commit also records, in its ``userMetadata``, an identifier of the ``changes`` commits it folded in
last (a hash of each commit file: file names are random, timestamps differ). A compaction that finds
one of them replaced folds the changes again from the first replaced version, under the next epoch's
application id (``cdcd-compact:e<n>``): Delta skips a commit whose transaction version is not above
the recorded one, and the new commits reuse numbers ``state`` already recorded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from cdcd import formats
from cdcd.lake.deltalog import LOG_DIR
from cdcd.lake.storage import LakeDir, is_delta, open_delta
from cdcd.lake.table import STATE

COMPACT_APP_ID = "cdcd-compact"
"""The state table's application transaction: its version is the changes-table version compacted up to."""

IDENTIFIED_VERSIONS = 64
"""A compaction commit identifies up to this many of the newest changes commits it folded in."""

USER_METADATA_CONF = "spark.databricks.delta.commitInfo.userMetadata"
_KEY = "cdcd_changes_commits"
_STARTS = "cdcd_generation_starts"
_HISTORY_LIMIT = 200
"""State commits searched, newest first, for the one that recorded the mark (OPTIMIZE and the
typed-table truncates come in between)."""


FORMAT_KEY = "cdcd_format"
"""The mark's format version in the ``userMetadata`` (``cdcd.formats.COMPACT_MARK``; absent: 1, v0.1.0's)."""


def _check_format(raw: object, state: LakeDir) -> None:
    try:
        found = None if raw is None else formats.parse_version(raw)
    except ValueError as exc:
        raise ValueError(f"{state}: compaction mark, userMetadata {FORMAT_KEY}: {exc}") from None
    formats.check(formats.COMPACT_MARK, found, f"{state} (its compaction mark)")


def compact_app_id(epoch: int) -> str:
    return COMPACT_APP_ID if epoch == 0 else f"{COMPACT_APP_ID}:e{epoch}"


@dataclass(frozen=True)
class CompactMark:
    epoch: int
    version: int
    """The changes version ``state`` reflects (-1: never compacted)."""
    commits: dict[int, str] | None
    """Identifiers of the newest changes commits folded in (None: not recorded, an older cdcd)."""
    generation_starts: frozenset[str] | None = None
    """The sources' generation starts compaction had seen (maintenance/lost_history.py; None: not recorded)."""

    @property
    def app_id(self) -> str:
        return compact_app_id(self.epoch)


def commit_id(changes: LakeDir, version: int) -> str | None:
    """An identifier of the ``changes`` commit at ``version`` (None: its file is gone)."""
    try:
        with (changes / LOG_DIR / f"{version:020d}.json").open("rb") as f:
            return hashlib.blake2b(f.read(), digest_size=12).hexdigest()
    except FileNotFoundError:
        return None


def commit_ids(changes: LakeDir, first: int, last: int, generation_starts: list[str]) -> str:
    """``userMetadata`` of a compaction commit that folded ``first..last`` in, having seen ``generation_starts``."""
    ids = {str(v): commit_id(changes, v) for v in range(max(first, last - IDENTIFIED_VERSIONS + 1), last + 1)}
    meta = {
        _KEY: {v: i for v, i in ids.items() if i is not None},
        _STARTS: generation_starts,
        FORMAT_KEY: formats.COMPACT_MARK.current,
    }
    return json.dumps(meta, sort_keys=True)


def read_mark(lake: LakeDir) -> CompactMark:
    state = lake / STATE
    if not is_delta(state):
        return CompactMark(0, -1, None)
    table = open_delta(state)
    epoch, version = 0, table.transaction_version(COMPACT_APP_ID)
    while True:
        newer = table.transaction_version(compact_app_id(epoch + 1))
        if newer is None:
            break
        epoch, version = epoch + 1, newer
    if version is None:
        return CompactMark(0, -1, None)
    for info in table.history(_HISTORY_LIMIT):
        try:
            meta = json.loads(info.get("userMetadata") or "{}")
        except ValueError:
            continue
        ids = meta.get(_KEY) if isinstance(meta, dict) else None
        if isinstance(ids, dict) and ids and max(int(v) for v in ids) == int(version):
            _check_format(meta.get(FORMAT_KEY), state)
            starts = meta.get(_STARTS)
            seen = frozenset(str(s) for s in starts) if isinstance(starts, list) else None
            return CompactMark(epoch, int(version), {int(v): str(i) for v, i in ids.items()}, seen)
    return CompactMark(epoch, int(version), None)


def replaced_from(changes: LakeDir, mark: CompactMark, end: int) -> int | None:
    """The first changes version ``mark`` names whose commit is not the one compacted (None: all are);
    ``end``: the changes table's version. A commit file cleaned up by log retention is no replacement,
    a version past ``end`` is (the newest commits deleted, not yet landed again)."""
    if not mark.commits:
        return None
    for version in sorted(mark.commits):
        found = commit_id(changes, version)
        if (found is None and version > end) or (found is not None and found != mark.commits[version]):
            return version
    return None
