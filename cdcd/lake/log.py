"""The lake's commit log: what makes landing exactly-once (DESIGN §7).

``<lake>/_cdcd_log/<seq>.json`` entries, one per landed batch: source node, first and last
position, the files it added (relative to ``<lake>/changes``), rows per cache. An entry is created
atomically (temp file, fsync, ``link`` — which refuses to overwrite — then fsync of the dir); it
is the commit point. Files are written under ``<lake>/_staging/<batch>/`` (Spark and readers skip
``_``-prefixed dirs) and renamed into ``changes/`` only after their entry exists; a restart
finishes those renames and deletes staging that no entry names and no live process owns.

The highest committed position per source is the replay filter: events at or below it are
dropped before writing. That is sound because the node and the daemon never deliver interleaved.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import structlog

from cdcd.durable import fsync_dir
from cdcd.wal.pointer import WalPosition

log = structlog.get_logger("cdcd.lake")

LOG_DIR = "_cdcd_log"
STAGING_DIR = "_staging"
CHANGES_DIR = "changes"


class CacheStats(msgspec.Struct, frozen=True):
    rows: int
    max_commit_ts_ns: int


class LogEntry(msgspec.Struct, frozen=True):
    seq: int
    batch: str
    source: str
    first: WalPosition
    last: WalPosition
    files: list[str]
    caches: dict[str, CacheStats]
    committed_ns: int


class LakeLogConflict(Exception):
    """Another writer committed overlapping positions first; the batch must be re-filtered."""


def _process_start(pid: int) -> str:
    """Start time of a process in clock ticks since boot ("" if gone): a pid alone can be reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def new_batch_id() -> str:
    """``<host>-<pid>-<process start>-<random>``: lets a restart tell a dead writer's staging from a
    live one's, even when a new process got the same pid (containers, pid reuse)."""
    pid = os.getpid()
    return f"{socket.gethostname()}-{pid}-{_process_start(pid) or 0}-{uuid.uuid4().hex[:12]}"


def _owner_alive(batch: str) -> bool:
    parts = batch.rsplit("-", 3)  # host names may contain '-': parse from the right
    if len(parts) != 4 or not parts[1].isdigit():
        return True  # not ours to judge: never touch it
    host, pid_text, started, _rand = parts
    if host != socket.gethostname():
        return True  # another host's writer
    return _process_start(int(pid_text)) == started


class NotALake(ValueError):
    """A path given as a lake has no commit log (a wrong --lake)."""


class LakeLog:
    def __init__(self, lake: Path, *, create: bool = True, keep_entries: bool = True) -> None:
        """``create=False`` for readers: a directory without a commit log is refused, never changed.
        ``keep_entries=False`` for writers: only the high-water marks are kept in memory, which then
        stays bounded however long the log grows."""
        self.lake = lake
        self.log_dir = lake / LOG_DIR
        self.staging = lake / STAGING_DIR
        self.changes = lake / CHANGES_DIR
        if not create and not self.log_dir.is_dir():
            raise NotALake(f"{lake} is not a cdcd lake (no {LOG_DIR}/ in it)")
        if create:
            for d in (self.log_dir, self.staging, self.changes):
                d.mkdir(parents=True, exist_ok=True)
        self._decoder = msgspec.json.Decoder(LogEntry)
        self._encoder = msgspec.json.Encoder()
        self.keep_entries = keep_entries
        self.entries: list[LogEntry] = []
        """Every entry read so far (only with ``keep_entries``)."""
        self.entry_count = 0
        self.high_water: dict[str, WalPosition] = {}
        self._seen = -1
        self._read_once = False
        self.linked_batch = ""
        """The last batch whose entry this process linked into the log."""

    # --- reading ---------------------------------------------------------------------------------
    def _entry_files(self) -> Iterator[tuple[int, Path]]:
        for entry in os.scandir(self.log_dir):
            name = entry.name
            if name.endswith(".json") and name[:-5].isdigit():
                yield int(name[:-5]), Path(entry.path)

    def _path(self, seq: int) -> Path:
        return self.log_dir / f"{seq:020d}.json"

    def _read(self, path: Path) -> LogEntry:
        try:
            return self._decoder.decode(path.read_bytes())
        except (msgspec.DecodeError, OSError) as exc:
            raise RuntimeError(f"{path}: unreadable lake log entry: {exc}") from exc

    def refresh(self) -> list[LogEntry]:
        """Read entries committed since the last refresh (by anyone); returns them in order.

        The first call lists the directory; later ones open the next sequence numbers until one is
        missing (commits take them without gaps), so a batch costs the same in a log of any length."""
        new: list[LogEntry] = []
        if not self._read_once:
            self._read_once = True
            for seq, path in sorted(self._entry_files()):
                if seq != self._seen + 1:
                    raise RuntimeError(f"{self.log_dir}: lake log has a gap before {path.name}")
                new.append(self._read(path))
                self._seen = seq
        while True:
            path = self._path(self._seen + 1)
            if not path.exists():
                break
            new.append(self._read(path))
            self._seen += 1
        for entry in new:
            if self.keep_entries:
                self.entries.append(entry)
            hw = self.high_water.get(entry.source)
            if hw is None or entry.last > hw:
                self.high_water[entry.source] = entry.last
        self.entry_count += len(new)
        return new

    @property
    def next_seq(self) -> int:
        return self._seen + 1

    # --- committing ------------------------------------------------------------------------------
    def commit(self, entry: LogEntry) -> LogEntry:
        """Append ``entry`` atomically as the next sequence number, re-checking the high-water mark
        against entries other writers added meanwhile. Raises LakeLogConflict on overlap."""
        while True:
            for other in self.refresh():
                if other.source == entry.source and other.last >= entry.first:
                    raise LakeLogConflict(
                        f"{other.batch} committed {other.first}..{other.last} of {other.source} first"
                    )
            entry = msgspec.structs.replace(entry, seq=self.next_seq, committed_ns=time.time_ns())
            final = self._path(entry.seq)
            tmp = self.log_dir / f".{entry.batch}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(self._encoder.encode(entry))
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, final)  # refuses to overwrite: two writers cannot take one seq
                except FileExistsError:
                    continue  # someone else took this seq: re-read and try the next
                finally:
                    tmp.unlink(missing_ok=True)
            except OSError as exc:
                raise _with_path(exc, f"lake log {final}") from None
            self.linked_batch = entry.batch  # committed from here on, whatever fails next
            fsync_dir(self.log_dir)
            self.refresh()
            return entry

    def publish(self, entry: LogEntry) -> None:
        """Move a committed entry's files from staging into ``changes/`` (idempotent)."""
        src_root = self.staging / entry.batch
        touched: set[Path] = set()
        for rel in entry.files:
            src, dst = src_root / rel, self.changes / rel
            if dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(src, dst)
            except FileNotFoundError:
                if dst.exists():  # another writer's recover() published it a moment ago
                    continue
                raise RuntimeError(
                    f"lake: {src} named by log entry {entry.seq} is missing (and not in {self.changes})"
                ) from None
            touched.add(dst.parent)
        for d in touched:
            fsync_dir(d)
        shutil.rmtree(src_root, ignore_errors=True)

    def recover(self) -> None:
        """Finish publishing committed batches; delete staging nobody committed or owns."""
        if not self.keep_entries and self._read_once:
            raise RuntimeError("LakeLog.recover() must be the first read of a log that keeps no entries")
        new = self.refresh()
        staged = {d.name for d in os.scandir(self.staging)}
        committed = {e.batch for e in (self.entries if self.keep_entries else new)}
        for entry in self.entries if self.keep_entries else new:
            if entry.batch in staged:
                self.publish(entry)
        del new  # at start-up only: the whole log passes through memory once
        for d in os.scandir(self.staging):
            if d.name in committed or _owner_alive(d.name):
                continue
            log.info("lake_staging_discarded", batch=d.name)
            shutil.rmtree(d.path, ignore_errors=True)
        for stale in self.log_dir.glob(".*.tmp"):
            if not _owner_alive(stale.name[1:-4]):
                stale.unlink(missing_ok=True)


def _with_path(exc: OSError, where: str) -> OSError:
    """The same OSError, its message naming the lake file (ENOSPC from a write names none)."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return OSError(exc.errno, f"{where}: {reason}")


def check_writable(lake: Path) -> None:
    """Fail at start, with the path, if the lake cannot be written."""
    try:
        lake.mkdir(parents=True, exist_ok=True)
        probe = lake / f".cdcd-write-probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            reason = f"not writable ({reason})"
        raise OSError(exc.errno, f"lake_path {lake}: {reason}") from None
