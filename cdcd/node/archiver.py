"""Moving closed segments to the archive, linking them for CDC, and archive retention."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import structlog

from cdcd import metrics
from cdcd.durable import fsync_dir
from cdcd.wal.segment import list_segments, segment_path

log = structlog.get_logger("cdcd.node.archiver")


def check_same_filesystem(archive_dir: Path, cdc_dir: Path) -> None:
    a, c = os.stat(archive_dir).st_dev, os.stat(cdc_dir).st_dev
    if a != c:
        raise OSError(
            f"cdc_dir {cdc_dir} is on another filesystem than wal_archive_dir {archive_dir}: "
            "CDC needs hard links, put both on one filesystem"
        )


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files in ``path``. The daemon deletes links while this runs: a file
    gone between listing and stat counts as gone (it once killed the WAL flusher thread)."""
    total = 0
    for entry in os.scandir(path):
        try:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return total


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISREG(mode):
        return "file"
    return "special file"


class Archiver:
    """Link (CDC) first, then rename into the archive: a crash between the two is finished on open."""

    def __init__(
        self,
        archive_dir: Path,
        cdc_dir: Path,
        *,
        cdc_enabled: bool,
        cdc_dir_max_bytes: int,
        archive_max_bytes: int,
        min_kept_segment: Callable[[], int],
        fsync: bool = True,
    ) -> None:
        self.archive_dir = archive_dir
        self.cdc_dir = cdc_dir
        self.cdc_enabled = cdc_enabled
        self.cdc_dir_max_bytes = cdc_dir_max_bytes
        self.archive_max_bytes = archive_max_bytes
        self.min_kept_segment = min_kept_segment
        self.fsync = fsync
        archived, _ = list_segments(archive_dir)
        self.last_archived = max(archived) if archived else -1
        self.skipped_links: set[int] = set()
        """Segments archived without a CDC link (over cdc_dir_max_bytes, or links off) since open."""
        self.links_on = True
        """The runtime CDC switch (``cdcd control cdc on|off``, Ignite's ``cdc.disabled``): while
        off, archived segments are not linked, like over ``cdc_dir_max_bytes``."""

    def archive(self, segment: int, work_path: Path) -> None:
        if self.cdc_enabled:
            self._link(segment, work_path)
        os.replace(work_path, segment_path(self.archive_dir, segment))
        if self.fsync:
            fsync_dir(self.archive_dir)
            fsync_dir(work_path.parent)
        self.last_archived = segment
        metrics.SEGMENTS_ARCHIVED.inc()
        metrics.WAL_SEGMENT.set(segment + 1)
        if self.archive_max_bytes:
            self.apply_retention()

    def _link(self, segment: int, work_path: Path) -> None:
        link = segment_path(self.cdc_dir, segment)
        try:
            found: os.stat_result | None = os.lstat(link)  # never follow a symlink someone put there
        except FileNotFoundError:
            found = None
        if found is not None and stat.S_ISREG(found.st_mode) and os.path.samestat(found, os.stat(work_path)):
            return  # linked before a crash, rename still to do
        if not self.links_on:
            self._skipped(segment, "warning", reason="cdc_disabled", hint="CDC is switched off (cdcd control cdc on)")
            return
        size = work_path.stat().st_size
        if self.cdc_dir_max_bytes:
            used = dir_bytes(self.cdc_dir)
            if used + size > self.cdc_dir_max_bytes:
                self._skipped(
                    segment,
                    "error",
                    reason="cdc_dir_full",
                    cdc_dir_bytes=used,
                    cdc_dir_max_bytes=self.cdc_dir_max_bytes,
                    hint="the CDC consumer is behind",
                )
                return
        if found is not None and stat.S_ISDIR(found.st_mode):
            # Not ours to remove, and a rename cannot replace it: refuse this link, keep the WAL running.
            self._skipped(
                segment,
                "error",
                reason="cdc_dir_entry_in_the_way",
                path=str(link),
                hint="a directory has this segment's name in the CDC dir; remove it",
            )
            return
        if found is not None:
            # Same name, not this segment: a leftover of an earlier node incarnation, or a symlink or
            # special file (the daemon never opens those). This segment wins.
            log.warning("cdc_link_replaced", path=str(link), segment=segment, was=_kind(found.st_mode))
            tmp = link.with_name(link.name + ".tmp")
            tmp.unlink(missing_ok=True)
            os.link(work_path, tmp)
            os.replace(tmp, link)
        else:
            os.link(work_path, link)
        if self.fsync:
            fsync_dir(self.cdc_dir)
        metrics.CDC_LINKS.inc()

    def _skipped(self, segment: int, level: str, *, hint: str, **fields: object) -> None:
        """A segment archived without its link: the daemon will stop at this gap (``missing segment N``)."""
        metrics.CDC_LINKS_SKIPPED.inc()
        self.skipped_links.add(segment)
        getattr(log, level)(
            "cdc_link_skipped",
            segment=segment,
            cdc_dir=str(self.cdc_dir),
            **fields,
            hint=f"{hint}; this segment is lost to CDC (cdcd control relink-lost-segments while the archive "
            "has it, else delete-lost-segment-links, then resend)",
        )

    def apply_retention(self) -> None:
        """Delete the oldest archived segments over ``archive_max_bytes``; never the checkpoint's or later."""
        segs, _ = list_segments(self.archive_dir)
        sizes = {idx: p.stat().st_size for idx, p in segs.items()}
        total = sum(sizes.values())
        keep_from = self.min_kept_segment()
        for idx in sorted(segs):
            if total <= self.archive_max_bytes or idx >= keep_from:
                break
            segs[idx].unlink()
            total -= sizes[idx]
            metrics.ARCHIVE_DELETED.inc()
            log.info("archive_segment_deleted", segment=idx, archive_bytes=total)
