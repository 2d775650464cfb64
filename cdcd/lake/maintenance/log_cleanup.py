"""Old Delta log files removed, so a table's log stays as long as its retention, not as long as its life.

Every commit adds a file to ``_delta_log`` and delta-rs lists the whole directory to bring a table up to date,
so each refresh and each commit's read costs more with every version the log ever had: live traffic commits
`changes` once a second or more (the realtime worker a dozen times), a million log files in days. Delta removes
log files older than ``delta.logRetentionDuration`` at a checkpoint; cdcd's writers commit with delta-rs and that
cleanup off (it knows nothing of what compaction has yet to read), so it is done here, by the maintainer, after
each compaction:

- Only whole versions before a checkpoint go (the newest checkpoint at or before the bound below, and never past
  the one ``_last_checkpoint`` names): every version from it on stays readable (its checkpoint and the commits
  after it), as Delta's own cleanup leaves them.
- The bound: the first version committed within the table's ``delta.logRetentionDuration`` (Delta's default, 30
  days, when unset), and, for ``changes``, the first version compaction has not folded yet (its change feed reads
  those commits, cdcd/lake/maintenance/feed.py): a compaction that stopped for longer than the retention keeps its
  log until it runs again; for a typed table, the version the latest cut names (readers open it there: a lake
  whose source has gone quiet reads the same cut for as long as it stays quiet).
- Oldest first, so a process killed in the middle leaves the log a readable suffix, as before.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from cdcd.lake.deltalog import LogListing, configuration, list_log
from cdcd.lake.storage import LakeDir, ObjectPath, is_delta

DEFAULT_LOG_RETENTION_MS = 30 * 24 * 3600 * 1000
"""Delta's ``delta.logRetentionDuration`` when a table does not set it (30 days)."""

_INTERVAL = re.compile(r"\s*(?:interval\s+)?(\d+)\s*(millisecond|second|minute|hour|day|week)s?\s*", re.IGNORECASE)
_UNIT_MS = {"millisecond": 1, "second": 1000, "minute": 60_000, "hour": 3_600_000, "day": 86_400_000}
_UNIT_MS["week"] = 7 * _UNIT_MS["day"]


def interval_ms(text: str) -> int:
    """A Delta interval property (``interval 1 hours``, ``30 days``) in milliseconds; ``ValueError`` otherwise."""
    m = _INTERVAL.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not an interval such as 'interval 1 hours'")
    return int(m.group(1)) * _UNIT_MS[m.group(2).lower()]


@dataclass(frozen=True)
class Cleaned:
    """What one cleanup did: the first version still readable and the log files deleted."""

    kept_from: int
    deleted: int
    remaining: int = 0
    """Log files left (commits, checkpoints, checksums)."""


def clean_log(
    table: LakeDir,
    retention_ms: int,
    *,
    keep_from: int | None = None,
    now_ms: int | None = None,
    listing: LogListing | None = None,
) -> Cleaned:
    """Delete the log files of ``table`` before the newest checkpoint at or before both the first version
    committed within ``retention_ms`` and ``keep_from`` (a version that must stay readable: compaction's next).
    Nothing when no checkpoint qualifies. ``listing``: the log as the caller read it."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    listing = list_log(table) if listing is None else listing
    files = listing.files
    commits = {f.version: f.mtime_ms for f in files if f.commit}
    if not commits:
        return Cleaned(0, 0)
    cutoff_ms = now_ms - retention_ms
    # The first version committed within the retention (a commit file's mtime is its commit time).
    recent = min((v for v, t in commits.items() if t >= cutoff_ms), default=max(commits) + 1)
    bound = recent if keep_from is None else min(recent, keep_from)
    # Never past the checkpoint ``_last_checkpoint`` names, where readers start (a writer killed between a newer
    # checkpoint's file and the pointer leaves it naming an older one).
    named = listing.checkpoint
    if named is None:
        return Cleaned(min(v.version for v in files), 0, len(files))
    bound = min(bound, named[0])
    checkpoints = sorted({f.version for f in files if f.checkpoint and f.version <= bound})
    if not checkpoints:
        return Cleaned(min(v.version for v in files), 0, len(files))
    kept_from = checkpoints[-1]
    doomed = sorted((f for f in files if f.version < kept_from), key=lambda f: f.version)
    for f in doomed:
        if isinstance(f.path, ObjectPath):
            f.path.fs.delete_file(f.path.fs_path)
        else:
            assert isinstance(f.path, Path)
            f.path.unlink(missing_ok=True)
    return Cleaned(kept_from, len(doomed), len(files) - len(doomed))


def retention_ms(configuration: dict[str, str]) -> int:
    """A table's ``delta.logRetentionDuration`` in milliseconds (Delta's default when unset)."""
    text = configuration.get("delta.logRetentionDuration")
    return DEFAULT_LOG_RETENTION_MS if not text else interval_ms(text)


def clean_logs(lake: LakeDir, compacted_to: int) -> dict[str, Cleaned]:
    """After a compaction that folded ``changes`` up to version ``compacted_to``: the logs of ``changes`` (never
    past ``compacted_to + 1``), ``state``, ``_cuts`` and every typed table (never past the version the latest cut
    names: readers open it there) cleaned by their own retention. Returns what each cleanup did, per table."""
    from cdcd.lake.cuts import latest_cut
    from cdcd.lake.table import CHANGES, CUTS, STATE, TABLES
    from cdcd.lake.typed.layout import list_tables

    tables: list[tuple[str, LakeDir, int | None]] = [
        (CHANGES, lake / CHANGES, compacted_to + 1),
        (STATE, lake / STATE, None),
        (CUTS, lake / CUTS, None),
    ]
    cut = latest_cut(lake)
    named = {} if cut is None else cut.tables
    tables += [(f"{TABLES}/{cache}", path, named.get(cache)) for cache, path in sorted(list_tables(lake).items())]
    out: dict[str, Cleaned] = {}
    for name, path, keep_from in tables:
        if not is_delta(path):
            continue
        listing = list_log(path)  # read once: the properties and the cleanup read the same listing
        out[name] = clean_log(path, retention_ms(configuration(path, listing)), keep_from=keep_from, listing=listing)
    return out
