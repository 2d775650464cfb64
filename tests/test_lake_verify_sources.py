"""`lake verify` over several nodes takes them as one cluster's (issue 29 item 4): two real nodes that wrote the
SAME keys independently, one further than the other (what the two-daemon lake test once had), are named as such
rather than counted as a plain row mismatch: their union is no state the lake could hold."""

from __future__ import annotations

from pathlib import Path

import structlog

from cdcd.lake.reading.verify import verify
from cdcd.node import Node
from cdcd.node.snapshot import NodeSnapshot


def write(node_dir: Path, puts: int, removes: range) -> None:
    """Keys 0..puts-1 of caches ``c`` and ``d`` with their number as value, then ``removes`` removed from ``c``."""
    with Node.open(node_dir) as node:
        for k in range(puts):
            node.cache("c").put(k, {"v": k, "round": puts})
            node.cache("d").put(k, {"v": k})
        for k in removes:
            node.cache("c").remove(k)


def test_nodes_holding_different_values_under_the_same_keys_are_named_not_ok(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write(a, 10, range(0))
    write(b, 12, range(3))  # the same keys written further: other values in c (and 3 removed), the same in d
    with NodeSnapshot(a) as na, NodeSnapshot(b) as nb, structlog.testing.capture_logs() as logs:
        checks = verify(tmp_path / "lake", [na, nb])
        # one node given twice: every key's copies agree, as a primary's and its backup's do
        same = verify(tmp_path / "lake", [na, na])
    assert {c.cache: c.conflicting_keys for c in checks} == {"c": 7, "d": 0}, checks  # keys 3..9 differ
    warned = [e for e in logs if e["event"] == "lake_verify_conflicting_nodes"]
    assert [(e["log_level"], e["cache"], e["keys"], e["nodes"]) for e in warned] == [("warning", "c", 7, 2)]
    assert not checks[0].ok
    assert same and all(c.conflicting_keys == 0 for c in same)
