"""A cache dropped and created again on a real node: the history the drop tests and the outage tests replay."""

from __future__ import annotations

from pathlib import Path

from cdcd.node import Node
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheOp, CacheRecord
from tests.support.wal import wal_records

NODE = {"wal_segment_size_bytes": 64 * 1024, "wal_force_archive_timeout_ms": 0}
OLD = {0: {"v": 0}, 1: {"v": 11}, 3: {"v": 3}, 4: {"v": 4}}
"""What ``c`` held when it was dropped."""
NEW = {0: {"v": 100}, 7: {"v": 7}, 8: {"v": 8}}
"""What ``c`` holds after it was created again."""
OTHER = {"x": 1, "y": 2}


def write_scenario(node_dir: Path) -> WalPointer:
    """The node's history (every record archived); returns the DESTROY record's pointer."""
    with Node.open(node_dir, **NODE) as node:
        c, o = node.cache("c"), node.cache("o")
        for k in range(5):
            c.put(k, {"v": k})
        c.put(1, {"v": 11})
        c.remove(2)
        o.put("x", 1)
        node.force_archive()
        assert node.destroy_cache("c")
        again = node.cache("c")
        for k, v in NEW.items():
            again.put(k, v)
        o.put("y", 2)
        node.force_archive()
    drops = [p for p, r in wal_records(node_dir) if type(r) is CacheRecord and r.op == CacheOp.DESTROY]
    assert len(drops) == 1
    return drops[0]
