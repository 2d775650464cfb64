"""Replication dead letters (issue 31 item 8): entries over the receiving node's ``replication_max_frame_bytes``
(the limit its welcome tells the sender) are set aside in the daemon's dead-letter file, never sent; every other
entry lands in the target exactly once (its WAL an entry-for-entry mirror of the rest, in order)."""

from __future__ import annotations

import json
from pathlib import Path

from cdcd.node.node import Node
from tests.support.replication_rig import (
    NODE_SETTINGS,
    DaemonProc,
    NodeProc,
    Procs,
    node_data,
    origin,
    procs,
    split_entries,
    stop_all,
    wait_caught_up,
)
from tests.support.wal import wal_events

__all__ = ["procs"]  # a fixture, used by name

FRAME_LIMIT = 65536


def test_entries_over_the_targets_frame_limit_become_dead_letters(tmp_path: Path, procs: Procs) -> None:
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2, replication_max_frame_bytes=FRAME_LIMIT)
    values = {k: {"k": k, "pad": "x" * (100_000 if k % 100 == 42 else k % 50)} for k in range(600)}
    big = sorted(k for k in values if k % 100 == 42)
    with Node.open(a.dir, cluster_id=a.cluster_id, **NODE_SETTINGS) as n:
        cache = n.cache("c")
        for i in range(0, len(values), 50):
            cache.put_all({k: values[k] for k in range(i, i + 50)})
        cache.put(big[0], {"k": big[0], "pad": "y" * 90_000})  # the same key refused twice
        n.force_archive()
    refused = [e for e in wal_events(a.dir) if e["value"] is not None and len(e["value"]["pad"]) >= 90_000]
    assert len(refused) == len(big) + 1
    dead = tmp_path / "dead.jsonl"
    b.start()
    a.start()
    daemon = DaemonProc(procs, tmp_path, a, b, dead_letters="on", dead_letters_path=str(dead))
    daemon.start()
    wait_caught_up((a, daemon))
    warned = daemon.events("dead_letter")
    stop_all(daemon, a, b)

    letters = [json.loads(line) for line in dead.read_text().splitlines()]
    assert [d["pos"] for d in letters] == [e["pos"] for e in refused]
    for d, e in zip(letters, refused, strict=True):
        assert (d["cache"], d["op"], d["key"], d["value"]) == (e["cache"], e["op"], e["key"], e["value"])
        assert (
            d["error"].startswith("an entry of ")
            and f"({FRAME_LIMIT} bytes, its replication_max_frame_bytes)" in (d["error"])
        )
    assert len(warned) == len(refused)

    refused_pos = {tuple(e["pos"]) for e in refused}
    a_events = wal_events(a.dir)
    a_local, _ = split_entries(a)
    sent = [e for e, ev in zip(a_local, a_events, strict=True) if tuple(ev["pos"]) not in refused_pos]
    _b_local, b_repl = split_entries(b)
    mirror = [(e.op, bytes(e.key), bytes(e.value), origin(e)) for e in b_repl]
    assert mirror == [(e.op, bytes(e.key), bytes(e.value), e.version) for e in sent], "the rest once, in order"
    expected = {k: v for k, v in values.items() if k not in big}
    assert node_data(b) == {"c": expected}
