"""What a receiving node remembers of caches its origins dropped: per (cache, origin cluster) the
drop's version, in ``<node_dir>/replication_drops.json``.

An origin's drop empties the cache here (the cache is destroyed, as on the origin; the origin's next
change of it creates it again). A change of that origin cluster with a lower version was written
before the drop, so when it arrives later (a resent batch, partitions of a Kafka topic read out of
step) it is rejected instead of bringing back a row the origin no longer has. A drop whose version
is not above the remembered one is the same drop again (a resend): it destroys nothing, the cache
may already hold the origin's rows written after the drop.

Format (``cdcd.formats.REPLICATION_DROPS``): version 2 is ``{"format": 2, "marks": {cache: {cluster id:
version}}}``; version 1, v0.1.0's, is the bare ``marks`` object (a cache may be called ``format``, hence
the wrapper). A version 1 file is rewritten as version 2 when it is loaded (a new file renamed over it).
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from cdcd import formats
from cdcd.durable import write_atomic
from cdcd.wal.records import CacheVersion

FILE_NAME = "replication_drops.json"

_marks_type = dict[str, dict[int, CacheVersion]]
_decoder = msgspec.json.Decoder(_marks_type)


class _File(msgspec.Struct):
    format: int
    marks: _marks_type = msgspec.field(default_factory=dict)


_file_decoder = msgspec.json.Decoder(_File)


def _encode(marks: _marks_type) -> bytes:
    return msgspec.json.encode(_File(formats.REPLICATION_DROPS.current, marks))


def _load(path: Path) -> _marks_type:
    """The marks in ``path``, a version 1 file rewritten as the current version; FormatTooNew for a newer one."""
    data = path.read_bytes()
    top = msgspec.json.decode(data)
    if isinstance(top, dict) and isinstance(top.get("format"), int) and not isinstance(top["format"], bool):
        formats.check(formats.REPLICATION_DROPS, top["format"], str(path))
        return _file_decoder.decode(data).marks
    marks = _decoder.decode(data)  # version 1: the bare marks
    write_atomic(path, _encode(marks))
    return marks


class DropMarksError(ValueError):
    """The marks file cannot be read (one line naming it)."""


class DropMarks:
    """The marks of one node; thread-safe (the endpoint serves connections on threads)."""

    _of: ClassVar[weakref.WeakKeyDictionary[Any, DropMarks]] = weakref.WeakKeyDictionary()
    _of_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        """Held across a drop (check, destroy, record): two connections never drop one cache at once."""
        self._marks: _marks_type = {}
        if path.exists():
            try:
                self._marks = _load(path)
            except (msgspec.DecodeError, OSError) as exc:
                raise DropMarksError(f"{path}: cannot read the replication drop marks: {exc}") from None

    @classmethod
    def of(cls, node: Any) -> DropMarks:
        """The marks of ``node`` (one object per node, loaded once)."""
        with cls._of_lock:
            marks = cls._of.get(node)
            if marks is None:
                marks = cls._of[node] = cls(Path(node.config.node_dir) / FILE_NAME)
            return marks

    def version(self, cache: str, cluster_id: int) -> CacheVersion | None:
        """The version of the last drop of ``cache`` by ``cluster_id`` (None: never dropped)."""
        of_cache = self._marks.get(cache)
        return None if of_cache is None else of_cache.get(cluster_id)

    def covers(self, cache: str, version: CacheVersion) -> bool:
        """Whether a drop of ``cache`` made ``version`` (of its origin cluster) obsolete."""
        mark = self.version(cache, version.cluster_id)
        return mark is not None and version < mark

    def record(self, cache: str, version: CacheVersion) -> None:
        """Remember a drop, durably (call with ``lock`` held)."""
        marks = {c: dict(v) for c, v in self._marks.items()}
        marks.setdefault(cache, {})[version.cluster_id] = version
        write_atomic(self.path, _encode(marks))
        self._marks = marks
