"""`cdcd node diff`: stopped nodes key by key, running nodes through their control sockets."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from cdcd.node.node import Node
from tests.support.procs import cdcd


def _fill(node: Node, variant: int) -> None:
    c = node.cache("c")
    c.put_all({i: {"v": i} for i in range(200)})
    node.cache("d").put(1, [1, 2])
    if variant:
        c.put(5, "changed")
        c.put(1000, "new")
        c.remove(7)


def _data_files(node_dir: Path) -> list[tuple[Path, int, int]]:
    """Every file but the locks (LMDB's reader table and the node lock are written by any reader)."""
    return sorted(
        (p, p.stat().st_size, p.stat().st_mtime_ns)
        for p in node_dir.rglob("*")
        if p.is_file() and p.name not in ("lock.mdb", "node.lock")
    )


def test_stopped_nodes_are_compared_key_by_key(tmp_path: Path) -> None:
    """Two stopped nodes: per cache rows, keys only on one side and keys with different values are
    counted and shown, exit 1; equal nodes exit 0 (and neither node dir is written to)."""
    for name, variant in (("a", 0), ("b", 1), ("c", 0)):
        with Node.open(tmp_path / name) as node:
            _fill(node, variant)
    before = _data_files(tmp_path / "a")
    r = cdcd("node", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert r.returncode == 1, r.stderr
    got = {d["cache"]: d for d in json.loads(r.stdout)}
    assert (got["c"]["only_a"], got["c"]["only_b"], got["c"]["different"], got["c"]["same"]) == (1, 1, 1, False)
    assert got["c"]["examples"] == ["5: different", "7: only in A", "1000: only in B"]
    assert got["d"]["same"] and got["d"]["rows_a"] == 1
    r = cdcd("node", "diff", str(tmp_path / "a"), str(tmp_path / "c"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DIFFERENT" not in r.stdout and r.stdout.count("same") == 2
    assert _data_files(tmp_path / "a") == before


def test_running_nodes_answer_checksums(tmp_path: Path) -> None:
    """A running node is compared through its control socket (rows and checksums, which agree
    with a stopped node's), so a live stand-by can be checked without stopping it."""
    with Node.open(tmp_path / "a") as node:
        _fill(node, 0)
    with Node.open(tmp_path / "b") as b, Node.open(tmp_path / "c") as c:
        _fill(b, 1)
        _fill(c, 0)
        r = cdcd("node", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
        assert r.returncode == 1, r.stderr
        got = {d["cache"]: d for d in json.loads(r.stdout)}
        assert not got["c"]["same"] and got["c"]["only_a"] is None and got["d"]["same"]
        r = cdcd("node", "diff", str(tmp_path / "c"), str(tmp_path / "a"))
        assert r.returncode == 0, r.stdout + r.stderr
    r = cdcd("node", "diff", str(tmp_path / "a"), str(tmp_path / "a"))
    assert r.returncode == 2 and "same node" in r.stderr
    assert isinstance(r, subprocess.CompletedProcess)
