"""``<lake>/_cdcd_caches.json``: the caches every daemon landing into the lake announced, by cache id
(name and partitions), for readers that want the caches' names without reading the change table.

Its top-level ``"format"`` is the format version (``cdcd.formats.LAKE_CACHES``); a file without one was
written by v0.1.0 (version 1, the same layout). The cache ids are the other keys (integers as text),
so a daemon of v0.1.0 sharing the lake during a rolling upgrade keeps the marker when it rewrites the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from cdcd import formats
from cdcd.durable import write_atomic
from cdcd.lake.storage import LakeDir, ObjectPath
from cdcd.wal.records import CacheInfo

FILE_NAME = "_cdcd_caches.json"
FORMAT_KEY = "format"


class RegistryUnreadable(ValueError):
    """The registry file is not what cdcd writes (one line naming it)."""


def read_registry(lake: LakeDir) -> dict[str, Any]:
    """The registry as stored (cache id -> entry, and ``"format"``); {} when there is none. FormatTooNew
    for a newer format than this code's."""
    path = lake / FILE_NAME
    if not path.exists():
        return {}
    try:
        known = json.loads(path.read_bytes())
    except ValueError as exc:
        raise RegistryUnreadable(f"{path}: not the JSON cdcd writes: {exc}") from None
    if not isinstance(known, dict):
        raise RegistryUnreadable(f"{path}: not the JSON object cdcd writes")
    try:
        found = formats.parse_version(known[FORMAT_KEY]) if FORMAT_KEY in known else None
    except ValueError as exc:
        raise RegistryUnreadable(f"{path}: {exc}") from None
    formats.check(formats.LAKE_CACHES, found, str(path))
    return known


def record_caches(lake: LakeDir, caches: Iterable[CacheInfo]) -> None:
    """Add ``caches`` to the registry (replaced whole: a rename locally, one PUT on an object store),
    marked with this code's format version."""
    path = lake / FILE_NAME
    known = read_registry(lake)
    for info in caches:
        known[str(info.cache_id)] = {"name": info.name, "partitions": info.config.partitions}
    known[FORMAT_KEY] = formats.LAKE_CACHES.current
    data = json.dumps(known, sort_keys=True).encode()
    if isinstance(path, ObjectPath):
        path.write_bytes(data)  # a PUT replaces the object whole
    else:
        write_atomic(path, data)
