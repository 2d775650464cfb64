"""``cdcd lake verify``: compare ``<lake>/state`` with the node, cache by cache (rows and an
order-independent checksum), read with delta-rs (no JVM), after ``cdcd lake check``'s checks of
both tables (a damaged lake raises DamagedLake: one line naming the file). The node's entries are
hashed as the lake writes them: keys as key text (one per key: two node keys never count once),
values as value text.

Several nodes are taken as one cluster's: a key lives on its primary and backups, with the same
value on each, and the lake's ``state`` is the union of their entries. Nodes that wrote the same
keys independently (two clusters landing into one lake under the same cache names) leave a
``state`` holding, per key, the change of highest version of either, and a key one of them removed
later is gone: no comparison with the nodes' entries can say whether that is right. A key live on
several nodes with different values shows it; such a cache is not OK, and one
``lake_verify_conflicting_nodes`` warning names it."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import structlog

from cdcd.lake.landing.arrow import key_to_json, to_json
from cdcd.lake.reading.check import require_sound
from cdcd.lake.storage import LakeDir, is_delta, open_delta
from cdcd.lake.table import STATE

log = structlog.get_logger("cdcd.lake")

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
    conflicting_keys: int = 0
    """Keys live on several of the nodes with different values (not one cluster's copies)."""

    @property
    def ok(self) -> bool:
        return (
            self.node_rows == self.lake_rows and self.node_checksum == self.lake_checksum and not self.conflicting_keys
        )


def lake_checksums(lake: LakeDir) -> dict[str, tuple[int, int]]:
    """Per cache of the state table: (rows, checksum)."""
    path = lake / STATE
    if not is_delta(path):
        return {}
    out: dict[str, tuple[int, int]] = {}
    scanner = open_delta(path).to_pyarrow_dataset().scanner(columns=["cache", "key", "value"])
    for batch in scanner.to_batches():
        for cache, key, value in zip(*(batch.column(i).to_pylist() for i in range(3)), strict=True):
            rows, total = out.get(cache, (0, 0))
            out[cache] = (rows + 1, (total + row_hash(key, value)) & _MASK)
    return out


def node_checksums(node: Any, cache: str) -> tuple[int, int]:
    """``node``: anything with ``raw_items(cache)`` (a NodeSnapshot, or a Node)."""
    total = rows = 0
    for key_raw, value_raw in node.raw_items(cache):
        total = (total + row_hash(key_to_json(key_raw), to_json(value_raw))) & _MASK
        rows += 1
    return rows, total


def verify(lake: LakeDir, nodes: list[Any]) -> list[CacheCheck]:
    """``nodes``: NodeSnapshots (or anything with ``caches()``/``raw_items()``), one per node whose
    data lands in this lake. A cache on several nodes is checked against the union of their entries
    (an entry held by two nodes, as a backup copy, counts once). A cache with ``cdc_enabled = false``
    is checked only if the lake has it, against nothing (it must not be there). DamagedLake when a
    table's log or a file it names is damaged (every data file's footer is read)."""
    require_sound(lake, read_files=True)
    lake_sums = lake_checksums(lake)
    off: set[str] = set()
    for node in nodes:
        infos = node.cache_infos() if hasattr(node, "cache_infos") else {}
        off |= {name for name, info in infos.items() if not info.config.cdc_enabled}
    node_sums: dict[str, tuple[int, int]] = {}
    conflicts: dict[str, int] = {}
    caches = sorted({c for node in nodes for c in node.caches()} - off)
    for cache in caches:
        holders = [node for node in nodes if cache in node.caches()]
        if len(holders) == 1:
            node_sums[cache] = node_checksums(holders[0], cache)
            continue
        entries = {(key_to_json(k), to_json(v)) for node in holders for k, v in node.raw_items(cache)}
        node_sums[cache] = (len(entries), sum(row_hash(k, v) for k, v in entries) & _MASK)
        values_per_key = Counter(k for k, _ in entries)
        if len(values_per_key) < len(entries):
            conflicts[cache] = sum(n > 1 for n in values_per_key.values())
            log.warning(
                "lake_verify_conflicting_nodes",
                cache=cache,
                keys=conflicts[cache],
                nodes=len(holders),
                hint="these nodes hold different values under the same keys: they wrote them independently, "
                "not as one cluster's copies; the lake keeps the highest version of each, which their data "
                "cannot be checked against",
            )
    out = []
    for cache in sorted(set(node_sums) | set(lake_sums)):
        n_rows, n_sum = node_sums.get(cache, (0, 0))
        l_rows, l_sum = lake_sums.get(cache, (0, 0))
        out.append(CacheCheck(cache, n_rows, l_rows, n_sum, l_sum, conflicts.get(cache, 0)))
    return out
