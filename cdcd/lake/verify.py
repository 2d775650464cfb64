"""``cdcd lake verify`` and ``cdcd lake show``: compare the lake with the node; summarise the lake."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds

from cdcd.lake.arrow import to_json
from cdcd.lake.compact import cache_of, read_meta, state_path
from cdcd.lake.log import LakeLog

_MASK = (1 << 64) - 1


def row_hash(key_json: str, value_json: str) -> int:
    digest = hashlib.blake2b(f"{key_json}\0{value_json}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class CacheCheck:
    cache: str
    node_rows: int
    lake_rows: int
    node_checksum: int
    lake_checksum: int

    @property
    def ok(self) -> bool:
        return self.node_rows == self.lake_rows and self.node_checksum == self.lake_checksum


def lake_checksums(lake: Path, cache: str) -> tuple[int, int]:
    path = state_path(lake, cache)
    if not path.exists():
        return 0, 0
    table = ds.dataset(str(path.resolve()), format="parquet").to_table(columns=["key", "value"])
    total = 0
    for key, value in zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True):
        total = (total + row_hash(key, value)) & _MASK
    return table.num_rows, total


def node_checksums(node: Any, cache: str) -> tuple[int, int]:
    """``node``: anything with ``raw_items(cache)`` (a NodeSnapshot, or a Node)."""
    total = rows = 0
    for key_raw, value_raw in node.raw_items(cache):
        total = (total + row_hash(to_json(key_raw), to_json(value_raw))) & _MASK
        rows += 1
    return rows, total


def verify(lake: Path, node: Any) -> list[CacheCheck]:
    """``node``: a NodeSnapshot (or anything with ``caches()``/``raw_items()``). A cache with
    ``cdc_enabled = false`` is checked only if the lake has it, against nothing (it must not be there)."""
    infos = node.cache_infos() if hasattr(node, "cache_infos") else {}
    off = {name for name, info in infos.items() if not info.config.cdc_enabled}
    caches = sorted((set(node.caches()) - off) | set(_lake_caches(lake)))
    out = []
    for cache in caches:
        n_rows, n_sum = (0, 0) if cache in off else node_checksums(node, cache)
        l_rows, l_sum = lake_checksums(lake, cache)
        out.append(CacheCheck(cache, n_rows, l_rows, n_sum, l_sum))
    return out


def _lake_caches(lake: Path) -> list[str]:
    state = lake / "state"
    if not state.exists():
        return []
    return [cache_of(p.name) for p in state.iterdir() if p.name.startswith("cache=")]


def show(lake: Path) -> list[dict[str, Any]]:
    """Per cache: change-log rows, last position and commit time, compacted state rows."""
    lake_log = LakeLog(lake, create=False)
    lake_log.refresh()
    caches: dict[str, dict[str, Any]] = {}
    for entry in lake_log.entries:
        for name, stats in entry.caches.items():
            row = caches.setdefault(name, {"cache": name, "rows": 0, "last_position": None, "last_commit": 0})
            row["rows"] += stats.rows
            row["last_position"] = str(entry.last)
            row["last_commit"] = max(row["last_commit"], stats.max_commit_ts_ns)
    out = []
    for name in sorted(caches):
        row = caches[name]
        ts = row["last_commit"]
        row["last_commit"] = datetime.fromtimestamp(ts / 1e9, UTC).isoformat(timespec="milliseconds") if ts else None
        meta = read_meta(lake, name)
        row["state_rows"] = meta.rows if meta.version else None
        out.append(row)
    return out
